"""Faults a long run meets, each against one uninterrupted run of the same deterministic job:
- soak: a 2-process run saving every step is killed with SIGKILL (every process at once) at a random
  moment, TRIALS times in a row, each time resumed by the next launch. Every launch must resume from
  a complete checkpoint that verifies and no published checkpoint may be lost (beyond what
  keep_latest_k deletes);
- preemption: SIGTERM to every worker ends the run after the current step with a complete
  checkpoint and exit status 0, and a later launch continues from it;
- auto-resume: under torchrun --max-restarts, SIGKILL of one rank restarts the job, which continues
  from the newest complete checkpoint on its own.
In every case each logged loss equals the uninterrupted run's at the same step, bitwise."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan.components.checkpoint import complete_checkpoints, verify_checkpoint

from helpers.launch import processes_naming, read_metrics, worker_pids
from helpers.paths import REPO, TINY

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

TRIALS = 12
REFERENCE_STEPS = 80
# Constant learning rate after warmup, so the total step count (which the launches vary) does not
# change any step's numbers.
JOB = TINY + [
    "--training.local_batch_size",
    "4",
    "--lr_scheduler.decay_ratio",
    "0",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval",
    "1",
    "--checkpoint.keep_latest_k",
    "2",
    "--checkpoint.no-last_save_model_only",
]


def launch(folder: Path, steps: int, *extra: str, torchrun: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        *torchrun,
        "-m",
        "torchtitan.train",
        *JOB,
        "--job.dump_folder",
        str(folder),
        "--training.steps",
        str(steps),
        *extra,
    ]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def logged_steps(folder: Path) -> int:
    path = folder / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for_steps(folder: Path, proc: subprocess.Popen, lines: int, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while logged_steps(folder) < lines:
        assert proc.poll() is None, f"the launch failed:\n{proc.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, "no step logged"
        time.sleep(0.05)


def all_losses(folder: Path) -> list[tuple[int, float]]:
    """(step, loss) of every line every launch logged (a fresh start or a restart keeps the earlier
    file as metrics.jsonl.N)."""
    out = []
    for path in sorted(folder.glob("metrics.jsonl*")):
        out += [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """{step: loss} of the uninterrupted run."""
    folder = tmp_path_factory.mktemp("reference")
    proc = launch(folder, REFERENCE_STEPS, "--checkpoint.no-enable_checkpoint", "--metrics.log_freq", "1")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return {r["step"]: r["loss"] for r in read_metrics(folder)}


def assert_losses_match(folder: Path, reference: dict[int, float]):
    seen = all_losses(folder)
    mismatched = [(step, loss, reference[step]) for step, loss in seen if loss != reference[step]]
    assert not mismatched, mismatched[:5]
    return seen


def test_random_sigkills_then_resume(tmp_path, reference):
    rng = random.Random(20261203)
    folder, ckpt_dir = tmp_path / "run", tmp_path / "run" / "checkpoint"
    moments = {"mid-save": 0, "mid-purge": 0, "between saves": 0}
    for trial in range(TRIALS):
        extra = ["--checkpoint.async_mode", "async"] if trial % 2 else []
        before_launch = complete_checkpoints(str(ckpt_dir))
        proc = launch(folder, 100000, *extra)
        wait_for_steps(folder, proc, logged_steps(folder) + 1)  # this launch has trained a step
        time.sleep(rng.uniform(0, 1.2))
        published = complete_checkpoints(str(ckpt_dir))
        for pid in processes_naming(str(folder)):  # every process of the job at once
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        proc.stderr.close()
        while processes_naming(str(folder)):
            time.sleep(0.05)
        names = os.listdir(ckpt_dir) if ckpt_dir.exists() else []  # what the kill left half-done
        if any(n.endswith(".partial") for n in names):
            moments["mid-save"] += 1
        elif any(n.startswith(".deleting-") for n in names):
            moments["mid-purge"] += 1
        else:
            moments["between saves"] += 1
        after = complete_checkpoints(str(ckpt_dir))
        # Nothing published is lost: the newest checkpoint seen before the kill is still there, and the
        # launch resumed from what the previous one left (its steps only went forward).
        assert not published or published[-1] in after, (trial, published, after)
        assert not before_launch or after[-1] >= before_launch[-1], (trial, before_launch, after)
        for step in after:
            assert verify_checkpoint(str(ckpt_dir / f"step-{step}")) is None, (trial, step)
    newest = complete_checkpoints(str(ckpt_dir))[-1]
    final = launch(folder, newest + 2)
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err[-4000:]
    assert f"resumed from {ckpt_dir / f'step-{newest}'} (step {newest})" in err
    assert not [n for n in os.listdir(ckpt_dir) if n.endswith(".partial")]

    assert newest + 2 <= REFERENCE_STEPS
    seen = assert_losses_match(folder, reference)
    assert {step for step, _ in seen} == set(range(1, newest + 3))
    print(f"{TRIALS} kills {moments}; {newest + 2} steps, {len(seen)} logged losses equal the uninterrupted run's")
    assert moments["mid-save"] >= 2, moments


def test_stop_signal_saves_the_step_and_exits_zero(tmp_path, reference):
    """What a scheduler does before a kill: SIGTERM to every worker (SLURM signals all of a step's
    processes; torchrun forwards a signal it gets to the workers the same way)."""
    folder, ckpt_dir = tmp_path / "run", tmp_path / "run" / "checkpoint"
    proc = launch(folder, 1000, "--checkpoint.interval", "1000")
    wait_for_steps(folder, proc, 2)
    sent = time.monotonic()
    for pid in worker_pids(str(folder)).values():
        os.kill(pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    assert proc.returncode == 0, err[-4000:]
    saved = complete_checkpoints(str(ckpt_dir))
    assert len(saved) == 1 and saved[0] >= 2, saved  # no periodic save was due: this one is the stop's
    assert verify_checkpoint(str(ckpt_dir / f"step-{saved[0]}")) is None
    assert f"stopped by SIGTERM after step {saved[0]} of 1000; saved checkpoint {ckpt_dir / f'step-{saved[0]}'} " in err
    assert took < 120  # job.stop_grace_seconds
    assert logged_steps(folder) == saved[0]  # the step it stopped after is logged too

    resumed = launch(folder, saved[0] + 2, "--checkpoint.interval", "1000")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-4000:]
    assert f"resumed from {ckpt_dir / f'step-{saved[0]}'}" in err
    seen = assert_losses_match(folder, reference)
    assert [step for step, _ in seen] == list(range(1, saved[0] + 3))
    print(f"stopped after step {saved[0]}, {took:.1f}s after SIGTERM; resumed to step {saved[0] + 2}")


def test_killed_rank_restarts_the_job_which_resumes(tmp_path, reference):
    """torchrun --max-restarts: SIGKILL of rank 1 mid-run; the restarted workers continue from the
    newest complete checkpoint with no manual step."""
    folder = tmp_path / "run"
    proc = launch(folder, 12, "--checkpoint.interval", "3", torchrun=("--max-restarts", "1"))
    wait_for_steps(folder, proc, 5)
    os.kill(worker_pids(str(folder))[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert re.search(r"resumed from \S+/step-(3|6) \(step \1\)", err), err[-4000:]
    seen = assert_losses_match(folder, reference)
    assert {step for step, _ in seen} == set(range(1, 13))
    assert sorted(r["step"] for r in read_metrics(folder)) == list(range(1, 13))  # metrics.jsonl reads as one run
