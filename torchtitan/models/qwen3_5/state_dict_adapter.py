"""Convert Qwen3.5 (dense, text) weights between our names and transformers' `Qwen3_5ForCausalLM`
(config.json model_type "qwen3_5_text"), and Qwen3.5-MoE (`args.moe` set) weights and
`Qwen3_5MoeForCausalLM` (model_type "qwen3_5_moe_text").

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

Qwen3.5-MoE's mlp: the router `mlp.gate.weight`; the routed experts as Qwen3-MoE's (hf_conversion:
the hub's one tensor per expert and projection, which to_hf writes and transformers 5 fuses on load, or
transformers' fused gate_up_proj / down_proj, both read); the shared expert `mlp.shared_expert.{gate,
up,down}_proj` (our feed_forward.shared_experts.w1, w3, w2) and its gate `mlp.shared_expert_gate`
(our feed_forward.shared_gate), renames. Our balancing bias (expert_bias) has no counterpart: to_hf
drops it (warning when it is non-zero: transformers then routes by score alone), from_hf gives zeros.
"""

import dataclasses
import logging

import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.hf_conversion import (
    EXPERT_PROJECTIONS,
    HF_ATTENTION,
    HF_FEED_FORWARD,
    HF_ROUTER,
    HF_TOP_LEVEL,
    check_keys,
    convert_from_hf,
    expert_block_from_hf,
    expert_from_hf,
    expert_hf_names,
    expert_to_hf,
    hf_text_config,
    split_layer_name,
    with_token_ids,
)
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.spec import HFAdapter
from torchtitan.models.qwen3_5.args import FULL, ModelArgs

logger = logging.getLogger(__name__)

MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
ARCHITECTURE, MOE_ARCHITECTURE = "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"

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
_MOE = {  # Qwen3.5-MoE's renamed feed-forward tensors
    **HF_ROUTER,
    "feed_forward.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
_EXPERT_BIAS = "feed_forward.expert_bias"


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
    if args.moe is not None:
        return f"a Qwen3.5-MoE model with {args.n_layers} layers and {args.moe.num_experts} experts"
    return f"a Qwen3.5 model with {args.n_layers} layers"


def check_exportable(args: ModelArgs) -> None:
    """UserError where args.moe routes otherwise than Qwen3_5MoeForCausalLM: a softmax over every expert,
    top-k renormalized, no scale, and one shared expert scaled by its sigmoid gate. Training-only
    settings (balancing bias, auxiliary losses, capacity) do not change what the model computes."""
    m = args.moe
    if m is None:
        return
    differences = [
        f"{name} = {value!r}"
        for name, value, theirs in [
            ("score_func", m.score_func, "softmax"),
            ("route_norm", m.route_norm, True),
            ("route_scale", m.route_scale, 1.0),
            ("num_expert_groups", m.num_expert_groups, None),
            ("num_shared_experts", m.num_shared_experts, 1),
            ("shared_gate", m.shared_gate, True),
        ]
        if value != theirs
    ]
    if differences:
        raise UserError(
            f"the model's MoE args have {', '.join(differences)}, which Hugging Face Qwen3.5-MoE cannot represent "
            "(a softmax over all experts, top-k renormalized, one shared expert with a sigmoid gate); only such "
            "models can be converted"
        )


def _ffn_names(args: ModelArgs) -> list[str]:
    if args.moe is None:
        return list(HF_FEED_FORWARD)
    return [*_MOE, *EXPERT_PROJECTIONS, _EXPERT_BIAS]


def _layer_names(args: ModelArgs, layer: int) -> list[str]:
    """Our layer-local names of layer `layer`."""
    mixer = (
        [f"attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")]
        if args.is_full_attention(layer)
        else [*_DELTANET, *_PERMUTED]
    )
    norms = [n for n in _CENTERED if args.is_full_attention(layer) or not n.startswith("attention.")]
    return mixer + norms + _ffn_names(args)


def our_names(args: ModelArgs) -> list[str]:
    names = ["tok_embeddings.weight", "norm.weight"] + ([] if args.tie_word_embeddings else ["output.weight"])
    return names + [f"layers.{i}.{n}" for i in range(args.n_layers) for n in _layer_names(args, i)]


def _hf_local(local: str) -> str:
    for table in (HF_ATTENTION, _CENTERED, _DELTANET, _PERMUTED, HF_FEED_FORWARD, _MOE):
        if local in table:
            return table[local]
    raise KeyError(local)


def hf_names(ours: str, args: ModelArgs, present: frozenset[str] = frozenset()) -> list[str]:
    """The HF tensors our tensor is read from; for the routed experts of a layer that `present` holds
    fused, that layer's fused tensor, else one per expert; none for the balancing bias."""
    layer, local = split_layer_name(ours, args.n_layers, _describe(args))
    if layer is None:
        if ours == "output.weight" and args.tie_word_embeddings:
            return ["model.embed_tokens.weight"]
        return [HF_TOP_LEVEL[ours]]
    if args.moe is not None and local == _EXPERT_BIAS:
        return []
    if args.moe is not None and local in EXPERT_PROJECTIONS:
        return expert_hf_names(layer, local, args.moe.num_experts, present)
    return [f"model.layers.{layer}.{_hf_local(local)}"]


def tensor_from_hf(ours: str, tensors: dict[str, torch.Tensor], args: ModelArgs) -> torch.Tensor:
    layer, local = split_layer_name(ours, args.n_layers, _describe(args))
    if args.moe is not None and local == _EXPERT_BIAS:
        return torch.zeros(args.moe.num_experts)  # a fresh balancing state, float32 as the model's buffer
    if args.moe is not None and layer is not None and local in EXPERT_PROJECTIONS:
        return expert_from_hf(layer, local, tensors, args.moe.num_experts, args.moe.hidden_dim)
    (name,) = hf_names(ours, args)
    t = tensors[name]
    if local in _PERMUTED:
        t = t[qkv_order(args).to(t.device)]
        return t.squeeze(1) if local.startswith("attention.conv1d") else t
    if local in _CENTERED or ours == "norm.weight":
        return t + 1
    return t


def block_from_hf(ours: str, read, args: ModelArgs, present: frozenset[str], offset, shape) -> torch.Tensor | None:
    """A block of the routed experts read from only its experts' bytes (HFAdapter.block_from_hf); None
    for every other tensor (the loader reads its sources whole)."""
    layer, local = split_layer_name(ours, args.n_layers, _describe(args))
    if args.moe is None or layer is None or local not in EXPERT_PROJECTIONS:
        return None
    return expert_block_from_hf(layer, local, read, present, args.moe.hidden_dim, offset, shape)


def tensor_to_hf(ours: str, w: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    layer, local = split_layer_name(ours, args.n_layers, _describe(args))
    if (ours == "output.weight" and args.tie_word_embeddings) or (args.moe is not None and local == _EXPERT_BIAS):
        return {}
    if args.moe is not None and layer is not None and local in EXPERT_PROJECTIONS:
        return expert_to_hf(layer, local, w)
    (name,) = hf_names(ours, args)
    if local in _PERMUTED:
        hf = torch.empty_like(w)
        hf[qkv_order(args).to(w.device)] = w
        return {name: hf.unsqueeze(1) if local.startswith("attention.conv1d") else hf}
    if local in _CENTERED or ours == "norm.weight":
        return {name: w - 1}
    return {name: w}


def to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    check_exportable(args)
    names = our_names(args)
    optional = (("output.weight",) if args.tie_word_embeddings else ()) + tuple(
        n for n in names if n.endswith(_EXPERT_BIAS)
    )  # dropped anyway
    check_keys(sd, names, "the model state dict", _describe(args), optional=optional)
    out, biased = {}, []
    for ours, w in sd.items():
        if ours.endswith(_EXPERT_BIAS) and not w.is_meta and torch.any(w != 0):
            biased.append(ours)
        out.update(tensor_to_hf(ours, w, args))
    if biased:
        logger.warning(
            f"dropping the non-zero MoE balancing bias ({biased[0]}"
            + (f" and {len(biased) - 1} more" if len(biased) > 1 else "")
            + "): Hugging Face Qwen3.5-MoE has "
            "none and chooses experts by router score alone, so the exported model may route some tokens to "
            "other experts than this one does"
        )
    return out


def from_hf(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    check_exportable(args)
    hf_sd = {k: v for k, v in hf_sd.items() if not k.startswith("mtp.")}  # the multi-token head is not ours
    present = frozenset(hf_sd)
    expected = sorted({n for ours in our_names(args) for n in hf_names(ours, args, present)})
    check_keys(hf_sd, expected, "the Hugging Face state dict", _describe(args), optional=("lm_head.weight",))
    out = convert_from_hf(our_names(args), hf_sd, args, hf_names, tensor_from_hf)
    if args.tie_word_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(
    args: ModelArgs, dtype: torch.dtype = torch.float32, bos_id: int | None = None, eos_id: int | None = None
) -> dict:
    dtype_name = str(dtype).removeprefix("torch.")
    check_exportable(args)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPES[0],
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "linear_num_key_heads": args.linear_num_key_heads,
        "linear_num_value_heads": args.linear_num_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.conv_kernel,
        "full_attention_interval": args.full_attention_interval,
        "layer_types": list(args.layer_types),
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    if args.moe is not None:  # Qwen3_5MoeTextConfig: no dense intermediate_size
        del config["intermediate_size"]
        config.update(
            {
                "architectures": [MOE_ARCHITECTURE],
                "model_type": MODEL_TYPES[1],
                "num_experts": args.moe.num_experts,
                "num_experts_per_tok": args.moe.top_k,
                "moe_intermediate_size": args.moe.hidden_dim,
                "shared_expert_intermediate_size": args.moe.shared_width,
            }
        )
    return with_token_ids(config, bos_id, eos_id)


def args_from_config(config: dict) -> ModelArgs:
    # The multimodal folder (the published checkpoints): its text model, by the rule every entry point reads.
    config = hf_text_config(config)
    if config.get("model_type") not in MODEL_TYPES:
        raise UserError(f"config.json model_type {config.get('model_type')!r} is not a Qwen3.5 text model")
    moe = _moe_args_from_config(config) if config["model_type"] == MODEL_TYPES[1] else None
    rope = config.get("rope_parameters") or {}
    # Multimodal rotary (mrope_section, mrope_interleaved) gives each frequency a time, height or width position;
    # a text token has the same three, so on text it is plain rotary.
    if rope.get("rope_type", "default") != "default":
        raise UserError(f"Hugging Face config has rope_parameters = {rope!r}: only plain rotary is supported")
    if config.get("attention_bias"):
        raise UserError("Hugging Face config has attention_bias = true: Qwen3.5 here has no attention biases")
    d = ModelArgs()
    args = ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads", d.n_kv_heads),
        head_dim=config.get("head_dim", d.head_dim),
        rope_theta=rope.get("rope_theta", d.rope_theta),
        partial_rotary_factor=rope.get("partial_rotary_factor", d.partial_rotary_factor),
        linear_num_key_heads=config.get("linear_num_key_heads", d.linear_num_key_heads),
        linear_num_value_heads=config.get("linear_num_value_heads", d.linear_num_value_heads),
        linear_key_head_dim=config.get("linear_key_head_dim", d.linear_key_head_dim),
        linear_value_head_dim=config.get("linear_value_head_dim", d.linear_value_head_dim),
        conv_kernel=config.get("linear_conv_kernel_dim", d.conv_kernel),
        full_attention_interval=config.get("full_attention_interval", d.full_attention_interval),
        hidden_dim=config["intermediate_size"] if moe is None else moe.hidden_dim,
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", d.norm_eps),
        max_seq_len=config.get("max_position_embeddings", d.max_seq_len),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        moe=moe,
    )
    types = config.get("layer_types")
    if types is not None and "full_attention_interval" not in config:
        # transformers 5.25 saves the pattern as layer_types only: its period is where the first full layer is.
        types = list(types)
        args = dataclasses.replace(
            args, full_attention_interval=types.index(FULL) + 1 if FULL in types else len(types) + 1
        )
    if types is not None and list(types) != [t if t == FULL else "linear_attention" for t in args.layer_types]:
        raise UserError(
            f"config.json layer_types {types} differ from full attention every "
            f"{args.full_attention_interval} layers, the only pattern supported"
        )
    return args


def _moe_args_from_config(config: dict) -> MoEArgs:
    """Qwen3_5MoeTextConfig's routing (its defaults, transformers 5.25, for absent keys): softmax top-k,
    always renormalized, one shared expert with a sigmoid gate."""
    fields = {
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    }
    fields = {k: config.get(k, d) for k, d in fields.items()}
    moe = MoEArgs(
        num_experts=fields["num_experts"],
        top_k=fields["num_experts_per_tok"],
        hidden_dim=fields["moe_intermediate_size"],
        num_shared_experts=1,
        shared_hidden_dim=fields["shared_expert_intermediate_size"],
        shared_gate=True,
        route_norm=True,
    )
    problems = moe.check()
    if problems:
        raise UserError(f"Hugging Face Qwen3.5-MoE config cannot be represented: {'; '.join(problems)}")
    return moe


ADAPTER = HFAdapter(
    model_types=MODEL_TYPES,
    to_hf=to_hf,
    from_hf=from_hf,
    config=hf_config,
    args_from_config=args_from_config,
    hf_names=hf_names,
    tensor_from_hf=tensor_from_hf,
    tensor_to_hf=tensor_to_hf,
    block_from_hf=block_from_hf,
)
