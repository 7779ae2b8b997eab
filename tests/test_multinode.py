"""Several nodes and the launcher's failure handling, on this machine: two "nodes" of two processes
started by scripts/multinode_trainer.slurm with faked SLURM variables (rendezvous on 127.0.0.1)
train as one process does; missing SLURM variables and an endpoint nobody answers end with one
message; a killed worker is restarted (MAX_RESTARTS) and then reported in one line; a stop signal
sent to the launcher (SIGTERM) or to its process group (Ctrl-C's SIGINT) stops the workers after a
step, without waiting for its shutdown timeout, with the exit status the help names."""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers.launch import free_port, read_metrics, start_lighthouse
from helpers.paths import PYTHON_DIR, REPO, TINY

SLURM = REPO / "scripts" / "multinode_trainer.slurm"


def env_of(**variables) -> dict:
    env = dict(os.environ, PATH=PYTHON_DIR + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1")
    for name in (
        "SLURM_JOB_ID",
        "SLURM_NNODES",
        "SLURM_JOB_NODELIST",
        "SLURM_NODEID",
        "SLURM_GPUS_ON_NODE",
        "HEAD_NODE_ADDR",
        "SRUN",
        "NGPU",
        "NNODES",
        "NODE_RANK",
        "RDZV_ENDPOINT",
        "RDZV_PORT",
        "RDZV_ID",
        "RDZV_TIMEOUT",
        "MAX_RESTARTS",
        "LOG_RANK",
        "LOG_DIR",
        "WORKER_START",
        "CONFIG_FILE",
        "LIGHTHOUSE",
        "DUMP_FOLDER",
        "SLURM_ARRAY_TASK_ID",
        "SLURM_ARRAY_TASK_MIN",
        "SLURM_ARRAY_TASK_COUNT",
    ):
        env.pop(name, None)
    env.update(variables)
    return env


def node_env(node: int, port: int, **extra) -> dict:
    """This machine as node `node` of a faked 2-node allocation; SRUN="" runs the node's launcher here."""
    return env_of(
        SLURM_JOB_ID="4242",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_NODEID=str(node),
        HEAD_NODE_ADDR="127.0.0.1",
        RDZV_PORT=str(port),
        SRUN="",
        NGPU="2",
        **extra,
    )


def start(cmd: list, env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_nodes_of_two_processes_train_as_one_process(tmp_path):
    import torch

    from torchtitan.config import load_config
    from torchtitan.train import train

    port = free_port()
    args = [*TINY, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "nodes")]
    nodes = [start(["bash", str(SLURM), *args], node_env(n, port)) for n in (0, 1)]
    threads = torch.get_num_threads()
    try:
        # The reference, in this process, while the nodes start: FSDP over 4 ranks against 1 process.
        # One thread, as each worker: a second one only contends for the 2 cores the nodes share.
        torch.set_num_threads(1)
        one = train(
            load_config([*TINY, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "one")])
        )
        outs = [p.communicate(timeout=240) for p in nodes]
    finally:
        torch.set_num_threads(threads)
        for p in nodes:
            p.kill()
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    logs = [out + err for out, err in outs]
    assert all("torchtitan: 2 nodes x 2 processes, rendezvous 127.0.0.1:" in log for log in logs)
    assert all("= 4 ranks on cpu" in log for log in logs)  # one mesh over both nodes
    # Each node shows its local rank 0, prefixed with its global rank: 0 on one node, 2 on the other.
    assert sorted(re.search(r"^\[rank(\d)\] ", log, re.M).group(1) for log in logs) == ["0", "2"]
    two = read_metrics(tmp_path / "nodes")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4, 5, 6]
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(one, two))
    assert diff < 1e-5, ([r["loss"] for r in one], [r["loss"] for r in two])
    assert not (tmp_path / "nodes" / ".run.lock").exists()  # rank 0 (on either node) released it


@pytest.mark.slow
def test_an_array_job_with_a_lighthouse_runs_one_replica_group_per_task(tmp_path):
    """LIGHTHOUSE set: array task i of an array of 2 is replica group i, dumping to DUMP_FOLDER/group<i>; both
    groups take part in every step and average their gradients (so they log the same losses)."""
    lighthouse, address = start_lighthouse()
    tasks = []
    try:
        for i in (0, 1):
            env = env_of(
                SLURM_JOB_ID=f"77{i}",
                SLURM_NNODES="1",
                SLURM_NODEID="0",
                HEAD_NODE_ADDR="127.0.0.1",
                RDZV_PORT=str(free_port()),
                SRUN="",
                NGPU="1",
                LIGHTHOUSE=address,
                DUMP_FOLDER=str(tmp_path),
                SLURM_ARRAY_TASK_ID=str(5 + i),
                SLURM_ARRAY_TASK_MIN="5",
                SLURM_ARRAY_TASK_COUNT="2",
            )
            tasks.append(
                start(["bash", str(SLURM), *TINY, "--training.steps", "3", "--training.global_batch_size", "4"], env)
            )
        outs = [p.communicate(timeout=300) for p in tasks]
    finally:
        for p in tasks:
            p.kill()
        lighthouse.kill()
        lighthouse.wait()
    for i, (p, (out, err)) in enumerate(zip(tasks, outs)):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
        assert f"torchtitan: replica group {i} of 2, lighthouse {address}" in err, err[-3000:]
    groups = [read_metrics(tmp_path / f"group{i}") for i in (0, 1)]
    assert all(r["replica_groups"] == 2 for g in groups for r in g) and len(groups[0]) == 3, groups
    assert [r["loss"] for r in groups[0]] == [r["loss"] for r in groups[1]]


def test_replica_groups_need_an_array_job():
    env = node_env(0, 29500, LIGHTHOUSE="http://127.0.0.1:1")
    proc = subprocess.run(["bash", str(SLURM)], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "SLURM_ARRAY_TASK_ID is not set: replica groups (LIGHTHOUSE) run as an array job" in proc.stderr


@pytest.mark.parametrize(
    "unset, message",
    [
        ("SLURM_JOB_ID", "SLURM_JOB_ID is not set: run this script with sbatch"),
        ("SLURM_NNODES", "SLURM_NNODES is not set"),
        (
            "HEAD_NODE_ADDR SLURM_JOB_NODELIST",
            "SLURM_JOB_NODELIST is not set: run this script with sbatch, or set HEAD_NODE_ADDR",
        ),
        ("NGPU", "NGPU is not set: set NGPU .* or allocate GPUs .SLURM_GPUS_ON_NODE."),
        ("SLURM_NODEID", "SLURM_NODEID is not set on this node"),
    ],
)
def test_missing_slurm_variables_are_named(unset, message):
    env = node_env(1, 29500)
    for name in unset.split():
        env.pop(name)
    start_time = time.monotonic()
    proc = subprocess.run(["bash", str(SLURM)], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert re.search(message, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start_time < 5  # nothing was started


@pytest.mark.skipif(shutil.which("scontrol") is not None, reason="a real scontrol would be asked about fake nodes")
def test_head_node_needs_scontrol_or_an_address():
    env = node_env(0, 29500)
    env.pop("HEAD_NODE_ADDR")
    proc = subprocess.run(["bash", str(SLURM)], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "HEAD_NODE_ADDR is not set: scontrol is not on PATH" in proc.stderr


def test_several_nodes_need_an_endpoint():
    proc = subprocess.run(
        ["./run_train.sh"], cwd=REPO, env=env_of(NNODES="2"), capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert "NNODES=2 needs RDZV_ENDPOINT=HOST:PORT" in proc.stderr


@pytest.mark.slow
def test_an_endpoint_nobody_answers_ends_within_the_rendezvous_timeout(tmp_path):
    # Node 1 waits for node 0's store (which never starts) for RDZV_TIMEOUT seconds, while its preflight
    # runs, then ends with one line (torchrun alone would wait 600 s to join, printing C++ retries).
    start_time = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SLURM), *TINY, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path)],
        cwd=REPO,
        env=node_env(1, free_port(), RDZV_TIMEOUT="2"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - start_time < 30
    assert proc.returncode == 1, proc.stderr
    assert re.search(
        r"error: nothing answers at the rendezvous endpoint 127\.0\.0\.1:\d+ after 2s .RDZV_TIMEOUT.", proc.stderr
    ), proc.stderr
    assert "Traceback" not in proc.stderr and "TCPStore" not in proc.stderr


def _pids_named(name: str, folder: Path) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if comm == name and str(folder) in cmdline:
            pids.append(int(pid))
    return pids


def _wait_for_pid(name: str, folder: Path, proc: subprocess.Popen, other_than=(), timeout=120) -> int:
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in _pids_named(name, folder) if p not in other_than]
        if pids:
            return pids[0]
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no process {name}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_killed_worker_is_restarted_then_reported_in_one_line(tmp_path):
    env = env_of(NGPU="2", MAX_RESTARTS="1")
    proc = start(["./run_train.sh", *TINY, "--training.steps", "1000", "--job.dump_folder", str(tmp_path)], env)
    try:
        first = _wait_for_pid("titan-rank1", tmp_path, proc)
        os.kill(first, signal.SIGKILL)
        # MAX_RESTARTS=1: the launcher starts both workers again; killing the new rank 1 ends the job.
        second = _wait_for_pid("titan-rank1", tmp_path, proc, other_than=(first,))
        os.kill(second, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err[-5000:]
    launcher_lines = [line for line in err.splitlines() if not line.startswith("[rank")]
    match = re.fullmatch(r"error: training failed: rank 1 was killed by SIGKILL; its output: (\S+)", launcher_lines[-1])
    assert match, err[-3000:]
    assert match.group(1).endswith(os.path.join("attempt_1", "1", "stderr.log")) and Path(match.group(1)).is_file()
    assert "Traceback" not in "\n".join(launcher_lines)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, to_group, checkpointing",
    [
        ("SIGTERM", False, False),  # a scheduler's signal, to the launcher only (sbatch --signal, scancel)
        ("SIGINT", True, True),  # Ctrl-C: the terminal signals the launcher and its workers (one process group)
    ],
)
def test_a_stop_signal_stops_the_workers_after_a_step_with_the_documented_exit_status(
    tmp_path, sig, to_group, checkpointing
):
    # The launcher passes the signal on and keeps watching: the workers finish the step, save (or say
    # that checkpointing is off) and return, and the launcher exits as job.stop_signals' help says: 0,
    # or 130 for Ctrl-C, at once instead of after its shutdown timeout (stop_grace_seconds + 15 s).
    from torchtitan.components.checkpoint import complete_checkpoints, verify_checkpoint
    from torchtitan.config import JobConfig

    assert sig in JobConfig().job.stop_signals
    ckpt = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "1000"] if checkpointing else []
    proc = subprocess.Popen(
        ["./run_train.sh", *TINY, "--training.steps", "1000", "--job.dump_folder", str(tmp_path), *ckpt],
        cwd=REPO,
        env=env_of(NGPU="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").exists():  # rank 0 logged step 1: the handlers are in place
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        if to_group:
            os.killpg(proc.pid, getattr(signal, sig))
        else:
            os.kill(proc.pid, getattr(signal, sig))
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - signalled
    finally:
        proc.kill()
    help_text = subprocess.run(
        ["./run_train.sh", "--help"], cwd=REPO, env=env_of(), capture_output=True, text=True
    ).stdout
    expected = 128 + signal.SIGINT if sig == "SIGINT" else 0
    assert "exits 0 (SIGINT: 130" in " ".join(help_text.split())
    assert proc.returncode == expected, err[-3000:]
    stopped = re.search(rf"stopped by {sig} after step (\d+) of 1000; (.*)", err)
    assert stopped, err[-3000:]
    step = int(stopped.group(1))
    if checkpointing:
        path = tmp_path / "checkpoint" / f"step-{step}"
        assert stopped.group(2).startswith(f"saved checkpoint {path} ")
        assert complete_checkpoints(str(tmp_path / "checkpoint")) == [step]  # the stop's save: no other was due
        assert verify_checkpoint(str(path)) is None
    else:
        assert stopped.group(2) == "nothing was saved: checkpointing is off (checkpoint.enable_checkpoint)"
        assert not (tmp_path / "checkpoint").exists()
    assert err.rstrip().endswith(
        f"stopped: the launcher received {sig}, passed it to the workers, and they stopped "
        f"after a step (exit status {expected})"
    )
    assert elapsed < 15, elapsed
    assert "Unable to shutdown" not in err and "Traceback" not in err
