"""What every config section is written with: a field with its help text (`opt`), and the helpers of the
sections' check()."""

from dataclasses import field


def opt(default, help: str):
    """A config field with its documentation."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


# Each section's check() returns every problem of its own values, as a message that names the keys and the fix;
# rules that read two sections are in rules.py. Rules are written `ok, message` with ok as a comparison that holds
# for good values, so that NaN fails it too.
def failed(*rules: tuple[bool, str]) -> list[str]:
    return [message for ok, message in rules if not ok]


def positive(section: str, values, *names: str) -> list[str]:
    return [
        f"{section}.{name} must be a positive integer, got {getattr(values, name)}; set it to 1 or more"
        for name in names
        if not getattr(values, name) > 0
    ]
