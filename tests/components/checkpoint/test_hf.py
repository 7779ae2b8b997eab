"""Hugging Face folders (hf.py): export and import checked against transformers' own
LlamaForCausalLM, and every bad folder refused from its headers."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchtitan.components.checkpoint import check_hf_folder, load_hf, meta_shapes, save_hf
from torchtitan.config import UserError
from torchtitan.models.registry import get_model_spec

from helpers.tiny_models import materialized, small_llama3_args

# The components are model-agnostic; llama3 is the family they are exercised with here (Qwen3's
# export is tested in tests/models/test_qwen3.py and through the trainer).
SPEC = get_model_spec("llama3")
ModelArgs = SPEC.args_cls


def tokens(args: ModelArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.hf
@pytest.mark.parametrize("n_kv_heads", [2, None], ids=["gqa", "mha"])
def test_export_matches_transformers_logits(tmp_path, n_kv_heads):
    transformers = pytest.importorskip("transformers")
    args = small_llama3_args(n_kv_heads=n_kv_heads, rope_theta=10000.0)
    model = materialized(SPEC.model_cls, args, seed=1)
    save_hf(tmp_path / "hf", model.state_dict(), SPEC.hf, args, torch.float32)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        diff = (hf(tokens(args)).logits - model(tokens(args))).abs().max().item()
    print(f"export {'gqa' if n_kv_heads else 'mha'} logits max abs diff {diff:.2e}")
    assert diff < 1e-4


def test_import_from_transformers_matches_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")

    sd, args = load_hf(tmp_path / "hf", SPEC.hf)
    assert (args.ffn_hidden_dim, args.kv_heads, args.rope_theta, args.norm_eps) == (160, 2, 5e5, 1e-5)
    model = materialized(SPEC.model_cls, args)
    model.load_state_dict(sd)
    with torch.no_grad():
        diff = (hf(tokens(args)).logits - model(tokens(args))).abs().max().item()
    print(f"import logits max abs diff {diff:.2e}")
    assert diff < 1e-4


# Llama 3.2's config.json fields (tied embeddings, "llama3" rotary scaling) at a scale where the
# scaling moves the rotary angles of a 48-token window: theta 100 and 16 original positions put the
# head's pairs across the slowed, ramped and kept bands.
LLAMA_3_2_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def llama_3_2_like(transformers, tmp_path, scaling=LLAMA_3_2_SCALING):
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={**scaling, "rope_theta": 100.0},
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    return hf


def long_tokens(args: ModelArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))


def test_tied_and_scaled_llama_3_2_imports_and_exports_with_transformers_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = llama_3_2_like(transformers, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")  # stored tied
    sd, args = load_hf(tmp_path / "hf", SPEC.hf)
    assert args.tie_word_embeddings and args.rope_scaling.factor == 32.0
    assert args.rope_scaling.original_max_position_embeddings == 16
    model = materialized(SPEC.model_cls, args)
    model.load_state_dict(sd)
    assert model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():
        expected = hf(long_tokens(args)).logits
        diff = (expected - model(long_tokens(args))).abs().max().item()
    assert diff < 1e-4, diff
    # The scaling matters here: without it the 1e-4 check above fails (measured 2e-3 off).
    plain = materialized(SPEC.model_cls, dataclasses.replace(args, rope_scaling=None))
    plain.load_state_dict(sd)
    with torch.no_grad():
        assert (expected - plain(long_tokens(args))).abs().max().item() > 1e-3
    # Export: the same config fields, no lm_head.weight, and transformers' logits again.
    save_hf(tmp_path / "out", model.state_dict(), SPEC.hf, args, torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rope_scaling"]["rope_type"] == "llama3"
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(long_tokens(args)).logits - expected).abs().max().item() < 1e-4


def test_other_rotary_scalings_are_refused(tmp_path):
    transformers = pytest.importorskip("transformers")
    llama_3_2_like(transformers, tmp_path, {"rope_type": "linear", "factor": 2.0})
    with pytest.raises(UserError, match=r"rope_parameters = .*linear.*Llama 3.1's scaling"):
        load_hf(tmp_path / "hf", SPEC.hf)


def test_sharded_save_writes_index_and_loads_back_exactly(tmp_path):
    args = small_llama3_args()
    sd = materialized(SPEC.model_cls, args).state_dict()
    save_hf(tmp_path / "hf", sd, SPEC.hf, args, torch.float32, max_shard_bytes=40_000)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "model.safetensors" not in files and not any(f.startswith(".") for f in files)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in sd.values())
    assert set(index["weight_map"].values()) == set(shards)
    # A tensor larger than the limit gets its own shard; the others stay under it.
    for shard in shards:
        stored = load_file(tmp_path / "hf" / shard)
        assert len(stored) == 1 or sum(t.numel() * 4 for t in stored.values()) <= 40_000

    back, back_args = load_hf(tmp_path / "hf", SPEC.hf, meta_shapes(SPEC, args))
    assert back.keys() == sd.keys() and back_args.ffn_hidden_dim == args.ffn_hidden_dim
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_bfloat16_export(tmp_path):
    args = small_llama3_args()
    sd = materialized(SPEC.model_cls, args).state_dict()
    save_hf(tmp_path / "hf", sd, SPEC.hf, args, torch.bfloat16, bos_id=1, eos_id=2)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["torch_dtype"], config["bos_token_id"], config["eos_token_id"]) == ("bfloat16", 1, 2)
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    back, _ = load_hf(tmp_path / "hf", SPEC.hf)
    for k in sd:
        assert torch.equal(back[k], sd[k].to(torch.bfloat16)), k


def test_refuses_to_overwrite_and_leaves_nothing_behind_on_failure(tmp_path):
    args = small_llama3_args()
    sd = materialized(SPEC.model_cls, args).state_dict()
    (tmp_path / "empty").mkdir()
    save_hf(tmp_path / "empty", sd, SPEC.hf, args, torch.float32)  # an empty folder may be filled
    with pytest.raises(UserError, match="already exists and is not empty"):
        save_hf(tmp_path / "empty", sd, SPEC.hf, args, torch.float32)
    del sd["norm.weight"]
    with pytest.raises(UserError, match="missing keys norm.weight"):
        save_hf(tmp_path / "broken", sd, SPEC.hf, args, torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_shape_mismatch_names_keys_and_shapes(tmp_path):
    args = small_llama3_args()
    save_hf(tmp_path / "hf", materialized(SPEC.model_cls, args).state_dict(), SPEC.hf, args, torch.float32)
    with pytest.raises(UserError, match=r"tok_embeddings\.weight: expected \(256, 64\), found \(128, 64\)"):
        load_hf(tmp_path / "hf", SPEC.hf, meta_shapes(SPEC, small_llama3_args(vocab_size=256)))
    with pytest.raises(UserError, match=r"layers\.2\.attention\.wq\.weight: missing"):
        load_hf(tmp_path / "hf", SPEC.hf, meta_shapes(SPEC, small_llama3_args(n_layers=3)))


def test_unreadable_folders_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_hf(tmp_path / "nope", SPEC.hf)
    (tmp_path / "hf").mkdir()
    with pytest.raises(UserError, match="config.json not found"):
        load_hf(tmp_path / "hf", SPEC.hf)
    args = small_llama3_args()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"hidden_size": 64, "mlp_bias": True}))
    with pytest.raises(UserError, match="lacks intermediate_size"):
        load_hf(tmp_path / "hf", SPEC.hf)
    save_hf(tmp_path / "pickled", materialized(SPEC.model_cls, args).state_dict(), SPEC.hf, args, torch.float32)
    (tmp_path / "pickled" / "model.safetensors").rename(tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(UserError, match="never loaded"):
        load_hf(tmp_path / "pickled", SPEC.hf)


def sharded_folder(tmp_path, name="hf"):
    args = small_llama3_args()
    save_hf(
        tmp_path / name,
        materialized(SPEC.model_cls, args).state_dict(),
        SPEC.hf,
        args,
        torch.float32,
        max_shard_bytes=40_000,
    )
    return tmp_path / name, args


def cast_folder(tmp_path, name, dtype):
    """A sharded folder whose first file holds its tensors in `dtype`."""
    folder, _ = sharded_folder(tmp_path, name)
    first = sorted(folder.glob("model-*.safetensors"))[0]
    save_file({k: v.to(dtype) for k, v in load_file(first).items()}, str(first))
    return folder


def test_bad_folders_are_refused_from_their_headers(tmp_path):
    """Each refused by check_hf_folder, which reads no weight: a shard of the index missing, a tensor the
    index lists but no shard holds, a dtype a model cannot take, another flavor's shapes, another family."""
    folder, args = sharded_folder(tmp_path, "missing_shard")
    sorted(folder.glob("model-*.safetensors"))[1].unlink()
    with pytest.raises(
        UserError,
        match=r"model.safetensors.index.json names model-0000\d-of-\d+.safetensors, which "
        r"does not exist",
    ):
        check_hf_folder(folder, SPEC.hf, meta_shapes(SPEC, args))

    folder, _ = sharded_folder(tmp_path, "unlisted")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = next(iter(index["weight_map"].values()))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"lists tensors missing from their files: model.layers.0.mlp.extra.weight"):
        check_hf_folder(folder, SPEC.hf, meta_shapes(SPEC, args))

    folder = cast_folder(tmp_path, "int8", torch.int8)
    with pytest.raises(UserError, match=r"is stored as I8, which a model cannot take"):
        check_hf_folder(folder, SPEC.hf, meta_shapes(SPEC, args))

    # uint8 is read (gpt-oss's MXFP4 blocks and scales), but a family that does not dequantize it refuses it.
    folder = cast_folder(tmp_path, "uint8", torch.uint8)
    with pytest.raises(
        UserError,
        match=r"our \S+ would be read from packed integer \(uint8\) data, which this "
        r"family's import does not dequantize",
    ):
        check_hf_folder(folder, SPEC.hf, meta_shapes(SPEC, args))

    folder, _ = sharded_folder(tmp_path, "flavor")
    with pytest.raises(UserError, match=r"tok_embeddings\.weight: expected \(256, 64\), found \(128, 64\)"):
        check_hf_folder(folder, SPEC.hf, meta_shapes(SPEC, small_llama3_args(vocab_size=256)))

    qwen = get_model_spec("qwen3")
    with pytest.raises(UserError, match=r"describes model_type 'llama', but this model reads 'qwen3'"):
        check_hf_folder(folder, qwen.hf)


def test_an_export_is_readable_by_others_as_the_umask_allows(tmp_path):
    # safetensors writes its files for their owner only (0600), and the staging folder is a fresh
    # mkdir; a published folder follows the umask as a plain write would.
    import os
    import stat

    args = small_llama3_args()
    sd = materialized(SPEC.model_cls, args).state_dict()
    before = os.umask(0o022)
    try:
        save_hf(tmp_path / "hf", sd, SPEC.hf, args, torch.float32)
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
