"""Convert Qwen3 weights between our names and Hugging Face `Qwen3ForCausalLM` names.

Pure tensor functions, no I/O, and a pure rename: our rotary embedding already uses Hugging Face's
`rotate_half` layout, so no row is permuted. With tied embeddings Hugging Face stores no
`lm_head.weight` (it ties it to `model.embed_tokens.weight` on load): `to_hf` writes none, and
`from_hf` accepts its absence (or a copy equal to the embedding) and returns `output.weight` as the
very tensor of `tok_embeddings.weight`, as our tied model's state dict has both names.
"""

import torch

from torchtitan.config.errors import UserError
from torchtitan.models.hf_conversion import ROTARY_INV_FREQ, check_keys, plain_rope_theta, unsupported
from torchtitan.models.qwen3.args import ModelArgs
from torchtitan.models.spec import HFAdapter

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_OURS_TIED, _HF_TIED = "output.weight", "lm_head.weight"


def _name_pairs(args: ModelArgs) -> dict[str, str]:
    """Our name -> HF name for every parameter of a model with `args` (the output layer included,
    even when tied)."""
    pairs = dict(_TOP_LEVEL)
    for i in range(args.n_layers):
        for ours, hf in _PER_LAYER.items():
            pairs[f"layers.{i}.{ours}"] = f"model.layers.{i}.{hf}"
    return pairs


def _check_keys(found, expected, optional: str | None, what: str, args: ModelArgs):
    tied = "tied" if args.tie_word_embeddings else "untied"
    check_keys(found, expected, what, f"a Qwen3 model with {args.n_layers} layers and {tied} embeddings",
               optional=(optional,) if optional else ())


def _check_tied_copy(sd: dict, output: str, embedding: str):
    """A stored output weight of a tied model must be the embedding (or an equal copy)."""
    if output in sd and sd[output] is not sd[embedding] and not torch.equal(sd[output], sd[embedding]):
        raise UserError(
            f"the model ties its embeddings (tie_word_embeddings), but {output} differs from {embedding}; "
            "these weights come from an untied model: use a configuration with tie_word_embeddings = false"
        )


def _check_shapes(sd: dict, args: ModelArgs, names: dict[str, str]):
    """UserError naming the first tensors whose shape does not fit `args` (keys in `names` order)."""
    hd, dim = args.head_dim, args.dim
    per_layer = {
        "attention.wq.weight": (args.n_heads * hd, dim),
        "attention.wk.weight": (args.kv_heads * hd, dim),
        "attention.wv.weight": (args.kv_heads * hd, dim),
        "attention.wo.weight": (dim, args.n_heads * hd),
        "attention.q_norm.weight": (hd,),
        "attention.k_norm.weight": (hd,),
        "feed_forward.w1.weight": (args.hidden_dim, dim),
        "feed_forward.w2.weight": (dim, args.hidden_dim),
        "feed_forward.w3.weight": (args.hidden_dim, dim),
        "attention_norm.weight": (dim,),
        "ffn_norm.weight": (dim,),
    }
    vocab = (args.vocab_size, dim)
    top = {"tok_embeddings.weight": vocab, "norm.weight": (dim,), "output.weight": vocab}
    wrong = []
    for ours, key in names.items():
        if key not in sd:
            continue
        expected = top.get(ours) or per_layer[ours.split(".", 2)[2]]
        if tuple(sd[key].shape) != expected:
            wrong.append(f"{key} has shape {tuple(sd[key].shape)}, expected {expected}")
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise UserError(
            f"tensors do not fit the Qwen3 configuration: {'; '.join(wrong[:3])}{more}. "
            "Check that the weights and the model configuration belong together."
        )


def to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face Qwen3ForCausalLM state dict (no lm_head.weight when tied)."""
    names = _name_pairs(args)
    tied = args.tie_word_embeddings
    _check_keys(sd, names, _OURS_TIED if tied else None, "the model state dict", args)
    _check_shapes(sd, args, {ours: ours for ours in names})
    if tied:
        _check_tied_copy(sd, _OURS_TIED, "tok_embeddings.weight")
    return {names[ours]: w for ours, w in sd.items() if not (tied and ours == _OURS_TIED)}


def from_hf(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hugging Face Qwen3ForCausalLM state dict -> our state dict; the inverse of to_hf. Tied:
    output.weight is the tok_embeddings.weight tensor itself."""
    pairs = _name_pairs(args)
    names = {hf: ours for ours, hf in pairs.items()}
    tied = args.tie_word_embeddings
    hf_sd = {k: v for k, v in hf_sd.items() if not ROTARY_INV_FREQ.fullmatch(k)}
    _check_keys(hf_sd, names, _HF_TIED if tied else None, "the Hugging Face state dict", args)
    _check_shapes(hf_sd, args, pairs)
    if tied:
        _check_tied_copy(hf_sd, _HF_TIED, "model.embed_tokens.weight")
    out = {names[hf]: w for hf, w in hf_sd.items() if not (tied and hf == _HF_TIED)}
    if tied:
        out[_OURS_TIED] = out["tok_embeddings.weight"]
    return out


def hf_config(
    args: ModelArgs, dtype: torch.dtype = torch.float32, bos_id: int | None = None, eos_id: int | None = None
) -> dict:
    """A config.json for Qwen3ForCausalLM describing a model with `args`, stored in `dtype`; read by
    transformers 4.51+ (rope_theta) and 5.x (rope_parameters)."""
    dtype_name = str(dtype).removeprefix("torch.")
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        # Plain rope, no scaling: both spellings, for transformers 4.x and 5.x.
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "torch_dtype": dtype_name,  # transformers 4.x
        "dtype": dtype_name,  # transformers 5.x
    }
    if bos_id is not None:
        config["bos_token_id"] = bos_id
    if eos_id is not None:
        config["eos_token_id"] = eos_id
    return config


def _unsupported(field: str, value, why: str) -> UserError:
    return unsupported(field, value, why, "Qwen3 dense")


def args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs for the Qwen3ForCausalLM described by a config.json dict; UserError if we cannot represent it."""
    required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    absent = [f for f in required if config.get(f) is None]
    if absent:
        raise UserError(f"Hugging Face config lacks {', '.join(absent)}; is this a Qwen3ForCausalLM config.json?")
    for field, wanted in [("model_type", "qwen3"), ("hidden_act", "silu")]:
        if config.get(field, wanted) != wanted:
            raise _unsupported(field, config[field], f"our model needs {wanted!r}")
    if config.get("attention_bias"):
        raise _unsupported("attention_bias", config["attention_bias"], "our attention projections have no biases")
    if config.get("use_sliding_window"):
        raise _unsupported("use_sliding_window", config["use_sliding_window"], "our attention is full causal attention")
    other_layers = sorted({t for t in config.get("layer_types") or [] if t != "full_attention"})
    if other_layers:
        raise _unsupported("layer_types", other_layers, "our attention is full causal attention in every layer")
    if config.get("attention_dropout"):
        raise _unsupported("attention_dropout", config["attention_dropout"], "our attention has no dropout")

    n_heads = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise _unsupported("num_key_value_heads", n_kv_heads, f"it must divide num_attention_heads = {n_heads}")
    # Qwen3Config's default head_dim is 128 whatever hidden_size / num_attention_heads is.
    head_dim = config.get("head_dim") or 128
    if head_dim % 2:
        raise _unsupported("head_dim", head_dim, "rotary embeddings need an even head_dim")
    return ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        head_dim=head_dim,
        vocab_size=config["vocab_size"],
        hidden_dim=config["intermediate_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=plain_rope_theta(config, 10000.0, "Qwen3 dense"),  # Qwen3Config's default
        max_seq_len=config.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


ADAPTER = HFAdapter(
    model_types=("qwen3",),
    to_hf=to_hf,
    from_hf=from_hf,
    config=hf_config,
    args_from_config=args_from_hf_config,
)
