"""Checks and loops shared by the families' Hugging Face adapters (state-dict keys, config.json
fields, the whole-dict conversions built from the per-tensor ones)."""

import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchtitan.config.errors import UserError

# Some exports store the rotary frequencies; every family recomputes them from the rotary theta.
ROTARY_INV_FREQ = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


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


def unsupported(field: str, value, why: str, family: str) -> UserError:
    return UserError(f"Hugging Face config has {field} = {value!r}: {why}; only plain {family} models can be imported")


def plain_rope_theta(config: dict, default: float, family: str) -> float:
    """The rotary theta of a config.json without rotary scaling (refused otherwise). Transformers
    before 5 write rope_theta (+ rope_scaling); 5 and later write rope_parameters."""
    for field in ("rope_scaling", "rope_parameters"):
        rope = config.get(field)
        if rope is None:
            continue
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        if kind != "default":
            raise unsupported(field, rope, "our model implements plain rotary embeddings without scaling", family)
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", default)))


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
