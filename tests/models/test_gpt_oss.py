"""gpt-oss (torchtitan/models/gpt_oss) against transformers' GptOssForCausalLM and against plain
references:
- the logits of a small model equal transformers' (eager attention, float32) with our weights put in
  its layout (gate and up interleaved in gate_up_proj): sinks, alternating windows, YaRN, the biased
  router and the clamped SwiGLU at once; a window, the sinks and the clamp are each seen to matter;
- YaRN's frequencies and attention factor equal transformers' rope init for the published config;
- the published flavors' total parameters equal transformers' model of the published config, and the
  active ones what a token uses (the model card's 3.6B and 5.1B without the input embedding);
- FLOPs count the active parameters and the windowed attention;
- each attention kernel available on CPU (SDPA/math, the per-document split, the KV cache,
  FlexAttention's forward) with sinks, a window and block-causal documents equals an explicit softmax
  over the masked logits with a sink column (ring context parallel: tests/distributed);
- KV-cache generation equals the full forward;
- preflight refuses an EP degree that does not divide the experts and a TP degree that does not
  divide the heads, and accepts a window that covers the training window (with a warning).
"""

import copy
import dataclasses
import math

import pytest
import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.attention import (
    document_ids,
    flex_attention_fn,
    sdpa_attention,
    split_attention,
)
from torchtitan.models.common.layers import KVCache, kv_caches
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.rotary import yarn_frequencies
from torchtitan.models.common.spec import transformer_flops_per_token
from torchtitan.models.gpt_oss.args import PUBLISHED_YARN, ModelArgs, flavors, validate
from torchtitan.models.gpt_oss.model import SinkAttention, Transformer
from torchtitan.models.registry import get_model_spec

transformers = pytest.importorskip("transformers")

SMALL = dict(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=256,
    sliding_window=5,
    max_seq_len=64,
    moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=48, load_balance_coeff=None),
    # YaRN with a short original context, so that the ramp and the factor act at these positions.
    rope_scaling=dataclasses.replace(PUBLISHED_YARN, original_max_position_embeddings=16, factor=4.0),
)


def small_args(**kw) -> ModelArgs:
    return ModelArgs(**{**SMALL, **kw})


def materialized(args: ModelArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.eval()


@torch.no_grad()
def sharpen(model: Transformer, seed: int = 1):
    """Weights large enough for the window, the sinks and the clamp to show in the logits (the
    training init, std 0.02, gives near-uniform attention and expert inputs far from the clamp)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif "embeddings" in name or p.ndim == 1 or name.endswith("_bias"):
            p.copy_(torch.randn(p.shape, generator=g))
        else:  # experts' weights are [experts, in, out], the others nn.Linear's [out, in]
            fan_in = p.shape[-2] if "experts" in name else p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=g) * 3 * fan_in**-0.5)


def hf_config(args: ModelArgs):
    y = args.rope_scaling
    return transformers.GptOssConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.moe.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        num_local_experts=args.moe.num_experts,
        num_experts_per_tok=args.moe.top_k,
        sliding_window=args.sliding_window,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": args.rope_theta,
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "truncate": y.truncate,
        },
        swiglu_limit=args.swiglu_limit,
        tie_word_embeddings=False,
        layer_types=None,
    )


def to_hf_layout(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names (the test's own table; our experts already have its layout)."""
    renames = {
        "tok_embeddings.": "model.embed_tokens.",
        "norm.": "model.norm.",
        "output.": "lm_head.",
        "layers.": "model.layers.",
        "attention_norm.": "input_layernorm.",
        "ffn_norm.": "post_attention_layernorm.",
        "attention.wq.": "self_attn.q_proj.",
        "attention.wk.": "self_attn.k_proj.",
        "attention.wv.": "self_attn.v_proj.",
        "attention.wo.": "self_attn.o_proj.",
        "attention.sinks.weight": "self_attn.sinks",
        "feed_forward.router.gate.": "mlp.router.",
        "feed_forward.experts.": "mlp.experts.",
    }
    out = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("expert_bias"):
            continue
        for ours, theirs in renames.items():
            name = name.replace(ours, theirs) if name.startswith(ours) or f".{ours}" in name else name
        out[name] = tensor
    return out


def hf_model(model: Transformer):
    cfg = hf_config(model.args)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    hf = transformers.GptOssForCausalLM(cfg).float().eval()
    missing, unexpected = hf.load_state_dict(to_hf_layout(model), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


def tokens(batch: int = 2, seq: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def float32_tolerance(model: Transformer, x: torch.Tensor) -> float:
    """Twice our own float32 round-off on these logits (against the same model in float64): two float32
    implementations of one function differ by about their round-offs, which the sharpened weights make ~1e-4
    here, so a fixed 1e-4 would judge the summation order. Far below what any feature moves (> 1e-2, below)."""
    with torch.no_grad():
        error = (model(x).double() - copy.deepcopy(model).double()(x)).abs().max().item()
    assert error < 1e-3, error
    return 2 * error


def test_logits_equal_transformers_gpt_oss():
    model = materialized(small_args())
    sharpen(model)
    hf = hf_model(model)
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    x = tokens()
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    print(f"max |logit diff| vs transformers: {(ours - theirs).abs().max().item():.2e}")
    torch.testing.assert_close(ours, theirs, atol=float32_tolerance(model, x), rtol=0)


@pytest.mark.parametrize("change", ["window", "sinks", "clamp", "yarn"])
def test_each_difference_changes_the_logits(change):
    """Against the same model with one feature removed: the comparison above would not notice a
    feature that does nothing at these sizes."""
    args = small_args()
    model = materialized(args)
    sharpen(model)
    x = tokens()
    with torch.no_grad():
        before = model(x)
        if change == "window":
            for layer in model.layers.values():
                layer.attention.window = None
        elif change == "sinks":
            for layer in model.layers.values():
                layer.attention.sinks.weight.fill_(-1e4)
        elif change == "clamp":
            for layer in model.layers.values():
                layer.feed_forward.experts.limit = 1e9
        else:
            model.args = dataclasses.replace(args, rope_scaling=None)
            model.rope = model._rope()
        assert (model(x) - before).abs().max() > 1e-2


def test_yarn_equals_transformers_rope_init():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.GptOssConfig()
    assert cfg.rope_parameters["truncate"] is False and cfg.rope_parameters["rope_theta"] == 150000.0
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours, magnitude = yarn_frequencies(64, 150000.0, PUBLISHED_YARN)
    torch.testing.assert_close(ours, inv_freq.float(), atol=0, rtol=1e-6)
    assert magnitude == pytest.approx(factor, rel=1e-12) and factor == pytest.approx(0.1 * math.log(32) + 1)
    # truncate matters here: rounding the ramp's bounds outwards gives other frequencies.
    rounded, _ = yarn_frequencies(64, 150000.0, dataclasses.replace(PUBLISHED_YARN, truncate=True))
    assert (rounded - inv_freq).abs().max() > 1e-4


def _hf_counts(n_layers: int, experts: int) -> tuple[int, int]:
    cfg = transformers.GptOssConfig(num_hidden_layers=n_layers, num_local_experts=experts, layer_types=None)
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(cfg)
    total = sum(p.numel() for p in hf.parameters())
    per_expert = sum(p.numel() for p in hf.model.layers[0].mlp.experts.parameters()) // experts
    active = total - n_layers * (experts - cfg.num_experts_per_tok) * per_expert
    return total, active


@pytest.mark.parametrize(
    "flavor, layers, experts, card_total, card_active",
    [("20b", 24, 32, 20.9e9, 3.6e9), ("120b", 36, 128, 116.8e9, 5.1e9)],
)
def test_published_parameter_counts(flavor, layers, experts, card_total, card_active):
    size = get_model_spec("gpt_oss").size(flavors[flavor])
    assert (size.total, size.active) == _hf_counts(layers, experts)
    # The model card's figures: the active count leaves out the input embedding (a lookup).
    assert size.total == pytest.approx(card_total, rel=5e-3)
    assert size.active - size.embedding == pytest.approx(card_active, rel=1e-2)


def test_flops_count_active_parameters_and_windows():
    spec = get_model_spec("gpt_oss")
    args = flavors["20b"]
    size = spec.size(args)
    seq = 4096
    windows = [128, None] * 12
    expected = transformer_flops_per_token(size.active - size.embedding, 64 * 64, windows, seq)
    assert spec.flops_per_token(args, seq) == expected
    # Half the layers see at most 128 keys: about half the attention of full causal layers everywhere.
    full = transformer_flops_per_token(size.active - size.embedding, 64 * 64, [None] * 24, seq)
    attention = 6 * (size.active - size.embedding)
    assert (expected - attention) / (full - attention) == pytest.approx(
        (4097 / 2 + (128 * 129 / 2 + (seq - 128) * 128) / seq) / 4097, rel=1e-9
    )


# ---- the kernels against a plain reference ---------------------------------------------------


def reference(q, k, v, sinks, doc_ids, window):
    """Explicit softmax over the masked logits with a sink column, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    seq = q.shape[2]
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    mask = (j <= i) & (i - j < window if window is not None else True)
    mask = mask[None, None] & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.double()[None, :, None, None].expand(*logits.shape[:3], 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def sink_out(attention_fn, q, k, v, sinks, doc_ids, window):
    out, lse = attention_fn(q, k, v, doc_ids=doc_ids, window=window, return_lse=True)
    return out * torch.sigmoid(lse - sinks[None, :, None]).unsqueeze(-1)


def kv_cache_fn(q, k, v, doc_ids=None, window=None, return_lse=True):
    """Decoding: a prompt of 11 tokens, then one token at a time (one document: the cache has no documents)."""
    assert doc_ids is None
    cache, outs, lses = KVCache(q.shape[2]), [], []
    for start, end in [(0, 11)] + [(p, p + 1) for p in range(11, q.shape[2])]:
        o, lse = cache.attend(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], start, window, True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


KERNELS = {"sdpa": sdpa_attention, "split": split_attention, "kv_cache": kv_cache_fn}


@pytest.mark.parametrize("kernel", [*KERNELS, "flex_forward"])
@pytest.mark.parametrize("window", [None, 4])
def test_kernels_with_sinks_windows_and_documents_equal_the_reference(kernel, window):
    g = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, seq, d = 2, 4, 2, 24, 16
    q = torch.randn(batch, heads, seq, d, generator=g) * 2
    k, v = (torch.randn(batch, kv_heads, seq, d, generator=g) * 2 for _ in range(2))
    sinks = torch.randn(heads, generator=g) * 2
    eos = torch.zeros(batch, seq, dtype=torch.long)
    eos[0, [6, 15]] = 1
    eos[1, [2]] = 1
    docs = None if kernel == "kv_cache" else document_ids(eos, 1)
    ref_docs = torch.zeros(batch, seq, dtype=torch.int32) if docs is None else docs
    expected = reference(q, k, v, sinks, ref_docs, window)
    if kernel == "flex_forward":
        fn = flex_attention_fn(compiled=False)
    else:
        fn = KERNELS[kernel]
    got = sink_out(fn, q, k, v, sinks, docs, window)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)
    if kernel != "flex_forward":  # gradients flow to the sinks through the lse (FlexAttention: no CPU backward)
        qg, sg = q.clone().requires_grad_(), sinks.clone().requires_grad_()
        sink_out(fn, qg, k, v, sg, docs, window).square().sum().backward()
        qr, sr = q.double().requires_grad_(), sinks.double().requires_grad_()
        reference(qr, k, v, sr, ref_docs, window).square().sum().backward()
        torch.testing.assert_close(sg.grad.double(), sr.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(qg.grad.double(), qr.grad, atol=1e-4, rtol=1e-4)


def test_kv_cache_generation_equals_the_full_forward():
    model = materialized(small_args())
    sharpen(model)
    x = tokens(seq=40, seed=1)
    with torch.no_grad():
        full = model(x)
        caches = kv_caches(model, 40)
        steps = [model(x[:, :16], cache=caches, start_pos=0)]
        steps += [model(x[:, p : p + 1], cache=caches, start_pos=p) for p in range(16, 40)]
    # float32 round-off of the sharpened weights (logits up to ~10; measured 2e-4); a wrong mask,
    # window or sink in the cache path moves logits by O(1).
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-3


def test_debugmodel_has_both_window_kinds_sinks_and_experts():
    args = flavors["debugmodel"]
    model = materialized(get_model_spec("gpt_oss").args_for_training("debugmodel", 4096, 256))
    windows = [layer.attention.window for layer in model.layers.values()]
    assert windows == [args.sliding_window, None] * (args.n_layers // 2) and args.sliding_window < 64
    assert all(isinstance(layer.attention, SinkAttention) for layer in model.layers.values())
    assert args.moe.num_experts >= 4 and args.moe.top_k == 4
    sinks = model.layers["0"].attention.sinks.weight
    assert sinks.shape == (args.n_heads,) and sinks.abs().max() > 0


# ---- checks before launch --------------------------------------------------------------------


class Dims:
    def __init__(self, ep=1):
        self.ep = ep


def test_validate_refuses_ep_that_does_not_divide_the_experts():
    with pytest.raises(UserError, match="num_experts = 8 is not divisible by parallelism.expert_parallel_degree = 3"):
        validate(flavors["debugmodel"], Dims(ep=3))
    validate(flavors["debugmodel"], Dims(ep=8))


def test_a_window_that_covers_the_training_window_is_full_attention(caplog):
    args = get_model_spec("gpt_oss").args_for_training("20b", 201088, 128)
    with caplog.at_level("WARNING"):
        validate(args, Dims())
    assert "like the full ones" in caplog.text
    caplog.clear()
    validate(get_model_spec("gpt_oss").args_for_training("20b", 201088, 4096), Dims())
    assert not caplog.text


@pytest.mark.parametrize(
    "nproc, args, message",
    [
        (
            3,
            ["--parallelism.expert_parallel_degree", "3"],
            "num_experts = 8 is not divisible by parallelism.expert_parallel_degree = 3",
        ),
        (
            3,
            ["--parallelism.tensor_parallel_degree", "3"],
            "tensor_parallel_degree = 3 does not divide model n_heads = 8 .query heads .and their sinks.",
        ),
    ],
)
def test_run_train_refuses_before_launch(tmp_path, nproc, args, message):
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NGPU=str(nproc), PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(
        ["./run_train.sh", "--model.name", "gpt_oss", "--job.dump_folder", str(tmp_path), *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(message, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


# ---- Hugging Face: config.json and state dict both ways (the trainer's export/import under every
# layout: tests/distributed/test_hf_sharded.py) ---------------------------------------------------


def test_hf_adapter_round_trip_and_transformers_logits():
    spec = get_model_spec("gpt_oss")
    args = small_args()
    model = materialized(args)
    sharpen(model)
    config = spec.hf.config(args, torch.float32, 1, 2)
    assert config["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert config["rope_parameters"]["truncate"] is False
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config._attn_implementation = "eager"
    hf = transformers.GptOssForCausalLM(hf_config).eval()
    hf_sd = spec.hf.to_hf(model.state_dict(), args)
    hf.load_state_dict(hf_sd, strict=True)  # every name and shape, nothing left over
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=float32_tolerance(model, x), rtol=0)
    back = spec.hf.from_hf(dict(hf_sd), args)
    ours = model.state_dict()
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    assert spec.hf.args_from_config(config) == args


def test_mxfp4_import_equals_transformers_dequantization(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from torchtitan.components.checkpoint import load_hf

    from helpers.hf import gpt_oss_mxfp4_folder

    args = small_args(dim=64, moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=64, load_balance_coeff=None))
    quantized = gpt_oss_mxfp4_folder(tmp_path / "mxfp4", args)
    ours, _ = load_hf(tmp_path / "mxfp4", get_model_spec("gpt_oss").hf)
    checked = 0
    for i in range(args.n_layers):
        for proj in ("gate_up_proj", "down_proj"):
            hf = f"model.layers.{i}.mlp.experts.{proj}"
            expected = convert_moe_packed_tensors(
                quantized[hf + "_blocks"].clone(), quantized[hf + "_scales"].clone(), dtype=torch.float32
            )
            got = ours[f"layers.{i}.feed_forward.experts.{proj}"]
            assert got.dtype == torch.float32 and torch.equal(got, expected), hf
            checked += 1
    assert checked == 2 * args.n_layers
    # A block of experts read from its own bytes only (what an EP or FSDP rank reads) is that block.
    spec = get_model_spec("gpt_oss")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    stored = {k: v for k, v in quantized.items() if k.startswith(name)}

    def read(hf_name, offset, shape):
        return stored[hf_name][tuple(slice(o, o + n) for o, n in zip(offset, shape))]

    block = spec.hf.block_from_hf(
        "layers.1.feed_forward.experts.gate_up_proj", read, args, frozenset(stored), (2, 32, 0), (2, 32, 128)
    )
    torch.testing.assert_close(block, ours["layers.1.feed_forward.experts.gate_up_proj"][2:4, 32:64], atol=0, rtol=0)


def test_mxfp4_scales_that_do_not_match_the_blocks_are_refused_before_launch(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers.hf import gpt_oss_mxfp4_folder

    spec = get_model_spec("gpt_oss")
    folder = tmp_path / "bad"
    gpt_oss_mxfp4_folder(folder, spec.args_for_training("debugmodel", 4096, 256), bad_scales=True)
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NGPU="1", PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(
        [
            "./run_train.sh",
            "--model.name",
            "gpt_oss",
            "--job.dump_folder",
            str(tmp_path / "out"),
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_path",
            str(folder),
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (
        "model.layers.0.mlp.experts.gate_up_proj: MXFP4 scales (8, 512, 9) (torch.uint8) do not match blocks "
        "(8, 512, 8, 16)"
    ) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_hf_import_refuses_what_it_cannot_read():
    spec = get_model_spec("gpt_oss")
    args = small_args()
    config = spec.hf.config(args)
    with pytest.raises(UserError, match="layer_types .* even layers"):
        spec.hf.args_from_config({**config, "layer_types": ["full_attention", "sliding_attention"] * 2})
