"""Convert DeepSeek-V3 weights between our names and Hugging Face `DeepseekV3ForCausalLM`'s.

Renames, and the routed experts between our 3-D weights and the hub's one tensor per expert (or
transformers 5's fused ones, read on import). No row is permuted: the published checkpoints rotate
adjacent feature pairs of the rotary parts ("rope_interleave": true), as our MLA does. The balancing
bias is the router's e_score_correction_bias, exported and imported, so an export computes what we
train. Multi-token prediction: module k is the published layer n_layers + k (model.layers.61 for
the 671B model): its block's tensors under the block's names, enorm, hnorm, eh_proj and
shared_head.norm, and copies of the embedding and the output layer (written on export, skipped on
import: ours are shared). transformers does not load those layers; an import reads as many as the
run's mtp_depth and skips the others.
"""

import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.hf_conversion import (
    EXPERT_PROJECTIONS,
    HF_ATTENTION,
    HF_BLOCK_NORMS,
    HF_FEED_FORWARD,
    HF_ROUTER,
    HF_TOP_LEVEL,
    ROTARY_INV_FREQ,
    check_keys,
    convert_from_hf,
    expert_block_from_hf,
    expert_from_hf,
    expert_hf_names,
    expert_to_hf,
    rope_config,
    rope_from_config,
    split_layer_name,
    unsupported,
    with_token_ids,
)
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.spec import HFAdapter
from torchtitan.models.deepseek_v3.args import ModelArgs

# MLA's own tensors (wq is q_proj, as the standard attention's), then the standard block's.
_ATTENTION = {
    "attention.wq.weight": HF_ATTENTION["attention.wq.weight"],
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": HF_ATTENTION["attention.wo.weight"],
    **HF_BLOCK_NORMS,
}
_MOE = {
    **HF_ROUTER,
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
FAMILY = "DeepSeek-V3"


def _describe(args: ModelArgs) -> str:
    return (
        f"a DeepSeek-V3 model with {args.n_layers} layers ({args.n_dense_layers} dense), "
        f"{args.moe.num_experts if args.moe else 0} experts and q_lora_rank {args.q_lora_rank}"
    )


def _moe_args(args: ModelArgs) -> MoEArgs:
    """The MoE settings, which a flavor with expert layers has (args.validate)."""
    assert args.moe is not None, f"{_describe(args)} has expert layers but no moe settings"
    return args.moe


def _layer_renames(layer: int, args: ModelArgs) -> dict[str, str]:
    """Our layer-local name -> HF layer-local name of the renamed tensors of `layer`."""
    queries = ("wq_a", "q_norm", "wq_b") if args.q_lora_rank else ("wq",)
    attention = {
        k: v
        for k, v in _ATTENTION.items()
        if k.split(".")[1] not in ("wq", "wq_a", "q_norm", "wq_b") or k.split(".")[1] in queries
    }
    ffn = (
        HF_FEED_FORWARD
        if layer < args.n_dense_layers
        else {k: v for k, v in _MOE.items() if "shared_experts" not in k or _moe_args(args).num_shared_experts}
    )
    mtp = {f"mtp.{k}": v for k, v in _MTP.items()} if layer >= args.n_layers else {}
    return {**attention, **ffn, **mtp}


# A multi-token-prediction module's own tensors, beside its block's, in the published layer of
# index n_layers + k (which also holds copies of the embedding and the output layer).
_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_MTP_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}


def _split(ours: str, args: ModelArgs) -> tuple[int | None, str]:
    """(HF layer index, our name within the layer) of our tensor; (None, ours) for a top-level one.
    An MTP module k is layer n_layers + k: its block's tensors keep their names, its own get "mtp."."""
    if ours.startswith("mtp."):
        _, k, local = (ours.split(".", 2) + ["", ""])[:3]
        if not k.isdigit() or int(k) >= args.mtp_depth:
            raise KeyError(f"{ours} is not a tensor of {_describe(args)}")
        return args.n_layers + int(k), local.removeprefix("block.") if local.startswith("block.") else "mtp." + local
    return split_layer_name(ours, args.n_layers, _describe(args))


def _our_names(args: ModelArgs) -> list[str]:
    names = list(HF_TOP_LEVEL)
    for i in range(args.n_layers + args.mtp_depth):
        prefix = f"layers.{i}." if i < args.n_layers else f"mtp.{i - args.n_layers}."
        for local in [*_layer_renames(i, args), *(EXPERT_PROJECTIONS if i >= args.n_dense_layers else ())]:
            names.append(
                prefix
                + (
                    local.removeprefix("mtp.")
                    if local.startswith("mtp.")
                    else ("block." + local if i >= args.n_layers else local)
                )
            )
    return names


def hf_names(ours: str, args: ModelArgs, present: frozenset[str]) -> list[str]:
    """The HF tensors our tensor `ours` is read from: the experts' per-expert (or fused) tensors,
    else its one renamed tensor."""
    layer, local = _split(ours, args)
    if layer is None:
        return [HF_TOP_LEVEL[ours]]
    if local in EXPERT_PROJECTIONS and layer >= args.n_dense_layers:
        return expert_hf_names(layer, local, _moe_args(args).num_experts, present)
    return [f"model.layers.{layer}.{_layer_renames(layer, args)[local]}"]


def tensor_from_hf(ours: str, tensors: dict[str, torch.Tensor], args: ModelArgs) -> torch.Tensor:
    layer, local = _split(ours, args)
    if layer is not None and local in EXPERT_PROJECTIONS:
        return expert_from_hf(layer, local, tensors, _moe_args(args).num_experts, _moe_args(args).hidden_dim)
    ((_, w),) = tensors.items()
    return w.float() if local == "feed_forward.expert_bias" else w  # our bias buffer is float32


def block_from_hf(ours: str, read, args: ModelArgs, present: frozenset[str], offset, shape) -> torch.Tensor | None:
    """A block of the experts read from only its experts' bytes (HFAdapter.block_from_hf); None for
    the rest."""
    layer, local = _split(ours, args)
    if layer is None or local not in EXPERT_PROJECTIONS or layer < args.n_dense_layers:
        return None
    return expert_block_from_hf(layer, local, read, present, _moe_args(args).hidden_dim, offset, shape)


def tensor_to_hf(ours: str, w: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    layer, local = _split(ours, args)
    if layer is None:
        # The published MTP layers hold their own copies of the embedding and the output layer.
        # (Clones: a safetensors file holds no two names of one storage.)
        copies = {
            f"model.layers.{args.n_layers + k}.{_MTP_COPIES[ours]}": w.clone()
            for k in range(args.mtp_depth)
            if ours in _MTP_COPIES
        }
        return {HF_TOP_LEVEL[ours]: w, **copies}
    if local in EXPERT_PROJECTIONS:
        return expert_to_hf(layer, local, w)
    return {f"model.layers.{layer}.{_layer_renames(layer, args)[local]}": w}


def _mtp_layers(hf_sd, args: ModelArgs):
    """The names of the multi-token-prediction layers stored after the decoder layers that `args`
    does not read (its mtp_depth first ones are read), and the MTP layers' copies of the embedding
    and the output layer: skipped."""
    skipped = []
    for key in hf_sd:
        parts = key.split(".")
        if key.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= args.n_layers:
            copy = ".".join(parts[3:]) in _MTP_COPIES.values()
            if copy or int(parts[2]) >= args.n_layers + args.mtp_depth:
                skipped.append(key)
    return skipped


def _expected_hf(args: ModelArgs, present) -> list[str]:
    names = []
    for ours in _our_names(args):
        names += hf_names(ours, args, present)
    return list(dict.fromkeys(names))


def to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face DeepseekV3ForCausalLM state dict (experts one tensor per expert)."""
    _check_exportable(args)
    check_keys(sd, _our_names(args), "the model state dict", _describe(args))
    out = {}
    for ours, w in sd.items():
        out.update(tensor_to_hf(ours, w, args))
    return out


def from_hf(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hugging Face DeepseekV3ForCausalLM state dict -> ours; runs on meta tensors as well."""
    skipped = set(_mtp_layers(hf_sd, args))
    hf_sd = {k: v for k, v in hf_sd.items() if k not in skipped and not ROTARY_INV_FREQ.fullmatch(k)}
    check_keys(hf_sd, _expected_hf(args, frozenset(hf_sd)), "the Hugging Face state dict", _describe(args))
    return convert_from_hf(_our_names(args), hf_sd, args, hf_names, tensor_from_hf)


def _check_exportable(args: ModelArgs) -> MoEArgs:
    """UserError for what DeepseekV3ForCausalLM cannot compute: no experts, softmax routing, a capacity
    limit; else the flavor's MoE settings."""
    m = args.moe
    if m is None:
        raise UserError(
            "DeepseekV3ForCausalLM has experts after the first_k_dense_replace layers; this flavor has none"
        )
    if m.score_func != "sigmoid":
        raise UserError(
            f"DeepseekV3ForCausalLM routes with sigmoid scores; this flavor uses {m.score_func!r} "
            "(DeepSeek-V2's softmax routing has no export here)"
        )
    if m.capacity_factor is not None:
        raise UserError("DeepseekV3ForCausalLM drops no token: train without moe.capacity_factor for an export")
    return m


def hf_config(
    args: ModelArgs, dtype: torch.dtype = torch.float32, bos_id: int | None = None, eos_id: int | None = None
) -> dict:
    """A config.json for DeepseekV3ForCausalLM describing a model with `args`, stored in `dtype`."""
    m = _check_exportable(args)
    dtype_name = str(dtype).removeprefix("torch.")
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": m.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "first_k_dense_replace": args.n_dense_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_routed_experts": m.num_experts,
        "n_shared_experts": m.num_shared_experts,
        "num_experts_per_tok": m.top_k,
        "n_group": m.num_expert_groups or 1,
        "topk_group": m.num_limited_groups or 1,
        "norm_topk_prob": m.route_norm,
        "routed_scaling_factor": m.route_scale,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "head_dim": args.qk_rope_head_dim,
        "rope_interleave": True,
        **rope_config(args.rope_theta, args.rope_scaling),
        # The context YaRN stretches to (transformers warns when it differs from factor x original).
        "max_position_embeddings": max(
            args.max_seq_len, int(args.rope_scaling.factor * args.rope_scaling.original_max_position_embeddings)
        )
        if args.rope_scaling is not None
        else args.max_seq_len,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": args.mtp_depth,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    return with_token_ids(config, bos_id, eos_id)


def args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs for the DeepseekV3ForCausalLM a config.json describes; UserError if we cannot represent it."""
    required = [
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "n_routed_experts",
        "num_experts_per_tok",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "vocab_size",
    ]
    absent = [f for f in required if config.get(f) is None]
    if absent:
        raise UserError(f"Hugging Face config lacks {', '.join(absent)}; is this a DeepseekV3ForCausalLM config.json?")
    for field, wanted in [
        ("hidden_act", "silu"),
        ("scoring_func", "sigmoid"),
        ("rope_interleave", True),
        ("tie_word_embeddings", False),
        ("attention_bias", False),
    ]:
        if config.get(field, wanted) != wanted:
            raise unsupported(field, config[field], f"our model needs {wanted!r}", FAMILY)
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads", heads) != heads:
        raise unsupported(
            "num_key_value_heads", config["num_key_value_heads"], "MLA has one key/value per head", FAMILY
        )
    theta, scaling = rope_from_config(config, 10000.0, FAMILY, kinds=("yarn",))
    groups, limited = config.get("n_group") or 1, config.get("topk_group") or 1
    moe = MoEArgs(
        num_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"],
        hidden_dim=config["moe_intermediate_size"],
        num_shared_experts=config.get("n_shared_experts") or 0,
        score_func="sigmoid",
        route_norm=bool(config.get("norm_topk_prob", True)),
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        num_expert_groups=groups if groups > 1 else None,
        num_limited_groups=limited if groups > 1 else None,
    )
    problems = moe.check()
    if problems:
        raise UserError(f"Hugging Face config's experts cannot be represented: {'; '.join(problems)}")
    return ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_dense_layers=config.get("first_k_dense_replace", 0),
        n_heads=heads,
        vocab_size=config["vocab_size"],
        inter_dim=config["intermediate_size"],
        moe=moe,
        q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=config.get("max_position_embeddings", 4096),
        mtp_depth=config.get("num_nextn_predict_layers") or 0,
    )


ADAPTER = HFAdapter(
    model_types=_MODEL_TYPES,
    to_hf=to_hf,
    from_hf=from_hf,
    config=hf_config,
    args_from_config=args_from_hf_config,
    hf_names=hf_names,
    tensor_from_hf=tensor_from_hf,
    tensor_to_hf=tensor_to_hf,
    block_from_hf=block_from_hf,
)
