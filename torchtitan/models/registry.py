"""The model registry: the one place that imports model families.

The families shipped with torchtitan are listed in `_BUILTIN` (name -> the family's package, whose
`build_spec()` is imported and called when the spec is first asked for; the spec is then kept).
Code outside the package extends the registry from a module that the job names in
`experimental.custom_import` (imported by `import_custom_module` before the model is looked up;
docs/models.md has worked examples):

- `register_flavor(model_name, flavor_name, args)` adds a size to a family (built in or
  registered), selected with model.flavor = flavor_name;
- `register_model(spec)` adds a whole family, selected with model.name = spec.name.

Every mistake is a UserError: one line and exit status 2 from the trainer, no traceback.
"""

import dataclasses
import importlib
import importlib.util
import os
import sys
from typing import Any

from torchtitan.config.errors import UserError
from torchtitan.models.common.hf_conversion import hf_text_config
from torchtitan.models.common.spec import ModelSpec

# name -> the package of the family, whose build_spec() gives its spec (imported only when asked for).
_BUILTIN: dict[str, str] = {
    "llama3": "torchtitan.models.llama3",
    "qwen3": "torchtitan.models.qwen3",
    "deepseek_v3": "torchtitan.models.deepseek_v3",
    "gpt_oss": "torchtitan.models.gpt_oss",
    "qwen3_5": "torchtitan.models.qwen3_5",
}
_BUILT: dict[str, ModelSpec] = {}  # the built-in specs built so far
_REGISTERED: dict[str, ModelSpec] = {}  # register_model's specs, as given
_ADDED_FLAVORS: dict[str, dict[str, Any]] = {}  # model name -> register_flavor's flavors
# model name -> its spec with the added flavors (rebuilt after each register_flavor). The specs
# above are never changed: a family's own flavors table stays as the family wrote it.
_WITH_ADDED: dict[str, ModelSpec] = {}

DOCS = "docs/models.md"


def register_model(spec: ModelSpec) -> None:
    """Make `spec` available as model.name = spec.name. A name that is built in or already
    registered is refused (UserError), unless it is the same spec again (a module imported twice).
    For a new size of an existing family, see `register_flavor`."""
    existing = _REGISTERED.get(spec.name)
    if spec.name in _BUILTIN or (existing is not None and existing is not spec and existing != spec):
        where = "built into torchtitan" if spec.name in _BUILTIN else "already registered by another spec"
        raise UserError(
            f"register_model: a model named {spec.name!r} is {where}; give yours another name "
            f"(dataclasses.replace(spec, name='{spec.name}_custom')), or, to add a size to {spec.name!r}, call "
            f"register_flavor({spec.name!r}, FLAVOR_NAME, args) instead (see {DOCS})"
        )
    _REGISTERED[spec.name] = spec


def register_flavor(model_name: str, flavor_name: str, args: Any) -> None:
    """Add a flavor (a size: an instance of the family's `args_cls`) to model `model_name`, a
    built-in family or one registered with `register_model` before, so that a job selects it with
    model.name = model_name, model.flavor = flavor_name. Call it at import time of the module named
    by `experimental.custom_import` (every process that builds the model imports it: the trainer's
    ranks, preflight, a resumed run, the scripts that take experimental.custom_import).

    The same flavor with equal args again does nothing (a module imported twice). Refused with a
    UserError: an unknown model, args that are not the family's args_cls, and a flavor name the
    model already has with other args (a built-in flavor cannot be redefined: pick a new name)."""
    if model_name not in _BUILTIN and model_name not in _REGISTERED:
        raise UserError(
            f"register_flavor: unknown model {model_name!r}; registered models: {', '.join(model_names())} "
            f"(a family of your own must be registered with register_model first)"
        )
    if not isinstance(flavor_name, str) or not flavor_name:
        raise UserError(
            f"register_flavor({model_name!r}, ...): the flavor name must be a non-empty string, got {flavor_name!r}"
        )
    spec = get_model_spec(model_name)
    cls = spec.args_cls
    if not isinstance(args, cls):
        example = next(iter(spec.flavors), None)
        hint = (
            f"; e.g. dataclasses.replace(get_model_args({model_name!r}, {example!r}), dim=..., n_layers=...)"
            if example is not None
            else ""
        )
        raise UserError(
            f"register_flavor({model_name!r}, {flavor_name!r}, ...): "
            f"args must be a {cls.__module__}.{cls.__qualname__} "
            f"(the args_cls of model {model_name!r}), got a {type(args).__module__}.{type(args).__qualname__}{hint}"
        )
    existing = spec.flavors.get(flavor_name)
    if existing is not None:
        if existing == args:
            return
        raise UserError(
            f"register_flavor({model_name!r}, {flavor_name!r}, ...): model {model_name!r} already has a flavor "
            f"{flavor_name!r} with other args ({_differences(existing, args)}); choose another flavor name"
        )
    _ADDED_FLAVORS.setdefault(model_name, {})[flavor_name] = args
    _WITH_ADDED.pop(model_name, None)


def _differences(old: Any, new: Any) -> str:
    """'dim 256 -> 128, n_layers 6 -> 2': the fields of two args that differ."""
    if not (dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new)):
        return f"{old!r} -> {new!r}"
    changed = [
        f"{f.name} {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}"
        for f in dataclasses.fields(old)
        if getattr(old, f.name) != getattr(new, f.name)
    ]
    return ", ".join(changed) or "not equal"


def model_names() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTERED})


def builtin_model_names() -> list[str]:
    """The families that ship with torchtitan (--help lists them; docs/models.md must name each)."""
    return list(_BUILTIN)


def help_with_families(text: str) -> str:
    """The config's --help text with the shipped families under model.name and every registered family's
    flavors under model.flavor (the config layer, below the models, cannot read them itself)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("  --model.name "):
            lines.insert(i + 2, f"      Shipped: {', '.join(builtin_model_names())}.")
        elif line.startswith("  --model.flavor "):
            lines[i + 2 : i + 2] = [
                f"      {name}: {', '.join(get_model_spec(name).flavors)}" for name in model_names()
            ]
    return "\n".join(lines)


def _own_spec(name: str) -> ModelSpec:
    """The spec as its family built it (or as registered), without the added flavors."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise UserError(
            f"unknown model.name '{name}'; registered models: {', '.join(model_names())} (a model defined "
            f"outside torchtitan registers itself in the module named by experimental.custom_import)"
        )
    if name not in _BUILT:
        _BUILT[name] = importlib.import_module(_BUILTIN[name]).build_spec()
    return _BUILT[name]


def get_model_spec(name: str) -> ModelSpec:
    """The spec of model `name`; its `flavors` include those added with `register_flavor`."""
    spec = _own_spec(name)
    added = _ADDED_FLAVORS.get(name)
    if not added:
        return spec
    if name not in _WITH_ADDED:
        _WITH_ADDED[name] = dataclasses.replace(spec, flavors={**spec.flavors, **added})
    return _WITH_ADDED[name]


def get_model_args(name: str, flavor: str):
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise UserError(
            f"unknown model.flavor '{flavor}' for model '{name}'; available flavors: {', '.join(spec.flavors)}; "
            f"to add one, call torchtitan.models.registry.register_flavor('{name}', '{flavor}', args) in a module "
            f"named by experimental.custom_import (see {DOCS})"
        )
    return spec.flavors[flavor]


def spec_for_hf_config(config: dict, where: str = "the Hugging Face config") -> ModelSpec:
    """The registered family whose Hugging Face adapter reads a config.json: the one whose model_types
    hold its language model's model_type (hf_text_config: a multimodal folder's text_config), the
    model_type that check_hf_folder checks, so that the scripts take every folder the trainer takes.
    `where` names the config in messages (e.g. the path of config.json)."""
    text = hf_text_config(config, where)
    model_type = text.get("model_type")
    for name in model_names():
        spec = get_model_spec(name)
        if spec.hf is not None and model_type in spec.hf.model_types:
            return spec
    known = sorted(t for n in model_names() if (hf := get_model_spec(n).hf) is not None for t in hf.model_types)
    field = (
        "model_type" if text is config else f"text_config.model_type (inside model_type {config.get('model_type')!r})"
    )
    raise UserError(
        f"{where} has {field} = {model_type!r}, which no registered model reads; supported: {', '.join(known)}; "
        "a family defined outside torchtitan is found once the module named by experimental.custom_import "
        "(--custom-import in scripts/convert_checkpoint.py) registers it"
    )


def import_custom_module(target: str) -> None:
    """Import `target` (a dotted module name importable from the working directory or sys.path, or
    the path of a .py file, relative to the working directory) so that it can call `register_model`
    and `register_flavor`. Empty: nothing to import. A UserError the module raises while imported
    (a refused registration) reaches the caller unchanged."""
    if not target:
        return
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise UserError(f"experimental.custom_import: file {target} not found")
        name = "torchtitan_custom_" + os.path.splitext(os.path.basename(target))[0]
        if name in sys.modules:
            return
        module_spec = importlib.util.spec_from_file_location(name, target)
        assert module_spec is not None and module_spec.loader is not None  # a .py file gets a source loader
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
