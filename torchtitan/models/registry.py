"""The model registry: the one place that imports model families.

The families shipped with torchtitan are listed in `_BUILTIN` (name -> the function building the
family's spec, imported only when asked for). A family defined outside the package registers
itself with `register_model(spec)` in a module that the job names in
`experimental.custom_import`; `import_custom_module` imports it before the model is looked up.
"""

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable

from torchtitan.config.errors import UserError
from torchtitan.models.spec import ModelSpec


def _llama3() -> ModelSpec:
    from torchtitan.models.llama3 import build_spec

    return build_spec()


def _qwen3() -> ModelSpec:
    from torchtitan.models.qwen3 import build_spec

    return build_spec()


_BUILTIN: dict[str, Callable[[], ModelSpec]] = {
    "llama3": _llama3,
    "qwen3": _qwen3,
}
_REGISTERED: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    """Make `spec` available as model.name = spec.name. Registering a name twice is an error,
    unless it is the very same spec (a module imported twice)."""
    if spec.name in _BUILTIN or _REGISTERED.get(spec.name, spec) is not spec:
        raise ValueError(f"a model named {spec.name!r} is already registered")
    _REGISTERED[spec.name] = spec


def model_names() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTERED})


def get_model_spec(name: str) -> ModelSpec:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise UserError(
            f"unknown model.name '{name}'; registered models: {', '.join(model_names())} (a model defined "
            f"outside torchtitan registers itself in the module named by experimental.custom_import)"
        )
    return _BUILTIN[name]()


def get_model_args(name: str, flavor: str):
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise UserError(
            f"unknown model.flavor '{flavor}' for model '{name}'; available flavors: {', '.join(spec.flavors)}"
        )
    return spec.flavors[flavor]


def spec_for_hf_config(config: dict) -> ModelSpec:
    """The registered family whose Hugging Face adapter reads a config.json with this model_type."""
    model_type = config.get("model_type")
    for name in model_names():
        spec = get_model_spec(name)
        if spec.hf is not None and model_type in spec.hf.model_types:
            return spec
    known = sorted(t for n in model_names() if get_model_spec(n).hf is not None for t in get_model_spec(n).hf.model_types)
    raise UserError(
        f"Hugging Face config has model_type = {model_type!r}, which no registered model reads; "
        f"supported: {', '.join(known)}"
    )


def import_custom_module(target: str) -> None:
    """Import `target` (a dotted module name importable from the working directory or sys.path, or
    the path of a .py file) so that it can call `register_model`. Empty: nothing to import."""
    if not target:
        return
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise UserError(f"experimental.custom_import: file {target} not found")
        name = "torchtitan_custom_" + os.path.splitext(os.path.basename(target))[0]
        if name in sys.modules:
            return
        module_spec = importlib.util.spec_from_file_location(name, target)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and target.startswith(e.name):
            raise UserError(
                f"experimental.custom_import: cannot import module {target!r} ({e}); give a dotted module name "
                f"importable from {os.getcwd()} or PYTHONPATH, or the path of a .py file"
            ) from None
        raise
