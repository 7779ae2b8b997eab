"""Replica groups on torchft ([fault_tolerance], torchtitan/components/fault_tolerance.py): bad input refused
before launch; two real groups (one process each) with a real lighthouse train as one data-parallel run; a group
SIGKILLed mid-run leaves the other training to the end."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PYTHON_DIR, REPO, TINY, free_port, read_metrics, start_lighthouse, train_in_process

FT = ["--fault_tolerance.enabled", "--fault_tolerance.group_count", "2"]


def env_of(**variables) -> dict:
    env = dict(os.environ, PATH=PYTHON_DIR + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1")
    for name in ("NGPU", "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "MAX_RESTARTS", "LOG_RANK", "LOG_DIR", "CONFIG_FILE",
                 "LIGHTHOUSE_PORT"):
        env.pop(name, None)
    env.update(variables)
    return env


def refused(*args: str) -> str:
    """run_train.sh's error line for a job refused before launch (exit 2, one line, no traceback)."""
    proc = subprocess.run(["./run_train.sh", *TINY, *args], cwd=REPO, env=env_of(NGPU="1"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def test_bad_input_is_refused_before_launch(tmp_path):
    from torchtitan.config import UserError, load_config

    lighthouse = f"http://127.0.0.1:{free_port()}"  # nothing answers there
    line = refused(*FT, "--fault_tolerance.lighthouse", lighthouse, "--fault_tolerance.timeout_seconds", "3",
                   "--job.dump_folder", str(tmp_path / "a"))
    assert f"fault_tolerance.lighthouse = {lighthouse} does not answer within" in line, line
    line = refused(*FT, "--fault_tolerance.group_id", "2", "--fault_tolerance.lighthouse", lighthouse,
                   "--job.dump_folder", str(tmp_path / "b"))
    assert "fault_tolerance.group_id = 2 is outside 0..group_count-1" in line, line

    def error_of(*args: str) -> str:
        with pytest.raises(UserError) as e:
            load_config([*TINY, *FT, "--fault_tolerance.lighthouse", lighthouse, *args])
        return str(e.value)

    assert "min_groups = 3 is above fault_tolerance.group_count = 2" in error_of("--fault_tolerance.min_groups", "3")
    assert "must be the lighthouse's http://HOST:PORT" in error_of("--fault_tolerance.lighthouse", "localhost")
    # Switched off, the section asks for nothing.
    assert not load_config(TINY).fault_tolerance.enabled


def test_without_torchft_the_recipe_is_refused_with_the_install_command(monkeypatch):
    import importlib.util

    from torchtitan.components import fault_tolerance
    from torchtitan.config import UserError, load_config

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else find_spec(name, *a))
    cfg = load_config([*TINY, *FT, "--fault_tolerance.lighthouse", "http://127.0.0.1:1"])
    with pytest.raises(UserError, match=r"needs the torchft package: pip install torchft==0\.2\.0"):
        fault_tolerance.check(cfg.fault_tolerance)


def test_data_lanes_make_each_group_a_data_parallel_replica():
    from torchtitan.components.fault_tolerance import data_lanes
    from torchtitan.config import load_config

    ft = load_config([*TINY, *FT, "--fault_tolerance.group_id", "1", "--fault_tolerance.lighthouse",
                      "http://h:1"]).fault_tolerance
    assert data_lanes(ft, 1, 2, 8) == (3, 4, 16)  # rank 1 of dp 2 in group 1 of 2: lane 3 of 4
    assert data_lanes(load_config(TINY).fault_tolerance, 1, 2, 8) == (1, 2, 8)


@pytest.mark.slow
def test_fewer_live_groups_than_min_groups_stop_the_run_within_the_quorum_timeout(tmp_path):
    lighthouse, address = start_lighthouse()
    try:
        proc = subprocess.run(["./run_train.sh", *TINY, *FT, "--fault_tolerance.min_groups", "2",
                               "--fault_tolerance.quorum_timeout_seconds", "3", "--fault_tolerance.lighthouse",
                               address, "--job.dump_folder", str(tmp_path)],
                              cwd=REPO, env=env_of(NGPU="1"), capture_output=True, text=True, timeout=300)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("only 1 replica group(s) alive for fault_tolerance.quorum_timeout_seconds = 3, fewer than "
            "fault_tolerance.min_groups = 2") in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()


# --- two real groups --------------------------------------------------------------------------------

STEPS = 8
KILL_AFTER = 3  # group 1 is SIGKILLed once its step 3 is logged


def _pids_of(folder: Path) -> list[int]:
    """Every live process of a group (its launcher and its workers, which are forked from it): their command line
    names the group's dump folder."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"{folder} " in cmdline + " " and state != "Z" and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


def _kill_group(folder: Path) -> None:
    """SIGKILL every process of a group (a real node loss: no signal handler runs)."""
    for pid in _pids_of(folder):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stop(procs: list, folders: list[Path], lighthouse: subprocess.Popen) -> None:
    """Leave nothing of a test running: the launch commands, every process of each group, the lighthouse."""
    for proc in procs:
        proc.kill()
        proc.wait()
    for folder in folders:
        _kill_group(folder)
    lighthouse.kill()
    lighthouse.wait()


def _logged_steps(folder: Path) -> int:
    try:
        return len(read_metrics(folder))
    except (OSError, ValueError):
        return 0


@pytest.fixture(scope="module")
def two_groups(tmp_path_factory):
    """Two groups of one process each with a real lighthouse; group 1 is SIGKILLed (launcher and worker) after
    step KILL_AFTER. Returns (folders, group 0's exit code and output)."""
    tmp = tmp_path_factory.mktemp("ft")
    lighthouse, address = start_lighthouse("--heartbeat_timeout_ms", "2000")
    folders = [tmp / "group0", tmp / "group1"]
    procs = []
    try:
        for g, folder in enumerate(folders):
            cmd = ["./run_train.sh", *TINY, *FT, "--training.steps", str(STEPS), "--training.global_batch_size", "4",
                   "--fault_tolerance.group_id", str(g), "--fault_tolerance.lighthouse", address,
                   "--job.dump_folder", str(folder)]
            with open(tmp / f"group{g}.log", "w") as log:  # a file: a full pipe would stop the group
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=env_of(NGPU="1"), stdout=log,
                                              stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 400
        while _logged_steps(folders[1]) < KILL_AFTER:
            assert procs[1].poll() is None and procs[0].poll() is None, "a group ended before the kill"
            assert time.monotonic() < deadline, "group 1 did not reach the kill step"
            time.sleep(0.1)
        _kill_group(folders[1])
        procs[0].wait(timeout=400)
        yield folders, procs[0].returncode, (tmp / "group0.log").read_text()
    finally:
        _stop(procs, folders, lighthouse)


@pytest.mark.slow
def test_two_groups_train_as_one_data_parallel_run(two_groups, tmp_path):
    """Each group reads its own lanes of a data-parallel degree 2; averaged over the groups, their gradients and
    losses are one run's with the groups' global batch together (here: one process, 2 accumulation steps)."""
    folders, _, _ = two_groups
    single = train_in_process(tmp_path / "single", "--training.steps", str(KILL_AFTER),
                              "--training.global_batch_size", "8")
    expected = [r["loss"] for r in single]
    for folder in folders:
        got = [r["loss"] for r in read_metrics(folder)[:KILL_AFTER]]
        assert got == pytest.approx(expected, abs=1e-5), (folder.name, got, expected)
        assert all(r["replica_groups"] == 2 for r in read_metrics(folder)[:KILL_AFTER])


@pytest.mark.slow
def test_a_killed_group_leaves_the_other_training_to_the_end(two_groups):
    folders, returncode, out = two_groups
    assert returncode == 0, out[-5000:]
    records = read_metrics(folders[0])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["replica_groups"] == 1 and records[0]["replica_groups"] == 2, records
    assert "1 replica group(s) in this step's quorum (was 2)" in out, out[-5000:]
    assert "training done" in out and "Traceback" not in out, out[-5000:]


def _weights(checkpoint: Path, tmp: Path) -> dict:
    """The model's tensors in a DCP checkpoint folder, by name."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(out))
    state = torch.load(out, weights_only=False)
    return state["model"] if "model" in state else {k: v for k, v in state.items() if k.startswith("model")}


@pytest.mark.slow
def test_a_restarted_group_heals_from_the_live_one_and_holds_its_weights(tmp_path):
    """Group 1 is SIGKILLed after step 3 and restarted with the same command: it heals from group 0 over the
    network (weights, optimizer state, LR schedule, step, data position) and joins; the checkpoints both groups then
    write at the same step hold bit-identical weights."""
    import hashlib

    lighthouse, address = start_lighthouse("--heartbeat_timeout_ms", "2000")
    folders = [tmp_path / "group0", tmp_path / "group1"]
    cmd = [*TINY, *FT, "--training.steps", "400", "--training.global_batch_size", "4",
           "--checkpoint.enable_checkpoint", "--checkpoint.interval", "10", "--checkpoint.keep_latest_k", "0",
           "--fault_tolerance.lighthouse", address]

    def start(g: int) -> subprocess.Popen:
        with open(tmp_path / f"group{g}.log", "w") as log:  # a file: a full pipe would stop the group
            return subprocess.Popen(["./run_train.sh", *cmd, "--fault_tolerance.group_id", str(g),
                                     "--job.dump_folder", str(folders[g])], cwd=REPO, env=env_of(NGPU="1"),
                                    stdout=log, stderr=subprocess.STDOUT)

    def saved(g: int) -> set[int]:
        root = folders[g] / "checkpoint"
        return {int(p.name[5:]) for p in root.glob("step-*") if (p / "train_state.json").exists()} \
            if root.is_dir() else set()

    procs = []
    try:
        procs = [start(0), start(1)]
        deadline = time.monotonic() + 300
        while _logged_steps(folders[1]) < KILL_AFTER:
            assert procs[0].poll() is None and procs[1].poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        _kill_group(folders[1])
        procs[1].wait()
        assert not saved(1)
        procs[1] = start(1)  # the same command
        while True:  # a step both groups saved after group 1 healed
            common = saved(0) & saved(1)
            if common:
                break
            assert procs[0].poll() is None and procs[1].poll() is None, "a group ended"
            assert time.monotonic() < deadline, "no common checkpoint"
            time.sleep(0.2)
    finally:
        _stop(procs, folders, lighthouse)
    out = (tmp_path / "group1.log").read_text()
    assert "healed from a live replica group at step" in out, out[-5000:]
    step = max(common)
    weights = [_weights(folder / "checkpoint" / f"step-{step}", tmp_path) for folder in folders]
    assert weights[0].keys() == weights[1].keys() and len(weights[0]) > 10

    def checksum(state: dict) -> str:
        return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()

    assert checksum(weights[0]) == checksum(weights[1])
