"""Start-up cost of a launch: seconds from running the command to each phase of rank 0.

    python scripts/benchmark_startup.py [--nproc N] [--repeat R] [--modes before,exec,fork] [--markdown] [overrides]

Each repeat runs every mode once (the order rotates between repeats, since the load of a shared
machine drifts) with the debug recipe, `--training.steps 1` and the overrides given, in a fresh
temporary dump folder. Modes:

- before: the launch as run_train.sh did it until the launcher existed: `python -m
  torchtitan.preflight` in one process, then `python -m torch.distributed.run ... -m
  torchtitan.train` in a second one, whose workers import torch a third time each.
- exec: `run_train.sh` with WORKER_START=exec: preflight and torchrun in one process
  (torchtitan.launch); workers run `python -m torchtitan.train`.
- fork: `run_train.sh` with WORKER_START=fork (the default on a machine without CUDA): workers
  are forked from the launcher, which imported torch and the trainer for the preflight.

Phases, as seconds since the command started (medians over the repeats):

- preflight done: the preflight process exited (before) / the launcher's check returned.
- workers imported: rank 0's trainer entered main() with every module imported.
- process group: rank 0's init_process_group returned.
- model built: rank 0 logged "training <model> ..." (model, optimizer, data and metrics ready).
- step 1 logged: rank 0 logged step 1 (the first step's own compute is included).

The phases are observed from outside the code measured: a sitecustomize.py on PYTHONPATH (written
by this script into a temporary folder) wraps torchtitan.preflight.check, logging.basicConfig
(train.main calls it first), torch.distributed.init_process_group and the log record factory, and
appends one JSON line per event to a file. It runs in every Python process of the launch; forked
workers inherit it from the launcher.

--markdown: after the table, one row per mode for docs/benchmarks.md, with the command, commit, machine and
date.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a plain script from a checkout
PHASES = ["preflight done", "workers imported", "process group", "model built", "step 1 logged"]

# run_train.sh before torchtitan/launch.py (commit a02cf7e), as the "before" mode runs it.
BEFORE = r"""
set -euo pipefail
status=0
WORLD_SIZE=${NGPU} python -m torchtitan.preflight --job.config_file "${CONFIG_FILE}" "$@" || status=$?
if [ "${status}" -ne 0 ]; then exit "${status}"; fi
exec python -m torch.distributed.run --nproc_per_node="${NGPU}" --rdzv_backend=c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter=0 --role=rank --tee=3 -m torchtitan.train --job.config_file "${CONFIG_FILE}" "$@"
"""

SITECUSTOMIZE = r'''
import atexit, importlib.abc, json, logging, os, sys, time

_TRACE = os.environ.get("STARTUP_TRACE")


def _event(name):
    with open(_TRACE, "a") as f:
        record = {"event": name, "t": time.time(), "rank": os.environ.get("RANK"), "pid": os.getpid()}
        f.write(json.dumps(record) + "\n")


def _after_import(module_name, patch):
    """Call patch(module) once `module_name` has been executed."""

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != module_name:
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Finder())


if _TRACE:
    def _patch_preflight(module):
        check = module.check

        def traced_check(*args, **kwargs):
            result = check(*args, **kwargs)
            _event("preflight done")
            return result

        module.check = traced_check

    def _patch_distributed(module):
        init = module.init_process_group

        def traced_init(*args, **kwargs):
            result = init(*args, **kwargs)
            _event("process group")
            return result

        module.init_process_group = traced_init

    _after_import("torchtitan.preflight", _patch_preflight)
    _after_import("torch.distributed", _patch_distributed)

    _basic_config = logging.basicConfig
    _seen = set()

    def traced_basic_config(*args, **kwargs):
        if "RANK" in os.environ and os.getpid() not in _seen:
            _seen.add(os.getpid())
            _event("workers imported")
        return _basic_config(*args, **kwargs)

    logging.basicConfig = traced_basic_config

    _factory = logging.getLogRecordFactory()

    def traced_record(*args, **kwargs):
        record = _factory(*args, **kwargs)
        if os.environ.get("RANK") == "0" and record.name.startswith("torchtitan"):
            message = str(record.msg)
            if message.startswith("training ") and " parameters" in message:
                _event("model built")
            elif message.startswith("step:"):
                _event("step 1 logged")
        return record

    logging.setLogRecordFactory(traced_record)

    def _at_exit():
        if sys.argv and sys.argv[0].endswith("preflight.py"):
            _event("preflight done")

    atexit.register(_at_exit)
'''


def run_once(mode: str, nproc: int, overrides: list[str], workdir: Path, index: int) -> dict[str, float]:
    trace = workdir / f"trace_{mode}_{index}.jsonl"
    dump = workdir / f"out_{mode}_{index}"
    env = dict(
        os.environ,
        STARTUP_TRACE=str(trace),
        NGPU=str(nproc),
        LOG_RANK="0",
        CONFIG_FILE=str(REPO / "train_configs" / "debug_model.toml"),
        PYTHONPATH=os.pathsep.join([str(workdir / "site"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
    )
    args = ["--training.steps", "1", "--job.dump_folder", str(dump), *overrides]
    if mode == "before":
        cmd = ["bash", "-c", BEFORE, "run_train.sh", *args]
    else:
        env["WORKER_START"] = mode
        cmd = ["./run_train.sh", *args]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    times: dict[str, float] = {}
    for line in trace.read_text().splitlines():
        e = json.loads(line)
        if e["event"] != "preflight done" and e["rank"] != "0":
            continue
        times.setdefault(e["event"], e["t"] - start)  # the first of each
    missing = [p for p in PHASES if p not in times]
    if missing:
        raise SystemExit(f"{mode}: no event for {missing}; trace:\n{trace.read_text()}")
    return times


def main(argv: list[str]) -> int:
    from torchtitan.config import load_config
    from torchtitan.config.errors import HelpRequested, UserError

    nproc, repeat, modes, overrides, markdown = 2, 3, ["before", "exec", "fork"], [], False
    i = 0
    while i < len(argv):
        if argv[i] == "--markdown":
            markdown, i = True, i + 1
        elif argv[i] in ("--nproc", "--repeat", "--modes"):
            if i + 1 == len(argv):
                raise UserError(f"{argv[i]} needs a value")
            value = argv[i + 1]
            if argv[i] == "--modes":
                modes = value.split(",")
            elif not value.isdigit() or int(value) < 1:
                raise UserError(f"{argv[i]} must be an integer of 1 or more, got {value!r}")
            elif argv[i] == "--nproc":
                nproc = int(value)
            else:
                repeat = int(value)
            i += 2
        else:
            overrides.append(argv[i])
            i += 1
    unknown = set(modes) - {"before", "exec", "fork"}
    if unknown or not modes:
        raise UserError(f"--modes: unknown modes {sorted(unknown)}; choose from before, exec, fork")
    # A mistake in the overrides is found here, not by the first launch.
    try:
        load_config(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), *overrides])
    except HelpRequested as h:  # this script's options first, then the trainer's
        raise HelpRequested(f"{__doc__}\nTrainer overrides, as for run_train.sh:\n\n{h.text}") from None
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "site").mkdir()
        (workdir / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        for r in range(repeat):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in order:
                times = run_once(mode, nproc, overrides, workdir, r)
                results[mode].append(times)
                print(f"repeat {r + 1} {mode:6s} " + "  ".join(f"{p}: {times[p]:5.2f}" for p in PHASES), flush=True)
    print(f"\nseconds from launch, median of {repeat} ({nproc} processes, debug recipe, 1 step):")
    print(f"{'phase':18s}" + "".join(f"{m:>9s}" for m in modes))
    for p in PHASES:
        print(f"{p:18s}" + "".join(f"{statistics.median(t[p] for t in results[m]):9.2f}" for m in modes))
    if markdown:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/benchmark_table.py
        import benchmark_table

        rows = [[m] + [f"{statistics.median(t[p] for t in results[m]):.2f}" for p in PHASES] for m in modes]
        benchmark_table.print_rows(["mode", *PHASES], rows, argv, __file__)
    return 0


if __name__ == "__main__":
    from torchtitan.config.errors import run_main

    sys.exit(run_main(main, sys.argv[1:]))
