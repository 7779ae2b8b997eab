"""User mistakes and how every command line reports them.

A mistake in the input (a config value, a path, a number) is the user's to fix: it is raised as
UserError and printed as one line, `error: <message>`, with exit status 2 and no traceback. Every
entry point (scripts/*.py, torchtitan.launch, torchtitan.preflight) exits through `run_main`, so
they all report it the same way; anything else is a bug and keeps its traceback.

Nothing here imports torch: the launcher and the scripts report mistakes before loading it.
"""

import argparse
import os
import sys
import tempfile
from collections.abc import Callable


class UserError(Exception):
    """A mistake in the user's input (config, paths, data): reported as one clear message, no traceback."""


class HelpRequested(Exception):
    """`--help` was asked for; `text` is what to print (not an error, so not a UserError)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def run_main(main: Callable[..., "int | None"], *args, help_status: int = 0) -> int:
    """The exit status of `main(*args)`: its own (None counts as 0); 2 after a UserError, printed as
    `error: <message>` on stderr; `help_status` after a config `--help` (HelpRequested), whose text
    goes to stdout."""
    try:
        code = main(*args)
    except HelpRequested as h:
        print(h.text, flush=True)
        return help_status
    except UserError as e:
        sys.stdout.flush()  # what the command printed before the mistake comes first
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except ModuleNotFoundError as e:
        if not e.name or e.name.split(".")[0] == "torchtitan":
            raise  # a module of the project itself: a bug
        # The optional packages are asked for by name where they are used; a missing one here is the environment.
        sys.stdout.flush()
        print(
            f"error: this Python ({sys.executable}) has no module '{e.name}': activate the project's environment "
            f"(source .venv/bin/activate; bash scripts/setup.sh creates it) or install the package",
            file=sys.stderr,
            flush=True,
        )
        return 2
    return 0 if code is None else code


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes (a missing argument, `--count abc`) are UserErrors: one line and exit
    status 2 through run_main, instead of argparse's usage block. Subcommand parsers inherit it."""

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")


def positive_int(text: str) -> int:
    """argparse type: an integer of 1 or more."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def check_output_path(
    path: "str | os.PathLike[str]", what: str, *, existing: str = "refuse", create_parents: bool = True
) -> None:
    """UserError unless `path` can be written, checked before the expensive work so that a bad output
    path costs nothing. `what` names it in the message (e.g. "--output", "OUTPUT").

    - Its nearest existing ancestor must be a folder in which this process can create entries, tried
      for real (root passes permission checks on read-only mounts and on /proc, which accept nothing).
    - Without `create_parents` its parent folder must exist already.
    - An existing `path`: `existing` = "refuse"; "replace_file" (a file is overwritten, a folder
      refused); "empty_folder" (an empty folder is replaced whole, e.g. by a converted checkpoint
      renamed into place); "write_into" (a folder is written into, its other files kept)."""
    path = os.fspath(path)
    full = os.path.abspath(path)
    if os.path.lexists(full):
        is_dir = os.path.isdir(full)
        if existing == "write_into" and is_dir:
            _check_creatable(full, what, path)
            return
        if existing == "empty_folder" and is_dir and not os.listdir(full):
            _check_creatable(os.path.dirname(full), what, path)
            return
        if existing == "replace_file" and not is_dir:
            try:
                with open(full, "ab"):  # opened for writing, nothing written
                    pass
            except OSError as e:
                raise UserError(
                    f"{what} {path} exists and cannot be written ({e.strerror}); choose another path"
                ) from None
            return
        if existing == "empty_folder" and is_dir:
            raise UserError(f"{what} {path} already exists and is not empty; choose a new path or delete it")
        want = {"replace_file": "a file", "write_into": "a folder", "empty_folder": "a new or empty folder"}
        need = f" (it must be {want[existing]})" if existing in want else ""
        raise UserError(
            f"{what} {path} already exists as a {'folder' if is_dir else 'file'}{need}; choose a new path or delete it"
        )
    parent = os.path.dirname(full)
    if not create_parents and not os.path.isdir(parent):
        blocker = _first_non_folder(parent)
        why = f"{blocker} is a file, not a folder" if blocker else f"the folder {parent} does not exist"
        raise UserError(f"{what} {path}: {why}; create the folder first or choose another path")
    ancestor = parent
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UserError(f"{what} {path}: {ancestor} is a file, not a folder; choose another path")
    _check_creatable(ancestor, what, path)


def _first_non_folder(folder: str) -> str | None:
    """The first ancestor of `folder` (from the root down) that exists and is not a folder."""
    parts = []
    while True:
        parts.append(folder)
        up = os.path.dirname(folder)
        if up == folder:
            break
        folder = up
    return next((p for p in reversed(parts) if os.path.lexists(p) and not os.path.isdir(p)), None)


def _check_creatable(folder: str, what: str, path: str) -> None:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=folder))
    except OSError as e:
        raise UserError(
            f"{what} {path}: cannot create anything in {folder} ({e.strerror}); choose a path in a "
            "folder you can write to"
        ) from None
