"""One live run per dump folder: a second run is refused while the first lives, a lock left by a
killed run is taken over, and a new run keeps an earlier run's metrics and config."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from torchtitan.components import run_lock
from torchtitan.components.checkpoint import complete_checkpoints, verify_checkpoint

from helpers.paths import REPO, TINY

TRAIN = [
    sys.executable,
    "-m",
    "torchtitan.train",
    *TINY,
    "--training.local_batch_size",
    "8",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval",
    "2",
    "--checkpoint.no-last_save_model_only",
]


def train(folder, *extra, **kwargs):
    return subprocess.run(
        [*TRAIN, "--job.dump_folder", str(folder), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def write_lock(folder, **record):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / run_lock.LOCK_FILE).write_text(json.dumps(record))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_live_run_is_refused_and_the_first_is_untouched(tmp_path):
    first = subprocess.Popen(
        [*TRAIN, "--job.dump_folder", str(tmp_path), "--training.steps", "2000"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not complete_checkpoints(str(tmp_path / "checkpoint")):
            assert time.monotonic() < deadline and first.poll() is None, "the first run never saved"
            time.sleep(0.2)
        second = train(tmp_path, "--training.steps", "4")
        assert second.returncode == 2
        assert (
            f"job.dump_folder {tmp_path} is in use by a running job (host {socket.gethostname()}, pid {first.pid}"
            in second.stderr
        )
        assert "Traceback" not in second.stderr
        # Preflight (run_train.sh's first step) says the same before anything starts.
        pre = subprocess.run(
            [sys.executable, "-m", "torchtitan.preflight", *TINY, "--job.dump_folder", str(tmp_path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert pre.returncode == 2 and "is in use by a running job" in pre.stderr
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    steps = complete_checkpoints(str(tmp_path / "checkpoint"))
    assert steps and all(verify_checkpoint(str(tmp_path / "checkpoint" / f"step-{s}")) is None for s in steps)
    # The killed run's lock is stale: the next run takes it over, resumes, and releases it at the end.
    resumed = train(tmp_path, "--training.steps", str(steps[-1] + 1))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"taking over the lock of {tmp_path} left by a run that is gone (host {socket.gethostname()}, pid {first.pid}"
        in resumed.stderr
    )
    assert not (tmp_path / run_lock.LOCK_FILE).exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_lock_liveness_rules(tmp_path):
    host = socket.gethostname()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(
            tmp_path, host=host, pid=sleeper.pid, start_time=run_lock._process_start_time(sleeper.pid), started=0
        )
        assert run_lock.holder_if_alive(str(tmp_path))["pid"] == sleeper.pid
        # The same pid number with another start time is a reused pid: stale.
        write_lock(tmp_path, host=host, pid=sleeper.pid, start_time="1", started=0)
        assert run_lock.holder_if_alive(str(tmp_path)) is None
    finally:
        sleeper.kill()
        sleeper.wait()
    write_lock(tmp_path, host=host, pid=sleeper.pid, start_time="1", started=0)
    assert run_lock.holder_if_alive(str(tmp_path)) is None  # the process is gone
    # Another host: alive while its heartbeat is fresh.
    write_lock(tmp_path, host="elsewhere", pid=1, start_time="1", started=0)
    assert run_lock.holder_if_alive(str(tmp_path))["host"] == "elsewhere"
    old = time.time() - run_lock.STALE_AFTER_S - 1
    os.utime(tmp_path / run_lock.LOCK_FILE, (old, old))
    assert run_lock.holder_if_alive(str(tmp_path)) is None


def test_heartbeat_keeps_the_lock_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = run_lock.RunLock(str(tmp_path))
    old = time.time() - 1000
    os.utime(lock.path, (old, old))
    time.sleep(0.3)
    assert time.time() - os.path.getmtime(lock.path) < 5
    lock.release()
    assert not os.path.exists(lock.path)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_new_run_keeps_the_earlier_runs_metrics_and_config(tmp_path):
    assert train(tmp_path, "--training.steps", "2", "--checkpoint.no-enable_checkpoint").returncode == 0
    first_metrics = (tmp_path / "metrics.jsonl").read_text()
    proc = train(tmp_path, "--training.steps", "3", "--checkpoint.no-enable_checkpoint")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "metrics.jsonl.1").read_text() == first_metrics
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert "steps = 2" in (tmp_path / "config.toml.1").read_text()
    assert "steps = 3" in (tmp_path / "config.toml").read_text()
    assert "holds an earlier run's metrics; kept it as" in proc.stderr
