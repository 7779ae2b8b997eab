"""Float8 training: swap the model's nn.Linear layers for torchao's Float8Linear.

The conversion runs in place on the meta-device model, before parallelization, so FSDP shards the
converted layers and `to_empty` + `init_weights` materialize them like any other. What is unusual:

- Float8Linear subclasses nn.Linear and keeps its `weight` Parameter, so parameter names, shapes and
  state_dict keys are unchanged: checkpoints load into a converted or an unconverted model alike, and
  the per-name seeded init gives the same weights either way.
- With `enable_fsdp_float8_all_gather` the weight becomes torchao's WeightWithDynamicFloat8CastTensor
  (a tensor subclass that casts to float8 before FSDP's all-gather). It behaves as a plain tensor for
  everything else, so it is harmless without FSDP; the scale precompute only acts on FSDP (DTensor)
  weights.
- Under CPU autocast Float8Linear does not cast its input (it only checks CUDA autocast), but the
  matmul still runs in float8 and autocast only relabels the float8 operands, giving a bf16 output.
- Under tensor parallel the converted layers take the ordinary colwise/rowwise styles: their
  weights are DTensors, so a tensorwise scale's amax is reduced over all shards and every rank
  scales alike. torchao's float8 TP styles (float8 all-gather of TP inputs) are not used: their
  collectives carry float8 tensors, which gloo cannot, so they could not be tested on CPU.
- torchao is imported lazily: a job without the float8 converter must not need it.
"""

import dataclasses
import logging
from typing import cast

from torch import nn

from torchtitan.config import Float8, UserError

logger = logging.getLogger(__name__)

# torch._scaled_mm needs both matmul dimensions of the weight divisible by 16.
_FLOAT8_DIM_MULTIPLE = 16
_TORCHAO_PIN = "torchao==0.18.0"  # the release built against torch 2.13


def _import_torchao_float8():
    try:
        import torchao.float8 as ao_float8
    except ImportError as e:
        raise UserError(
            f"model.converters includes 'float8', which needs torchao, but it cannot be imported ({e}); "
            f"install it with `pip install {_TORCHAO_PIN}` (the version that matches torch 2.13), "
            f"or remove 'float8' from model.converters."
        ) from None
    return ao_float8


def float8_linear_config(cfg: Float8):
    """torchao's Float8LinearConfig for the [float8] section."""
    ao_float8 = _import_torchao_float8()
    # The config validator refuses float8 all-gather with other recipes.
    assert cfg.recipe_name == "tensorwise" or not cfg.enable_fsdp_float8_all_gather
    if cfg.recipe_name == "tensorwise":
        return ao_float8.Float8LinearConfig(
            enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather, emulate=cfg.emulate
        )
    config = ao_float8.Float8LinearConfig.from_recipe_name(cfg.recipe_name)
    return dataclasses.replace(config, emulate=cfg.emulate)


def high_precision_reason(fqn: str, linear: nn.Linear, cfg: Float8, high_precision: tuple[str, ...] = ()) -> str | None:
    """Why convert_to_float8 keeps the Linear `fqn` in high precision, or None: it converts it."""
    kept = [suffix for suffix in high_precision if fqn.endswith(suffix)]
    if kept:
        # E.g. a mixture of experts' router: its scores pick the experts, and float8 rounding would
        # change which ones.
        return f"the model spec's high_precision {kept[0]!r}"
    matches = [f for f in cfg.filter_fqns if f and f in fqn]
    if matches:
        return f"float8.filter_fqns entry {matches[0]!r}"
    dims = (linear.in_features, linear.out_features)
    if any(d % _FLOAT8_DIM_MULTIPLE for d in dims):
        return (
            f"in/out features {dims[0]}x{dims[1]} are not both multiples of {_FLOAT8_DIM_MULTIPLE}, which "
            f"float8 matmuls need"
        )
    return None


def convert_to_float8(model: nn.Module, cfg: Float8, high_precision: tuple[str, ...] = ()) -> list[str]:
    """Swap, in place, every nn.Linear for a Float8Linear except those whose name ends with one of
    `high_precision` (the model spec's), contains one of `cfg.filter_fqns`, or whose dimensions are
    not multiples of 16. Returns the converted names."""
    ao_float8 = _import_torchao_float8()
    config = float8_linear_config(cfg)
    converted: list[str] = []

    def keep_or_convert(module: nn.Module, fqn: str) -> bool:
        # torchao asks only about nn.Linear modules (swap_linear_layers checks isinstance first).
        reason = high_precision_reason(fqn, cast(nn.Linear, module), cfg, high_precision)
        if reason:
            logger.info(f"float8: keeping {fqn} in high precision ({reason})")
            return False
        converted.append(fqn)
        return True

    # torchao returns a new module instead of converting in place when the root itself is a Linear.
    if isinstance(model, nn.Linear):
        raise ValueError("convert_to_float8 converts the Linear layers inside a model, not a bare nn.Linear")
    ao_float8.convert_to_float8_training(model, module_filter_fn=keep_or_convert, config=config)
    logger.info(
        f"float8: converted {len(converted)} linear layers to torchao Float8Linear (recipe {cfg.recipe_name}"
        f"{', float8 FSDP all-gather' if cfg.enable_fsdp_float8_all_gather else ''}"
        f"{', emulated' if cfg.emulate else ''})"
    )
    return converted


def precompute_float8_scales(model: nn.Module) -> None:
    """After each optimizer step: compute every float8-all-gathered weight's scale with one all-reduce,
    instead of one all-reduce per weight inside the next forward's all-gathers."""
    _import_torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)
