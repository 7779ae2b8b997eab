"""scripts/benchmark_table.py: the rows every benchmark script's --markdown prints for docs/benchmarks.md.

No subprocess: git is replaced where the commit is asked for."""

import json
import subprocess

import pytest

from helpers.launch import load_script
from helpers.paths import REPO


@pytest.fixture(scope="module")
def bt():
    return load_script(REPO / "scripts" / "benchmark_table.py", "benchmark_table")


def test_table_appends_command_commit_machine_and_date(bt):
    lines = bt.table(
        ["seq", "tokens/s"],
        [[4096, "1,185"], [16384, None]],
        "python scripts/benchmark_cp.py --seq 4096",
        commit_="abc1234",
        machine_="AMD EPYC, 2 cores",
        date="2026-12-08",
    )
    assert lines == [
        "| seq | tokens/s | command | commit | machine | date |",
        "|---|---|---|---|---|---|",
        "| 4096 | 1,185 | `python scripts/benchmark_cp.py --seq 4096` | abc1234 | AMD EPYC, 2 cores | 2026-12-08 |",
        "| 16384 |  | `python scripts/benchmark_cp.py --seq 4096` | abc1234 | AMD EPYC, 2 cores | 2026-12-08 |",
    ]


def test_cells_stay_one_line_and_escape_pipes(bt):
    assert bt.row(["a|b", "two\nlines", None, 1.5]) == "| a\\|b | two lines |  | 1.5 |"


def test_a_row_of_the_wrong_width_is_refused(bt):
    with pytest.raises(ValueError, match="2 columns"):
        bt.table(["a", "b"], [[1]], "cmd", commit_="x", machine_="m", date="2026-01-01")


def test_command_line_is_the_script_from_the_root_without_markdown(bt):
    script = str(REPO / "scripts" / "benchmark.py")
    assert bt.command_line(["--steps", "20", "--markdown", "--model.flavor", "10M"], script) == (
        "python scripts/benchmark.py --steps 20 --model.flavor 10M"
    )
    torchrun = ["torchrun", "--nproc_per_node", "4"]
    assert bt.command_line(["run", "/tmp/a b"], str(REPO / "scripts" / "benchmark_hf.py"), torchrun) == (
        "torchrun --nproc_per_node 4 scripts/benchmark_hf.py run '/tmp/a b'"
    )


def test_commit_is_the_short_head_or_unknown(bt, monkeypatch):
    def git(returncode, stdout):
        return lambda *a, **k: subprocess.CompletedProcess(a, returncode, stdout=stdout, stderr="")

    monkeypatch.setattr(bt.subprocess, "run", git(0, "1d37a9e\n"))
    assert bt.commit() == "1d37a9e"
    monkeypatch.setattr(bt.subprocess, "run", git(128, ""))  # not a git checkout
    assert bt.commit() == "unknown"

    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(bt.subprocess, "run", no_git)
    assert bt.commit() == "unknown"


def test_machine_names_the_cpu_its_cores_and_the_load(bt, tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: avx2\n")
    monkeypatch.setattr(bt.os, "cpu_count", lambda: 2)
    assert bt.machine(str(cpuinfo), load=3.14) == "AMD EPYC 7B13, 2 cores, load average 3.1"
    with_gpu = bt.machine(str(cpuinfo), gpu="NVIDIA H200", load=0.0)
    assert with_gpu == "NVIDIA H200, AMD EPYC 7B13, 2 cores, load average 0.0"
    assert bt.cpu_model(str(tmp_path / "missing")) != ""
    assert bt.today().count("-") == 2


def test_training_row_reads_a_runs_metrics(bt, tmp_path):
    records = [
        {"step": 1, "loss": 8.6943, "time": 1.2},
        {"step": 100, "validation_loss": 5.0},
        {"step": 200, "loss": 3.98912, "time": 340.55},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "config.toml").write_text(
        '[model]\nname = "llama3"\nflavor = "debugmodel"\n\n[training]\nmixed_precision_param = "float32"\n'
    )
    cells = bt.training_row(tmp_path / "metrics.jsonl", "347 s from launch to exit")
    assert cells == ["llama3 debugmodel, float32", "200", "8.6943", "3.9891", "340.6", "347 s from launch to exit"]
    assert len(cells) == len(bt.TRAINING_COLUMNS)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no logged training step"):
        bt.training_row(tmp_path / "metrics.jsonl")


def test_the_provenance_columns_are_those_of_docs_benchmarks(bt):
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert "| command | commit | machine | date |" in text
    assert bt.PROVENANCE == ("command", "commit", "machine", "date")
    header = "| " + " | ".join([*bt.TRAINING_COLUMNS, *bt.PROVENANCE]) + " |"
    assert header in text, "the Training runs table of docs/benchmarks.md has other columns than TRAINING_COLUMNS"
