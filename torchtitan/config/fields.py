"""What every config section is written with: a documented field (`option`: its default and its help text),
and the helpers of the sections' check() (`broken_rules`: the messages of the rules that do not hold)."""

import dataclasses
from dataclasses import field
from typing import Any


def option(default: Any, help: str) -> Any:
    """A config field with its documentation. Typed `Any`, as `dataclasses.field` is, so that the annotation of
    the field it sets is the type the checker sees."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


# Each section's check() returns every problem of its own values, as a message that names the keys and the fix;
# rules that read two sections are in rules.py. Rules are written `ok, message` with ok as a comparison that holds
# for good values, so that NaN fails it too.
def broken_rules(*rules: tuple[bool, str]) -> list[str]:
    """The messages of the `(ok, message)` rules whose `ok` is false."""
    return [message for ok, message in rules if not ok]


def positive(section: str, values, *names: str) -> list[str]:
    return [
        f"{section}.{name} must be a positive integer, got {getattr(values, name)}; set it to 1 or more"
        for name in names
        if not getattr(values, name) > 0
    ]


def changed_keys(values, *names: str) -> list[str]:
    """The keys of a section (those named, or all) whose values differ from the section's defaults: what a recipe or
    the command line set. A rule refuses such keys where the feature that reads them is off."""
    defaults = type(values)()
    names = names or tuple(f.name for f in dataclasses.fields(values))
    return [name for name in names if getattr(values, name) != getattr(defaults, name)]
