"""The model registry: one ModelSpec per model family, listed explicitly below.

Adding a family: write torchtitan/models/<family>/ (args, model, parallelize) and add one line to
`MODEL_SPECS`. Nothing registers itself by being imported.
"""

from dataclasses import dataclass
from typing import Callable

from torch import nn

from torchtitan.config.errors import UserError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    flavors: dict  # flavor name -> model args
    parallelize: Callable  # (model, parallel_dims, mesh, parallelism, training, activation_checkpoint sections) -> model


def _llama3() -> ModelSpec:
    from torchtitan.models.llama3 import args, model, parallelize

    return ModelSpec("llama3", model.Transformer, args.flavors, parallelize.parallelize_llama)


MODEL_SPECS: dict[str, Callable[[], ModelSpec]] = {
    "llama3": _llama3,
}


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODEL_SPECS:
        raise UserError(f"unknown model.name '{name}'; registered models: {', '.join(sorted(MODEL_SPECS))}")
    return MODEL_SPECS[name]()


def get_model_args(name: str, flavor: str):
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise UserError(
            f"unknown model.flavor '{flavor}' for model '{name}'; available flavors: {', '.join(spec.flavors)}"
        )
    return spec.flavors[flavor]
