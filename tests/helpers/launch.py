"""Running jobs and scripts from the tests: multi-process launches under torchrun, one-process jobs in this
process, scripts/ modules imported by path, and the processes, ports and lighthouses that the fault tests
look for or start; with the job arguments and tolerance shared by the multi-process tests."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from helpers.paths import PYTHON_DIR, RECIPE, RUN_JOBS, TINY

# Job arguments shared by the multi-process tests (tests/distributed/).
FP32_TOL = 1e-5  # float32 layouts against one process: the largest difference allowed (losses, weights)
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
SAVE3 = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "3", "--checkpoint.no-last_save_model_only"]


def launch(jobs: dict[str, list[str] | dict], nproc: int, tmp: Path, timeout: int = 600) -> dict[str, list[dict]]:
    """Run named jobs (extra argv each, or a {"copy": [src, dst]} step, where "{tmp}" stands for
    `tmp`) in one launch; returns each training job's metrics.jsonl records."""
    argvs = [
        {"copy": [p.format(tmp=tmp) for p in extra["copy"]]}
        if isinstance(extra, dict)
        else TINY + ["--job.dump_folder", str(tmp / name)] + extra
        for name, extra in jobs.items()
    ]
    spec = tmp / f"jobs_{nproc}.json"
    spec.write_text(json.dumps(argvs))
    run_script(RUN_JOBS, [str(spec)], nproc, tmp, timeout)
    return {name: read_metrics(tmp / name) for name, extra in jobs.items() if not isinstance(extra, dict)}


def run_script(script: Path, args: list[str], nproc: int, cwd: Path, timeout: int = 600):
    """Run `script` with `args` in one process, or under torchrun with `nproc`; assert it succeeds."""
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0",
            str(script),
            *args,
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"launch failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def losses(records: list[dict]) -> list[float]:
    """The loss of each metrics record, in order."""
    return [r["loss"] for r in records]


def debug_config(*overrides: str):
    """The debug model's config (RECIPE) with `overrides`."""
    from torchtitan.config import load_config

    return load_config([*RECIPE, *overrides])


def load_script(path: Path, name: str):
    """The script at `path` (scripts/*.py, not a package) imported as a module named `name`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on at the moment (for a rendezvous endpoint)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_naming(text: str) -> list[int]:
    """Pids of live (not zombie) processes, other than this one, whose command line contains `text`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z" and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


def start_lighthouse(*flags: str) -> tuple[subprocess.Popen, str]:
    """A real torchft lighthouse on a free port, once it answers (a loaded host may take seconds to start
    it, and the trainer refuses a lighthouse that does not answer); (its process, its address)."""
    import time
    import urllib.request

    port = free_port()
    proc = subprocess.Popen(
        [str(Path(PYTHON_DIR) / "torchft_lighthouse"), "--min_replicas", "1", "--bind", f"127.0.0.1:{port}", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{address}/status", timeout=1)
            return proc, address
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the lighthouse on port {port} did not answer (exit {proc.poll()})") from None
            time.sleep(0.2)


def worker_pids(text: str) -> dict[int, int]:
    """{rank: pid} of the torchrun workers (not the launcher) whose command line contains `text`."""
    workers = {}
    for pid in processes_naming(text):
        try:
            environ = dict(
                v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in v
            )
        except OSError:
            continue
        if "TORCHELASTIC_RUN_ID" in environ and "RANK" in environ:
            workers[int(environ["RANK"])] = pid
    return workers


def train_in_process(folder: Path, *extra: str) -> list[dict]:
    """One process's job (TINY + `extra`, dumping to `folder`) run in this process, on one thread
    like `launch`'s processes (OMP_NUM_THREADS=1: several threads per process slow a shared host
    down); its metrics records. The thread count and TINY's deterministic algorithms are
    process-wide, set back after the job so that later tests run as they would alone."""
    import torch

    from torchtitan.config import load_config
    from torchtitan.train import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(load_config(TINY + ["--job.dump_folder", str(folder), *extra]))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)


def drop_closed_log_handlers():
    """Remove the root logger's stream handlers whose stream is closed: an in-process run's setup_logging binds
    the root logger to the sys.stderr of its test, which pytest closes after that test; a later in-process run
    would log into it ("I/O operation on closed file")."""
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
            root.removeHandler(handler)
