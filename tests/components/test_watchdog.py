"""Stragglers and stalls (torchtitan/components/watchdog.py): the straggler decision on its own, the own-time
measure, the config's refusals, one process whose async checkpoint write blocks for real (a named pipe where
DCP writes), and three 2-rank gloo runs with real slow or stuck processes: a rank SIGSTOPped in bursts is
named; a run with none names none and then stalls for real in a checkpoint write (a named pipe where rank 0
writes train_state.json); a stopped data worker blocks a step's data read."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchtitan.components import watchdog
from torchtitan.components.watchdog import STALL_EXIT, Watchdog, persistent_straggler, ratios
from torchtitan.config import UserError, load_config

from helpers.launch import processes_naming, worker_pids
from helpers.paths import TINY

# --- the decision ------------------------------------------------------------------------------------


def test_ratios_compare_each_rank_with_the_median_of_the_others():
    assert ratios([1.0, 1.0]) == [1.0, 1.0]
    assert ratios([1.0, 3.0]) == [1 / 3, 3.0]
    # Four ranks: rank 3's others are 1, 1, 2 (median 1); rank 0's are 1, 2, 4 (median 2).
    assert ratios([1.0, 1.0, 2.0, 4.0]) == [0.5, 0.5, 2.0, 4.0]
    assert ratios([0.0, 0.0]) == [1.0, 1.0]


def test_a_rank_is_named_only_when_slow_in_every_window():
    slow1 = [1.0, 2.0, 1.0]
    assert persistent_straggler([slow1, slow1, slow1], 1.5) == 1
    # Slow in two windows of three: not persistent.
    assert persistent_straggler([slow1, [1.0, 1.2, 1.0], slow1], 1.5) is None
    # Exactly the factor is not slower than it.
    assert persistent_straggler([[1.0, 1.5, 1.0]] * 3, 1.5) is None
    # A different rank slow in each window: none is persistent.
    assert persistent_straggler([[2.0, 1.0, 1.0], [1.0, 2.0, 1.0]], 1.5) is None
    # Two persistently slow ranks: the slower in the latest window.
    assert persistent_straggler([[3.0, 2.0, 1.0, 1.0, 1.0], [2.0, 3.0, 1.0, 1.0, 1.0]], 1.5) == 1
    assert persistent_straggler([[5.0]], 1.5) is None  # one rank: nothing to compare with
    assert persistent_straggler([], 1.5) is None


def test_own_time_counts_work_and_data_reads_not_sleep():
    # The sampled thread's own time: running counts, sleeping (as in a collective, waiting for peers) does not,
    # sleeping inside a data read does.
    with Watchdog(0, 0, 1.5, 3, torch.device("cpu")) as w:
        time.sleep(0.5)
        slept = w.own_seconds
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pass
        worked = w.own_seconds - slept
        with watchdog.phase("data", "reading the data for step 1"):
            time.sleep(0.5)
        reading = w.own_seconds - slept - worked
    assert slept < 0.25 and worked > 0.3 and reading > 0.3, (slept, worked, reading)
    assert watchdog._active is None


# --- the config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--metrics.straggler_factor", "1"], "metrics.straggler_factor must be 0 (off) or more than 1"),
        (["--metrics.straggler_factor", "nan"], "metrics.straggler_factor must be 0 (off) or more than 1"),
        (["--metrics.straggler_windows", "0"], "metrics.straggler_windows must be a positive integer, got 0"),
        (
            ["--comm.data_timeout_seconds", "-1"],
            "comm.data_timeout_seconds must be 0 (no limit) or a positive number of seconds, got -1",
        ),
        (
            ["--comm.checkpoint_timeout_seconds", "-5"],
            "comm.checkpoint_timeout_seconds must be 0 (no limit) or a positive number of seconds, got -5",
        ),
    ],
)
def test_bad_values_are_refused(argv, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(argv)


def test_defaults_and_off():
    cfg = load_config([])
    assert (cfg.metrics.straggler_factor, cfg.metrics.straggler_windows) == (1.5, 3)
    assert (cfg.comm.data_timeout_seconds, cfg.comm.checkpoint_timeout_seconds) == (600, 1800)
    off = load_config(
        [
            "--metrics.straggler_factor",
            "0",
            "--comm.data_timeout_seconds",
            "0",
            "--comm.checkpoint_timeout_seconds",
            "0",
        ]
    )
    assert (off.metrics.straggler_factor, off.comm.data_timeout_seconds, off.comm.checkpoint_timeout_seconds) == (
        0,
        0,
        0,
    )


# --- an async checkpoint's background write that never returns, in one process --------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_background_checkpoint_write_that_never_returns_ends_the_run(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torchtitan.train",
        *TINY,
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "8",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "4",
        "--checkpoint.async_mode",
        "async",
        "--comm.checkpoint_timeout_seconds",
        "3",
    ]
    log = open(tmp_path / "output.log", "w")  # noqa: SIM115 (the trainer's stdout for its whole run)
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    _wait_for_step(tmp_path, proc, 1)
    # Where DCP's background thread writes this rank's tensors of step 4: a named pipe nobody reads.
    partial = tmp_path / "checkpoint" / ".step-4.partial"
    partial.mkdir(parents=True)
    os.mkfifo(partial / "__0_0.distcp")
    out = _finish(tmp_path, proc)
    assert proc.returncode == STALL_EXIT != 0
    assert (
        "stalled: writing checkpoint step-4 in the background took more than 3 s (comm.checkpoint_timeout_seconds)"
    ) in out
    assert "Traceback" not in out
    # Training went on while the write hung: the stall is the background phase's, not a step's.
    assert max(r["step"] for r in _records(tmp_path)) > 4
    assert not (tmp_path / "checkpoint" / "step-4").exists()


# --- real 2-rank runs ------------------------------------------------------------------------------


def _start(folder: Path, *extra: str) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "-m",
        "torchtitan.train",
        *TINY,
        "--job.dump_folder",
        str(folder),
        *extra,
    ]
    log = open(folder / "output.log", "w")  # noqa: SIM115 (the trainer's stdout for its whole run)
    return subprocess.Popen(
        cmd,
        cwd=folder,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_step(folder: Path, proc: subprocess.Popen, step: int, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in _records(folder)):
        assert proc.poll() is None, (folder / "output.log").read_text()[-3000:]
        assert time.monotonic() < deadline, f"no record of step {step}"
        time.sleep(0.05)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def _finish(folder: Path, proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        for pid in processes_naming(str(folder)):  # whatever a failed test left: continued, then killed
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    return (folder / "output.log").read_text()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_stopped_in_bursts_is_named(tmp_path):
    # The defaults' factor (1.5) over 3 windows of 2 steps: rank 1 runs 0.2 s of every 0.7 s. (The bad values'
    # exit 2 before launch is the config's, tests/config/test_config.py.)
    proc = _start(tmp_path, "--training.steps", "8", "--metrics.log_freq", "2")
    _wait_for_step(tmp_path, proc, 1)
    slow = worker_pids(str(tmp_path))[1]
    while proc.poll() is None:
        try:
            os.kill(slow, signal.SIGSTOP)
            time.sleep(0.5)
            os.kill(slow, signal.SIGCONT)
            time.sleep(0.2)
        except ProcessLookupError:  # the run ended
            break
    out = _finish(tmp_path, proc)
    assert proc.returncode == 0, out[-3000:]
    records = _records(tmp_path)
    named = {r["step"]: r["straggler_rank"] for r in records if "straggler_rank" in r}
    # Named once 3 windows (steps 2, 4, 6) have been compared, and in every record after; never another rank.
    assert named == {6: 1, 8: 1}, records
    assert all(r["step_time_max_over_median"] > 1.5 for r in records if r["step"] in named)
    assert "WARNING straggler: rank 1 spent" in out
    assert "straggler: rank 0" not in out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_no_straggler_without_one_and_a_checkpoint_write_that_never_returns_ends_the_run(tmp_path):
    proc = _start(
        tmp_path,
        "--training.steps",
        "10",
        "--metrics.log_freq",
        "2",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "8",
        "--comm.checkpoint_timeout_seconds",
        "4",
    )
    _wait_for_step(tmp_path, proc, 1)
    # Past start-up (which clears partial checkpoints): where rank 0 writes step 8's train_state.json, a named pipe
    # that nobody reads. Its open() blocks for real, as on storage that stopped answering.
    partial = tmp_path / "checkpoint" / ".step-8.partial"
    partial.mkdir(parents=True)
    os.mkfifo(partial / "train_state.json.tmp")
    _wait_for_step(tmp_path, proc, 8)
    reached = time.monotonic()
    out = _finish(tmp_path, proc)
    took = time.monotonic() - reached
    assert proc.returncode != 0
    assert (
        "stalled: writing checkpoint step-8 took more than 4 s (comm.checkpoint_timeout_seconds); likely storage "
        "that stopped answering"
    ) in out
    assert f"(exit {STALL_EXIT}); the launcher stops the others" in out
    # No traceback from the stalled rank; at most the peer's broken collective's and the launcher's summary.
    assert "[rank0]: Traceback" not in out and out.count("Traceback") <= 2, out[-5000:]
    assert took < 4 + 20, took
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 4, 6, 8]
    # The comparison ran in every window after the first, and named no one.
    assert all("step_time_max_over_median" in r for r in records[1:])
    assert not any("straggler_rank" in r for r in records), records
    assert "WARNING straggler" not in out
    assert not (tmp_path / "checkpoint" / "step-8").exists()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_data_read_that_blocks_ends_the_run_naming_the_step(tmp_path):
    proc = _start(
        tmp_path, "--training.steps", "60", "--training.data_workers", "1", "--comm.data_timeout_seconds", "4"
    )
    _wait_for_step(tmp_path, proc, 1)
    # Rank 1's data worker (its forked child): stopped, it sends no more windows; once the queued ones are
    # used, rank 1's read of the pipe from it blocks.
    parents = {pid: _parent(pid) for pid in processes_naming(str(tmp_path))}
    rank1 = next(
        pid
        for pid, parent in parents.items()
        if parent == proc.pid and b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    )
    children = [pid for pid, parent in parents.items() if parent == rank1]
    assert len(children) == 1, parents
    os.kill(children[0], signal.SIGSTOP)
    stopped = time.monotonic()
    out = _finish(tmp_path, proc)
    took = time.monotonic() - stopped
    assert proc.returncode != 0
    line = next(line for line in out.splitlines() if "stalled:" in line)
    assert line.startswith("[rank1]"), line
    assert "took more than 4 s (comm.data_timeout_seconds); likely a read that blocks" in line
    step = int(line.split("reading the data for step ")[1].split()[0])
    assert step > max(r["step"] for r in _records(tmp_path))
    assert "[rank1]: Traceback" not in out and out.count("Traceback") <= 2, out[-5000:]
    assert took < 4 + 25, took
    assert children[0] not in processes_naming(str(tmp_path))  # the stopped worker did not outlive the run
