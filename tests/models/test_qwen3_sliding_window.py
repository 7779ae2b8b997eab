"""Qwen3 sliding-window attention against Hugging Face transformers: a Qwen3ForCausalLM whose last
layers slide (use_sliding_window, sliding_window, max_window_layers) converts to our args and gives
its logits; the window is seen to matter; the config round trip; a window with block-causal
documents; Qwen3-MoE, which slides every layer or none."""

import dataclasses

import pytest
import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3.args import ModelArgs
from torchtitan.models.qwen3.hf_config import args_from_hf_config, hf_config
from torchtitan.models.qwen3.model import Transformer
from torchtitan.models.qwen3.state_dict_adapter import from_hf, to_hf

from helpers.tiny_models import materialized

transformers = pytest.importorskip("transformers")

WINDOW, FIRST_SLIDING, LAYERS, VOCAB, SEQ = 5, 2, 4, 256, 24
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 1):
    """Weights that make attention sharp enough for the window to show in the logits: norms
    per-feature (ones would hide a misplaced norm), matrices ~ N(0, 1/fan_in), embeddings N(0, 1).
    transformers' own init (std 0.02) gives near-uniform attention, where dropping keys changes little."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def hf_qwen3(**config) -> "transformers.PreTrainedModel":
    cfg = transformers.Qwen3Config(
        **{**TINY, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": FIRST_SLIDING, **config}
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    randomize(model)
    return model


def ours_from(hf, args: ModelArgs) -> Transformer:
    model = materialized(Transformer, args)  # init_weights: the rotary table; every weight is then replaced
    model.load_state_dict(from_hf(hf.state_dict(), args))
    return model.eval()


def windowed_args(**change) -> ModelArgs:
    """Our args of TINY's shape whose layers FIRST_SLIDING and later slide by WINDOW, with `change`."""
    base = dict(
        dim=64,
        n_layers=LAYERS,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=96,
        vocab_size=VOCAB,
        sliding_window=WINDOW,
        max_window_layers=FIRST_SLIDING,
    )
    return ModelArgs(**{**base, **change})


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))


def test_windowed_qwen3_matches_transformers_and_the_window_matters():
    hf = hf_qwen3()
    assert hf.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    args = args_from_hf_config(hf.config.to_dict())
    assert (args.sliding_window, args.max_window_layers) == (WINDOW, FIRST_SLIDING)
    assert [args.layer_window(i) for i in range(LAYERS)] == [None, None, WINDOW, WINDOW]
    model = ours_from(hf, args)
    x = tokens()
    with torch.no_grad():
        theirs, ours = hf(x).logits, model(x)
        diff = (ours - theirs).abs().max().item()
        # The same weights without the window: far off, so the comparison above tests the window (and
        # its size: transformers' window W is the last W positions, the query's own included, as ours).
        unwindowed = ours_from(hf, dataclasses.replace(args, sliding_window=None, max_window_layers=0))
        off_by_none = (unwindowed(x) - theirs).abs().max().item()
        one_wider = ours_from(hf, dataclasses.replace(args, sliding_window=WINDOW + 1))
        off_by_one = (one_wider(x) - theirs).abs().max().item()
        every_layer = ours_from(hf, dataclasses.replace(args, max_window_layers=0))
        off_in_layers = (every_layer(x) - theirs).abs().max().item()
    print(
        f"max |logit diff| vs transformers: {diff:.2e}; without the window {off_by_none:.2e}; "
        f"window + 1 {off_by_one:.2e}; every layer windowed {off_in_layers:.2e}"
    )
    assert diff < 1e-4
    assert min(off_by_none, off_by_one, off_in_layers) > 1e-2
    # Positions within the window of the start see every earlier token: the same logits there.
    torch.testing.assert_close(unwindowed(x)[:, :WINDOW], theirs[:, :WINDOW], rtol=0, atol=1e-4)


def test_transformers_loads_our_windowed_export(tmp_path):
    """Our args with a window -> config.json + weights -> transformers gives our logits."""
    import json

    from safetensors.torch import save_file

    args = windowed_args(max_seq_len=64, rope_theta=10000.0, max_window_layers=1)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    randomize(model)
    save_file(
        {k: v.contiguous() for k, v in to_hf(model.state_dict(), args).items()}, str(tmp_path / "model.safetensors")
    )
    (tmp_path / "config.json").write_text(json.dumps(hf_config(args)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    assert hf.config.layer_types == ["full_attention"] + ["sliding_attention"] * 3
    assert hf.config.sliding_window == WINDOW
    x = tokens()
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max().item() < 1e-4


def test_config_round_trip_and_what_transformers_builds_from_it():
    args = windowed_args()
    written = hf_config(args)
    assert (written["use_sliding_window"], written["sliding_window"], written["max_window_layers"]) == (
        True,
        WINDOW,
        FIRST_SLIDING,
    )
    assert args_from_hf_config(written) == args
    # transformers derives the same layer types from the fields alone as the list we write.
    without_list = {k: v for k, v in written.items() if k not in ("architectures", "layer_types")}
    assert transformers.Qwen3Config(**without_list).layer_types == written["layer_types"]
    assert args_from_hf_config({k: v for k, v in written.items() if k != "layer_types"}) == args
    # Every layer windowed; no window (written as published configs do: every layer full).
    every = dataclasses.replace(args, max_window_layers=0)
    assert args_from_hf_config(hf_config(every)) == every
    none = dataclasses.replace(args, sliding_window=None, max_window_layers=0)
    assert hf_config(none)["use_sliding_window"] is False and hf_config(none)["max_window_layers"] == LAYERS
    assert args_from_hf_config(hf_config(none)) == none


@pytest.mark.parametrize(
    "change, window, first_sliding",
    [
        # use_sliding_window false: no window, whatever sliding_window and max_window_layers say (as in Qwen3Config).
        ({"use_sliding_window": False, "layer_types": None}, None, 0),
        ({"use_sliding_window": False, "layer_types": None, "max_window_layers": 0}, None, 0),
        # A window that no layer has is no window.
        ({"max_window_layers": LAYERS, "layer_types": None}, None, 0),
        ({"layer_types": ["full_attention"] * LAYERS}, None, 0),
        # layer_types decides over max_window_layers, as in transformers 5; the legacy "attention" is full.
        ({"layer_types": ["attention", "sliding_attention", "sliding_attention", "sliding_attention"]}, WINDOW, 1),
        # Keys left out take Qwen3Config's defaults: sliding_window 4096, max_window_layers 28 (> 4 layers here).
        ({"sliding_window": None, "layer_types": None, "max_window_layers": 0, "_drop": "sliding_window"}, 4096, 0),
        ({"layer_types": None, "_drop": "max_window_layers"}, None, 0),
    ],
)
def test_hf_window_fields_import_as_transformers_reads_them(change, window, first_sliding):
    config = {**hf_config(windowed_args())}
    change = dict(change)
    drop = change.pop("_drop", None)
    config.update(change)
    config = {k: v for k, v in config.items() if k != drop and not (k == "layer_types" and v is None)}
    args = args_from_hf_config(config)
    assert (args.sliding_window, args.max_window_layers) == (window, first_sliding)
    hf = transformers.Qwen3Config(**{k: v for k, v in config.items() if k != "architectures"})
    assert [args.layer_window(i) for i in range(LAYERS)] == [
        hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        # Sliding then full: max_window_layers cannot say it.
        (
            {"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]},
            r"layer_types = '1 x sliding_attention, 1 x full_attention, 2 x sliding_attention'.*layer 0 slides but a "
            r"later layer attends fully",
        ),
        (
            {"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]},
            r"layer_types .*layer 1 slides",
        ),
        ({"layer_types": ["full_attention"] * 2 + ["chunked_attention"] * 2}, r"layer_types = \['chunked_attention'\]"),
        ({"layer_types": ["full_attention"] * 3}, r"layer_types .*one type for each of the 4 layers"),
        # Sliding layers with no window: transformers' config sets sliding_window None without use_sliding_window.
        ({"use_sliding_window": False}, r"layer_types .*sliding_attention layers but no window"),
        ({"sliding_window": 0}, r"sliding_window = 0"),
    ],
)
def test_inexpressible_window_configs_are_user_errors(change, message):
    config = hf_config(windowed_args())
    with pytest.raises(UserError, match=message):
        args_from_hf_config({**config, **change})


def test_sliding_layers_without_a_window_fail_in_transformers_too():
    # Why the refusal above is right: transformers cannot run that config either.
    hf = hf_qwen3(use_sliding_window=False, layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2)
    with pytest.raises(TypeError):  # its sliding-window KV cache layer needs an integer window
        hf(tokens(1))
    with pytest.raises(ValueError, match="sliding_window"):  # and so does its sliding mask
        hf(tokens(1), use_cache=False)


def test_window_composes_with_documents():
    """block_causal with a window: a packed document's logits are those of the document alone."""
    hf = hf_qwen3()
    model = ours_from(hf, args_from_hf_config(hf.config.to_dict()))
    x = tokens(2)
    lengths = [[9, 11, 4], [3, 14, 7]]  # documents longer and shorter than the window
    doc_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    with torch.no_grad():
        packed = model(x, doc_ids=doc_ids)
        worst = 0.0
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = model(x[b : b + 1, start : start + n])
                worst = max(worst, (packed[b : b + 1, start : start + n] - alone).abs().max().item())
                start += n
        # The documents do change one another's logits without the document mask.
        mixed = (model(x)[0, 9:20] - model(x[:1, 9:20])[0]).abs().max().item()
    print(f"max |logit diff| packed vs alone: {worst:.2e}; without the document mask {mixed:.2e}")
    assert worst < 1e-5
    assert mixed > 1e-2


# ---- Qwen3-MoE: every layer slides, or none ----


def test_windowed_qwen3_moe_matches_transformers():
    moe_config = dict(
        TINY,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=0,
    )
    cfg = transformers.Qwen3MoeConfig(**moe_config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    randomize(hf)
    args = args_from_hf_config(hf.config.to_dict())
    assert args.moe is not None and (args.sliding_window, args.max_window_layers) == (WINDOW, 0)
    model = ours_from(hf, args)
    x = tokens()
    with torch.no_grad():
        theirs = hf(x).logits
        diff = (model(x) - theirs).abs().max().item()
        unwindowed = ours_from(hf, dataclasses.replace(args, sliding_window=None))
        off = (unwindowed(x) - theirs).abs().max().item()
    print(f"Qwen3-MoE max |logit diff| vs transformers: {diff:.2e}; without the window {off:.2e}")
    assert diff < 1e-4 and off > 1e-2
    assert args_from_hf_config(hf_config(args)) == args


def test_qwen3_moe_window_on_some_layers_is_refused_both_ways():
    args = ModelArgs(
        dim=64,
        n_layers=LAYERS,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=32, route_norm=True),
        sliding_window=WINDOW,
    )
    written = hf_config(args)
    assert (written["use_sliding_window"], written["max_window_layers"]) == (True, 0)
    assert "layer_types" not in written  # Qwen3MoeConfig has none
    with pytest.raises(UserError, match=r"max_window_layers = 0 can be converted"):
        hf_config(dataclasses.replace(args, max_window_layers=2))
    # transformers 5 would slide every layer; releases before it only layers 2 and later.
    with pytest.raises(UserError, match=r"max_window_layers = 2.*ignores max_window_layers"):
        args_from_hf_config({**written, "max_window_layers": 2})
    with pytest.raises(UserError, match=r"max_window_layers = None"):
        args_from_hf_config({k: v for k, v in written.items() if k != "max_window_layers"})
    with pytest.raises(UserError, match=r"layer_types .*no per-layer types"):
        args_from_hf_config({**written, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2})
    # No window at all: use_sliding_window false, or true without a window; a window no layer has is none.
    assert args_from_hf_config({**written, "use_sliding_window": False}).sliding_window is None
    assert args_from_hf_config({**written, "sliding_window": None}).sliding_window is None
    assert hf_config(dataclasses.replace(args, max_window_layers=LAYERS))["use_sliding_window"] is False
