"""scripts/benchmark_loss.py end to end at tiny sizes: every case runs and prints its row (the figures
themselves measure the machine and are not checked, except the losses, which chunking must not change)."""

import subprocess
import sys

import pytest

from helpers.paths import REPO

pytestmark = pytest.mark.slow  # a process per case (each imports torch): about 30 s on a quiet 2-core host

SCRIPT = REPO / "scripts" / "benchmark_loss.py"


def run(*argv: str) -> list[str]:
    out = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "failed" not in out.stdout, out.stdout
    return [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_the_output_layer_cases_print_their_rows():
    rows = run(
        "--tokens",
        "64",
        "--dim",
        "16",
        "--vocab",
        "512",
        "--dtype",
        "float32,bfloat16",
        "--chunks",
        "0,16",
        "--recompute",
        "16",
    )
    assert len(rows) == 6
    assert [r.split(" | ")[2] for r in rows[:3]] == ["whole logits", "16", "16 (recompute in backward)"]


def test_whole_steps_train_the_same_model_chunked():
    rows = run(
        "--step",
        "debugmodel",
        "--vocab",
        "512",
        "--tokens",
        "32",
        "--steps",
        "2",
        "--dtype",
        "float32",
        "--chunks",
        "0,8",
    )
    losses = [float(r.split(" | ")[4]) for r in rows]
    assert len(rows) == 2 and abs(losses[0] - losses[1]) < 1e-4, rows
