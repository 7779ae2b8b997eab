"""The entries of list-valued keys, each a small language: optimizer.param_groups
("PATTERN [lr_mult=X] [weight_decay=Y] [optimizer=AdamW]") and the dataset mixtures ("WEIGHT:SOURCE").
Each parser reports every problem of a list at once, as one UserError."""

import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction

from torchtitan.config.errors import UserError

PARAM_GROUP_SYNTAX = (
    "PATTERN [lr_mult=X] [weight_decay=Y] [optimizer=AdamW], e.g. 'tok_embeddings lr_mult=0.5 weight_decay=0'"
)
PARAM_GROUP_OPTIONS = ("lr_mult", "weight_decay", "optimizer")


@dataclass(frozen=True)
class ParamGroupRule:
    """One optimizer.param_groups entry: parameters whose name `pattern` matches (re.search) train at
    lr_mult x the scheduled learning rate, with `weight_decay` (None: the parameter's default); with
    `adamw` (optimizer=AdamW, under Muon) by AdamW even where Muon would take them."""

    pattern: str
    lr_mult: float = 1.0
    weight_decay: float | None = None
    adamw: bool = False


def parse_param_groups(entries: list[str], key: str = "optimizer.param_groups") -> list[ParamGroupRule]:
    """The rules of optimizer.param_groups, in order; every problem at once as one UserError."""
    rules, problems = [], []
    for entry in entries:
        if not entry.split():
            problems.append(f"an entry is empty; write {PARAM_GROUP_SYNTAX}")
            continue
        pattern, *options = entry.split()
        values: dict[str, float] = {}  # lr_mult, weight_decay
        adamw = False
        bad = False
        for option in options:
            name, sep, text = option.partition("=")
            try:
                value = float(text)
            except ValueError:
                value = None
            if sep and name == "optimizer":
                if text.lower() == "adamw" and not adamw:
                    adamw = True
                    continue
                problems.append(
                    f"{entry!r}: optimizer = {text!r} "
                    + (
                        "is given twice"
                        if adamw
                        else "is not an option; optimizer=AdamW (with optimizer.name = 'Muon') gives the matched "
                        "parameters to AdamW"
                    )
                )
            elif not sep or name not in PARAM_GROUP_OPTIONS:
                problems.append(
                    f"{entry!r}: {option!r} is not an option; write {PARAM_GROUP_SYNTAX} (the pattern "
                    f"cannot contain spaces)"
                )
            elif name in values:
                problems.append(f"{entry!r}: {name} is given twice")
            elif value is None or not math.isfinite(value):
                problems.append(f"{entry!r}: {name} = {text!r} is not a number")
            elif name == "lr_mult" and not value > 0:
                problems.append(f"{entry!r}: lr_mult must be greater than 0, got {text}")
            elif name == "weight_decay" and not value >= 0:
                problems.append(f"{entry!r}: weight_decay must be 0 or more, got {text}")
            else:
                values[name] = value
                continue
            bad = True
        try:
            re.compile(pattern)
        except re.error as e:
            problems.append(f"{entry!r}: {pattern!r} is not a regular expression ({e})")
            bad = True
        if not bad:
            rules.append(ParamGroupRule(pattern, **values, adamw=adamw))
    patterns = [r.pattern for r in rules]
    duplicates = sorted({p for p in patterns if patterns.count(p) > 1})
    if duplicates:
        problems.append(
            f"{', '.join(map(repr, duplicates))} appears more than once; the first entry would take "
            f"every parameter it matches, so give each pattern once"
        )
    if problems:
        raise UserError(f"{key}: " + "; ".join(problems))
    return rules


MAX_MIX_PERIOD = 1_000_000  # a mixture's schedule is a pattern of this many samples at most (data/mixing.py)
MIX_SYNTAX = (
    "WEIGHT:SOURCE[#FIELD], e.g. 0.6:data/web or 0.4:data/books#content "
    "(a list in TOML, comma-separated on the command line)"
)


def split_text_field(spec: str) -> tuple[str, str | None]:
    """A mixture's SOURCE#FIELD: (the source, the field or column holding its text), as a Hugging Face
    dataset names its own text column; (spec, None) without '#': the source reads
    dataset_text_field."""
    source, sep, field = spec.rpartition("#")
    return (source, field) if sep else (spec, None)


def parse_mix(entries: list[str], key: str) -> tuple[list[Fraction], list[str]]:
    """The weights (normalized to sum 1) and source specs of a mixture; every problem at once as one UserError."""
    weights, specs, problems = [], [], []
    for entry in entries:
        weight, sep, spec = entry.partition(":")
        try:
            value = Fraction(weight.strip())
        except (ValueError, ZeroDivisionError):
            value = None
        if not sep or not spec.strip():
            problems.append(f"{entry!r} is not {MIX_SYNTAX}")
        elif value is None:
            problems.append(f"{entry!r}: the weight {weight.strip()!r} is not a number")
        elif value < 0:
            problems.append(f"{entry!r}: the weight is negative")
        elif split_text_field(spec.strip())[1] == "" or not split_text_field(spec.strip())[0]:
            problems.append(f"{entry!r}: write SOURCE#FIELD with a source and the name of its text field after '#'")
        else:
            weights.append(value)
            specs.append(spec.strip())
    if not entries:
        problems.append(f"it is empty; give one or more {MIX_SYNTAX}")
    elif not problems and sum(weights) == 0:
        problems.append("every weight is zero; give at least one source a positive weight")
    problems += _repeated_sources(specs)
    if not problems:
        total = sum(weights)
        period = math.lcm(*((w / total).denominator for w in weights))
        if period > MAX_MIX_PERIOD:
            problems.append(
                f"the weights' schedule would repeat only every {period:,} samples (the common denominator of the "
                f"normalized weights; at most {MAX_MIX_PERIOD:,}); round the weights to fewer digits"
            )
    if problems:
        raise UserError(f"{key}: " + "; ".join(problems))
    total = sum(weights)
    return [w / total for w in weights], specs


HF_PREFIX = "hf:"  # a mixture's SOURCE that names a Hugging Face dataset


def _source_identity(spec: str) -> str:
    """What a mixture's SOURCE reads, whatever its spelling: the real path of a file or folder (trailing
    slashes, `./`, `..` and links resolved), else the name itself (a named dataset, hf:ORG/NAME)."""
    path = spec[len(HF_PREFIX) :] if spec.startswith(HF_PREFIX) else spec
    return os.path.realpath(path) if path and os.path.exists(path) else spec


def _repeated_sources(specs: list[str]) -> list[str]:
    """A source given twice, under any spelling, or a file or folder inside another source's folder:
    its documents would be read by two sources, outside the weights."""
    problems, named = [], {}  # identity -> the specs that name it
    for spec in specs:
        named.setdefault(_source_identity(split_text_field(spec)[0]), []).append(spec)
    for identity, names in named.items():
        if len(names) > 1:
            names = list(dict.fromkeys(names))
            same = (
                f"{names[0]} appears more than once"
                if len(names) == 1
                else f"{' and '.join(map(repr, names))} are the same source ({identity})"
            )
            problems.append(f"{same}; give each source once with its total weight")
    paths = [(identity, names[0]) for identity, names in named.items() if os.path.isabs(identity)]
    for outer, outer_spec in paths:
        for inner, inner_spec in paths:
            if inner.startswith(outer.rstrip(os.sep) + os.sep):
                problems.append(
                    f"{inner_spec!r} is inside {outer_spec!r}, so its documents would be read by both "
                    "sources; give each document to one source (raise a weight instead of listing it twice)"
                )
    return problems


# What dataset_path holds for the datasets that read it; python_stdlib and python_stdlib_test are embedded and
# read none (c4 and c4_test read it when set).
