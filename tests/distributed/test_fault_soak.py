"""Fault-injection soak: a 2-process run saving every step is killed with SIGKILL (every process at
once) at a random moment, 20 times in a row, each time resumed by the next launch. Every launch must
resume from a complete checkpoint that verifies, no published checkpoint may be lost (beyond what
keep_latest_k deletes), and in deterministic mode every logged loss must equal the uninterrupted
run's at the same step."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, read_metrics
from torchtitan.components.checkpoint import complete_checkpoints, verify_checkpoint

pytestmark = pytest.mark.slow

TRIALS = 20
# Constant learning rate after warmup, so the total step count (which the last launch changes) does not
# change any step's numbers.
JOB = TINY + ["--training.local_batch_size", "4", "--lr_scheduler.decay_ratio", "0", "--checkpoint.enable_checkpoint",
              "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2", "--checkpoint.no-last_save_model_only"]


def launch(folder: Path, steps: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", "-m", "torchtitan.train", *JOB, "--job.dump_folder", str(folder),
           "--training.steps", str(steps), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def processes_naming(text: str) -> list[int]:
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


def logged_steps(folder: Path) -> int:
    path = folder / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def all_losses(folder: Path) -> list[tuple[int, float]]:
    """(step, loss) of every line every launch logged (a fresh start keeps the earlier file as metrics.jsonl.N)."""
    out = []
    for path in sorted(folder.glob("metrics.jsonl*")):
        out += [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]
    return out


def test_random_sigkills_then_resume(tmp_path):
    rng = random.Random(20261203)
    folder, ckpt_dir = tmp_path / "run", tmp_path / "run" / "checkpoint"
    moments = {"mid-save": 0, "mid-purge": 0, "between saves": 0}
    for trial in range(TRIALS):
        extra = ["--checkpoint.async_mode", "async"] if trial % 2 else []
        before_launch = complete_checkpoints(str(ckpt_dir))
        proc = launch(folder, 100000, *extra)
        lines = logged_steps(folder)
        deadline = time.monotonic() + 120
        while logged_steps(folder) <= lines:  # this launch has trained a step
            assert proc.poll() is None, f"trial {trial}: the launch failed:\n{proc.stderr.read()[-4000:]}"
            assert time.monotonic() < deadline, f"trial {trial}: no step logged"
            time.sleep(0.05)
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

    reference = launch(tmp_path / "reference", newest + 2, "--checkpoint.no-enable_checkpoint")
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err[-4000:]
    expected = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "reference")}
    seen = all_losses(folder)
    assert {step for step, _ in seen} == set(expected)
    mismatched = [(step, loss, expected[step]) for step, loss in seen if loss != expected[step]]
    assert not mismatched, mismatched[:5]
    print(f"{TRIALS} kills {moments}; {newest + 2} steps, {len(seen)} logged losses equal the uninterrupted run's")
    assert moments["mid-save"] >= 3, moments
