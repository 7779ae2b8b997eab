"""Profiler traces and the CPU memory timeline land at the configured steps, one file per rank."""

import json

import pytest

from torchtitan.config import UserError, load_config
from torchtitan.preflight import preflight
from torchtitan.train import train

from helpers.paths import RECIPE, REPO


def short_run(tmp_path, *overrides, steps=4):
    return train(
        load_config(
            [
                *RECIPE,
                "--job.dump_folder",
                str(tmp_path),
                "--training.steps",
                str(steps),
                "--training.seq_len",
                "32",
                "--training.local_batch_size",
                "2",
                "--metrics.device_peak_tflops",
                "1",
                *overrides,
            ]
        )
    )


def test_traces_every_profile_freq_steps(tmp_path):
    short_run(
        tmp_path,
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--profiling.save_traces_folder",
        "traces",
        steps=5,
    )
    folders = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert folders == ["iteration_2", "iteration_4"]
    trace = json.loads((tmp_path / "traces" / "iteration_2" / "rank0_trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)  # the step's matmuls were recorded


def test_a_rerun_keeps_the_earlier_runs_traces(tmp_path):
    """A second run in the same dump folder writes its own traces without overwriting the first's: a fresh start
    keeps the earlier folder as traces.1; a run resumed from step 2 keeps the earlier traces of later steps."""
    profile = [
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--profiling.save_traces_folder",
        "traces",
    ]
    short_run(tmp_path, *profile, steps=4)
    first = (tmp_path / "traces" / "iteration_4" / "rank0_trace.json").read_bytes()
    short_run(tmp_path, *profile, "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", steps=4)
    assert (tmp_path / "traces.1" / "iteration_4" / "rank0_trace.json").read_bytes() == first
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["iteration_2", "iteration_4"]
    second = (tmp_path / "traces" / "iteration_4" / "rank0_trace.json").read_bytes()
    (tmp_path / "checkpoint" / "step-4").rename(tmp_path / "step-4-aside")  # resume from step 2, redo 3-4
    short_run(tmp_path, *profile, "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", steps=4)
    assert (tmp_path / "traces" / "iteration_4.1" / "rank0_trace.json").read_bytes() == second
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["iteration_2", "iteration_4", "iteration_4.1"]


def test_cpu_memory_timeline(tmp_path):
    short_run(tmp_path, "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "3", steps=3)
    path = tmp_path / "memory_snapshot" / "iteration_3" / "rank0_memory_timeline.json"
    timeline = json.loads(path.read_text())
    times, sizes = timeline
    assert len(times) == len(sizes) > 0
    assert max(sum(row) for row in sizes) > 1e6  # more than a megabyte live at the peak


def test_no_profiling_writes_nothing(tmp_path):
    short_run(tmp_path, steps=2)
    assert not (tmp_path / "profile_traces").exists() and not (tmp_path / "memory_snapshot").exists()


def test_cpu_offload_is_rejected_on_cpu():
    cfg = load_config(
        ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--training.enable_cpu_offload"]
    )
    with pytest.raises(UserError, match="training.enable_cpu_offload .* this job runs on the CPU"):
        preflight(cfg, world_size=2)
