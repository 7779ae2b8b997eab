"""gpt-oss weights and config.json to and from Hugging Face's `GptOssForCausalLM` (transformers 5).

Every tensor is a rename: the rotary layout is Hugging Face's rotate-half, and the experts keep
Hugging Face's own layout (gate_up_proj [experts, dim, 2 x hidden], gate and linear part in the even
and odd columns; down_proj [experts, hidden, dim]; their biases), so an import under any layout reads
each rank's block of a tensor directly. Our `expert_bias` (the optional balancing bias, added to the
router's scores only to choose experts) has no counterpart: GptOssForCausalLM chooses by the router's
logits alone. The export drops it (with a warning when it is not zero: the exported model may then
route some tokens elsewhere); the import gives zeros, a fresh balancing state.

MXFP4. The published checkpoints store the experts' two matrices quantized: `<name>_blocks`
[experts, rows, dim / 32, 16] uint8 (32 FP4 e2m1 values per block, two per byte, the low nibble
first) and `<name>_scales` [experts, rows, dim / 32] uint8 (a power of two per block, biased by 127),
rows being the matrix's output features (gate_up_proj: 2 x hidden, down_proj: dim). The import
dequantizes them (exactly, in float32; the loader casts to the training dtype) and transposes them
to our (Hugging Face's in-memory) layout, and a sharded import reads only each rank's experts'
bytes (block_from_hf). A folder whose scales do not match its blocks is refused before launch. The
export writes float tensors (an MXFP4 export is not offered).
"""

import dataclasses
import logging

import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.hf_conversion import (
    HF_BLOCK_NORMS,
    HF_TOP_LEVEL,
    ROTARY_INV_FREQ,
    check_keys,
    convert_from_hf,
    rope_config,
    rope_from_config,
    split_layer_name,
    unsupported,
    with_token_ids,
)
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.spec import HFAdapter
from torchtitan.models.gpt_oss.args import ModelArgs

logger = logging.getLogger(__name__)

FAMILY = "gpt-oss"
_EXPERT_BIAS = "feed_forward.expert_bias"
_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _layer_table() -> dict[str, str]:
    """Our layer-local name -> Hugging Face's (under model.layers.N)."""
    table = {
        f"attention.{ours}.{kind}": f"self_attn.{theirs}_proj.{kind}"
        for ours, theirs in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))
        for kind in ("weight", "bias")
    }
    table["attention.sinks.weight"] = "self_attn.sinks"
    table.update(HF_BLOCK_NORMS)
    table.update({f"feed_forward.router.gate.{kind}": f"mlp.router.{kind}" for kind in ("weight", "bias")})
    table.update({f"feed_forward.experts.{t}": f"mlp.experts.{t}" for t in _EXPERT_TENSORS})
    return table


_LAYER = _layer_table()


def _describe(args: ModelArgs) -> str:
    return f"a gpt-oss model with {args.n_layers} layers and {args.moe.num_experts} experts"


def _our_names(args: ModelArgs) -> list[str]:
    """Every tensor of our state dict, the balancing bias included."""
    return [*HF_TOP_LEVEL, *(f"layers.{i}.{local}" for i in range(args.n_layers) for local in (*_LAYER, _EXPERT_BIAS))]


_MXFP4 = ("_blocks", "_scales")
# FP4 e2m1: sign, 2 exponent bits, 1 mantissa bit (OCP microscaling formats).
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def hf_names(ours: str, args: ModelArgs, present: frozenset[str] = frozenset()) -> list[str]:
    """The Hugging Face tensors `ours` is read from: its one renamed tensor, or, for an expert matrix
    stored in MXFP4, its blocks and scales ([] for the balancing bias)."""
    layer, local = split_layer_name(ours, args.n_layers, _describe(args))
    if layer is None:
        return [HF_TOP_LEVEL[ours]]
    if local == _EXPERT_BIAS:
        return []
    name = f"model.layers.{layer}.{_LAYER[local]}"
    if name + "_blocks" in present or name + "_scales" in present:
        return [name + suffix for suffix in _MXFP4]
    return [name]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "MXFP4") -> torch.Tensor:
    """[experts, rows, groups, 16] uint8 blocks and [experts, rows, groups] uint8 scales -> float32
    [experts, groups x 32, rows] (the matrix as x @ W[e] reads it). Works on meta tensors (shapes)."""
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or blocks.ndim != 4
        or tuple(blocks.shape[:-1]) != tuple(scales.shape)
        or blocks.shape[-1] != 16
    ):
        raise UserError(
            f"{name}: MXFP4 scales {tuple(scales.shape)} ({scales.dtype}) do not match blocks {tuple(blocks.shape)} "
            f"({blocks.dtype}): blocks must be uint8 [experts, rows, groups, 16] and scales uint8 [experts, rows, "
            "groups]; the folder is damaged or not a gpt-oss MXFP4 checkpoint"
        )
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # low nibble first
    values = values.flatten(-2) * torch.exp2(scales.float() - 127.0).unsqueeze(-1)
    return values.flatten(-2).transpose(1, 2).contiguous()


def tensor_from_hf(ours: str, tensors: dict[str, torch.Tensor], args: ModelArgs) -> torch.Tensor:
    if ours.endswith(_EXPERT_BIAS):
        return torch.zeros(args.moe.num_experts)  # float32, as the model's buffer
    if len(tensors) == 2:  # MXFP4, in hf_names' order
        (name, blocks), (_, scales) = tensors.items()
        return dequantize_mxfp4(blocks, scales, name.removesuffix("_blocks"))
    ((_, w),) = tensors.items()
    return w


def block_from_hf(ours: str, read, args: ModelArgs, present: frozenset[str], offset, shape) -> torch.Tensor | None:
    """A block [e, in, out] of an MXFP4 expert matrix from only its bytes (whole 32-value groups of `in`);
    None otherwise (renames are read by block anyway; an unaligned block reads the sources whole)."""
    names = hf_names(ours, args, present)
    if len(names) != 2 or len(shape) != 3 or offset[1] % 32 or shape[1] % 32:
        return None
    (e, i, o), (ne, ni, no) = offset, shape
    blocks = read(names[0], (e, o, i // 32, 0), (ne, no, ni // 32, 16))
    scales = read(names[1], (e, o, i // 32), (ne, no, ni // 32))
    return dequantize_mxfp4(blocks, scales, names[0].removesuffix("_blocks"))


def tensor_to_hf(ours: str, w: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    names = hf_names(ours, args)
    return {names[0]: w} if names else {}


def to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> GptOssForCausalLM's (the balancing bias dropped, with a warning if not zero)."""
    check_exportable(args)
    optional = tuple(n for n in _our_names(args) if n.endswith(_EXPERT_BIAS))
    check_keys(sd, _our_names(args), "the model state dict", _describe(args), optional=optional)
    biased = [n for n in optional if n in sd and not sd[n].is_meta and torch.any(sd[n] != 0)]
    if biased:
        logger.warning(
            f"dropping the non-zero MoE balancing bias ({biased[0]}, {len(biased)} layers): "
            "GptOssForCausalLM has none and chooses experts by the router's logits alone"
        )
    out = {}
    for ours, w in sd.items():
        out.update(tensor_to_hf(ours, w, args))
    return out


def from_hf(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """GptOssForCausalLM's state dict -> ours (expert_bias zeros); runs on meta tensors as well."""
    hf_sd = {k: v for k, v in hf_sd.items() if not ROTARY_INV_FREQ.fullmatch(k)}
    present = frozenset(hf_sd)
    expected = [n for ours in _our_names(args) for n in hf_names(ours, args, present)]
    check_keys(hf_sd, expected, "the Hugging Face state dict", _describe(args))
    return convert_from_hf(_our_names(args), hf_sd, args, hf_names, tensor_from_hf)


def check_exportable(args: ModelArgs) -> None:
    if args.moe.capacity_factor is not None:
        raise UserError("GptOssForCausalLM drops no token: train without moe.capacity_factor for an export")


def _layer_types(args: ModelArgs) -> list[str]:
    return ["full_attention" if args.layer_window(i) is None else "sliding_attention" for i in range(args.n_layers)]


def hf_config(
    args: ModelArgs, dtype: torch.dtype = torch.float32, bos_id: int | None = None, eos_id: int | None = None
) -> dict:
    """A config.json for GptOssForCausalLM describing a model with `args`, stored in `dtype`."""
    check_exportable(args)
    dtype_name = str(dtype).removeprefix("torch.")
    rope = rope_config(args.rope_theta, args.rope_scaling)
    y = args.rope_scaling
    if y is not None:  # YaRN's bounds rounding, which config.json says with "truncate" (default true)
        rope = {
            **rope,
            "rope_scaling": {**rope["rope_scaling"], "truncate": y.truncate},
            "rope_parameters": {**rope["rope_parameters"], "truncate": y.truncate},
        }
    context = max(args.max_seq_len, int(y.factor * y.original_max_position_embeddings)) if y else args.max_seq_len
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "sliding_window": args.sliding_window,
        "layer_types": _layer_types(args),
        **rope,
        "max_position_embeddings": context,
        "intermediate_size": args.moe.hidden_dim,
        "num_local_experts": args.moe.num_experts,
        "num_experts_per_tok": args.moe.top_k,
        "swiglu_limit": args.swiglu_limit,
        "swiglu_alpha": args.swiglu_alpha,
        "hidden_act": "silu",
        # No auxiliary loss nor router logits when the export is fine-tuned as it is.
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    return with_token_ids(config, bos_id, eos_id)


def args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs of the GptOssForCausalLM a config.json describes; UserError for what we cannot represent."""
    required = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "num_local_experts",
        "num_experts_per_tok",
        "vocab_size",
    ]
    absent = [f for f in required if config.get(f) is None]
    if absent:
        raise UserError(f"Hugging Face config lacks {', '.join(absent)}; is this a GptOssForCausalLM config.json?")
    for field, wanted in (("attention_bias", True), ("tie_word_embeddings", False), ("hidden_act", "silu")):
        if config.get(field, wanted) != wanted:
            raise unsupported(field, config[field], f"our model needs {wanted!r}", FAMILY)
    layers, window = config["num_hidden_layers"], config.get("sliding_window")
    ours = ["sliding_attention" if i % 2 == 0 and window else "full_attention" for i in range(layers)]
    types = config.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    if list(types) != ours:
        raise unsupported(
            "layer_types",
            types,
            "our model slides on the even layers (0, 2, ...) only, with sliding_window set",
            FAMILY,
        )
    theta, scaling = rope_from_config(config, 150000.0, FAMILY, kinds=("yarn",))
    if scaling is not None:
        rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
        scaling = dataclasses.replace(
            scaling, truncate=bool(rope.get("truncate", True)), mscale=float(rope.get("mscale") or 1.0)
        )
    moe = MoEArgs(
        num_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        hidden_dim=config["intermediate_size"],
        load_balance_coeff=None,
    )
    problems = moe.check()
    if problems:
        raise UserError(f"Hugging Face config's experts cannot be represented: {'; '.join(problems)}")
    return ModelArgs(
        dim=config["hidden_size"],
        n_layers=layers,
        n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        sliding_window=window if any(t == "sliding_attention" for t in types) else None,
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=config.get("max_position_embeddings", 131072),
        vocab_size=config["vocab_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        moe=moe,
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
    )


ADAPTER = HFAdapter(
    model_types=("gpt_oss",),
    to_hf=to_hf,
    from_hf=from_hf,
    config=hf_config,
    args_from_config=args_from_hf_config,
    hf_names=hf_names,
    tensor_from_hf=tensor_from_hf,
    tensor_to_hf=tensor_to_hf,
    block_from_hf=block_from_hf,
)
