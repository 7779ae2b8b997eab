"""Replica groups on torchft ([fault_tolerance], torchtitan/components/fault_tolerance.py): bad input refused
before launch; two real groups (one process each) with a real lighthouse train as one data-parallel run; a group
SIGKILLed mid-run leaves the other training to the end."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.launch import free_port, read_metrics, start_lighthouse, train_in_process
from helpers.paths import PYTHON_DIR, REPO, TINY

FT = ["--fault_tolerance.enabled", "--fault_tolerance.group_count", "2"]


def env_of(**variables) -> dict:
    env = dict(os.environ, PATH=PYTHON_DIR + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1")
    for name in (
        "NGPU",
        "NNODES",
        "NODE_RANK",
        "RDZV_ENDPOINT",
        "MAX_RESTARTS",
        "LOG_RANK",
        "LOG_DIR",
        "CONFIG_FILE",
        "LIGHTHOUSE_PORT",
    ):
        env.pop(name, None)
    env.update(variables)
    return env


def refused(*args: str) -> str:
    """run_train.sh's error line for a job refused before launch (exit 2, one line, no traceback)."""
    proc = subprocess.run(
        ["./run_train.sh", *TINY, *args], cwd=REPO, env=env_of(NGPU="1"), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bad_input_is_refused_before_launch(tmp_path):
    from torchtitan.config import UserError, load_config

    lighthouse = f"http://127.0.0.1:{free_port()}"  # nothing answers there
    line = refused(
        *FT,
        "--fault_tolerance.lighthouse",
        lighthouse,
        "--fault_tolerance.timeout_seconds",
        "3",
        "--job.dump_folder",
        str(tmp_path / "a"),
    )
    assert f"fault_tolerance.lighthouse = {lighthouse} does not answer within" in line, line
    line = refused(
        *FT,
        "--fault_tolerance.group_id",
        "2",
        "--fault_tolerance.lighthouse",
        lighthouse,
        "--job.dump_folder",
        str(tmp_path / "b"),
    )
    assert "fault_tolerance.group_id = 2 is outside 0..group_count-1" in line, line

    def error_of(*args: str) -> str:
        with pytest.raises(UserError) as e:
            load_config([*TINY, *FT, "--fault_tolerance.lighthouse", lighthouse, *args])
        return str(e.value)

    assert "min_groups = 3 is above fault_tolerance.group_count = 2" in error_of("--fault_tolerance.min_groups", "3")
    assert "must be the lighthouse's http://HOST:PORT" in error_of("--fault_tolerance.lighthouse", "localhost")
    # Switched off, the section asks for nothing.
    assert not load_config(TINY).fault_tolerance.enabled


@pytest.mark.slow
@pytest.mark.multiprocess
def test_diloco_keys_are_checked_before_launch(tmp_path):
    """fault_tolerance.sync and DiLoCo's keys: bad values end the job before launch (exit 2, one line); DiLoCo's
    keys set under sync = 'every_step' or without fault_tolerance.enabled, where nothing reads them, are refused
    rather than ignored."""
    from torchtitan.config import UserError, load_config

    line = refused(
        *FT,
        "--fault_tolerance.sync",
        "diloco",
        "--fault_tolerance.sync_every",
        "0",
        "--fault_tolerance.lighthouse",
        "http://127.0.0.1:1",
        "--job.dump_folder",
        str(tmp_path),
    )
    assert "fault_tolerance.sync_every must be a positive integer, got 0" in line, line

    def error_of(*args: str) -> str:
        with pytest.raises(UserError) as e:
            load_config([*TINY, *FT, "--fault_tolerance.lighthouse", "http://h:1", *args])
        return str(e.value)

    diloco = ["--fault_tolerance.sync", "diloco"]
    assert "expected one of 'every_step', 'diloco'" in error_of("--fault_tolerance.sync", "local_sgd")
    for key, value in (("sync_every", "10"), ("outer_lr", "1.0"), ("outer_momentum", "0.0")):
        assert f"fault_tolerance.{key} = {value} is only read under fault_tolerance.sync = 'diloco'" in error_of(
            f"--fault_tolerance.{key}", value
        ), key
    assert "outer_nesterov = False is only read under" in error_of("--fault_tolerance.no-outer_nesterov")
    assert "outer_lr must be a positive number, got 0.0" in error_of(*diloco, "--fault_tolerance.outer_lr", "0")
    assert "outer_momentum must be in [0, 1), got 1.0" in error_of(*diloco, "--fault_tolerance.outer_momentum", "1")
    assert "outer_nesterov needs fault_tolerance.outer_momentum > 0" in error_of(
        *diloco, "--fault_tolerance.outer_momentum", "0"
    )
    with pytest.raises(UserError, match=r"fault_tolerance.sync = 'diloco' is only read with fault_tolerance.enabled"):
        load_config([*TINY, *diloco])
    ft = load_config([*TINY, *FT, "--fault_tolerance.lighthouse", "http://h:1", *DILOCO_H1]).fault_tolerance
    assert (ft.sync, ft.sync_every, ft.outer_lr, ft.outer_momentum, ft.outer_nesterov) == ("diloco", 1, 1, 0, False)


def test_replica_group_keys_without_fault_tolerance_are_refused():
    """group_count, group_id, the lighthouse and every other key of the section say which job this is: set while
    fault_tolerance.enabled is off, the run would train as a plain run (exit 0) instead of the group asked for."""
    from torchtitan.config import UserError, load_config

    for key, value in (
        ("group_count", "2"),
        ("group_id", "1"),
        ("lighthouse", "http://h:1"),
        ("min_groups", "2"),
        ("timeout_seconds", "5"),
        ("quorum_timeout_seconds", "5"),
    ):
        with pytest.raises(UserError, match=rf"fault_tolerance\.{key} = .* is only read with fault_tolerance\.enabled"):
            load_config([*TINY, f"--fault_tolerance.{key}", value])


@pytest.mark.parametrize(
    "address, why",
    [
        ("http://127.0.0.1:29x10", "Port could not be cast to integer"),
        ("http://127.0.0.1:70000", "Port out of range"),
        ("http://:29510", "must be the lighthouse's http://HOST:PORT"),
        ("http://127.0.0.1:29510/status", "nothing after the port"),
        ("127.0.0.1:29510", "must be the lighthouse's http://HOST:PORT"),
    ],
)
def test_a_malformed_lighthouse_address_is_one_line_before_launch(address, why):
    """A typo in the lighthouse's port: a config error naming the key (before: a 57-line traceback once the job
    had started)."""
    from torchtitan.config import UserError, load_config

    with pytest.raises(UserError) as e:
        load_config([*TINY, *FT, "--fault_tolerance.lighthouse", address])
    assert "fault_tolerance.lighthouse" in str(e.value) and why in str(e.value), str(e.value)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_lighthouse_port_without_fault_tolerance_starts_nothing(tmp_path):
    """LIGHTHOUSE_PORT for a job that is not a replica group (or that names another lighthouse) is refused before
    anything starts: no lighthouse is left running, and the job does not train as a plain run."""
    port = free_port()
    for extra, message in (
        (
            [],
            f"LIGHTHOUSE_PORT={port} starts a torchft lighthouse for replica groups, but "
            "fault_tolerance.enabled is false",
        ),
        (
            [*FT, "--fault_tolerance.lighthouse", "http://127.0.0.1:1"],
            f"LIGHTHOUSE_PORT={port} starts a lighthouse at http://127.0.0.1:{port}, but "
            "fault_tolerance.lighthouse = http://127.0.0.1:1",
        ),
    ):
        proc = subprocess.run(
            ["./run_train.sh", *TINY, *extra, "--job.dump_folder", str(tmp_path)],
            cwd=REPO,
            env=env_of(NGPU="1", LIGHTHOUSE_PORT=str(port)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
        assert not _lighthouses_on(port)
        assert not (tmp_path / "metrics.jsonl").exists()


def _lighthouses_on(port: int) -> list[int]:
    """The pids of torchft lighthouses bound to 127.0.0.1:`port`."""
    return [
        pid
        for pid in _pids_of_command(f"--bind 127.0.0.1:{port}")
        if "torchft_lighthouse" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    ]


def _pids_of_command(text: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_without_torchft_the_recipe_is_refused_with_the_install_command(monkeypatch):
    import importlib.util

    from torchtitan.components import fault_tolerance
    from torchtitan.config import UserError, load_config

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else find_spec(name, *a)
    )
    cfg = load_config([*TINY, *FT, "--fault_tolerance.lighthouse", "http://127.0.0.1:1"])
    with pytest.raises(UserError, match=r"needs the torchft package: pip install torchft==0\.2\.0"):
        fault_tolerance.check(cfg.fault_tolerance)


def test_data_lanes_make_each_group_a_data_parallel_replica():
    from torchtitan.components.fault_tolerance import data_lanes
    from torchtitan.config import load_config

    ft = load_config(
        [*TINY, *FT, "--fault_tolerance.group_id", "1", "--fault_tolerance.lighthouse", "http://h:1"]
    ).fault_tolerance
    assert data_lanes(ft, 1, 2, 8) == (3, 4, 16)  # rank 1 of dp 2 in group 1 of 2: lane 3 of 4
    assert data_lanes(load_config(TINY).fault_tolerance, 1, 2, 8) == (1, 2, 8)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fewer_live_groups_than_min_groups_stop_the_run_within_the_quorum_timeout(tmp_path):
    lighthouse, address = start_lighthouse()
    try:
        proc = subprocess.run(
            [
                "./run_train.sh",
                *TINY,
                *FT,
                "--fault_tolerance.min_groups",
                "2",
                "--fault_tolerance.quorum_timeout_seconds",
                "3",
                "--fault_tolerance.lighthouse",
                address,
                "--job.dump_folder",
                str(tmp_path),
            ],
            cwd=REPO,
            env=env_of(NGPU="1"),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "only 1 replica group(s) alive for fault_tolerance.quorum_timeout_seconds = 3, fewer than "
        "fault_tolerance.min_groups = 2"
    ) in proc.stderr, proc.stderr[-3000:]
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
            cmd = [
                "./run_train.sh",
                *TINY,
                *FT,
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
            with open(tmp / f"group{g}.log", "w") as log:  # a file: a full pipe would stop the group
                procs.append(
                    subprocess.Popen(cmd, cwd=REPO, env=env_of(NGPU="1"), stdout=log, stderr=subprocess.STDOUT)
                )
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


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_groups_train_as_one_data_parallel_run(two_groups, tmp_path):
    """Each group reads its own lanes of a data-parallel degree 2; averaged over the groups, their gradients and
    losses are one run's with the groups' global batch together (here: one process, 2 accumulation steps)."""
    folders, _, _ = two_groups
    single = train_in_process(
        tmp_path / "single", "--training.steps", str(KILL_AFTER), "--training.global_batch_size", "8"
    )
    expected = [r["loss"] for r in single]
    for folder in folders:
        got = [r["loss"] for r in read_metrics(folder)[:KILL_AFTER]]
        assert got == pytest.approx(expected, abs=1e-5), (folder.name, got, expected)
        assert all(r["replica_groups"] == 2 for r in read_metrics(folder)[:KILL_AFTER])


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_restarted_group_heals_from_the_live_one_and_holds_its_weights(tmp_path):
    """Group 1 is SIGKILLed after step 3 and restarted with the same command: it heals from group 0 over the
    network (weights, optimizer state, LR schedule, step, data position) and joins; the checkpoints both groups then
    write at the same step hold bit-identical weights."""
    import hashlib

    lighthouse, address = start_lighthouse("--heartbeat_timeout_ms", "2000")
    folders = [tmp_path / "group0", tmp_path / "group1"]
    cmd = [
        *TINY,
        *FT,
        "--training.steps",
        "400",
        "--training.global_batch_size",
        "4",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "10",
        "--checkpoint.keep_latest_k",
        "0",
        "--fault_tolerance.lighthouse",
        address,
    ]

    def start(g: int) -> subprocess.Popen:
        with open(tmp_path / f"group{g}.log", "w") as log:  # a file: a full pipe would stop the group
            return subprocess.Popen(
                ["./run_train.sh", *cmd, "--fault_tolerance.group_id", str(g), "--job.dump_folder", str(folders[g])],
                cwd=REPO,
                env=env_of(NGPU="1"),
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def saved(g: int) -> set[int]:
        root = folders[g] / "checkpoint"
        return (
            {int(p.name[5:]) for p in root.glob("step-*") if (p / "train_state.json").exists()}
            if root.is_dir()
            else set()
        )

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


# --- DiLoCo (fault_tolerance.sync = "diloco") ----------------------------------------------------------

# An inner AdamW made linear in the gradient (eps far above sqrt(v): momentum SGD with lr / eps) and no clipping:
# then H = 1 DiLoCo with outer SGD lr 1 and no momentum averages the groups' updates, which is the update of the
# averaged gradient: synchronous training. (With an ordinary AdamW it averages Adam updates, not gradients.)
LINEAR = ["--optimizer.eps", "1000", "--optimizer.lr", "2", "--training.max_norm", "1e9"]
DILOCO_H1 = [
    "--fault_tolerance.sync",
    "diloco",
    "--fault_tolerance.sync_every",
    "1",
    "--fault_tolerance.outer_lr",
    "1",
    "--fault_tolerance.outer_momentum",
    "0",
    "--fault_tolerance.no-outer_nesterov",
]


def _start_group(g: int, folder: Path, address: str, *args: str, log: Path | None = None) -> subprocess.Popen:
    """Replica group g (one process, run_train.sh) on the lighthouse at `address`, its output in a file (a full
    pipe would stop it)."""
    with open(log or folder.parent / f"{folder.name}.log", "w") as out:
        return subprocess.Popen(
            [
                "./run_train.sh",
                *TINY,
                *FT,
                "--training.global_batch_size",
                "4",
                "--fault_tolerance.group_id",
                str(g),
                "--fault_tolerance.lighthouse",
                address,
                "--job.dump_folder",
                str(folder),
                *args,
            ],
            cwd=REPO,
            env=env_of(NGPU="1"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.multiprocess
@pytest.mark.slow
def test_diloco_with_h1_outer_sgd_lr1_and_no_momentum_is_synchronous_training(tmp_path):
    """Two DiLoCo groups (sync_every 1, outer SGD lr 1, no momentum) against one synchronous run of both groups'
    batch (which the two-group test shows is the every_step groups' run): per step, the mean of the groups'
    losses is the synchronous loss, and both groups end with its weights, within 1e-5."""
    save = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", str(STEPS), "--checkpoint.keep_latest_k", "0"]
    lighthouse, address = start_lighthouse("--heartbeat_timeout_ms", "2000")
    folders = [tmp_path / "group0", tmp_path / "group1"]
    procs = []
    try:
        procs = [
            _start_group(g, folders[g], address, "--training.steps", str(STEPS), *LINEAR, *DILOCO_H1, *save)
            for g in range(2)
        ]
        single = train_in_process(tmp_path / "single", "--training.steps", str(STEPS), *LINEAR, *save)
        for g, proc in enumerate(procs):
            assert proc.wait(timeout=300) == 0, (tmp_path / f"group{g}.log").read_text()[-5000:]
    finally:
        _stop(procs, folders, lighthouse)
    records = [read_metrics(folder) for folder in folders]
    assert [r["step"] for r in records[0]] == list(range(1, STEPS + 1))
    mean = [(a["loss"] + b["loss"]) / 2 for a, b in zip(*records)]
    expected = [r["loss"] for r in single]
    print(f"largest loss difference from synchronous training {max(abs(a - b) for a, b in zip(mean, expected)):.2e}")
    assert max(abs(a - b) for a, b in zip(mean, expected)) < 1e-5, (mean, expected)
    assert records[0][0]["loss"] != records[1][0]["loss"]  # each group trains on its own lanes
    reference = _weights(tmp_path / "single" / "checkpoint" / f"step-{STEPS}", tmp_path)
    for folder in folders:
        weights = _weights(folder / "checkpoint" / f"step-{STEPS}", tmp_path)
        assert weights.keys() == reference.keys() and len(weights) > 10
        diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
        print(f"{folder.name}: largest weight difference from synchronous training {diff:.2e}")
        assert diff < 1e-5, (folder.name, diff)


# --- many kill points; the data each group trained ------------------------------------------------

# A group's trainer for the tests below (test-only): it records, per step, the samples its lanes read (lane index
# and the lane's sample number before the read: sample s of lane l is global sample s x lanes + l), whether the
# step's update was taken, and the learning rate; and with FT_TEST_KILL = "N:POINT" it SIGKILLs its own process
# (no handler runs) at POINT of its N-th step: "start" (before the step's quorum), "average" (before its
# gradients go to the other groups, which wait for them in their all-reduce), "commit" (after the all-reduce,
# before the commit vote), "update" (after the vote, before the optimizer step).
RECORDING_TRAINER = """
import json, os, signal, sys

from torchtitan.train import Trainer, main

RECORD = os.environ["FT_TEST_RECORD"]
KILL_STEP, _, KILL_POINT = (os.environ.get("FT_TEST_KILL") or "0:").partition(":")


def die(point, calls):
    if calls == int(KILL_STEP) and point == KILL_POINT:
        os.kill(os.getpid(), signal.SIGKILL)


class Recording(Trainer):
    calls = 0

    def train_step(self, step, data_iter):
        self.calls += 1
        die("start", self.calls)
        if self.calls == 1:
            average, should_commit = self.ctx.replicas.average, self.ctx.replicas.should_commit

            def averaged(*args):
                die("average", self.calls)
                average(*args)
                die("commit", self.calls)

            def vote(step):
                committed = should_commit(step)
                die("update", self.calls)
                return committed

            self.ctx.replicas.average, self.ctx.replicas.should_commit = averaged, vote
        lanes = self.ctx.dataloader.dataset.lanes
        before = {lane.index: lane.next_sample for lane in lanes}
        taken, lr = self.ctx.optim.steps_taken, self.ctx.optim.lr
        result = super().train_step(step, data_iter)
        samples = [[i, s] for lane in lanes for i in [lane.index] for s in range(before[i], lane.next_sample)]
        with open(RECORD, "a") as f:
            f.write(json.dumps({"step": step, "samples": samples, "taken": self.ctx.optim.steps_taken > taken,
                                "lr": lr, "pid": os.getpid()}) + "\\n")
        return result


sys.exit(main(sys.argv[1:], Recording))
"""

KILL_POINTS = ["start", "average", "commit", "update"]


def _records(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _expected_lrs(steps: int, *args: str) -> list[float]:
    """The learning rate of steps 1..steps of this job's schedule (optimizer.lr and lr_scheduler of TINY + args)."""
    import torch

    from torchtitan.components.lr_scheduler import build_lr_scheduler
    from torchtitan.config import load_config

    cfg = load_config([*TINY, *args])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimizer.lr)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, steps)
    lrs = []
    for _ in range(steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs


@pytest.fixture(scope="module")
def kill_points(tmp_path_factory):
    """Group 0 trains KILL_STEPS steps with min_groups = 2 (so that it waits for group 1 instead of running ahead);
    group 1 is started, killed at one point of its second step, and restarted with the same command (it heals
    from group 0), once per KILL_POINTS, plus one kill from outside at a delay into a step; its last restart runs
    to the end. Returns (tmp folder, group 0's exit code and output, the kills done)."""
    tmp = tmp_path_factory.mktemp("kill_points")
    script = tmp / "recording_trainer.py"
    script.write_text(RECORDING_TRAINER)
    lighthouse, address = start_lighthouse("--heartbeat_timeout_ms", "1000")
    folders = [tmp / "group0", tmp / "group1"]
    args = [
        *TINY,
        *FT,
        "--training.steps",
        str(KILL_STEPS),
        "--training.global_batch_size",
        "4",
        "--fault_tolerance.min_groups",
        "2",
        "--fault_tolerance.lighthouse",
        address,
        "--fault_tolerance.timeout_seconds",
        "10",
    ]

    def start(g: int, kill: str = "") -> subprocess.Popen:
        env = env_of(FT_TEST_RECORD=str(tmp / f"group{g}.jsonl"), FT_TEST_KILL=kill)
        with open(tmp / f"group{g}.log", "a") as out:
            return subprocess.Popen(
                [
                    sys.executable,
                    str(script),
                    *args,
                    "--fault_tolerance.group_id",
                    str(g),
                    "--job.dump_folder",
                    str(folders[g]),
                ],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    procs, kills = [], []
    try:
        procs = [start(0), start(1, f"2:{KILL_POINTS[0]}")]
        for point in [*KILL_POINTS[1:], "outside", None]:
            assert procs[1].wait(timeout=300) == -signal.SIGKILL, (tmp / "group1.log").read_text()[-5000:]
            kills.append(len(_records(tmp / "group1.jsonl")))
            if point == "outside":  # SIGKILLed from here 0.05 s after its second step is recorded
                procs[1] = start(1)
                seen = len(_records(tmp / "group1.jsonl"))
                deadline = time.monotonic() + 300
                while len(_records(tmp / "group1.jsonl")) < seen + 2:
                    assert procs[1].poll() is None and time.monotonic() < deadline, "group 1 ended before the kill"
                    time.sleep(0.01)
                time.sleep(0.05)
                procs[1].kill()
            else:
                procs[1] = start(1, f"2:{point}" if point else "")
        assert procs[1].wait(timeout=300) == 0, (tmp / "group1.log").read_text()[-5000:]
        procs[0].wait(timeout=300)
        yield tmp, procs[0].returncode, (tmp / "group0.log").read_text(), kills
    finally:
        _stop(procs, folders, lighthouse)


KILL_STEPS = 24


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_group_killed_at_many_points_of_a_step_leaves_the_other_training_to_the_end(kill_points):
    """At every kill point the survivor neither crashes nor stops: it ends at the last step with steps 1..N logged
    once each, each at its own step's learning rate (a step not committed is dropped, its rate spent: no step
    skipped or counted twice in the schedule), its updates taken = steps - uncommitted_steps."""
    tmp, returncode, out, kills = kill_points
    assert returncode == 0, out[-5000:]
    assert "training done" in out and "Traceback" not in out, out[-5000:]
    assert len(kills) == len(KILL_POINTS) + 1
    records = read_metrics(tmp / "group0")
    assert [r["step"] for r in records] == list(range(1, KILL_STEPS + 1))
    steps = _records(tmp / "group0.jsonl")
    assert [r["step"] for r in steps] == list(range(1, KILL_STEPS + 1))
    expected = _expected_lrs(KILL_STEPS, "--training.steps", str(KILL_STEPS))
    assert [r["lr"] for r in steps] == pytest.approx(expected, rel=1e-6)
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-6)
    dropped = records[-1]["uncommitted_steps"]
    print(f"{len(kills)} kills; the survivor dropped {dropped} step(s): {[r['step'] for r in steps if not r['taken']]}")
    assert sum(r["taken"] for r in steps) == KILL_STEPS - dropped
    # The kills inside the step's all-reduce drop the survivor's step; the others need not.
    assert 1 <= dropped <= len(kills), dropped
    assert out.count("not committed (a replica group failed during it") == dropped, out[-5000:]
    assert records[-1]["replica_groups"] == 2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_no_sample_is_trained_twice_when_a_group_dies_and_comes_back(kill_points):
    """Every sample (lane, sample number) that a committed update of either group trained was read once: neither
    the survivor nor a restarted group (its lanes advanced to the step it healed at) reads it again; and each
    group reads only its own lanes (group g: lanes 4g..4g+3 of 8)."""
    tmp, _, _, _ = kill_points
    trained: dict[tuple[int, int], tuple] = {}
    for g in range(2):
        records = _records(tmp / f"group{g}.jsonl")
        assert records
        for r in records:
            assert {lane for lane, _ in r["samples"]} == set(range(4 * g, 4 * g + 4)), r
            if not r["taken"]:
                continue
            for lane, sample in r["samples"]:
                assert (lane, sample) not in trained, (
                    f"lane {lane} sample {sample} trained by group {g} at step "
                    f"{r['step']} and before at {trained[(lane, sample)]}"
                )
                trained[(lane, sample)] = (g, r["step"], r["pid"])
    # The restarted incarnations of group 1 each started at the step they healed at, its lanes advanced to it.
    for r in _records(tmp / "group1.jsonl"):
        assert all(sample == r["step"] - 1 for _, sample in r["samples"]), r


# --- DiLoCo: a lost group, checkpoints ------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_after_a_diloco_sync_moe_groups_hold_the_same_weights_and_expert_biases(tmp_path):
    """Qwen3-MoE, sync_every 2: between syncs each group moves its expert biases by its own loads; a sync makes them
    their mean, with the weights, so that at the last step (a sync) both groups hold the same model, biases included."""
    save = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]
    moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
    lighthouse, address = start_lighthouse("--heartbeat_timeout_ms", "2000")
    folders = [tmp_path / "group0", tmp_path / "group1"]
    procs = []
    try:
        procs = [
            _start_group(
                g,
                folders[g],
                address,
                "--training.steps",
                "4",
                *moe,
                "--fault_tolerance.sync",
                "diloco",
                "--fault_tolerance.sync_every",
                "2",
                *save,
            )
            for g in range(2)
        ]
        for g, proc in enumerate(procs):
            assert proc.wait(timeout=300) == 0, (tmp_path / f"group{g}.log").read_text()[-5000:]
    finally:
        _stop(procs, folders, lighthouse)
    import torch

    weights = [_weights(folder / "checkpoint" / "step-4", tmp_path) for folder in folders]
    biases = [k for k in weights[0] if k.endswith("expert_bias")]
    assert biases and any(weights[0][k].abs().sum() > 0 for k in biases)  # balancing moved them
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), [
        k for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])
    ][:5]


DILOCO = ["--fault_tolerance.sync", "diloco", "--fault_tolerance.sync_every", "3"]  # outer SGD 0.7, Nesterov 0.9


@pytest.mark.multiprocess
@pytest.mark.slow
def test_under_diloco_a_killed_group_leaves_the_other_training_to_the_end(tmp_path):
    """sync_every 3: group 1 is SIGKILLed between two syncs (after its step 4 is logged); group 0's next sync
    (step 6) goes on with the groups alive, and it trains to the last step, syncing alone."""
    lighthouse, address = start_lighthouse("--heartbeat_timeout_ms", "1000")
    folders = [tmp_path / "group0", tmp_path / "group1"]
    procs = []
    try:
        procs = [_start_group(g, folders[g], address, "--training.steps", "9", *DILOCO) for g in range(2)]
        deadline = time.monotonic() + 300
        while _logged_steps(folders[1]) < 4:
            assert procs[0].poll() is None and procs[1].poll() is None, "a group ended before the kill"
            assert time.monotonic() < deadline, "group 1 did not reach the kill step"
            time.sleep(0.05)
        _kill_group(folders[1])
        assert procs[0].wait(timeout=300) == 0, (tmp_path / "group0.log").read_text()[-5000:]
    finally:
        _stop(procs, folders, lighthouse)
    out = (tmp_path / "group0.log").read_text()
    records = read_metrics(folders[0])
    assert [r["step"] for r in records] == list(range(1, 10))
    assert records[2]["replica_groups"] == 2 and records[-1]["replica_groups"] == 1, records
    assert "1 replica group(s) in this step's quorum (was 2)" in out, out[-5000:]
    assert "training done" in out and "Traceback" not in out, out[-5000:]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_resumed_diloco_run_continues_exactly(tmp_path):
    """A DiLoCo group (sync_every 2, outer Nesterov momentum) saves at step 3, between two syncs: the checkpoint
    holds the local weights, diloco/step-3-rank-0.pt the reference weights and the outer momentum. Resumed from
    it, the run's losses are those of the run that went on; without that file, the resume says so and differs."""
    import shutil

    lighthouse, address = start_lighthouse()
    args = [
        *FT,
        "--fault_tolerance.group_count",
        "1",
        "--fault_tolerance.lighthouse",
        address,
        "--fault_tolerance.sync",
        "diloco",
        "--fault_tolerance.sync_every",
        "2",
        "--training.global_batch_size",
        "4",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "0",
    ]
    folder = tmp_path / "run"
    try:
        straight = [r["loss"] for r in train_in_process(folder, *args)]
        assert sorted(p.name for p in (folder / "checkpoint" / "diloco").iterdir()) == [
            "step-3-rank-0.pt",
            "step-6-rank-0.pt",
        ]

        def resume() -> list[float]:
            shutil.rmtree(folder / "checkpoint" / "step-6")
            (folder / "checkpoint" / "diloco" / "step-6-rank-0.pt").unlink()
            return [r["loss"] for r in train_in_process(folder, *args)]

        assert resume() == straight[3:]
        (folder / "checkpoint" / "diloco" / "step-3-rank-0.pt").unlink()
        without = resume()
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert without[0] == straight[3] and without[1:] != straight[4:]


# --- checkpoints between fault-tolerant and normal runs -------------------------------------------


def _lanes_at(checkpoint: Path) -> dict[int, int]:
    """{lane: samples it read} of a checkpoint's data state (train_state.json)."""
    import json

    state = json.loads((checkpoint / "train_state.json").read_text())["dataloader"]["dataset_state"]
    return {lane: sum(s["next_sample"] for s in position) for lane, position in state["lanes"]}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_checkpoints_cross_between_fault_tolerant_and_normal_runs(tmp_path):
    """A group's checkpoint (group 0 of 2: lanes 0-3 of 8) resumes as a normal run (lanes 0-3 of 4), and a normal
    run's checkpoint starts a group: weights, optimizer state, schedule and step carry over; the data state,
    of another layout, does not (asked for before launch: checkpoint.exclude_from_loading = ['dataloader']), and
    the new run's lanes start at the checkpoint's step (3): after its steps 4-5 each lane has read 5 samples."""
    import shutil

    lighthouse, address = start_lighthouse("--heartbeat_timeout_ms", "1000")
    group = [
        *FT,
        "--fault_tolerance.lighthouse",
        address,
        "--fault_tolerance.quorum_timeout_seconds",
        "1",
        "--training.global_batch_size",
        "4",
    ]  # group 0 of 2, alone
    save = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0"]
    cross = ["--checkpoint.exclude_from_loading", "dataloader", "--training.steps", "5"]
    try:
        train_in_process(tmp_path / "ft", *group, *save, "--training.steps", "3")
        train_in_process(tmp_path / "normal", "--training.global_batch_size", "4", *save, "--training.steps", "3")
        assert _lanes_at(tmp_path / "ft" / "checkpoint" / "step-3") == {lane: 3 for lane in range(4)}
        for source, target in (("ft", "to_normal"), ("normal", "to_ft")):
            shutil.copytree(tmp_path / source / "checkpoint", tmp_path / target / "checkpoint")
        # Without the exclusion, before launch: the group's data state is of another layout.
        line = refused(
            "--training.global_batch_size",
            "4",
            *save,
            "--training.steps",
            "5",
            "--job.dump_folder",
            str(tmp_path / "to_normal"),
        )
        assert "saved with training.global_batch_size = 8" in line and "exclude_from_loading dataloader" in line
        # Within one layout the data state carries over: the group resumes its own checkpoint through run_train.sh
        # (whose preflight compares the data state's global batch with the groups' together).
        proc = subprocess.run(
            [
                "./run_train.sh",
                *TINY,
                *group,
                *save,
                "--training.steps",
                "4",
                "--fault_tolerance.quorum_timeout_seconds",
                "10",
                "--job.dump_folder",
                str(tmp_path / "ft"),
            ],
            cwd=REPO,
            env=env_of(NGPU="1"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-3000:]
        assert [r["step"] for r in read_metrics(tmp_path / "ft")] == [1, 2, 3, 4]
        to_normal = train_in_process(tmp_path / "to_normal", "--training.global_batch_size", "4", *save, *cross)
        to_ft = train_in_process(tmp_path / "to_ft", *group, *save, *cross)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    lrs = _expected_lrs(5, "--training.steps", "5")
    for records in (to_normal, to_ft):
        assert [r["step"] for r in records] == [4, 5] and [r["lr"] for r in records] == pytest.approx(lrs[3:])
    assert _lanes_at(tmp_path / "to_normal" / "checkpoint" / "step-5") == {lane: 5 for lane in range(4)}
    assert _lanes_at(tmp_path / "to_ft" / "checkpoint" / "step-5") == {lane: 5 for lane in range(4)}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_under_diloco_a_restarted_group_heals_in_a_sync_and_holds_the_same_weights(tmp_path):
    """sync_every 2, min_groups 2 (group 0 waits at its sync instead of syncing alone): group 1 is SIGKILLed after
    its step 3 and restarted with the same command; it heals in group 0's sync at step 4 (weights, optimizer,
    reference weights and outer momentum, step, data position), and both groups end with bit-identical weights."""
    import hashlib

    lighthouse, address = start_lighthouse("--heartbeat_timeout_ms", "1000")
    folders = [tmp_path / "group0", tmp_path / "group1"]
    args = [
        "--training.steps",
        "6",
        *DILOCO[:2],
        "--fault_tolerance.sync_every",
        "2",
        "--fault_tolerance.min_groups",
        "2",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "6",
        "--checkpoint.keep_latest_k",
        "0",
    ]
    procs = []
    try:
        procs = [_start_group(g, folders[g], address, *args) for g in range(2)]
        deadline = time.monotonic() + 300
        while _logged_steps(folders[1]) < 3:
            assert procs[0].poll() is None and procs[1].poll() is None, "a group ended before the kill"
            assert time.monotonic() < deadline, "group 1 did not reach the kill step"
            time.sleep(0.05)
        _kill_group(folders[1])
        procs[1].wait()
        procs[1] = _start_group(1, folders[1], address, *args, log=tmp_path / "group1-restarted.log")
        for g, proc in enumerate(procs):
            assert proc.wait(timeout=300) == 0, (tmp_path / f"group{g}.log").read_text()[-5000:]
    finally:
        _stop(procs, folders, lighthouse)
    out = (tmp_path / "group1-restarted.log").read_text()
    assert "healed from a live replica group at step 4" in out and "Traceback" not in out, out[-5000:]
    assert [r["step"] for r in read_metrics(folders[0])] == list(range(1, 7))
    weights = [_weights(folder / "checkpoint" / "step-6", tmp_path) for folder in folders]

    def checksum(state: dict) -> str:
        return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()

    assert len(weights[0]) > 10 and checksum(weights[0]) == checksum(weights[1])


def _launch_groups(tmp: Path, port: int, ids: list[int], *extra: str) -> list[subprocess.Popen]:
    """One run_train.sh per group id, all with LIGHTHOUSE_PORT=`port` (the documented quick start); output in
    tmp/group<i>.log."""
    procs = []
    for i, g in enumerate(ids):
        cmd = [
            "./run_train.sh",
            *TINY,
            *FT,
            "--training.global_batch_size",
            "4",
            "--fault_tolerance.group_id",
            str(g),
            "--job.dump_folder",
            str(tmp / f"group{i}"),
            *extra,
        ]
        with open(tmp / f"group{i}.log", "w") as log:  # a file: a full pipe would stop the group
            procs.append(
                subprocess.Popen(
                    cmd, cwd=REPO, env=env_of(NGPU="1", LIGHTHOUSE_PORT=str(port)), stdout=log, stderr=subprocess.STDOUT
                )
            )
    return procs


def _stop_all(procs: list[subprocess.Popen], tmp: Path, port: int) -> None:
    for i, proc in enumerate(procs):
        proc.kill()
        proc.wait()
        _kill_group(tmp / f"group{i}")
    for pid in _lighthouses_on(port):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_groups_started_with_one_id_both_stop(tmp_path):
    """Two groups launched together with fault_tolerance.group_id 0 would each read group 0's lanes: the job would
    train them twice per step and group 1's never, and exit 0. Both stop at their first quorum with one line (exit
    2). Launched together with LIGHTHOUSE_PORT, as the quick start does, they start one lighthouse between them (no
    'Address already in use', no traceback in either log)."""
    port = free_port()
    procs = _launch_groups(tmp_path, port, [0, 0])
    try:
        for proc in procs:
            proc.wait(timeout=300)
        logs = [(tmp_path / f"group{i}.log").read_text() for i in range(2)]
        for proc, log in zip(procs, logs):
            assert proc.returncode == 2, log[-3000:]
            assert "fault_tolerance.group_id = 0 is the id of 2 replica groups in this quorum" in log, log[-3000:]
            assert "Traceback" not in log and "Address already in use" not in log, log[-3000:]
        assert sum(log.count("started a torchft lighthouse") for log in logs) == 1, logs
        assert len(_lighthouses_on(port)) == 1
    finally:
        _stop_all(procs, tmp_path, port)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_group_that_joins_with_a_live_groups_id_stops_and_the_live_groups_train_on(tmp_path):
    """Groups 0 and 1 train; a third launch with group_id 1 heals into their quorum, finds the id taken and stops
    (exit 2, one line); groups 0 and 1 train on (the step in flight when it left is not committed, as when a group
    dies) until SIGTERM stops them after a step, exit 0."""
    port = free_port()
    procs = _launch_groups(tmp_path, port, [0, 1], "--training.steps", "100000")
    try:

        def wait_for_step(step: int):
            deadline = time.monotonic() + 300
            while _logged_steps(tmp_path / "group1") < step:
                assert all(p.poll() is None for p in procs[:2]), "a live group ended"
                assert time.monotonic() < deadline, f"the groups did not reach step {step}"
                time.sleep(0.2)

        wait_for_step(2)
        procs += _launch_groups(tmp_path, port, [0, 1, 1], "--training.steps", "100000")[2:]
        procs[2].wait(timeout=300)
        late = (tmp_path / "group2.log").read_text()
        assert procs[2].returncode == 2, late[-3000:]
        assert (
            "fault_tolerance.group_id = 1 is the id of 2 replica groups in this quorum (1 of them already "
            "training)" in late
        ), late[-3000:]
        wait_for_step(_logged_steps(tmp_path / "group1") + 3)  # training on without it
        for proc in procs[:2]:
            proc.send_signal(signal.SIGTERM)
        for i in range(2):
            procs[i].wait(timeout=300)
            log = (tmp_path / f"group{i}.log").read_text()
            assert procs[i].returncode == 0 and "stopped by SIGTERM" in log and "Traceback" not in log, log[-3000:]
            steps = [r["step"] for r in read_metrics(tmp_path / f"group{i}")]
            assert steps == list(range(1, len(steps) + 1)), steps
    finally:
        _stop_all(procs, tmp_path, port)


class _RunsCode:
    """A payload whose unpickling would run a command (a peer, or anything reaching the healing port, sending it)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_healing_group_reads_only_weights_from_its_peer(tmp_path):
    """The state a healing group receives over HTTP (torchft's checkpoint transport) is read with torch's
    weights-only unpickler: tensors, numbers and containers load, without the 'buffer is not writable' warning
    of every heal; a payload that would run code is refused and runs nothing (torchft's own transport unpickles
    it with weights_only=False)."""
    import http.server
    import io
    import threading
    import warnings
    from datetime import timedelta

    import torch
    from torch.distributed._serialization import _streaming_save

    from torchtitan.components.fault_tolerance import weights_only_transport

    payloads = {}

    class Serve(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = payloads[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    def payload(name, obj):
        buf = io.BytesIO()
        _streaming_save(obj, buf)
        payloads[f"/{name}"] = buf.getvalue()

    state = {
        "step": 3,
        "model": [{"w": torch.arange(6.0).view(2, 3)}],
        "schedulers": [{"last_epoch": 3}],
        "counters": {"skipped_steps": 0},
        "lr": 0.5,
        "nesterov": True,
        "name": "x",
    }
    payload("state", state)
    marker = tmp_path / "ran"
    payload("evil", {"step": 1, "x": _RunsCode(marker)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        transport = type(weights_only_transport(timedelta(seconds=10)))
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = transport._load_from_address(f"{base}/state", timedelta(seconds=10))
        assert not caught, [str(w.message) for w in caught]
        assert torch.equal(got["model"][0]["w"], state["model"][0]["w"]) and got["schedulers"] == state["schedulers"]
        with pytest.raises(Exception, match="unsupported GLOBAL posix.system"):
            transport._load_from_address(f"{base}/evil", timedelta(seconds=10))
        assert not marker.exists()
    finally:
        server.shutdown()


def test_an_uncommitted_step_names_the_failure_in_plain_words():
    from torchtitan.components.fault_tolerance import collective_error

    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:43213: "
        "Connection reset by peer\nmore lines"
    )
    assert collective_error(gloo) == "read error from 127.0.0.1:43213: Connection reset by peer"
    assert collective_error(TimeoutError()) == "TimeoutError"
