"""run_train.sh as a user runs it: a short 2-process training run, recipe selection, overrides,
--help, and every user mistake reported once, clearly, within seconds, with no traceback."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.launch import processes_naming
from helpers.paths import PYTHON_DIR, REPO


def run_train(*args, env=None, timeout=300):
    full_env = dict(os.environ, PATH=PYTHON_DIR + os.pathsep + os.environ["PATH"], **(env or {}))
    start = time.monotonic()
    proc = subprocess.run(
        ["./run_train.sh", *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    return proc, time.monotonic() - start


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_process_run_with_inherited_recipe(tmp_path):
    recipe = tmp_path / "short.toml"
    recipe.write_text(
        f'[job]\nbase_config = "{REPO / "train_configs" / "debug_model.toml"}"\n'
        # A data worker per rank: the workers end with their trainer, which exits (a forked child of the
        # launcher, where no atexit handler runs).
        "[training]\nsteps = 8\nseq_len = 64\ndata_workers = 1\n[metrics]\nlog_freq = 4\n"
    )
    out = tmp_path / "out"
    proc, _ = run_train(
        "--job.dump_folder",
        str(out),
        "--training.local_batch_size=2",
        env={"NGPU": "2", "CONFIG_FILE": str(recipe), "LOG_RANK": "0,1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    # The first lines say what is trained, on which mesh, with which batch.
    assert "training llama3 debugmodel: 7,212,288 parameters" in log
    assert "FSDP: pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=1 = 2 ranks" in log
    assert "global batch 4 x seq 64 = 256 tokens/step" in log
    assert "[rank1]" in log  # LOG_RANK=0,1 shows both ranks
    # A start-up that fits a screen: where the resolved config went instead of the config itself, no
    # warnings the project causes itself (a deprecated variable, device-mesh slicing), one rank prefix.
    start_up = [line for line in log.split("step:")[0].splitlines() if line.startswith("[rank0]")]
    assert len(start_up) <= 20, "\n".join(start_up)
    assert f"written to {out / 'config.toml'}" in log and "[training]" not in log
    assert "Warning" not in log and "deprecated" not in log, log[:3000]
    assert re.search(r"^\[rank0\] \d\d:\d\d:\d\d INFO ", log, re.M) and not re.search(r"\[rank\d\]:?\s*\[rank", log)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 4, 8]  # recipe's steps and log_freq, CLI's batch size
    assert list((out / "tb").glob("events.out.tfevents.*"))
    resolved = (out / "config.toml").read_text()
    assert (
        "steps = 8" in resolved
        and "local_batch_size = 2" in resolved
        and "data_workers = 1" in resolved
        and 'flavor = "debugmodel"' in resolved
    )


@pytest.mark.multiprocess
def test_outside_the_projects_environment_the_launcher_says_how_to_enter_it(tmp_path):
    """run_train.sh without the venv active: a Python without the project's packages (here a bare venv), or no
    `python` at all, is one line saying how to activate the environment (before: an 18-line ModuleNotFoundError)."""
    import venv

    venv.create(tmp_path / "bare", with_pip=False)
    bare = dict(os.environ, PATH=str(tmp_path / "bare" / "bin") + os.pathsep + "/usr/bin:/bin")
    bare.pop("VIRTUAL_ENV", None)
    for env, what in ((bare, "has no module 'torch'"), ({**bare, "PATH": str(tmp_path)}, "no 'python' command")):
        proc = subprocess.run(
            ["/bin/bash", "./run_train.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and what in lines[0], proc.stderr
        assert "source .venv/bin/activate" in lines[0] and "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.multiprocess
def test_ctrl_c_before_training_starts_is_one_line(tmp_path):
    """Ctrl-C (SIGINT to the process group) while the launcher imports torch, and while its preflight waits on the
    data (a named pipe nobody writes: the launcher blocks opening it): exit status 130 and one line, no
    KeyboardInterrupt traceback, no worker started."""
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    for moment in ("importing", "checking"):
        proc = subprocess.Popen(
            [
                "./run_train.sh",
                "--training.dataset",
                "local",
                "--training.dataset_path",
                str(fifo),
                "--job.dump_folder",
                str(tmp_path / "out"),
            ],
            cwd=REPO,
            start_new_session=True,
            env=dict(os.environ, PATH=PYTHON_DIR + os.pathsep + os.environ["PATH"]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        if moment == "importing":
            time.sleep(1)
        else:
            while Path(f"/proc/{proc.pid}/wchan").read_text() != "wait_for_partner":  # open() of the pipe
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and err.strip().splitlines() == [
            "stopped: Ctrl-C before training started; no worker was launched"
        ], (moment, out[-2000:], err[-3000:])
        assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.multiprocess
def test_help_lists_options():
    """--help shows what the job would run with (the recipe's and the command line's values beside the schema's
    defaults), the launch variables and every family's flavors."""
    proc, _ = run_train("--help", "--training.seq_len", "128")
    assert proc.returncode == 0
    for key in ("local_batch_size", "data_parallel_shard_degree", "warmup_steps", "device_peak_tflops"):
        assert key in proc.stdout
    recipe = "./train_configs/debug_model.toml"
    assert f"--training.steps (int, here: 200 in {recipe}; default: 10000)" in proc.stdout
    assert f"--lr_scheduler.warmup_steps (int, here: 20 in {recipe}; default: 200)" in proc.stdout
    assert "--training.seq_len (int, here: 128 from the command line; default: 2048)" in proc.stdout
    assert "--training.local_batch_size (int, here: 4 in" in proc.stdout
    for variable in ("NGPU", "CONFIG_FILE", "LOG_RANK", "LIGHTHOUSE_PORT", "RDZV_ENDPOINT"):
        assert f"\n    {variable} " in proc.stdout, variable
    assert (
        "      qwen3_5: debugmodel, 9B, debugmodel_moe, 35B-A3B" in proc.stdout
        and "      llama3: debugmodel, " in proc.stdout
    )


EMPTY = "empty.jsonl"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--training.stpes", "5"], {}, "did you mean '--training.steps'"),
        (["--training.steps", "ten"], {}, "training.steps: expected an integer, got 'ten'"),
        (["--training.seq_len", "0"], {}, "training.seq_len must be a positive integer"),
        (
            ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
            {"NGPU": "3"},
            "multiply to 4 .* but the job has 3 processes",
        ),
        (["--model.tokenizer_path", "/no/tok.model"], {}, "tokenizer model not found at '/no/tok.model'"),
        (["--training.dataset", "local", "--training.dataset_path", "/no/data.jsonl"], {}, "does not exist"),
        (["--training.dataset", "local", "--training.dataset_path", EMPTY], {}, "is empty"),
        (
            ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "102"],
            {},
            "seq_len = 102 must be divisible by 2 x context_parallel_degree",
        ),
        (
            ["--parallelism.context_parallel_degree", "4"],
            {},
            "context_parallel_degree 4 x tensor_parallel_degree 1 = 4 does not divide the world size 2",
        ),
        (["--parallelism.tensor_parallel_degree", "3"], {"NGPU": "3"}, "tensor_parallel_degree = 3 does not divide"),
        (
            [
                "--parallelism.context_parallel_degree",
                "3",
                "--parallelism.context_parallel_method",
                "ulysses",
                "--training.seq_len",
                "96",
            ],
            {"NGPU": "3"},
            "must divide the model's 16 query heads.*largest degree that works is 2",
        ),
        ([], {"CONFIG_FILE": "/no/recipe.toml"}, "not found: /no/recipe.toml"),
    ],
)
def test_user_mistakes_fail_fast_and_clearly(tmp_path, args, env, message):
    import re

    (tmp_path / EMPTY).write_text("")
    args = [str(tmp_path / a) if a == EMPTY else a for a in args]
    proc, seconds = run_train(*args, env=env, timeout=60)
    assert proc.returncode == 2
    assert re.search(message, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert seconds < 20  # checked before torchrun starts any process


@pytest.mark.parametrize("kind", ["a corpus shorter than one sequence", "a binary file among the data"])
def test_data_that_cannot_train_is_refused_by_the_launcher_before_any_worker_starts(
    tmp_path, monkeypatch, capsys, kind
):
    """run_train.sh's launcher in this process (torchtitan.launch.main), with the step that starts the workers
    (launch.run: torchrun, the trainers, their models) replaced by a failure: the preflight refuses the data,
    exit status 2 and one line, before any worker or model exists."""
    import gc

    import torch

    from torchtitan import launch

    from helpers.paths import MODEL, RECIPE

    data = tmp_path / "data"
    data.mkdir()
    if kind == "a corpus shorter than one sequence":
        # 2 ranks x local batch 4: 8 lanes of the recipe's seq_len 256; each lane would read all of the corpus
        # in 8 epochs before finding it cannot fill one sequence, after launch and the model build.
        (data / "one.jsonl").write_text(json.dumps({"text": "def f():\n    return 1\n"}) + "\n")
        expected = (
            rf"error: dataset local at {re.escape(str(data))} is too small: its documents tokenize to \d+ "
            r"tokens in all, fewer than one sequence of training.seq_len \+ 1 = 257, so no sample"
        )
    else:
        # Enough good text first (the source was checked by its first document), then the tokenizer's model
        # file copied in by mistake as text: it used to be decoded with replacement characters and trained on.
        (data / "a.jsonl").write_text(json.dumps({"text": "def f():\n    return 1\n" * 400}) + "\n")
        (data / "b.txt").write_bytes(MODEL.read_bytes())
        expected = rf"error: {re.escape(str(data / 'b.txt'))} is not UTF-8 text: at byte \d+ of the file"

    def start_workers(*args, **kwargs):
        raise AssertionError("the job was launched: the data passed the preflight")

    monkeypatch.setattr(launch, "run", start_workers)
    threads = torch.get_num_threads()  # the launcher limits itself to one thread
    try:
        code = launch.main(
            [
                "--nproc-per-node",
                "2",
                "--",
                *RECIPE,
                "--job.dump_folder",
                str(tmp_path / "out"),
                "--training.dataset",
                "local",
                "--training.dataset_path",
                str(data),
            ]
        )
    finally:
        torch.set_num_threads(threads)
        gc.unfreeze()
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match(expected, errors[0]), err
    assert "Traceback" not in err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_rank_reports_an_error_under_plain_torchrun(tmp_path):
    # Without run_train.sh's pre-launch check, each rank finds the problem itself and exits non-zero.
    (tmp_path / EMPTY).write_text("")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "-m",
        "torchtitan.train",
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        "--training.dataset",
        "local",
        "--training.dataset_path",
        str(tmp_path / EMPTY),
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("error: dataset local at") == 2
    assert time.monotonic() - start < 60


def readme_layout_commands() -> list[str]:
    """The commands of the README's layout table (the list scripts/check_layouts.sh runs)."""
    text = (REPO / "docs" / "parallelism.md").read_text()
    return re.findall(r"^\| [^|]* \| `(NGPU=[^`]*)`", text, flags=re.M)


def test_readme_lists_every_layout_and_each_passes_preflight(tmp_path):
    from torchtitan.config import load_config
    from torchtitan.preflight import preflight

    commands = readme_layout_commands()
    described = set()
    for command in commands:
        words = command.split()
        ngpu = int(words[0].removeprefix("NGPU="))
        assert words[1] == "./run_train.sh", command
        cfg = load_config(
            [
                "--job.config_file",
                str(REPO / "train_configs" / "debug_model.toml"),
                "--job.dump_folder",
                str(tmp_path),
                *words[2:],
            ]
        )
        dims = preflight(cfg, ngpu).parallel_dims
        described.add(dims.describe().split(":")[0])
    # Every composition the parallelism issue names has a command.
    for layout in [
        "FSDP",
        "HSDP",
        "DDP",
        "TP",
        "FSDP x TP",
        "HSDP x TP",
        "PP",
        "PP x FSDP",
        "PP x TP",
        "PP x FSDP x TP",
        "FSDP x CP",
        "FSDP x CP x TP",
        "PP x FSDP x CP",
        "PP x FSDP x CP x TP",
    ]:
        assert layout in described, f"no README command for {layout}: {sorted(described)}"


def _start_long_run(folder: Path, *extra: str) -> subprocess.Popen:
    full_env = dict(os.environ, PATH=PYTHON_DIR + os.pathsep + os.environ["PATH"], NGPU="2", OMP_NUM_THREADS="1")
    args = [
        "--job.dump_folder",
        str(folder),
        "--training.steps",
        "100000",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "2",
        *extra,
    ]
    return subprocess.Popen(
        ["./run_train.sh", *args],
        cwd=REPO,
        env=full_env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_checkpoint(folder: Path, proc: subprocess.Popen, timeout: float = 120):
    from torchtitan.components.checkpoint import complete_checkpoints

    deadline = time.monotonic() + timeout
    while not complete_checkpoints(str(folder / "checkpoint")):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint was published"
        time.sleep(0.2)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_workers_stop_when_the_launcher_is_killed(tmp_path):
    from torchtitan.components.checkpoint import complete_checkpoints, verify_checkpoint

    proc = _start_long_run(tmp_path)
    try:
        _wait_for_checkpoint(tmp_path, proc)
        assert len(processes_naming(str(tmp_path))) >= 3  # the launcher and its two workers
        os.kill(proc.pid, 9)  # run_train.sh became the launcher; only it is killed
        proc.wait()
        killed = time.monotonic()
        while processes_naming(str(tmp_path)) and time.monotonic() - killed < 30:
            time.sleep(0.1)
        left = processes_naming(str(tmp_path))
        assert not left, f"workers still running after 30 s: {left}"
        assert time.monotonic() - killed < 10
    finally:
        for pid in processes_naming(str(tmp_path)):
            os.kill(pid, 9)
    steps = complete_checkpoints(str(tmp_path / "checkpoint"))
    assert steps and all(verify_checkpoint(str(tmp_path / "checkpoint" / f"step-{s}")) is None for s in steps)


def _worker_of_rank(folder: Path, rank: int) -> int:
    for pid in processes_naming(str(folder)):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        # A forked worker (the launcher's default on CPU) has the launcher's initial environment and
        # command line; it names itself after its rank. An exec'd one has RANK in its environment.
        if name == f"titan-rank{rank}" or (f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b"".join(env)):
            return pid
    raise AssertionError(f"no worker of rank {rank}")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_train_timeout(tmp_path):
    """comm.train_timeout_seconds bounds every collective after the first step."""
    proc = _start_long_run(tmp_path, "--comm.train_timeout_seconds", "5")
    stopped = None
    try:
        _wait_for_checkpoint(tmp_path, proc)
        waiting, stopped = _worker_of_rank(tmp_path, 0), _worker_of_rank(tmp_path, 1)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        while waiting in processes_naming(str(tmp_path)) and time.monotonic() - start < 90:
            time.sleep(0.1)
        elapsed = time.monotonic() - start
        os.kill(stopped, signal.SIGCONT)  # lets torchrun's SIGTERM end it without its 30 s grace
        proc.wait(timeout=60)
    finally:
        for pid in processes_naming(str(tmp_path)):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, 9)
    err = proc.stderr.read()
    assert proc.returncode != 0
    # Rank 0's collective gives up after the 5 s train timeout (the 300 s init timeout would keep it waiting).
    assert "Timed out waiting 5000ms" in err
    assert elapsed < 5 + 10, elapsed
