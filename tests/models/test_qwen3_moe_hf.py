"""Qwen3-MoE <-> Hugging Face Qwen3MoeForCausalLM: export loads in transformers with our logits,
transformers' save_pretrained imports with its logits, both expert layouts (the hub's per-expert
tensors, transformers 5's fused gate_up_proj / down_proj) read to the same tensors, and configs we
cannot represent are refused naming the field."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchtitan.components.checkpoint import load_hf, meta_shapes, save_hf
from torchtitan.config.errors import UserError
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3.hf_config import args_from_hf_config, hf_config
from torchtitan.models.qwen3.state_dict_adapter import from_hf, to_hf
from torchtitan.models.registry import get_model_spec

from helpers.tiny_models import materialized

SPEC = get_model_spec("qwen3")
E, TOP_K, HIDDEN, DIM = 4, 2, 32, 64


def moe_args(route_norm: bool = True, **kw):
    base = dict(
        dim=DIM,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=128,
        vocab_size=128,
        max_seq_len=64,
        moe=MoEArgs(num_experts=E, top_k=TOP_K, hidden_dim=HIDDEN, route_norm=route_norm),
    )
    base.update(kw)
    return SPEC.args_cls(**base)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 1):
    """Per-feature norm weights (ones would hide a swapped norm) and every matrix ~ N(0, 1/fan_in),
    so that the experts (whose init is small) and the routing weigh in the logits: a swapped gate and
    up projection, or another renormalization of the top-k weights, shows far above 1e-4. Embeddings
    are left as they are. fan_in is the last dimension for nn.Linear weights and both 3-D layouts."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif p.dim() >= 2 and "embed" not in name:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def tokens(vocab: int = 128):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


def expert_bias_keys(args) -> list[str]:
    return [f"layers.{i}.feed_forward.expert_bias" for i in range(args.n_layers)]


# ---- export: our model -> transformers ----


@pytest.mark.parametrize("route_norm", [True, False])
def test_export_loads_as_qwen3_moe_with_our_logits(tmp_path, route_norm):
    transformers = pytest.importorskip("transformers")
    args = moe_args(route_norm)
    model = materialized(SPEC.model_cls, args, seed=3)
    randomize(model)
    # Qwen3-MoE has no balancing bias: compare with ours at zero (as init leaves it).
    sd = model.state_dict()
    assert all(torch.equal(sd[k], torch.zeros(E)) for k in expert_bias_keys(args))
    save_hf(tmp_path / "hf", sd, SPEC.hf, args, torch.float32)

    # On disk: the hub layout, one tensor per expert and projection; no bias.
    on_disk = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for ours, proj in [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")]:
        expert_2 = sd[f"layers.1.feed_forward.experts.{ours}"][2]
        assert torch.equal(on_disk[f"model.layers.1.mlp.experts.2.{proj}.weight"], expert_2)
    assert torch.equal(on_disk["model.layers.0.mlp.gate.weight"], sd["layers.0.feed_forward.router.gate.weight"])
    assert not any("bias" in k for k in on_disk)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    c = hf.config
    moe = (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob)
    assert moe == (E, TOP_K, HIDDEN, route_norm)
    every_layer = (c.decoder_sparse_step, list(c.mlp_only_layers), c.router_aux_loss_coef, c.output_router_logits)
    assert every_layer == (1, [], 0.0, False)
    assert c.head_dim == 16 and not c.tie_word_embeddings
    x = tokens()
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    diff = (ours - theirs).abs().max().item()
    print(f"export route_norm={route_norm}: max |logit diff| = {diff:.3g}")
    assert diff < 1e-4

    # The comparison sees what it names: our model with gate and up swapped, or with the other
    # renormalization, is far from transformers' logits.
    swapped = materialized(SPEC.model_cls, args)
    swap = {"experts.w1": "experts.w3", "experts.w3": "experts.w1"}
    swapped.load_state_dict({k: sd[next((k.replace(a, b) for a, b in swap.items() if a in k), k)] for k in sd})
    other_norm = materialized(SPEC.model_cls, moe_args(not route_norm))
    other_norm.load_state_dict(sd)
    with torch.no_grad():
        assert (swapped(x) - theirs).abs().max().item() > 1e-2
        assert (other_norm(x) - theirs).abs().max().item() > 1e-2


def test_export_drops_a_nonzero_bias_with_a_warning_and_refuses_other_routing(caplog):
    args = moe_args()
    sd = materialized(SPEC.model_cls, args).state_dict()
    sd["layers.0.feed_forward.expert_bias"] = torch.tensor([0.1, -0.1, 0.0, 0.0])
    with caplog.at_level("WARNING"):
        hf = to_hf(sd, args)
    assert "layers.0.feed_forward.expert_bias" in caplog.text and not any("bias" in k for k in hf)
    del sd["layers.1.feed_forward.expert_bias"]  # absent is fine too: it is dropped anyway
    to_hf(sd, args)
    for name, value in [("score_func", "sigmoid"), ("num_shared_experts", 1), ("route_scale", 2.5)]:
        other = moe_args(moe=MoEArgs(num_experts=E, top_k=TOP_K, hidden_dim=HIDDEN, **{name: value}))
        with pytest.raises(UserError, match=f"{name} = {value!r}"):
            hf_config(other)
        with pytest.raises(UserError, match=name):
            to_hf(materialized(SPEC.model_cls, other).state_dict(), other)


# ---- import: transformers -> our model ----


@pytest.mark.parametrize("route_norm", [True, False])
def test_save_pretrained_imports_with_transformers_logits(tmp_path, route_norm):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=DIM,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=HIDDEN,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=route_norm,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    randomize(hf, seed=2)
    hf.save_pretrained(tmp_path / "hf")

    sd, args = load_hf(tmp_path / "hf", SPEC.hf)
    assert args.moe == MoEArgs(num_experts=E, top_k=TOP_K, hidden_dim=HIDDEN, route_norm=route_norm)
    assert (args.dim, args.head_dim, args.n_kv_heads, args.hidden_dim) == (DIM, 16, 2, 128)
    assert all(torch.equal(sd[k], torch.zeros(E)) for k in expert_bias_keys(args))  # fresh balancing state
    # What the trainer's initial load checks: every tensor of our model, the bias included.
    load_hf(tmp_path / "hf", SPEC.hf, meta_shapes(SPEC, args))
    model = materialized(SPEC.model_cls, args, seed=5)
    model.load_state_dict(sd)  # strict
    x = tokens()
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    diff = (ours - theirs).abs().max().item()
    print(f"import route_norm={route_norm}: max |logit diff| = {diff:.3g}")
    assert diff < 1e-4

    # transformers' own (in-memory, fused) state dict gives exactly the tensors of its files.
    hf_sd = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_sd
    fused = from_hf(hf_sd, args)
    assert fused.keys() == sd.keys() and all(torch.equal(fused[k], sd[k]) for k in sd)
    # The config round trip.
    assert args_from_hf_config(hf_config(args)) == args


def test_published_30b_a3b_config_gives_the_flavor():
    # Qwen/Qwen3-30B-A3B config.json (transformers 4.51 spelling).
    published = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    assert args_from_hf_config(published) == SPEC.flavors["30B-A3B"]
    # transformers 5 writes num_local_experts; without head_dim, Qwen3MoeConfig's attention uses hidden / heads.
    v5 = {k: v for k, v in published.items() if k not in ("num_experts", "head_dim")} | {"num_local_experts": 128}
    args = args_from_hf_config(v5)
    assert args.moe.num_experts == 128 and args.head_dim == 2048 // 32


# ---- the two expert layouts ----


def _hub_and_fused(args, sd):
    """The same weights as hand-written Hugging Face state dicts: per expert (hub files) and fused
    (transformers 5 in memory: gate rows, then up rows)."""
    common = {k: v for k, v in to_hf(sd, args).items() if ".mlp.experts." not in k}
    hub, fused = dict(common), dict(common)
    for i in range(args.n_layers):
        w1, w3, w2 = (sd[f"layers.{i}.feed_forward.experts.{w}"] for w in ("w1", "w3", "w2"))
        for e in range(E):
            hub[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"] = w1[e].clone()
            hub[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"] = w3[e].clone()
            hub[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"] = w2[e].clone()
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = w2.clone()
    return hub, fused


def test_per_expert_and_fused_files_read_to_the_same_tensors(tmp_path):
    args = moe_args()
    model = materialized(SPEC.model_cls, args, seed=4)
    randomize(model)
    sd = model.state_dict()
    hub, fused = _hub_and_fused(args, sd)
    assert to_hf(sd, args).keys() == hub.keys()  # to_hf writes the hub layout
    for name, hf_sd in [("hub", hub), ("fused", fused)]:
        save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(tmp_path / f"{name}.safetensors"))
    from_hub = from_hf(load_file(str(tmp_path / "hub.safetensors")), args)
    from_fused = from_hf(load_file(str(tmp_path / "fused.safetensors")), args)
    for back in (from_hub, from_fused):
        assert back.keys() == sd.keys()
        for k in sd:
            assert torch.equal(back[k], sd[k]), k
        assert back["layers.0.feed_forward.experts.w1"].shape == (E, HIDDEN, DIM)
        assert back["layers.0.feed_forward.experts.w2"].shape == (E, DIM, HIDDEN)
    # A non-zero bias is not exported: it reads back as zeros.
    sd["layers.1.feed_forward.expert_bias"] = torch.ones(E)
    assert torch.equal(from_hf(to_hf(sd, args), args)["layers.1.feed_forward.expert_bias"], torch.zeros(E))
    # Layers may differ in layout (each layer's is detected on its own).
    mixed = {k: v for k, v in hub.items() if not k.startswith("model.layers.1.mlp.experts.")}
    mixed |= {k: v for k, v in fused.items() if k.startswith("model.layers.1.mlp.experts.")}
    assert all(torch.equal(from_hf(mixed, args)[k], sd[k]) for k in sd if "bias" not in k)


def test_wrong_expert_keys_and_shapes_are_named():
    args = moe_args()
    sd = materialized(SPEC.model_cls, args).state_dict()
    hub, fused = _hub_and_fused(args, sd)
    del hub["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(
        UserError,
        match=r"Qwen3-MoE model with 2 layers, 4 experts.*"
        r"missing keys model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight",
    ):
        from_hf(hub, args)
    both = {**fused, "model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(HIDDEN, DIM)}
    with pytest.raises(UserError, match=r"unknown keys model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight"):
        from_hf(both, args)
    with pytest.raises(UserError, match=r"gate_up_proj has shape \(4, 64, 64\), expected \(8, 64, 64\)"):
        from_hf(fused, moe_args(moe=MoEArgs(num_experts=8, top_k=TOP_K, hidden_dim=HIDDEN)))
    # Dense weights for an MoE model and back.
    dense = dataclasses.replace(args, moe=None)
    with pytest.raises(UserError, match=r"unknown keys model\.layers\.0\.mlp\.gate\.weight"):
        from_hf(fused, dense)
    with pytest.raises(UserError, match=r"unknown keys model\.layers\.0\.mlp\.gate_proj\.weight"):
        from_hf(to_hf(materialized(SPEC.model_cls, dense).state_dict(), dense), args)


# ---- configs we cannot represent ----


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decoder_sparse_step": 2}, r"decoder_sparse_step = 2.*no dense layers"),
        ({"mlp_only_layers": [0]}, r"mlp_only_layers = \[0\].*no dense layers"),
        ({"shared_expert_intermediate_size": 64}, r"shared_expert_intermediate_size = 64"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok = 5"),
        ({"num_experts": 0}, r"num_experts = 0"),
        ({"num_experts": None}, r"lacks num_experts"),
        ({"moe_intermediate_size": None}, r"lacks moe_intermediate_size"),
        # A window converts on every layer only (max_window_layers 0): transformers 5 ignores max_window_layers
        # (here the number of layers, as our no-window export writes it) and earlier releases do not.
        ({"use_sliding_window": True, "sliding_window": 8}, r"max_window_layers = 2.*ignores max_window_layers"),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 0,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            r"layer_types = .*no per-layer types",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, r"rope_parameters"),
    ],
)
def test_unrepresentable_moe_configs_are_user_errors(change, message):
    config = {**hf_config(moe_args()), **change}
    config = {k: v for k, v in config.items() if v is not None or k not in change}
    with pytest.raises(UserError, match=message):
        args_from_hf_config(config)
