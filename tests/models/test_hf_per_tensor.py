"""The Hugging Face adapters one tensor at a time (HFAdapter.hf_names / tensor_from_hf / tensor_to_hf),
which a streaming import or export uses so that no rank holds the whole model: they give exactly what
the whole-dict to_hf / from_hf give, for every family and layout; and from_hf runs every key and shape
check on meta tensors built from a folder's safetensors headers, with the errors of real tensors."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from torchtitan.config.errors import UserError
from torchtitan.models.registry import get_model_spec

from helpers.tiny_models import materialized

CASES = [
    ("llama3", "debugmodel"),
    ("qwen3", "debugmodel"),
    ("qwen3", "debugmodel_tied"),
    ("qwen3", "debugmodel_moe"),
    ("qwen3_5", "debugmodel_moe"),
]
IDS = [f"{family}-{flavor}" for family, flavor in CASES]


def tied(args) -> bool:
    return getattr(args, "tie_word_embeddings", False)  # Llama 3 args have no such field: never tied


def moe(args) -> bool:
    return getattr(args, "moe", None) is not None


def build(family: str, flavor: str):
    """(adapter, args, our state dict) of the flavor's model on CPU, initialized with seed 0."""
    spec = get_model_spec(family)
    args = spec.args_for_training(flavor, 256, 32)
    return spec.hf, args, materialized(spec.model_cls, args).state_dict()


def fused(hf_sd: dict, args) -> dict:
    """The same weights in transformers 5's in-memory MoE layout: per layer, gate_up_proj
    [experts, 2 x hidden, dim] (gate rows, then up rows) and down_proj [experts, dim, hidden]."""
    out = {k: v for k, v in hf_sd.items() if ".mlp.experts." not in k}
    for i in range(args.n_layers):
        per_expert = [f"model.layers.{i}.mlp.experts.{x}.{{}}.weight" for x in range(args.moe.num_experts)]
        gate, up, down = (
            torch.stack([hf_sd[k.format(p)] for k in per_expert]) for p in ("gate_proj", "up_proj", "down_proj")
        )
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = down
    return out


def layouts(adapter, args, sd) -> dict[str, dict]:
    """The HF state dicts to import: what to_hf writes, and for MoE the fused layout too."""
    hf_sd = adapter.to_hf(sd, args)
    return {"hub": hf_sd} | ({"fused": fused(hf_sd, args)} if moe(args) else {})


@pytest.mark.parametrize("family, flavor", CASES, ids=IDS)
def test_per_tensor_export_is_to_hf(family, flavor):
    adapter, args, sd = build(family, flavor)
    whole = adapter.to_hf(sd, args)
    merged, count = {}, 0
    for name, t in sd.items():
        part = adapter.tensor_to_hf(name, t, args)
        merged.update(part)
        count += len(part)
    assert count == len(merged)  # no HF name comes from two of our tensors
    assert list(merged) == list(whole)
    for k in whole:
        assert merged[k].dtype == whole[k].dtype and torch.equal(merged[k], whole[k]), k
    if tied(args):
        assert adapter.tensor_to_hf("output.weight", sd["output.weight"], args) == {}
    if moe(args):
        assert adapter.tensor_to_hf("layers.0.feed_forward.expert_bias", torch.ones(args.moe.num_experts), args) == {}


def check_per_tensor_import(adapter, args, hf_sd: dict) -> dict:
    """Every tensor of from_hf(hf_sd) rebuilt from its hf_names alone, exactly; every HF tensor used.
    Returns {our name: its HF names}."""
    whole = adapter.from_hf(hf_sd, args)
    present = frozenset(hf_sd)
    used, wanted = set(), {}
    for name, expected in whole.items():
        names = adapter.hf_names(name, args, present)
        wanted[name] = names
        assert set(names) <= present, name
        t = adapter.tensor_from_hf(name, {n: hf_sd[n] for n in names}, args)
        assert t.shape == expected.shape and t.dtype == expected.dtype and torch.equal(t, expected), name
        used.update(names)
    assert used == set(hf_sd)  # nothing in the folder is ignored
    return wanted


@pytest.mark.parametrize("family, flavor", CASES, ids=IDS)
def test_per_tensor_import_is_from_hf(family, flavor):
    adapter, args, sd = build(family, flavor)
    for layout, hf_sd in layouts(adapter, args, sd).items():
        wanted = check_per_tensor_import(adapter, args, hf_sd)
        assert wanted.keys() == sd.keys(), layout
        if moe(args):
            e = args.moe.num_experts
            assert wanted["layers.1.feed_forward.expert_bias"] == []
            if layout == "fused":
                assert wanted["layers.1.feed_forward.experts.w1"] == ["model.layers.1.mlp.experts.gate_up_proj"]
                assert wanted["layers.1.feed_forward.experts.w3"] == ["model.layers.1.mlp.experts.gate_up_proj"]
                assert wanted["layers.1.feed_forward.experts.w2"] == ["model.layers.1.mlp.experts.down_proj"]
            else:
                assert wanted["layers.1.feed_forward.experts.w2"] == [
                    f"model.layers.1.mlp.experts.{x}.down_proj.weight" for x in range(e)
                ]
    if moe(args):
        # Layers may differ in layout: each layer's is read from the names present.
        hub, fused_sd = layouts(adapter, args, sd).values()
        mixed = {k: v for k, v in hub.items() if not k.startswith("model.layers.1.mlp.experts.")}
        mixed |= {k: v for k, v in fused_sd.items() if k.startswith("model.layers.1.mlp.experts.")}
        check_per_tensor_import(adapter, args, mixed)


def test_tied_output_reads_the_embedding_and_checks_a_stored_copy():
    adapter, args, sd = build("qwen3", "debugmodel_tied")
    hf_sd = adapter.to_hf(sd, args)
    assert "lm_head.weight" not in hf_sd
    assert adapter.hf_names("output.weight", args, frozenset(hf_sd)) == ["model.embed_tokens.weight"]
    embedding = hf_sd["model.embed_tokens.weight"]
    assert adapter.tensor_from_hf("output.weight", {"model.embed_tokens.weight": embedding}, args) is embedding
    # A folder that stores lm_head.weight as a copy: read with the embedding, so its check runs per tensor too.
    with_copy = {**hf_sd, "lm_head.weight": embedding.clone()}
    names = adapter.hf_names("output.weight", args, frozenset(with_copy))
    assert names == ["model.embed_tokens.weight", "lm_head.weight"]
    check_per_tensor_import(adapter, args, with_copy)
    differs = {**with_copy, "lm_head.weight": embedding + 1}
    with pytest.raises(UserError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        adapter.tensor_from_hf("output.weight", {n: differs[n] for n in names}, args)
    with pytest.raises(UserError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        adapter.from_hf(differs, args)
    # Untied: lm_head.weight, written and read.
    adapter, args, sd = build("qwen3", "debugmodel")
    assert adapter.hf_names("output.weight", args, frozenset(adapter.to_hf(sd, args))) == ["lm_head.weight"]
    assert list(adapter.tensor_to_hf("output.weight", sd["output.weight"], args)) == ["lm_head.weight"]


# ---- from_hf on meta tensors (a folder's safetensors headers) ----

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def header_tensors(path) -> dict[str, torch.Tensor]:
    """Meta tensors with the names, shapes and dtypes of a safetensors file's header; no data read."""
    with safe_open(str(path), framework="pt") as f:
        return {
            k: torch.empty(f.get_slice(k).get_shape(), device="meta", dtype=_DTYPES[f.get_slice(k).get_dtype()])
            for k in f.keys()  # noqa: SIM118 (a safetensors file, not a dict: no `in`)
        }


def assert_same_user_error(adapter, args, real: dict, meta: dict):
    with pytest.raises(UserError) as from_real:
        adapter.from_hf(real, args)
    with pytest.raises(UserError) as from_meta:
        adapter.from_hf(meta, args)
    assert str(from_meta.value) == str(from_real.value)


# (family, flavor, layout, a key to remove, a key to give a wrong shape)
META_CASES = [
    ("llama3", "debugmodel", "hub", "model.layers.2.mlp.up_proj.weight", "model.layers.1.self_attn.k_proj.weight"),
    ("qwen3", "debugmodel", "hub", "model.norm.weight", "model.layers.1.self_attn.v_proj.weight"),
    ("qwen3", "debugmodel_tied", "hub", "model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight"),
    (
        "qwen3",
        "debugmodel_moe",
        "hub",
        "model.layers.3.mlp.experts.5.up_proj.weight",
        "model.layers.0.mlp.experts.1.down_proj.weight",
    ),
    (
        "qwen3",
        "debugmodel_moe",
        "fused",
        "model.layers.2.mlp.experts.down_proj",
        "model.layers.1.mlp.experts.gate_up_proj",
    ),
]


@pytest.mark.parametrize(
    "family, flavor, layout, missing, wrong", META_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in META_CASES]
)
def test_from_hf_checks_meta_tensors_of_a_folder(tmp_path, family, flavor, layout, missing, wrong):
    adapter, args, sd = build(family, flavor)
    real = {k: v.to(torch.bfloat16).contiguous() for k, v in layouts(adapter, args, sd)[layout].items()}
    save_file(real, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    meta = header_tensors(tmp_path / "model.safetensors")
    assert meta.keys() == real.keys() and all(t.is_meta for t in meta.values())

    out = adapter.from_hf(dict(meta), args)
    assert out.keys() == sd.keys()
    for k, t in out.items():
        assert t.shape == sd[k].shape, k
        if k.endswith("expert_bias"):  # no HF tensor: a fresh zero state, float32
            assert t.dtype == torch.float32 and not t.is_meta and not t.any()
        else:
            assert t.is_meta and t.dtype == torch.bfloat16, k
    if tied(args):
        assert out["output.weight"] is out["tok_embeddings.weight"]
        # A stored copy of the embedding cannot be compared on meta: its value check waits for the data.
        assert (
            adapter.from_hf({**meta, "lm_head.weight": meta["model.embed_tokens.weight"].clone()}, args).keys()
            == sd.keys()
        )
    # Per tensor on meta as well.
    for name in sd:
        names = adapter.hf_names(name, args, frozenset(meta))
        assert adapter.tensor_from_hf(name, {n: meta[n] for n in names}, args).shape == sd[name].shape, name

    # A missing key and a wrong shape: the UserError of real tensors, word for word.
    assert_same_user_error(
        adapter, args, {k: v for k, v in real.items() if k != missing}, {k: v for k, v in meta.items() if k != missing}
    )
    shape = list(real[wrong].shape)
    shape[0] += 1
    assert_same_user_error(
        adapter,
        args,
        {**real, wrong: torch.zeros(shape, dtype=torch.bfloat16)},
        {**meta, wrong: torch.empty(shape, device="meta", dtype=torch.bfloat16)},
    )
