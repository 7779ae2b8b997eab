"""Convert Qwen3.5 (dense, text) weights between our names and transformers' `Qwen3_5ForCausalLM`
(config.json model_type "qwen3_5_text").

What is not a rename:
- Hugging Face's zero-centered RMSNorms (block norms, final norm, q_norm, k_norm) store weight - 1 and
  scale by (1 + weight); ours store the scale itself: ours = theirs + 1. The DeltaNet output norm
  (linear_attn.norm) is a plain RMSNorm in both.
- linear_attn.in_proj_qkv [2 key_dim + value_dim, dim] holds all queries, then all keys, then all
  values; ours has the same rows grouped by key head (its query, its key, the values of its value
  heads: model.py says why), and linear_attn.conv1d.weight [channels, 1, kernel] likewise against our
  conv1d.weight [channels, kernel]: one fixed row permutation (`qkv_order`) each way.
Everything else renames: full attention under self_attn (q_proj holds query and gate per head, our
wq as it is), DeltaNet under linear_attn (in_proj_z, in_proj_a, in_proj_b, A_log, dt_bias, norm,
out_proj), SwiGLU under mlp. Every conversion is per tensor (the sharded loader and exporter).
"""

import dataclasses

import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.hf_conversion import (
    HF_ATTENTION, HF_FEED_FORWARD, HF_TOP_LEVEL, check_keys, convert_from_hf, split_layer_name, with_token_ids,
)
from torchtitan.models.common.spec import HFAdapter
from torchtitan.models.qwen3_5.args import FULL, ModelArgs

MODEL_TYPES = ("qwen3_5_text",)
ARCHITECTURE = "Qwen3_5ForCausalLM"

_CENTERED = {  # ours -> HF, stored as weight - 1 there
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_DELTANET = {
    "attention.in_proj_z.weight": "linear_attn.in_proj_z.weight",
    "attention.in_proj_a.weight": "linear_attn.in_proj_a.weight",
    "attention.in_proj_b.weight": "linear_attn.in_proj_b.weight",
    "attention.heads.A_log": "linear_attn.A_log",
    "attention.heads.dt_bias": "linear_attn.dt_bias",
    "attention.norm.weight": "linear_attn.norm.weight",
    "attention.out_proj.weight": "linear_attn.out_proj.weight",
}
_PERMUTED = {  # ours -> HF, rows permuted (qkv_order)
    "attention.in_proj_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attention.conv1d.weight": "linear_attn.conv1d.weight",
}


def qkv_order(args: ModelArgs) -> torch.Tensor:
    """For each of our in_proj_qkv rows (grouped by key head), the HF row it is."""
    nk, dk, dv = args.linear_num_key_heads, args.linear_key_head_dim, args.linear_value_head_dim
    per_key = args.linear_num_value_heads // nk
    rows = []
    for h in range(nk):
        rows += range(h * dk, (h + 1) * dk)  # its query
        rows += range(nk * dk + h * dk, nk * dk + (h + 1) * dk)  # its key
        rows += range(2 * nk * dk + h * per_key * dv, 2 * nk * dk + (h + 1) * per_key * dv)  # its values
    return torch.tensor(rows)


def _describe(args: ModelArgs) -> str:
    return f"a Qwen3.5 model with {args.n_layers} layers"


def _layer_names(args: ModelArgs, layer: int) -> list[str]:
    """Our layer-local names of layer `layer`."""
    mixer = [f"attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")] if args.is_full_attention(layer) \
        else [*_DELTANET, *_PERMUTED]
    norms = [n for n in _CENTERED if args.is_full_attention(layer) or not n.startswith("attention.")]
    return mixer + norms + list(HF_FEED_FORWARD)


def our_names(args: ModelArgs) -> list[str]:
    names = ["tok_embeddings.weight", "norm.weight"] + ([] if args.tie_word_embeddings else ["output.weight"])
    return names + [f"layers.{i}.{n}" for i in range(args.n_layers) for n in _layer_names(args, i)]


def _hf_local(local: str) -> str:
    for table in (HF_ATTENTION, _CENTERED, _DELTANET, _PERMUTED, HF_FEED_FORWARD):
        if local in table:
            return table[local]
    raise KeyError(local)


def hf_names(ours: str, args: ModelArgs, present: frozenset[str] = frozenset()) -> list[str]:
    layer, local = split_layer_name(ours, args.n_layers, _describe(args))
    if layer is None:
        if ours == "output.weight" and args.tie_word_embeddings:
            return ["model.embed_tokens.weight"]
        return [HF_TOP_LEVEL[ours]]
    return [f"model.layers.{layer}.{_hf_local(local)}"]


def tensor_from_hf(ours: str, tensors: dict[str, torch.Tensor], args: ModelArgs) -> torch.Tensor:
    (name,) = hf_names(ours, args)
    t = tensors[name]
    layer, local = split_layer_name(ours, args.n_layers, _describe(args))
    if local in _PERMUTED:
        t = t[qkv_order(args).to(t.device)]
        return t.squeeze(1) if local.startswith("attention.conv1d") else t
    if local in _CENTERED or ours == "norm.weight":
        return t + 1
    return t


def tensor_to_hf(ours: str, w: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    layer, local = split_layer_name(ours, args.n_layers, _describe(args))
    if ours == "output.weight" and args.tie_word_embeddings:
        return {}
    (name,) = hf_names(ours, args)
    if local in _PERMUTED:
        hf = torch.empty_like(w)
        hf[qkv_order(args).to(w.device)] = w
        return {name: hf.unsqueeze(1) if local.startswith("attention.conv1d") else hf}
    if local in _CENTERED or ours == "norm.weight":
        return {name: w - 1}
    return {name: w}


def to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    check_keys(sd, our_names(args), "the model state dict", _describe(args),
               optional=("output.weight",) if args.tie_word_embeddings else ())
    out = {}
    for ours, w in sd.items():
        out.update(tensor_to_hf(ours, w, args))
    return out


def from_hf(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    hf_sd = {k: v for k, v in hf_sd.items() if not k.startswith("mtp.")}  # the multi-token head is not ours
    expected = sorted({n for ours in our_names(args) for n in hf_names(ours, args)})
    check_keys(hf_sd, expected, "the Hugging Face state dict", _describe(args),
               optional=("lm_head.weight",))
    out = convert_from_hf(our_names(args), hf_sd, args, hf_names, tensor_from_hf)
    if args.tie_word_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32, bos_id: int | None = None,
              eos_id: int | None = None) -> dict:
    dtype = str(dtype).removeprefix("torch.")
    config = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPES[0], "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "linear_num_key_heads": args.linear_num_key_heads, "linear_num_value_heads": args.linear_num_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim, "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.conv_kernel, "full_attention_interval": args.full_attention_interval,
        "layer_types": list(args.layer_types), "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta,
                            "partial_rotary_factor": args.partial_rotary_factor},
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu", "attention_bias": False, "dtype": dtype, "torch_dtype": dtype,
    }
    return with_token_ids(config, bos_id, eos_id)


def args_from_config(config: dict) -> ModelArgs:
    if config.get("model_type") == "qwen3_5" and "text_config" in config:
        config = config["text_config"]  # the multimodal folder: its text model
    if config.get("model_type") not in MODEL_TYPES:
        raise UserError(f"config.json model_type {config.get('model_type')!r} is not a Qwen3.5 text model")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or rope.get("mrope_interleaved"):
        raise UserError(f"Hugging Face config has rope_parameters = {rope!r}: only plain rotary is supported")
    if config.get("attention_bias"):
        raise UserError("Hugging Face config has attention_bias = true: Qwen3.5 here has no attention biases")
    d = ModelArgs()
    args = ModelArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads", d.n_kv_heads), head_dim=config.get("head_dim", d.head_dim),
        rope_theta=rope.get("rope_theta", d.rope_theta),
        partial_rotary_factor=rope.get("partial_rotary_factor", d.partial_rotary_factor),
        linear_num_key_heads=config.get("linear_num_key_heads", d.linear_num_key_heads),
        linear_num_value_heads=config.get("linear_num_value_heads", d.linear_num_value_heads),
        linear_key_head_dim=config.get("linear_key_head_dim", d.linear_key_head_dim),
        linear_value_head_dim=config.get("linear_value_head_dim", d.linear_value_head_dim),
        conv_kernel=config.get("linear_conv_kernel_dim", d.conv_kernel),
        full_attention_interval=config.get("full_attention_interval", d.full_attention_interval),
        hidden_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", d.norm_eps),
        max_seq_len=config.get("max_position_embeddings", d.max_seq_len),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )
    types = config.get("layer_types")
    if types is not None and "full_attention_interval" not in config:
        # transformers 5.25 saves the pattern as layer_types only: its period is where the first full layer is.
        types = list(types)
        args = dataclasses.replace(args, full_attention_interval=types.index(FULL) + 1 if FULL in types
                                   else len(types) + 1)
    if types is not None and list(types) != [t if t == FULL else "linear_attention" for t in args.layer_types]:
        raise UserError(f"config.json layer_types {types} differ from full attention every "
                        f"{args.full_attention_interval} layers, the only pattern supported")
    return args


ADAPTER = HFAdapter(model_types=MODEL_TYPES, to_hf=to_hf, from_hf=from_hf, config=hf_config,
                    args_from_config=args_from_config, hf_names=hf_names, tensor_from_hf=tensor_from_hf,
                    tensor_to_hf=tensor_to_hf)
