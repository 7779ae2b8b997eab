"""Qwen3 and Qwen3-MoE configs to and from Hugging Face's config.json (`Qwen3ForCausalLM`,
`Qwen3MoeForCausalLM`): what a model with our args is called there, and the args of a hub model, or a
UserError naming what we cannot represent. The tensors' names and layouts are state_dict_adapter's.

Sliding-window attention. Hugging Face's sliding mask (transformers 5 masking_utils,
`sliding_window_overlay`) lets query i see key j when j <= i and j > i - sliding_window, i.e. the
last `sliding_window` positions, itself included; ours (`torchtitan.models.common.attention.visible`) is
j <= i and i - j < window: the same set, so the window converts as it is, with no +-1.
- Qwen3 dense: layer i slides when `layer_types[i] == "sliding_attention"`; Qwen3Config builds
  layer_types, when absent, as "sliding" for i >= max_window_layers if use_sliding_window (else no
  window at all, whatever sliding_window says). We read layer_types when given (transformers 5 uses
  it over max_window_layers) and accept the patterns our args express: full layers first, then
  sliding ones, all with the one sliding_window. We write both spellings, consistent.
- Qwen3-MoE: transformers 5's Qwen3MoeForCausalLM has no layer_types and applies the window to
  every layer, ignoring max_window_layers, while older releases applied it from max_window_layers
  on; only max_window_layers = 0 (every layer) means the same to both, so that is what we read and
  write, and we refuse the rest.
"""

from typing import Any

import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.hf_conversion import decoder_config, plain_rope_theta, unsupported, with_token_ids
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3.args import ModelArgs

MODEL_TYPES = ("qwen3", "qwen3_moe")


def check_exportable(args: ModelArgs):
    """UserError if args.moe routes in a way Qwen3MoeForCausalLM cannot (softmax, top-k, optional
    renormalization, no scale, no groups, no shared experts), or slides some layers only (it slides
    every layer or none). Training-only settings (balancing bias, auxiliary losses, capacity) do not
    change what the exported model computes."""
    m = args.moe
    if m is None:
        return
    windows = layer_windows(args)
    if any(w is not None for w in windows) and None in windows:
        raise UserError(
            f"the model has a sliding window of {args.sliding_window} from layer max_window_layers = "
            f"{args.max_window_layers} on, and full attention before; Hugging Face Qwen3-MoE applies its window "
            "to every layer or none (transformers 5 ignores max_window_layers), so only max_window_layers = 0 "
            "can be converted"
        )
    differences = [
        f"{name} = {value!r}"
        for name, value, plain in [
            ("score_func", m.score_func, "softmax"),
            ("num_shared_experts", m.num_shared_experts, 0),
            ("route_scale", m.route_scale, 1.0),
            ("num_expert_groups", m.num_expert_groups, None),
        ]
        if value != plain
    ]
    if differences:
        raise UserError(
            f"the model's MoE args have {', '.join(differences)}, which Hugging Face Qwen3-MoE cannot represent "
            "(it routes by a softmax over all experts, top-k, optionally renormalized, without shared experts); "
            "only such models can be converted"
        )


def layer_windows(args: ModelArgs) -> list[int | None]:
    return [args.layer_window(i) for i in range(args.n_layers)]


def hf_config(
    args: ModelArgs, dtype: torch.dtype = torch.float32, bos_id: int | None = None, eos_id: int | None = None
) -> dict:
    """A config.json for Qwen3ForCausalLM (Qwen3MoeForCausalLM when args.moe is set) describing a
    model with `args`, stored in `dtype`; read by transformers 4.51+ (rope_theta) and 5.x (rope_parameters).
    Sliding windows: see _hf_window_fields."""
    check_exportable(args)
    dtype_name = str(dtype).removeprefix("torch.")
    config = {
        **decoder_config(args, "Qwen3ForCausalLM", "qwen3"),  # plain rope, in both spellings
        "attention_dropout": 0.0,
        **_hf_window_fields(args),
        "torch_dtype": dtype_name,  # transformers 4.x
        "dtype": dtype_name,  # transformers 5.x
    }
    if args.moe is not None:
        config.update(
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                # The hub's spelling; transformers 5 maps it to num_local_experts (and writes that).
                "num_experts": args.moe.num_experts,
                "num_experts_per_tok": args.moe.top_k,
                "moe_intermediate_size": args.moe.hidden_dim,
                "norm_topk_prob": args.moe.route_norm,
                # Every layer a mixture of experts; intermediate_size (above) would size dense layers only.
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                # No auxiliary loss nor router logits if the export is fine-tuned as it is: we balance
                # with a bias, which Qwen3-MoE does not have.
                "router_aux_loss_coef": 0.0,
                "output_router_logits": False,
            }
        )
    return with_token_ids(config, bos_id, eos_id)


def _hf_window_fields(args: ModelArgs) -> dict:
    """use_sliding_window, sliding_window, max_window_layers (and layer_types, dense only) giving each
    layer the window it has here. A window that no layer has (max_window_layers >= n_layers) is
    written as none: Qwen3-MoE would otherwise apply it to every layer."""
    windows = layer_windows(args)
    sliding = any(w is not None for w in windows)
    fields: dict[str, Any] = {
        "use_sliding_window": sliding,
        "sliding_window": args.sliding_window if sliding else None,
        # No window: every layer full, as the published configs write it. A window: its first layer (0
        # for Qwen3-MoE, which check_exportable ensures).
        "max_window_layers": max(args.max_window_layers, 0) if sliding else args.n_layers,
    }
    if args.moe is None:
        # Qwen3Config would build the same list from the fields above; written out so that a reader that
        # takes layer_types over max_window_layers (transformers 5) cannot disagree with one that does not.
        fields["layer_types"] = ["full_attention" if w is None else "sliding_attention" for w in windows]
    return fields


_DENSE_FAMILY = "Qwen3 dense"
_MOE_FAMILY = "Qwen3-MoE (every layer a mixture of experts, no shared experts)"


def _unsupported(field: str, value, why: str, family: str = _DENSE_FAMILY) -> UserError:
    return unsupported(field, value, why, family)


def _moe_args_from_hf_config(config: dict) -> MoEArgs:
    """The MoEArgs of a Qwen3MoeForCausalLM config.json; UserError if we cannot represent it."""
    family = _MOE_FAMILY
    # transformers 5 writes num_local_experts (its attribute for num_experts), the hub num_experts.
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    fields = {
        "num_experts": num_experts,
        "num_experts_per_tok": config.get("num_experts_per_tok"),
        "moe_intermediate_size": config.get("moe_intermediate_size"),
    }
    absent = [f for f, v in fields.items() if v is None]
    if absent:
        raise UserError(
            f"Hugging Face config has model_type = 'qwen3_moe' but lacks {', '.join(absent)}; "
            "is this a Qwen3MoeForCausalLM config.json?"
        )
    if num_experts < 1:
        raise _unsupported("num_experts", num_experts, "a Qwen3-MoE model without experts is a dense one", family)
    step = config.get("decoder_sparse_step", 1)
    if step != 1:
        raise _unsupported(
            "decoder_sparse_step",
            step,
            "only every layer a mixture of experts (1) is supported; we have no dense layers in an MoE model",
            family,
        )
    dense_layers = config.get("mlp_only_layers") or []
    if dense_layers:
        raise _unsupported("mlp_only_layers", dense_layers, "we have no dense layers in an MoE model", family)
    for field in (
        "shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "num_shared_experts",
        "n_shared_experts",
    ):
        if config.get(field):
            raise _unsupported(field, config[field], "Qwen3-MoE has no shared experts and we convert none", family)
    moe = MoEArgs(
        num_experts=num_experts,
        top_k=config["num_experts_per_tok"],
        hidden_dim=config["moe_intermediate_size"],
        route_norm=bool(config.get("norm_topk_prob", False)),  # Qwen3MoeConfig's default
        score_func="softmax",
    )
    problems = moe.check()
    if problems:
        raise _unsupported("num_experts_per_tok", moe.top_k, "; ".join(problems), family)
    return moe


# Defaults (transformers 5.25) for keys a config.json leaves out: sliding_window, Qwen3Config's and
# Qwen3MoeConfig's; max_window_layers, Qwen3Config's (Qwen3MoeConfig has none, see below).
_HF_DEFAULT_SLIDING_WINDOW, _HF_DEFAULT_MAX_WINDOW_LAYERS = 4096, 28
_FULL, _SLIDING = "full_attention", "sliding_attention"


def _hf_window(config: dict, family: str) -> int | None:
    """The window transformers applies where a layer slides: Qwen3Config and Qwen3MoeConfig set
    sliding_window to None unless use_sliding_window, so the value alone never turns a window on."""
    if not config.get("use_sliding_window", False):
        return None
    window = config.get("sliding_window", _HF_DEFAULT_SLIDING_WINDOW)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise _unsupported("sliding_window", window, "a sliding window is a positive number of positions", family)
    return window


def _runs(types: list) -> str:
    """layer_types in short, for an error message: "2 x full_attention, 30 x sliding_attention"."""
    runs: list[list] = []
    for t in types:
        if runs and runs[-1][1] == t:
            runs[-1][0] += 1
        else:
            runs.append([1, t])
    return ", ".join(f"{n} x {t}" for n, t in runs)


def _dense_windows_from_hf_config(config: dict, n_layers: int) -> tuple[int | None, int]:
    """(sliding_window, max_window_layers) of our args giving each layer of a Qwen3ForCausalLM the
    window transformers gives it; UserError for a layer pattern our args cannot express."""
    family = _DENSE_FAMILY
    window = _hf_window(config, family)
    types = config.get("layer_types")
    if types is None:
        # Qwen3Config.__post_init__'s rule.
        first = config.get("max_window_layers", _HF_DEFAULT_MAX_WINDOW_LAYERS)
        if isinstance(first, bool) or not isinstance(first, int):
            raise _unsupported("max_window_layers", first, "it must be a number of layers", family)
        types = [_SLIDING if window is not None and i >= first else _FULL for i in range(n_layers)]
    else:
        if not isinstance(types, list) or len(types) != n_layers:
            raise _unsupported("layer_types", types, f"it must list one type for each of the {n_layers} layers", family)
        # transformers' legacy spelling "attention" is full attention (configuration_utils remaps it).
        types = [_FULL if t == "attention" else t for t in types]
        others = sorted({str(t) for t in types} - {_FULL, _SLIDING})
        if others:
            raise _unsupported(
                "layer_types", others, "our layers attend fully or through a sliding window only", family
            )
        if _SLIDING in types and window is None:
            raise _unsupported(
                "layer_types",
                _runs(types),
                "it has sliding_attention layers but no window (use_sliding_window is false or sliding_window "
                "null), which transformers cannot run either",
                family,
            )
    first_sliding = types.index(_SLIDING) if _SLIDING in types else n_layers
    if _FULL in types[first_sliding:]:
        raise _unsupported(
            "layer_types",
            _runs(types),
            f"layer {first_sliding} slides but a later layer attends fully; our args (max_window_layers) express "
            "only full layers first, then sliding ones",
            family,
        )
    if first_sliding == n_layers:  # no layer slides: no window, whatever sliding_window says
        return None, 0
    return window, first_sliding


def _moe_windows_from_hf_config(config: dict, n_layers: int) -> tuple[int | None, int]:
    """(sliding_window, max_window_layers) for a Qwen3MoeForCausalLM: the window on every layer or
    none (see the module docstring); UserError where transformers releases disagree."""
    family = _MOE_FAMILY
    window = _hf_window(config, family)
    types = config.get("layer_types")
    implied = [_FULL if window is None else _SLIDING] * n_layers
    if types is not None and [_FULL if t == "attention" else t for t in types] != implied:
        raise _unsupported(
            "layer_types",
            _runs(types) if isinstance(types, list) else types,
            "Qwen3MoeForCausalLM has no per-layer types: it applies the sliding window to every layer when "
            f"use_sliding_window is set, and to none otherwise, i.e. {implied[0]} everywhere here",
            family,
        )
    if window is None:
        return None, 0
    first = config.get("max_window_layers")
    if first != 0:
        raise _unsupported(
            "max_window_layers",
            first,
            "with use_sliding_window, transformers 5's Qwen3MoeForCausalLM slides every layer and ignores "
            "max_window_layers, while earlier releases slid only layers max_window_layers and later; only "
            "max_window_layers = 0 (every layer) means the same in both",
            family,
        )
    return window, 0


def args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs for the Qwen3ForCausalLM or Qwen3MoeForCausalLM (model_type "qwen3_moe", args.moe
    set) described by a config.json dict; UserError if we cannot represent it."""
    moe_type = config.get("model_type") == "qwen3_moe"
    family = _MOE_FAMILY if moe_type else _DENSE_FAMILY
    required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    required += [] if moe_type else ["intermediate_size"]  # unused when every layer is an MoE
    absent = [f for f in required if config.get(f) is None]
    if absent:
        what = "Qwen3MoeForCausalLM" if moe_type else "Qwen3ForCausalLM"
        raise UserError(f"Hugging Face config lacks {', '.join(absent)}; is this a {what} config.json?")
    if config.get("model_type", "qwen3") not in MODEL_TYPES:
        raise _unsupported("model_type", config["model_type"], "our model needs 'qwen3' or 'qwen3_moe'", family)
    if config.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", config["hidden_act"], "our model needs 'silu'", family)
    if config.get("attention_bias"):
        raise _unsupported(
            "attention_bias", config["attention_bias"], "our attention projections have no biases", family
        )
    n_layers = config["num_hidden_layers"]
    sliding_window, max_window_layers = (_moe_windows_from_hf_config if moe_type else _dense_windows_from_hf_config)(
        config, n_layers
    )
    if config.get("attention_dropout"):
        raise _unsupported("attention_dropout", config["attention_dropout"], "our attention has no dropout", family)
    moe = _moe_args_from_hf_config(config) if moe_type else None

    n_heads = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise _unsupported("num_key_value_heads", n_kv_heads, f"it must divide num_attention_heads = {n_heads}", family)
    # Qwen3Config's default head_dim is 128 whatever hidden_size / num_attention_heads is;
    # Qwen3MoeConfig has none: its attention then uses hidden_size // num_attention_heads.
    head_dim = config.get("head_dim") or (config["hidden_size"] // n_heads if moe_type else 128)
    if head_dim % 2:
        raise _unsupported("head_dim", head_dim, "rotary embeddings need an even head_dim", family)
    return ModelArgs(
        dim=config["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        head_dim=head_dim,
        vocab_size=config["vocab_size"],
        # Qwen3MoeConfig's default when absent (unused: every layer is an MoE).
        hidden_dim=config.get("intermediate_size") or 6144,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=plain_rope_theta(config, 10000.0, family),  # Qwen3Config's and Qwen3MoeConfig's default
        max_seq_len=config.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        moe=moe,
        sliding_window=sliding_window,
        max_window_layers=max_window_layers,
    )
