"""The suite's pytest markers, and the check that a test carries the markers of what it does.

- `slow`: more than about 10 s on a 2-core CPU host; stage 3 of scripts/check.sh, left out of the quick check.
- `multiprocess`: starts other processes (torchrun jobs, the launcher, a script, a process group); one that
  imports torch costs seconds, so most such tests are also `slow`.
- `compile`: runs torch.compile (in this process or in the processes it starts).
- `hf`: needs transformers (interop with Hugging Face models and tokenizers); the dev extra pins it.
- `network`: reaches the internet; skipped unless pytest is given `--network`.

conftest.py wraps each test's setup and call in `checked`, which names the marker a test lacks, as a
warning in pytest's summary (with TORCHTITAN_MARKER_CHECK=strict, as the test's failure):
- `multiprocess`: it started a process (subprocess or multiprocessing);
- `compile`: dynamo ran in this process;
- `hf`: it imported transformers (an import statement calls `__import__` also when the module is loaded
  already, so this does not depend on the order of the tests), or its test module holds transformers.
What runs in the processes a test starts is not seen (compile inside a launched job): those markers are
also set by hand, and `slow` is set from measured durations. With TORCHTITAN_MARKER_SURVEY=FILE in the
environment, each lacking marker is appended to FILE as a line `nodeid<TAB>marker` instead of failing the
test: for marking a new test module in one run.
"""

import builtins
import contextlib
import dataclasses
import multiprocessing.process
import os
import subprocess
import sys

import pytest

MARKERS = {
    "slow": "more than about 10 s on a 2-core CPU host (stage 3 of scripts/check.sh; deselect with -m 'not slow')",
    "multiprocess": "starts other processes: torchrun jobs, the launcher, a script, a process group",
    "compile": "runs torch.compile, in this process or in the processes it starts",
    "hf": "needs transformers (pinned in the dev extra), for Hugging Face interop",
    "network": "reaches the internet; skipped unless pytest is given --network",
}


def _dynamo_frames() -> int:
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


@dataclasses.dataclass
class Watched:
    """What code run under `watch` did that a marker stands for."""

    started: list[str] = dataclasses.field(default_factory=list)  # processes, as their command lines
    imported_transformers: bool = False
    compiled: bool = False

    def needs(self) -> dict[str, str]:
        """{marker: why} for what was done."""
        needs = {}
        if self.started:
            needs["multiprocess"] = f"it started a process ({self.started[0]})"
        if self.compiled:
            needs["compile"] = "torch.compile (dynamo) ran in it"
        if self.imported_transformers:
            needs["hf"] = "it imports transformers"
        return needs


@contextlib.contextmanager
def watch():
    """Record, into the Watched it yields, the processes started, the transformers imports and dynamo's
    frames while the block runs."""
    seen = Watched()
    popen_execute = subprocess.Popen._execute_child
    process_start = multiprocessing.process.BaseProcess.start
    real_import = builtins.__import__

    def execute_child(self, args, *rest, **kw):
        seen.started.append(str(args if isinstance(args, str) else " ".join(map(str, args)))[:120])
        return popen_execute(self, args, *rest, **kw)

    def start(self):
        seen.started.append(f"multiprocessing {self.name}")
        return process_start(self)

    def tracked_import(name, *args, **kw):
        if name == "transformers" or name.startswith("transformers."):
            seen.imported_transformers = True
        return real_import(name, *args, **kw)

    frames = _dynamo_frames()
    subprocess.Popen._execute_child = execute_child
    multiprocessing.process.BaseProcess.start = start
    builtins.__import__ = tracked_import
    try:
        yield seen
    finally:
        subprocess.Popen._execute_child = popen_execute
        multiprocessing.process.BaseProcess.start = process_start
        builtins.__import__ = real_import
        seen.compiled = _dynamo_frames() > frames


# {(where the fixture is defined, its name): {marker: why}}: what each fixture's setup did, once it has run.
# A session or module fixture runs for the first test that asks for it; every test that asks for it needs its
# markers, so that which test ran first does not decide which one fails. Keyed by where it is defined too:
# test modules reuse fixture names (`runs`) for fixtures that do different things.
FIXTURE_NEEDS: dict[tuple[str, str], dict[str, str]] = {}


@contextlib.contextmanager
def fixture_watched(fixturedef):
    """Around a fixture's setup (conftest's pytest_fixture_setup): remember what it needs."""
    with watch() as seen:
        yield
    name = fixturedef.argname
    if seen.needs():
        FIXTURE_NEEDS.setdefault((fixturedef.baseid, name), {}).update(
            {marker: f"its fixture {name!r}: {why}" for marker, why in seen.needs().items()}
        )


def _fixture_needs(item: pytest.Item) -> dict[str, str]:
    needs: dict[str, str] = {}
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in getattr(item, "fixturenames", ()):
        if name in definitions and definitions[name]:
            for marker, why in FIXTURE_NEEDS.get((definitions[name][-1].baseid, name), {}).items():
                needs.setdefault(marker, why)
    return needs


@contextlib.contextmanager
def checked(item: pytest.Item):
    """Run one phase of `item` (setup or call), then fail it with the markers that what it did, or what
    its fixtures did when they were set up, needs."""
    with watch() as seen:
        yield
    needs = seen.needs()
    for marker, why in _fixture_needs(item).items():
        needs.setdefault(marker, why)
    module = getattr(item, "module", None)
    if module is not None and any(getattr(v, "__name__", "").startswith("transformers") for v in vars(module).values()):
        needs.setdefault("hf", "its module imported transformers")
    marked = {m.name for m in item.iter_markers()}
    lacking = [(marker, why) for marker, why in needs.items() if marker not in marked]
    if not lacking:
        return
    survey = os.environ.get("TORCHTITAN_MARKER_SURVEY")
    if survey:
        with open(survey, "a") as f:
            f.writelines(f"{item.nodeid}\t{name}\n" for name, _ in lacking)
        return
    reasons = "; ".join(f"@pytest.mark.{name}: {why}" for name, why in lacking)
    message = f"{item.nodeid} lacks markers (see tests/helpers/markers.py): {reasons}"
    if os.environ.get("TORCHTITAN_MARKER_CHECK") == "strict":
        pytest.fail(message, pytrace=False)
    item.warn(pytest.PytestWarning(message))
