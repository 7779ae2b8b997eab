"""Rows of docs/benchmarks.md: the part every benchmark script's --markdown shares.

A row of docs/benchmarks.md holds a benchmark's own columns, then where its figures come from: the
command that produced them, the commit, the machine and the date. A benchmark script given --markdown
prints, after its usual output, `print_rows(columns, rows, argv, __file__)`: the header of its table and
its rows, to replace the rows of the same command and machine in docs/benchmarks.md. The scripts import
this module from their own folder (`sys.path.insert(0, <scripts/>)`), only when --markdown is given.

A training run's row (docs/benchmarks.md, "Training runs"), from the metrics.jsonl it wrote, printed on
the machine that ran it:

    python scripts/benchmark_table.py metrics outputs/metrics.jsonl --command './run_train.sh'
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROVENANCE = ("command", "commit", "machine", "date")
# The columns of docs/benchmarks.md's "Training runs" table, before PROVENANCE.
TRAINING_COLUMNS = ("run", "steps", "loss, first step", "loss, last step", "training s", "other figures")


def commit(repo: Path = REPO) -> str:
    """The short hash of the checkout's HEAD, or "unknown" outside a git checkout (or without git)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else its architecture."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine() or 'unknown'} CPU"  # platform.processor() would run uname


def gpu_name() -> str | None:
    """The CUDA device's name (with the count when there are several), if the script uses torch on CUDA.
    torch is not imported here: a script that did not import it measured no GPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    return torch.cuda.get_device_name(0) + (f" x {count}" if count > 1 else "")


def machine(cpuinfo: str = "/proc/cpuinfo", gpu: str | None = None, load: float | None = None) -> str:
    """The machine a row was measured on: the GPU if any, the CPU model and its cores, and the load
    average of the last minute (a shared host's wall times follow it)."""
    parts = [gpu] if gpu else []
    parts.append(f"{cpu_model(cpuinfo)}, {os.cpu_count()} cores")
    if load is None and hasattr(os, "getloadavg"):
        load = os.getloadavg()[0]
    if load is not None:
        parts.append(f"load average {load:.1f}")
    return ", ".join(parts)


def today() -> str:
    return datetime.date.today().isoformat()


def command_line(argv: Sequence[str], script: str | None = None, launcher: Sequence[str] = ("python",)) -> str:
    """The command that measures the row again: `python scripts/NAME.py ARGS`, the script's path taken
    from the repository root, without --markdown."""
    path = Path(script or sys.argv[0]).resolve()
    try:
        shown = path.relative_to(REPO).as_posix()
    except ValueError:
        shown = str(path)
    return shlex.join([*launcher, shown, *(a for a in argv if a != "--markdown")])


def cell(value) -> str:
    """A table cell: "" for None, one line, pipes escaped."""
    if value is None:
        return ""
    return " ".join(str(value).split("\n")).replace("|", "\\|").strip()


def row(cells: Iterable) -> str:
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def table(
    columns: Sequence[str],
    rows: Iterable[Sequence],
    command: str,
    *,
    commit_: str | None = None,
    machine_: str | None = None,
    date: str | None = None,
) -> list[str]:
    """The header, the separator and the rows of a docs/benchmarks.md table: each row's own cells, then
    the command (as code), the commit, the machine and the date, found once for all rows."""
    where = [f"`{command}`", commit_ or commit(), machine_ or machine(gpu=gpu_name()), date or today()]
    out = [row([*columns, *PROVENANCE]), "|" + "---|" * (len(columns) + len(PROVENANCE))]
    for cells in rows:
        cells = list(cells)
        if len(cells) != len(columns):
            raise ValueError(f"a row of {len(cells)} cells for the {len(columns)} columns {list(columns)}")
        out.append(row([*cells, *where]))
    return out


def print_table(columns: Sequence[str], rows: Iterable[Sequence], command: str) -> None:
    """What --markdown prints after a script's usual output."""
    print("\nrows for docs/benchmarks.md:\n" + "\n".join(table(columns, rows, command)), flush=True)


def print_rows(
    columns: Sequence[str],
    rows: Iterable[Sequence],
    argv: Sequence[str],
    script: str,
    launcher: Sequence[str] = ("python",),
) -> None:
    """print_table with the command of `script` run with `argv` (by `launcher`)."""
    print_table(columns, rows, command_line(argv, script, launcher))


def training_row(metrics: Path, other: str = "") -> list[str]:
    """The "Training runs" cells of a run from its metrics.jsonl (and the config.toml beside it): the
    model, flavor and precision, the last step, the losses of the first and last logged steps, and the
    trainer's seconds at the last step."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r and "step" in r]
    if not steps:
        raise ValueError(f"{metrics}: no logged training step")
    first, last = steps[0], steps[-1]
    run = metrics.parent.name
    config = metrics.parent / "config.toml"
    try:
        import tomllib

        cfg = tomllib.loads(config.read_text())
        run = f"{cfg['model']['name']} {cfg['model']['flavor']}, {cfg['training']['mixed_precision_param']}"
    except (ImportError, OSError, KeyError, ValueError):
        pass
    seconds = f"{last['time']:.1f}" if "time" in last else ""
    return [run, str(last["step"]), f"{first['loss']:.4f}", f"{last['loss']:.4f}", seconds, other]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    runs = sub.add_parser("metrics", help="the Training runs row of a run's metrics.jsonl")
    runs.add_argument("metrics", type=Path, help="the run's metrics.jsonl (in its dump folder)")
    runs.add_argument("--command", required=True, help="the command that ran it, as the row shows it")
    runs.add_argument("--other", default="", help="the row's 'other figures' cell")
    args = parser.parse_args(argv)
    if not args.metrics.is_file():
        parser.error(f"{args.metrics} is not a file")
    try:
        cells = training_row(args.metrics, args.other)
    except ValueError as e:
        parser.error(str(e))
    print("\n".join(table(TRAINING_COLUMNS, [cells], args.command)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
