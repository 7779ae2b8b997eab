"""Checks shared by the families' Hugging Face adapters (state-dict keys, config.json fields)."""

import re

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
