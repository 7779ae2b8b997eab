"""Load a JobConfig from dataclass defaults, a TOML recipe and command-line overrides.

Precedence: defaults < recipe (`--job.config_file`, with `[job] base_config` inheritance) <
command line. Every user mistake becomes one `UserError` naming the key, the value and where it
came from. This module must not import torch: it runs before launch to validate a job quickly.
"""

import dataclasses
import difflib
import os
import sys
import types
import typing
from typing import Literal, cast

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project runs on 3.11, tomli is the 3.10 fallback
    import tomli as tomllib  # pyrefly: ignore[missing-import]  # tomli is installed on Python 3.10 only (pyproject)

from torchtitan.config.errors import HelpRequested, UserError
from torchtitan.config.job_config import ANY, NOT_IMPLEMENTED_KEYS, NOT_IMPLEMENTED_WHY, JobConfig
from torchtitan.config.rules import check_rules

# Origin of a value given on the command line (file values carry their path instead).
_CLI = None

_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


# ---------------------------------------------------------------------------------------------
# Schema lookups


def _section_classes() -> dict[str, type]:
    # Every field of JobConfig is a section built by its class (default_factory=Section).
    return {f.name: cast(type, f.default_factory) for f in dataclasses.fields(JobConfig)}


def _field_types(section: str) -> dict[str, object]:
    cls = _section_classes().get(section)
    if cls is None:
        return {}
    # get_type_hints resolves the annotations even if the schema module ever turns them to strings.
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _all_sections() -> list[str]:
    names = list(_section_classes())
    return names + [s for s in NOT_IMPLEMENTED_KEYS if s not in names]


def _section_keys(section: str) -> list[str]:
    return list(_field_types(section)) + list(NOT_IMPLEMENTED_KEYS.get(section, {}))


def _all_dotted_names() -> list[str]:
    return [f"{s}.{k}" for s in _all_sections() for k in _section_keys(s)]


def _not_implemented_type(inert: object) -> object:
    """The type a not-implemented key's value must have: that of its inert value (ANY: anything)."""
    if inert is ANY:
        return ANY
    if isinstance(inert, list):
        return list[str]
    return type(inert)


def _key_type(section: str, key: str) -> object | None:
    """The type of a known key (ANY for an any-valued not-implemented key), None if the key is unknown."""
    types = _field_types(section)
    if key in types:
        return types[key]
    not_implemented = NOT_IMPLEMENTED_KEYS.get(section, {})
    if key in not_implemented:
        return _not_implemented_type(not_implemented[key])
    return None


def _unwrap_optional(tp: object) -> tuple[object, bool]:
    args = typing.get_args(tp)
    if type(None) in args and typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
        # typing.Union: a union built at run time from a tuple has no `X | Y` spelling.
        union = typing.Union[tuple(rest)]  # noqa: UP007  # pyrefly: ignore[invalid-annotation]  # a value, not a hint
        return union, True
    return tp, False


def _alternatives(tp: object) -> tuple[object, ...] | None:
    """The members of a union such as `int | Literal["auto"]` (a number or a word); None for other types."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


# ---------------------------------------------------------------------------------------------
# Messages


def _where(origin: str | None) -> str:
    return "on the command line" if origin is _CLI else f"in {origin}"


def _from(origin: str | None) -> str:
    return "from the command line" if origin is _CLI else f"in {origin}"


def _show(value: object) -> str:
    """A value as the user wrote it, for error messages."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def _type_name(tp: object) -> str:
    """Short type name for --help."""
    if tp is ANY:
        return "any"
    inner, optional = _unwrap_optional(tp)
    alternatives = _alternatives(inner)
    if alternatives:
        name = "|".join(_type_name(a) for a in alternatives)
    elif typing.get_origin(inner) is Literal:
        name = "|".join(str(c) for c in typing.get_args(inner))
    elif inner in (list[str], list[list[str]]):
        name = "list[str]" if inner == list[str] else "list[list[str]]"
    else:
        name = cast(type, inner).__name__  # what is left is a plain class: bool, int, float, str
    return name + "|none" if optional else name


def _expected(tp: object, origin: str | None) -> str:
    """What a value of this type looks like, for error messages."""
    inner, optional = _unwrap_optional(tp)
    alternatives = _alternatives(inner)
    if alternatives:
        text = " or ".join(_expected(a, origin) for a in alternatives)
    elif typing.get_origin(inner) is Literal:
        text = "one of " + ", ".join(repr(c) for c in typing.get_args(inner))
    else:
        shapes: dict[object, str] = {
            bool: "a boolean (true or false)",
            int: "an integer",
            float: "a number",
            str: "a string",
            list[str]: "a list of strings",
            list[list[str]]: "a list of lists of strings (on the command line: 'a,b;c,d')",
        }
        text = shapes.get(inner, str(inner))
    # Only the command line can spell "unset"; TOML has no null, a recipe just leaves the key out.
    if optional and origin is _CLI:
        text += " or none"
    return text


# What other trainers and papers call a key that has another name here (whole words of a key).
KEY_SYNONYMS = {
    "learning_rate": "lr",
    "max_lr": "lr",
    "peak_lr": "lr",
    "lr_warmup_steps": "warmup_steps",
    "num_warmup_steps": "warmup_steps",
    "warmup": "warmup_steps",
    "max_steps": "steps",
    "num_steps": "steps",
    "total_steps": "steps",
    "train_steps": "steps",
    "training_steps": "steps",
    "iterations": "steps",
    "batch_size": "local_batch_size",
    "micro_batch_size": "local_batch_size",
    "sequence_length": "seq_len",
    "seq_length": "seq_len",
    "max_seq_len": "seq_len",
    "max_seq_length": "seq_len",
    "context_length": "seq_len",
    "max_grad_norm": "max_norm",
    "grad_clip": "max_norm",
    "clip_grad_norm": "max_norm",
    "gradient_clipping": "max_norm",
    "wd": "weight_decay",
    "epsilon": "eps",
    "adam_beta1": "beta1",
    "adam_beta2": "beta2",
    "adam_eps": "eps",
    "output_dir": "dump_folder",
    "save_dir": "dump_folder",
    "save_interval": "interval",
    "save_steps": "interval",
    "logging_steps": "log_freq",
    "log_interval": "log_freq",
    "model_name": "name",
    "random_seed": "seed",
}


def _words(name: str) -> set[str]:
    return set(name.lower().replace("-", "_").split("_"))


def _closest(name: str, candidates: list[str]) -> str | None:
    """The candidate a mistyped `name` most likely meant. The words of the key come first: a known
    synonym (learning_rate -> lr), then the candidate sharing the most words with it (the spelling
    breaking ties); spelling alone (difflib) when no word matches."""
    section, dot, key = name.rpartition(".")
    lead = section + dot
    for phrase, ours in KEY_SYNONYMS.items():
        if phrase == key.lower() and lead + ours in candidates:
            return lead + ours
    words = _words(key) - {""}

    def shared(candidate: str) -> int:
        c_section, c_dot, c_key = candidate.rpartition(".")
        return len(words & _words(c_key)) if c_section + c_dot == lead else 0

    best = max(candidates, key=lambda c: (shared(c), difflib.SequenceMatcher(None, name, c).ratio()), default=None)
    if best is not None and shared(best) and shared(best) * 2 >= len(words):
        return best
    match = difflib.get_close_matches(name, candidates, n=1)
    return match[0] if match else None


def _did_you_mean(name: str, candidates: list[str], prefix: str = "") -> str:
    match = _closest(name, candidates)
    return f"; did you mean '{prefix}{match}'?" if match else ""


def _unknown_section(section: str, origin: str | None, key: str | None = None) -> UserError:
    if key is not None:
        # On the command line the whole name is known, so suggest a whole name.
        near = difflib.get_close_matches(section, _all_sections(), n=1)
        if near and key in _section_keys(near[0]):
            hint = f"; did you mean '--{near[0]}.{key}'?"
        else:
            hint = _did_you_mean(f"{section}.{key}", _all_dotted_names(), "--")
            hint = hint or (f"; did you mean section '{near[0]}'?" if near else "")
        return UserError(f"unknown config section '{section}' in '--{section}.{key}' {_where(origin)}{hint}")
    match = difflib.get_close_matches(section, _all_sections(), n=1)
    hint = f"; did you mean '[{match[0]}]'?" if match else ""
    return UserError(f"unknown config section '[{section}]' {_where(origin)}{hint}")


def _unknown_key(section: str, key: str, origin: str | None) -> UserError:
    prefix = "--" if origin is _CLI else ""
    hint = _did_you_mean(key, _section_keys(section), f"{prefix}{section}.")
    if not hint:
        # A key put in the wrong section is a common slip: point at where it lives (under its name here).
        ours = KEY_SYNONYMS.get(key.lower(), key)
        homes = [s for s in _all_sections() if ours in _section_keys(s)]
        if homes:
            hint = f"; did you mean '{prefix}{homes[0]}.{ours}'?"
        else:
            hint = _did_you_mean(f"{section}.{key}", _all_dotted_names(), prefix)
    return UserError(f"unknown config key '{prefix}{section}.{key}' {_where(origin)}{hint}")


# ---------------------------------------------------------------------------------------------
# Values from TOML


def _check_toml_value(section: str, key: str, value: object, tp: object, origin: str) -> object:
    """The value if it fits the type (ints widen to float), else a UserError."""
    if tp is ANY:
        return value
    inner, _ = _unwrap_optional(tp)
    ok = False
    alternatives = _alternatives(inner)
    if alternatives:
        for alternative in alternatives:
            try:
                return _check_toml_value(section, key, value, alternative, origin)
            except UserError:
                pass
    elif typing.get_origin(inner) is Literal:
        ok = any(type(value) is type(c) and value == c for c in typing.get_args(inner))
    elif inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif inner is str:
        ok = isinstance(value, str)
    elif inner == list[str]:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif inner == list[list[str]]:
        ok = isinstance(value, list) and all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in value)
    if not ok:
        raise UserError(f"{section}.{key}: expected {_expected(tp, origin)}, got {_show(value)} ({_from(origin)})")
    return value


def _check_toml_table(data: dict, path: str) -> dict[tuple[str, str], object]:
    """Flatten one recipe to {(section, key): value}, rejecting unknown names and wrong types."""
    out = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            if section in _all_sections():
                raise UserError(f"'{section}' in {path} must be a [{section}] table, got {_show(table)}")
            # A key written above the first [section] header.
            homes = [s for s in _all_sections() if section in _section_keys(s)]
            hint = f"; did you mean '{homes[0]}.{section}' (put it under [{homes[0]}])?" if homes else ""
            raise UserError(f"config key '{section}' in {path} is outside any [section]{hint}")
        if section not in _all_sections():
            raise _unknown_section(section, path)
        for key, value in table.items():
            tp = _key_type(section, key)
            if tp is None:
                raise _unknown_key(section, key, path)
            if (section, key) == ("job", "config_file"):
                raise UserError(
                    f"job.config_file cannot be set inside a recipe ({path}); "
                    "pass --job.config_file on the command line"
                )
            out[(section, key)] = _check_toml_value(section, key, value, tp, path)
    return out


def _read_toml(path: str, what: str) -> dict:
    if os.path.isdir(path):
        raise UserError(f"{what} is a folder, not a TOML file: {path}")
    if not os.path.isfile(path):
        raise UserError(f"{what} not found: {path}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"cannot parse TOML in {path}: {e}") from None


def _load_recipe(path: str, what: str, chain: tuple[str, ...]) -> dict[tuple[str, str], tuple]:
    """{(section, key): (value, origin path)} of a recipe merged over its base chain."""
    real = os.path.realpath(path)
    if real in [os.path.realpath(p) for p in chain]:
        raise UserError("recipe inheritance cycle: " + " -> ".join([*chain, path]))
    table = _check_toml_table(_read_toml(path, what), path)
    base = table.pop(("job", "base_config"), None)
    merged = {}
    if base is not None:
        base_path = os.path.join(os.path.dirname(path), cast(str, base))  # checked as job.base_config's type
        merged = _load_recipe(base_path, f"base_config {base!r} of {path}", (*chain, path))
        # The resolved base_config is this recipe's own, not the base's.
        merged[("job", "base_config")] = (base, path)
    merged.update({k: (v, path) for k, v in table.items()})
    return merged


# ---------------------------------------------------------------------------------------------
# Values from the command line


def _parse_cli_value(section: str, key: str, text: str, tp: object) -> object:
    if tp is ANY:
        return text
    inner, optional = _unwrap_optional(tp)
    if optional and text.lower() in ("none", "null"):
        return None
    value: object = text
    ok = True
    alternatives = _alternatives(inner)
    if alternatives:
        for alternative in alternatives:
            try:
                return _parse_cli_value(section, key, text, alternative)
            except UserError:
                pass
        ok = False
    elif inner is bool:
        ok = text.lower() in _BOOL_WORDS
        value = _BOOL_WORDS.get(text.lower())
    elif inner is int:
        try:
            value = int(text)
        except ValueError:
            ok = False
    elif inner is float:
        try:
            value = float(text)
        except ValueError:
            ok = False
    elif inner == list[str]:
        value = [item.strip() for item in text.split(",") if item.strip()]
    elif inner == list[list[str]]:  # groups separated by ';', items by ','
        value = [
            [item.strip() for item in group.split(",") if item.strip()] for group in text.split(";") if group.strip()
        ]
    elif typing.get_origin(inner) is Literal:
        ok = text in typing.get_args(inner)
    if not ok:
        raise UserError(f"{section}.{key}: expected {_expected(tp, _CLI)}, got {text!r} (from the command line)")
    return value


def _is_bool(tp: object) -> bool:
    return _unwrap_optional(tp)[0] is bool


def _parse_cli(argv: list[str]) -> dict[tuple[str, str], object]:
    """{(section, key): typed value} of the command-line overrides, last one winning."""
    out: dict[tuple[str, str], object] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            raise UserError(
                f"unexpected command-line argument {arg!r}; overrides look like "
                "--section.key VALUE or --section.key=VALUE (see --help)"
            )
        name, eq, inline = arg[2:].partition("=")
        section, dot, key = name.partition(".")
        if not dot or not section or not key or "." in key:
            raise UserError(f"command-line argument {arg!r} is not of the form --section.key (see --help)")
        section, key = section.replace("-", "_"), key.replace("-", "_")
        if section not in _all_sections():
            raise _unknown_section(section, _CLI, key)
        tp = _key_type(section, key)
        negated = _key_type(section, key[3:]) if key.startswith("no_") else None
        if tp is None and negated is not None and _is_bool(negated):
            if eq:
                raise UserError(f"--{name} takes no value (it sets {section}.{key[3:]} to false)")
            out[(section, key[3:])] = False
            continue
        if tp is None:
            raise _unknown_key(section, key, _CLI)
        if (section, key) == ("job", "base_config"):
            raise UserError(
                "job.base_config can only be set inside a recipe; on the command line, "
                "pass that recipe with --job.config_file instead"
            )
        has_next = i < len(argv) and not argv[i].startswith("--")
        if eq:
            text = inline
        elif _is_bool(tp):
            # A bare boolean flag means true; a following true/false word is its value.
            if has_next and argv[i].lower() in _BOOL_WORDS:
                text = argv[i]
                i += 1
            else:
                text = "true"
        elif has_next:
            text = argv[i]
            i += 1
        elif tp is ANY:
            # Not-implemented keys that take anything are mostly upstream flags: bare means true.
            out[(section, key)] = True
            continue
        else:
            raise UserError(f"--{name} needs a value (--{name} VALUE or --{name}=VALUE)")
        out[(section, key)] = _parse_cli_value(section, key, text, tp)
    return out


# ---------------------------------------------------------------------------------------------
# Loading


def _check_not_implemented(merged: dict[tuple[str, str], tuple]) -> None:
    """Not-implemented keys load only while they hold their inert value."""
    for (section, key), (value, origin) in merged.items():
        inert = NOT_IMPLEMENTED_KEYS.get(section, {}).get(key, ANY)
        if inert is ANY or (type(value) is type(inert) and value == inert):
            continue
        why = NOT_IMPLEMENTED_WHY.get(f"{section}.{key}", NOT_IMPLEMENTED_WHY.get(section, ""))
        reason = f": {why}" if why else ""
        raise UserError(
            f"{section}.{key} = {_toml_value(value)} ({_from(origin)}) is not supported yet{reason}. "
            f"Remove it or set it to {_toml_value(inert)}."
        )


def _build(merged: dict[tuple[str, str], tuple], recipe: str | None) -> JobConfig:
    sections = {}
    for section, cls in _section_classes().items():
        kwargs = {k: merged[(section, k)][0] for k in _field_types(section) if (section, k) in merged}
        if section == "job":
            kwargs["config_file"] = recipe
        sections[section] = cls(**kwargs)
    return JobConfig(**sections)


def load_config(argv: list[str]) -> JobConfig:
    """The JobConfig of defaults < TOML recipe (--job.config_file) < command-line overrides."""
    if "--help" in argv or "-h" in argv:
        raise HelpRequested(help_text(*_values_for_help([a for a in argv if a not in ("--help", "-h")])))
    overrides = _parse_cli(list(argv))
    recipe = cast("str | None", overrides.pop(("job", "config_file"), None))  # parsed as job.config_file's type
    merged = {}
    if recipe is not None:
        merged = _load_recipe(recipe, "recipe file (--job.config_file)", ())
    merged.update({k: (v, _CLI) for k, v in overrides.items()})
    _check_not_implemented(merged)
    cfg = _build(merged, recipe)
    validate(cfg)
    return _resolve_hf_assets(cfg)


def _resolve_hf_assets(cfg: JobConfig) -> JobConfig:
    """model.hf_assets_path is the Hugging Face folder the initial weights come from (the reference
    schema's meaning) when checkpoint.initial_load_path is unset; anything else it could ask for is refused."""
    path, c = cfg.model.hf_assets_path, cfg.checkpoint
    if path is None:
        return cfg
    if c.initial_load_in_hf and c.initial_load_path in (None, "", path):
        return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, initial_load_path=path))
    raise UserError(
        f"model.hf_assets_path = {path!r} is read only as the Hugging Face weights folder of "
        f"checkpoint.initial_load_in_hf when checkpoint.initial_load_path is unset; here it would be unused "
        f"(the tokenizer comes from model.tokenizer_path). Unset it, or set "
        f"checkpoint.initial_load_in_hf = true to start from those weights"
    )


# ---------------------------------------------------------------------------------------------
# Value checks (the rules themselves: each section's check() in its *_sections.py module, and rules.py)


def validate(cfg: JobConfig) -> None:
    """Check the values that need no files and no world size; raise UserError listing every problem."""
    problems = check_rules(cfg)
    if len(problems) == 1:
        raise UserError(f"invalid config: {problems[0]}")
    if problems:
        raise UserError("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


# ---------------------------------------------------------------------------------------------
# Output


def _toml_str(text: str) -> str:
    short = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
    out = []
    for ch in text:
        if ch in short:
            out.append(short[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F or 0xD800 <= ord(ch) <= 0xDFFF:
            # TOML forbids raw control characters; lone surrogates cannot even be encoded.
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, float):
        return repr(value)  # repr round-trips exactly and is valid TOML (1e-08, inf, nan)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return _toml_str(str(value))


def config_to_toml(cfg: JobConfig) -> str:
    """The resolved config as a TOML recipe that loads back to the same values."""
    lines = ["# Resolved torchtitan config: defaults < recipe < command line."]
    for section in _section_classes():
        lines += ["", f"[{section}]"]
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if (section, f.name) == ("job", "config_file") and value is not None:
                # Set only by --job.config_file; kept as provenance.
                lines.append(f"# config_file = {_toml_value(value)}  (the recipe this was resolved from)")
            elif (section, f.name) == ("job", "base_config") and value is not None:
                # Its keys are already merged below; reloading the base would also break once moved.
                lines.append(f"# base_config = {_toml_value(value)}  (already merged into these values)")
            elif value is None:
                lines.append(f"# {f.name} = (unset)")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def config_to_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)


def _help_default(value: object) -> str:
    return "unset" if value is None else _toml_value(value)


def _values_for_help(argv: list[str]) -> tuple[dict, str | None, str | None]:
    """What the recipe and the other arguments given with --help set, for help_text: ({(section, key): (value,
    origin)}, the recipe's path, why they could not be read (help then shows the defaults alone))."""
    try:
        overrides = _parse_cli(argv)
        recipe = cast("str | None", overrides.pop(("job", "config_file"), None))  # parsed as job.config_file's type
        merged = _load_recipe(recipe, "recipe file (--job.config_file)", ()) if recipe is not None else {}
    except UserError as e:
        return {}, None, str(e)
    merged.update({k: (v, _CLI) for k, v in overrides.items()})
    return merged, recipe, None


def help_text(values: dict | None = None, recipe: str | None = None, unread: str | None = None) -> str:
    """The --help text, generated from the schema: each key with its default and, where the recipe or the command
    line set it (`values`: {(section, key): (value, origin)}), the value this job would run with."""
    values = values or {}
    lines = [
        "usage: [--job.config_file RECIPE.toml] [--section.key VALUE ...]",
        "",
        "Precedence: defaults < TOML recipe < command line. Command-line forms: --section.key VALUE,",
        "--section.key=VALUE; booleans: --section.key (true), --section.key false, --section.no-key;",
        "lists: a,b,c; optional values: none or null to unset; '-' may replace '_' in names.",
    ]
    if recipe is not None:
        lines += [
            "",
            f"Values marked 'here' are what this job sets: recipe {recipe} (and its base recipes) and the "
            "command line.",
        ]
    if unread is not None:
        lines += [
            "",
            f"(The defaults alone: the recipe or the arguments given with --help could not be read: {unread})",
        ]
    for section, cls in _section_classes().items():
        lines += ["", f"[{section}]"]
        types = _field_types(section)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            shown = f"default: {_help_default(default)}"
            if (section, f.name) in values and f.name != "base_config":
                value, origin = values[(section, f.name)]
                shown = f"here: {_help_default(value)} {_from(origin)}; {shown}"
            lines.append(f"  --{section}.{f.name} ({_type_name(types[f.name])}, {shown})")
            lines.append(f"      {f.metadata.get('help', '')}")
    lines += [
        "",
        "Planned keys (not implemented yet): accepted only with their inert value shown here;",
        "'any': any value loads, since the section is off (its enabled key must stay false).",
    ]
    for section, keys in NOT_IMPLEMENTED_KEYS.items():
        lines += ["", f"[{section}]"]
        for key, inert in keys.items():
            shown = "any" if inert is ANY else _toml_value(inert)
            lines.append(f"  --{section}.{key} = {shown}")
    return "\n".join(lines) + "\n"
