"""Checks and loops shared by the families' Hugging Face adapters (state-dict keys, config.json
fields, the whole-dict conversions built from the per-tensor ones)."""

import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Literal, overload

import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.rotary import RopeScaling, YarnScaling

# Some exports store the rotary frequencies; every family recomputes them from the rotary theta.
ROTARY_INV_FREQ = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# Hugging Face's names of the standard decoder's tensors (ours, Meta's, on the left): the top level,
# and within block N (model.layers.N.<name>) the attention, its optional per-head q/k norms (Qwen3),
# the two pre-norms, a SwiGLU feed-forward or an MoE router.
HF_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
HF_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
HF_QK_NORMS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
HF_BLOCK_NORMS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
HF_FEED_FORWARD = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
HF_ROUTER = {"feed_forward.router.gate.weight": "mlp.gate.weight"}


def first(keys: list[str], n: int = 5) -> str:
    more = f" (and {len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def check_keys(found, expected, what: str, model: str, optional: tuple[str, ...] = ()) -> None:
    """UserError naming the first unknown and missing keys of `found` against `expected` (keys in
    `optional` may be absent); `model` describes the configuration, e.g. 'a Llama 3 model with 2 layers'."""
    unknown = [k for k in found if k not in expected]
    missing = [k for k in expected if k not in found and k not in optional]
    if unknown or missing:
        parts = ([f"unknown keys {first(unknown)}"] if unknown else []) + (
            [f"missing keys {first(missing)}"] if missing else []
        )
        raise UserError(
            f"{what} does not match {model}: {'; '.join(parts)}. "
            "Check that the weights and the model configuration belong together."
        )


def split_layer_name(ours: str, n_layers: int, model: str) -> tuple[int | None, str]:
    """(layer, name within it) of our tensor `ours` ("layers.N.<name>"); (None, ours) for a top-level
    one; KeyError for a layer that `model` (its description) lacks."""
    if not ours.startswith("layers."):
        return None, ours
    _, layer, local = (ours.split(".", 2) + ["", ""])[:3]
    if not layer.isdigit() or int(layer) >= n_layers:
        raise KeyError(f"{ours} is not a tensor of {model}")
    return int(layer), local


def hf_text_config(config: dict, where: str = "the Hugging Face config") -> dict:
    """The settings of the language model that a Hugging Face config.json describes. Every entry point
    (the family that reads a folder, the trainer's check and vocabulary, the conversion and generation
    scripts) reads them here, so that none accepts a layout another refuses.

    A text model's config is itself. A multimodal one (transformers' *ForConditionalGeneration: the
    published Qwen3.5 folders are model_type 'qwen3_5' around a text_config of model_type
    'qwen3_5_text') nests them in text_config; its outer tie_word_embeddings, where present, is the one
    transformers ties the output layer by, so it replaces the text_config's. `where` names the config in
    messages (e.g. the path of config.json)."""
    text = config.get("text_config")
    if text is None:
        # A vision tower's own config (vision_config, no text model beside it) has no vocabulary: a config
        # with vocab_size at its top level is a text model that also has a vision tower (e.g. Qwen2-VL).
        if "vision_config" in config and "vocab_size" not in config:
            raise UserError(
                f"{where} describes a vision tower only (vision_config, no text_config): this trainer "
                "trains a text model; give a folder that holds one"
            )
        return config
    if not isinstance(text, dict) or not text:
        raise UserError(
            f"{where} has text_config = {text!r}, not the object of the language model's settings "
            "that transformers writes; download or export the folder's config.json again"
        )
    if "tie_word_embeddings" in config:
        return {**text, "tie_word_embeddings": config["tie_word_embeddings"]}
    return text


def unsupported(field: str, value, why: str, family: str) -> UserError:
    return UserError(f"Hugging Face config has {field} = {value!r}: {why}; only plain {family} models can be imported")


def _rope_fields(config: dict) -> dict:
    """The rotary settings of a config.json in one dict: transformers before 5 write rope_theta (+
    rope_scaling); 5 and later write rope_parameters (theta and scaling together)."""
    fields = dict(config.get("rope_scaling") or {})
    fields.update(config.get("rope_parameters") or {})
    return fields


_SCALING_NAMES = {"llama3": "Llama 3.1's scaling (rope_type 'llama3')", "yarn": "YaRN (rope_type 'yarn')"}


# The scaling returned is one of `kinds`: a family that implements one kind gets that kind's type.
@overload
def rope_from_config(
    config: dict, default_theta: float, family: str, kinds: tuple[Literal["llama3"]]
) -> tuple[float, RopeScaling | None]: ...
@overload
def rope_from_config(
    config: dict, default_theta: float, family: str, kinds: tuple[Literal["yarn"]]
) -> tuple[float, YarnScaling | None]: ...
@overload
def rope_from_config(
    config: dict, default_theta: float, family: str, kinds: tuple[str, ...] = ()
) -> tuple[float, RopeScaling | YarnScaling | None]: ...
def rope_from_config(
    config: dict, default_theta: float, family: str, kinds: tuple[str, ...] = ()
) -> tuple[float, RopeScaling | YarnScaling | None]:
    """(rope theta, scaling or None) of a config.json, the scaling one of `kinds` ("llama3": Llama
    3.1's, "yarn"); any other scaling is refused, naming what the family implements."""
    for field in ("rope_scaling", "rope_parameters"):
        if config.get(field) is not None and not isinstance(config[field], dict):
            raise unsupported(field, config[field], "it must be a mapping", family)
    rope = _rope_fields(config)
    theta = float(rope.get("rope_theta", config.get("rope_theta", default_theta)))
    found = {
        field: config[field].get("rope_type", config[field].get("type", "default"))
        for field in ("rope_scaling", "rope_parameters")
        if config.get(field) is not None
    }
    scalings = {field: kind for field, kind in found.items() if kind != "default"}
    if not scalings:
        return theta, None
    for field, kind in scalings.items():
        if kind not in kinds:
            what = " or ".join(_SCALING_NAMES[k] for k in kinds) or "plain rotary embeddings without scaling"
            raise unsupported(field, config[field], f"our model implements {what}", family)
    kind = next(iter(scalings.values()))
    try:
        if kind == "llama3":
            return theta, RopeScaling(
                float(rope["factor"]),
                float(rope.get("low_freq_factor", 1.0)),
                float(rope.get("high_freq_factor", 4.0)),
                int(rope["original_max_position_embeddings"]),
            )
        factor = rope.get("factor") or config["max_position_embeddings"] / rope["original_max_position_embeddings"]
        return theta, YarnScaling(
            float(factor),
            int(rope["original_max_position_embeddings"]),
            float(rope.get("beta_fast") or 32.0),
            float(rope.get("beta_slow") or 1.0),
            float(rope.get("mscale") or 0.0),
            float(rope.get("mscale_all_dim") or 0.0),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise unsupported(
            "rope_scaling",
            rope,
            f"a {kind!r} scaling needs factor and original_max_position_embeddings ({e!r})",
            family,
        ) from None


def plain_rope_theta(config: dict, default: float, family: str) -> float:
    """The rotary theta of a config.json without rotary scaling (refused otherwise)."""
    return rope_from_config(config, default, family)[0]


def decoder_config(args, architecture: str, model_type: str) -> dict:
    """The config.json fields of a standard decoder (Llama's, Qwen3's), in transformers' order: sizes,
    norm, rotary (both spellings, rope_config), context, tying, SwiGLU, no attention bias. `args`
    give dim, ffn_hidden_dim, n_layers, n_heads, kv_heads, head_dim, vocab_size, norm_eps, rope_theta,
    max_seq_len, tie_word_embeddings, and rope_scaling where they have it."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        **rope_config(args.rope_theta, getattr(args, "rope_scaling", None)),
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def with_token_ids(config: dict, bos_id: int | None, eos_id: int | None) -> dict:
    """`config` with the tokenizer's bos_token_id and eos_token_id, those that are known."""
    ids = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    return {**config, **{field: value for field, value in ids.items() if value is not None}}


def rope_config(theta: float, scaling: RopeScaling | YarnScaling | None) -> dict:
    """config.json's rotary fields, in both spellings (transformers 4.x and 5.x)."""
    params = {"rope_type": "default", "rope_theta": theta}
    legacy = None
    if isinstance(scaling, RopeScaling):
        legacy = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    elif isinstance(scaling, YarnScaling):
        legacy = {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
            "mscale": scaling.mscale,
            "mscale_all_dim": scaling.mscale_all_dim,
        }
    if legacy is not None:
        params = {**legacy, "rope_theta": theta}
    return {"rope_theta": theta, "rope_scaling": legacy, "rope_parameters": params}


# Tied embeddings: Hugging Face stores the embedding only (or lm_head.weight as an equal copy), and
# our tied output.weight is the embedding tensor itself.
HF_EMBEDDING, HF_LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tied_output_hf_names(present: frozenset[str]) -> list[str]:
    """What a tied output.weight is read from: the embedding, then lm_head.weight if the folder stores one."""
    return [HF_EMBEDDING] + ([HF_LM_HEAD] if HF_LM_HEAD in present else [])


def tied_output_from_hf(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A tied output.weight from the tensors tied_output_hf_names names: the embedding itself (a stored
    lm_head.weight must be an equal copy)."""
    check_tied_copy(tensors, HF_LM_HEAD, HF_EMBEDDING)
    return tensors[HF_EMBEDDING]


def check_tied_copy(sd: dict, output: str, embedding: str):
    """A stored output weight of a tied model must be the embedding (or an equal copy). A value check:
    skipped on meta tensors (a folder checked from its headers), which have shapes only."""
    if output not in sd or sd[output] is sd[embedding] or is_meta(sd[output], sd[embedding]):
        return
    if not torch.equal(sd[output], sd[embedding]):
        raise UserError(
            f"the model ties its embeddings (tie_word_embeddings), but {output} differs from {embedding}; "
            "these weights come from an untied model: use a configuration with tie_word_embeddings = false"
        )


def is_meta(*tensors: torch.Tensor) -> bool:
    """Whether any of `tensors` has no data (built from a safetensors header only): value checks skip it."""
    return any(t.is_meta for t in tensors)


def convert_from_hf(
    ours: Iterable[str],
    hf_sd: dict[str, torch.Tensor],
    args: Any,
    hf_names: Callable[[str, Any, frozenset[str]], list[str]],
    tensor_from_hf: Callable[[str, dict[str, torch.Tensor], Any], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Our state dict with the names `ours`, each tensor built by `tensor_from_hf` from the HF tensors
    `hf_names` gives it: a family's whole-dict from_hf, after its checks, is this loop and no other rule.
    `hf_sd` must be the caller's own dict: each HF tensor is removed from it once the last of our tensors
    built from it is, so that when nobody else holds the loaded dict (load_hf) the memory of, e.g.,
    per-expert tensors is freed as they are stacked, and the peak stays about one layer above the model."""
    present = frozenset(hf_sd)
    wanted = {name: hf_names(name, args, present) for name in ours}
    uses = Counter(n for names in wanted.values() for n in names)
    out = {}
    for name, names in wanted.items():
        out[name] = tensor_from_hf(name, {n: hf_sd[n] for n in names}, args)
        for n in names:
            uses[n] -= 1
            if not uses[n]:
                del hf_sd[n]
    return out


# Routed experts (torchtitan.models.common.moe): our 3-D weights, experts first, against the hub's
# one tensor per expert and projection, or transformers 5's fused ones ([experts, 2 x hidden, dim]
# gate rows then up rows, and down_proj [experts, dim, hidden]), under model.layers.N.mlp.experts.
EXPERT_PROJECTIONS = {
    "feed_forward.experts.w1": "gate_proj",
    "feed_forward.experts.w3": "up_proj",
    "feed_forward.experts.w2": "down_proj",
}
FUSED_GATE_UP, FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def expert_key(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def experts_fused(names, layer: int) -> bool:
    """Whether `names` (a state dict or a set of HF names) holds the experts of `layer` fused: either
    fused tensor present (the other one, if absent, is then a missing key)."""
    return f"model.layers.{layer}.{FUSED_GATE_UP}" in names or f"model.layers.{layer}.{FUSED_DOWN}" in names


def expert_hf_names(layer: int, local: str, num_experts: int, present) -> list[str]:
    """What our expert weight `local` (a key of EXPERT_PROJECTIONS) of `layer` is read from: the
    layer's fused tensor if the folder fuses that layer, else one tensor per expert in expert order."""
    proj = EXPERT_PROJECTIONS[local]
    if experts_fused(present, layer):
        return [f"model.layers.{layer}.{FUSED_DOWN if proj == 'down_proj' else FUSED_GATE_UP}"]
    return [expert_key(layer, x, proj) for x in range(num_experts)]


def expert_from_hf(
    layer: int, local: str, tensors: dict[str, torch.Tensor], num_experts: int, hidden_dim: int
) -> torch.Tensor:
    """Our expert weight from exactly expert_hf_names' tensors: stacked, or sliced from the fused one."""
    proj = EXPERT_PROJECTIONS[local]
    gate_up = tensors.get(f"model.layers.{layer}.{FUSED_GATE_UP}")
    if gate_up is not None:
        return (gate_up[:, :hidden_dim] if proj == "gate_proj" else gate_up[:, hidden_dim:]).contiguous()
    down = tensors.get(f"model.layers.{layer}.{FUSED_DOWN}")
    if down is not None:
        return down
    return torch.stack([tensors[expert_key(layer, x, proj)] for x in range(num_experts)])


def expert_block_from_hf(
    layer: int, local: str, read, present, hidden_dim: int, offset: tuple[int, ...], shape: tuple[int, ...]
) -> torch.Tensor:
    """The block (offset, shape) of expert_from_hf's result, reading only its bytes: the block's
    experts, each its block of one tensor per expert, or one block of the fused tensor."""
    proj = EXPERT_PROJECTIONS[local]
    if experts_fused(present, layer):
        fused, shift = (
            (FUSED_DOWN, 0) if proj == "down_proj" else (FUSED_GATE_UP, 0 if proj == "gate_proj" else hidden_dim)
        )
        return read(f"model.layers.{layer}.{fused}", (offset[0], offset[1] + shift, *offset[2:]), shape)
    return torch.stack(
        [read(expert_key(layer, x, proj), offset[1:], shape[1:]) for x in range(offset[0], offset[0] + shape[0])]
    )


def expert_to_hf(layer: int, local: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our expert weight as the hub lays it out: one tensor per expert (views of ours)."""
    return {expert_key(layer, x, EXPERT_PROJECTIONS[local]): w[x] for x in range(w.shape[0])}
