"""What a lost process costs: replica groups (fault tolerance) against a checkpoint restart.

    python scripts/benchmark_recovery.py [--kill-after K] [--markdown] [overrides]

Both runs train the debug recipe for 100 steps at seq 64, batch 4 per group, one process each, in a temporary
folder, and SIGKILL a whole launch (launcher and worker) once it has logged step K (default 25):

- replica groups: two groups and a local torchft lighthouse; group 1 is killed and restarted at once with the same
  command. Printed: seconds from the kill to group 0's next logged step, how far group 0 got meanwhile, and seconds
  to group 1's first step back (after its start-up and healing from group 0).
- checkpoint restart: one run with checkpoints every 10 steps, killed and restarted with the same command.
  Printed: seconds from the kill to its first step after the checkpoint and to step K + 1, and the steps redone.
--markdown also prints the four figures as rows of docs/benchmarks.md's table, with the command, commit, machine
and date.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = [
    "./run_train.sh",
    "--training.steps",
    "100",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "4",
    "--training.deterministic",
    "--metrics.log_freq",
    "1",
]


def _steps(folder: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return []


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, NGPU="1", OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(condition, what: str, timeout: float = 900):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def _lighthouse() -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "torchft_lighthouse"),
            "--min_replicas",
            "1",
            "--bind",
            f"127.0.0.1:{port}",
            "--heartbeat_timeout_ms",
            "2000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def answers() -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=1)
            return True
        except OSError:
            return False

    _wait(answers, "the lighthouse", 60)
    return proc, f"http://127.0.0.1:{port}"


def replica_groups(root: Path, kill_after: int, overrides: list[str]):
    lighthouse, address = _lighthouse()
    folders = [root / "group0", root / "group1"]

    def cmd(g: int) -> list[str]:
        return [
            *RUN,
            "--fault_tolerance.enabled",
            "--fault_tolerance.group_count",
            "2",
            "--fault_tolerance.group_id",
            str(g),
            "--fault_tolerance.lighthouse",
            address,
            "--job.dump_folder",
            str(folders[g]),
            *overrides,
        ]

    procs = [_start(cmd(g), root / f"group{g}.log") for g in (0, 1)]
    try:
        _wait(lambda: _steps(folders[1])[-1:] >= [kill_after], f"group 1's step {kill_after}")
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        procs[1].wait()
        at_kill, logged = _steps(folders[0])[-1], len(_steps(folders[1]))
        procs[1] = _start(cmd(1), root / "group1.log")
        _wait(lambda: _steps(folders[0])[-1] > at_kill, "group 0's next step")
        survivor = time.monotonic() - killed
        _wait(lambda: len(_steps(folders[1])) > logged, "group 1's first step back")
        back = time.monotonic() - killed
        group1, group0 = _steps(folders[1])[-1], _steps(folders[0])[-1]
        print(
            f"replica groups: group 1 killed after step {kill_after} (group 0 at step {at_kill}); group 0 logged its "
            f"next step {survivor:.1f}s after the kill; group 1, restarted at once, logged step "
            f"{group1} {back:.1f}s after the kill, group 0 then at step {group0}"
        )
        return [
            [f"replica groups: group 0's next logged step (group 0 at step {at_kill} at the kill)", f"{survivor:.1f}"],
            [
                f"replica groups: group 1, restarted at once, logs its first step back (step {group1}; group 0 then "
                f"at step {group0})",
                f"{back:.1f}",
            ],
        ]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        lighthouse.kill()


def checkpoint_restart(root: Path, kill_after: int, overrides: list[str]):
    folder = root / "restart"
    cmd = [
        *RUN,
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "10",
        "--job.dump_folder",
        str(folder),
        *overrides,
    ]
    proc = _start(cmd, root / "restart.log")
    try:
        _wait(lambda: _steps(folder)[-1:] >= [kill_after], f"step {kill_after}")
        os.killpg(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        resumed = kill_after // 10 * 10 + 1  # the first step after the last checkpoint (metrics.jsonl is rewound)
        proc = _start(cmd, root / "restart.log")
        _wait(lambda: _steps(folder)[-1:] == [resumed], f"step {resumed} of the restarted run")
        first = time.monotonic() - killed
        _wait(lambda: _steps(folder)[-1] > kill_after, f"step {kill_after + 1}")
        back = time.monotonic() - killed
        print(
            f"checkpoint restart: killed after step {kill_after}; the restarted run logged step {resumed} "
            f"{first:.1f}s after the kill and step {kill_after + 1} {back:.1f}s after it "
            f"({kill_after - resumed + 1} steps trained twice)"
        )
        return [
            [
                f"checkpoint restart: the restarted run's first step ({resumed}, after its checkpoint)",
                f"{first:.1f}",
            ],
            [f"checkpoint restart: step {kill_after + 1} (steps {resumed}-{kill_after} trained twice)", f"{back:.1f}"],
        ]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    from torchtitan.config import load_config
    from torchtitan.config.errors import HelpRequested, UserError

    kill_after, overrides = 25, [a for a in argv if a != "--markdown"]
    if "--kill-after" in overrides:
        i = overrides.index("--kill-after")
        value = overrides[i + 1] if i + 1 < len(overrides) else ""
        if not value.isdigit() or not 1 <= int(value) < 100:
            raise UserError(f"--kill-after must be an integer from 1 to 99, got {value!r}")
        kill_after = int(value)
        del overrides[i : i + 2]
    # A mistake in the overrides is found here, not by the first launch.
    try:
        load_config(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), *overrides])
    except HelpRequested as h:  # this script's options first, then the trainer's
        raise HelpRequested(f"{__doc__}\nTrainer overrides, as for run_train.sh:\n\n{h.text}") from None
    with tempfile.TemporaryDirectory() as tmp:
        rows = replica_groups(Path(tmp), kill_after, overrides)
        rows += checkpoint_restart(Path(tmp), kill_after, overrides)
    if "--markdown" in argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/benchmark_table.py
        import benchmark_table

        benchmark_table.print_rows(["event", "seconds after the SIGKILL"], rows, argv, __file__)
    return 0


if __name__ == "__main__":
    from torchtitan.config.errors import run_main

    sys.exit(run_main(main, sys.argv[1:]))
