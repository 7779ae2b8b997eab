"""Replica groups with tensor, pipeline, context and expert parallel inside each group: two real groups of two
processes each, with a real lighthouse, log the losses of one process that trains their global batch together.
Rank r of every group holds the same shards, so each rank averages its own local gradient shards with rank r of
the other groups (torchtitan/components/fault_tolerance.py); an MoE model's expert-bias balancing counts the
tokens of every group, so the groups keep the same routing."""

import os
import signal
import subprocess
import time

import pytest

from helpers.launch import launch, processes_naming, read_metrics, start_lighthouse
from helpers.paths import PYTHON_DIR, REPO, TINY

pytestmark = [pytest.mark.multiprocess]

STEPS = 4
FT = ["--fault_tolerance.enabled", "--fault_tolerance.group_count", "2"]
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
# name: (the layout inside each group of 2 processes, the model)
LAYOUTS = {
    "tp2_moe": (["--parallelism.tensor_parallel_degree", "2"], MOE),
    "pp2": (
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"],
        [],
    ),
    "cp2_ep2_moe": (["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"], MOE),
}


ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("NGPU", "LIGHTHOUSE_PORT", "CONFIG_FILE")},
    "PATH": PYTHON_DIR + os.pathsep + os.environ["PATH"],
    "OMP_NUM_THREADS": "1",
    "NGPU": "2",
}


def _run_groups(name: str, layout: list[str], model: list[str], address: str, tmp) -> list:
    """Both groups of one layout, started together; their dump folders once both ended."""
    folders = [tmp / f"{name}_group{g}" for g in range(2)]
    procs = []
    try:
        for g, folder in enumerate(folders):
            cmd = [
                "./run_train.sh",
                *TINY,
                *FT,
                *model,
                *layout,
                "--training.steps",
                str(STEPS),
                "--training.global_batch_size",
                "4",
                "--fault_tolerance.group_id",
                str(g),
                "--fault_tolerance.lighthouse",
                address,
                "--job.dump_folder",
                str(folder),
            ]
            with open(tmp / f"{name}_group{g}.log", "w") as log:  # a file: a full pipe would stop the group
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 600
        for g, proc in enumerate(procs):
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, (tmp / f"{name}_group{g}.log").read_text()[-5000:]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for folder in folders:  # every process of a group that did not end
            for pid in processes_naming(f"{folder} "):
                os.kill(pid, signal.SIGKILL)
    return folders


@pytest.mark.slow
def test_groups_with_tp_pp_cp_ep_inside_train_as_one_run(tmp_path):
    # One process, the groups' global batch together (2 x 4), one job per model.
    models = {"llama": [], "moe": MOE}
    single = launch(
        {f"single_{m}": [*extra, "--training.steps", str(STEPS)] for m, extra in models.items()}, 1, tmp_path
    )
    lighthouse, address = start_lighthouse("--heartbeat_timeout_ms", "2000")
    try:
        for name, (layout, model) in LAYOUTS.items():
            expected = [r["loss"] for r in single["single_moe" if model else "single_llama"]]
            for folder in _run_groups(name, layout, model, address, tmp_path):
                records = read_metrics(folder)
                got = [r["loss"] for r in records]
                assert got == pytest.approx(expected, abs=1e-5), (name, folder.name, got, expected)
                if model:  # the expert loads of each step: both groups' tokens, as the one process's
                    loads = [r["moe_max_over_mean"] for r in single["single_moe"]]
                    assert [r["moe_max_over_mean"] for r in records] == pytest.approx(loads, abs=1e-6), name
                assert all(r["replica_groups"] == 2 for r in records), (name, records)
    finally:
        lighthouse.kill()
        lighthouse.wait()
