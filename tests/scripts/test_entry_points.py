"""Every command line reports a mistake the same way: one line `error: <message>` on stderr, exit
status 2, no traceback (torchtitan.config.errors.run_main), and an output path is checked before the
work it would receive (check_output_path): a folder that does not exist where one must, a path under
a file, a place nothing can be created in (/proc), an existing target that must not be replaced.
scripts/plan.py's own mistakes are in tests/planner."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.config.errors import ArgumentParser, UserError, check_output_path, run_main

from helpers.paths import REPO

SCRIPTS = REPO / "scripts"


# ---- the helpers ---------------------------------------------------------------------------------


@pytest.fixture
def places(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    return tmp_path


@pytest.mark.parametrize(
    "path,kwargs,message",
    [
        ("new.toml", {}, None),
        ("a/b/new", {}, None),  # missing parents may be created
        ("a/new.toml", {"create_parents": False}, "the folder {t}/a does not exist"),
        ("file/out", {}, "{t}/file is a file, not a folder"),
        ("file/a/out", {"create_parents": False}, "{t}/file is a file, not a folder"),
        ("file", {}, "already exists as a file"),
        ("file", {"existing": "replace_file"}, None),
        ("full", {"existing": "replace_file"}, "already exists as a folder (it must be a file)"),
        ("empty", {"existing": "empty_folder"}, None),
        ("full", {"existing": "empty_folder"}, "already exists and is not empty"),
        ("full", {"existing": "write_into"}, None),
        ("file", {"existing": "write_into"}, "already exists as a file (it must be a folder)"),
        ("/proc/out", {}, "cannot create anything in /proc"),
        ("/proc/a/b", {}, "cannot create anything in /proc"),
    ],
)
def test_output_paths(places, path, kwargs, message):
    full = path if path.startswith("/") else str(places / path)
    if message is None:
        check_output_path(full, "OUT", **kwargs)
        assert not (places / "a").exists()  # checking creates nothing
        return
    with pytest.raises(UserError) as e:
        check_output_path(full, "OUT", **kwargs)
    assert str(e.value).startswith(f"OUT {full}") and message.format(t=places) in str(e.value)


def test_run_main(capsys):
    def fails():
        print("before")
        raise UserError("the reason; the fix")

    assert run_main(fails) == 2
    out, err = capsys.readouterr()
    assert out == "before\n" and err == "error: the reason; the fix\n"
    assert run_main(lambda: None) == 0 and run_main(lambda code: code, 3) == 3

    from torchtitan.config import load_config

    assert run_main(load_config, ["--help"], help_status=3) == 3
    assert "--job.config_file" in capsys.readouterr().out
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        run_main(lambda: 1 / 0)


def test_argument_mistakes_are_user_errors():
    parser = ArgumentParser(prog="tool")
    parser.add_argument("--count", type=int, required=True)
    with pytest.raises(UserError, match=r"argument --count: invalid int value: 'x' \(see tool --help\)"):
        parser.parse_args(["--count", "x"])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("go").add_argument("target")
    with pytest.raises(UserError, match="the following arguments are required: target"):
        parser.parse_args(["--count", "1", "go"])


# ---- the scripts ---------------------------------------------------------------------------------


def run(argv: list[str], env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *map(str, argv)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


CASES = {
    # Outputs: checked before the input is read (the input here does not even exist) or any work.
    "convert under a file": (
        ["convert_checkpoint.py", "to-hf", "{t}/nope", "{t}/file/hf"],
        "error: OUTPUT {t}/file/hf: {t}/file is a file, not a folder",
    ),
    "convert into /proc": (
        ["convert_checkpoint.py", "from-hf", "{t}/nope", "/proc/step-0"],
        "error: OUTPUT /proc/step-0: cannot create anything in /proc",
    ),
    "convert into a non-empty folder": (
        ["convert_checkpoint.py", "to-hf", "{t}/nope", "{t}/full"],
        "already exists and is not empty",
    ),
    "benchmark_hf make into an existing folder": (
        ["benchmark_hf.py", "make", "{t}/empty"],
        "error: FOLDER {t}/empty already exists as a folder",
    ),
    "benchmark_hf make an unknown flavor": (
        ["benchmark_hf.py", "make", "{t}/new", "--flavor", "nope"],
        "unknown model.flavor 'nope'",
    ),
    "benchmark_hf run a missing folder": (
        ["benchmark_hf.py", "run", "{t}/nope"],
        "error: FOLDER {t}/nope does not exist or is not a folder",
    ),
    "train_tokenizer into /proc": (
        ["train_tokenizer.py", "--output", "/proc/tok.model"],
        "error: --output /proc/tok.model: cannot create anything in /proc",
    ),
    "train_tokenizer vocabulary 0": (
        ["train_tokenizer.py", "--vocab-size", "0"],
        "argument --vocab-size: must be 1 or more, got 0",
    ),
    "short_documents under a file": (["short_documents.py", "{t}/file/docs.jsonl"], "{t}/file is a file, not a folder"),
    "short_documents 0 lines": (
        ["short_documents.py", "{t}/docs.jsonl", "--lines", "0"],
        "argument --lines: must be 1 or more",
    ),
    "fetch_tokenizer under a file": (
        ["fetch_tokenizer.py", "org/model", "--out", "{t}/file/tok"],
        "error: --out {t}/file/tok: {t}/file is a file, not a folder",
    ),
    "pretokenize 0 documents per chunk": (
        ["pretokenize.py", "python_stdlib", "{t}/tokens", "--tokenizer", "x", "--chunk-docs", "0"],
        "argument --chunk-docs: must be 1 or more",
    ),
    "pretokenize without arguments": (["pretokenize.py"], "the following arguments are required"),
    "benchmark_data data-parallel degree 0": (["benchmark_data.py", "--dp", "1,0"], "argument --dp: each must be 1"),
    "benchmark_data under a file": (
        ["benchmark_data.py", "--folder", "{t}/file/tokens"],
        "{t}/file is a file, not a folder",
    ),
    "validate_memory_estimate unknown layout": (
        ["validate_memory_estimate.py", "--only", "nope"],
        "--only nope: no such layout",
    ),
    "benchmark_startup unknown mode": (["benchmark_startup.py", "--modes", "nope"], "unknown modes ['nope']"),
    "benchmark_startup bad count": (["benchmark_startup.py", "--nproc", "x"], "--nproc must be an integer"),
    "benchmark_recovery bad kill step": (
        ["benchmark_recovery.py", "--kill-after", "100"],
        "--kill-after must be an integer from 1 to 99, got '100'",
    ),
    "benchmark_recovery bad override": (["benchmark_recovery.py", "--training.steps", "x"], "training.steps"),
    # The trainer's own checks before any run is launched.
    "benchmark_cp unknown variant": (["benchmark_cp.py", "--variants", "ring"], "--variants: unknown ['ring']"),
    "benchmark_cp Ulysses degree that cannot split the heads": (
        ["benchmark_cp.py", "--nproc", "3", "--seq", "96", "--variants", "ulysses"],
        "The largest degree that works is 2",
    ),
    "benchmark unknown flavor": (["benchmark.py", "--model.flavor", "nope"], "unknown model.flavor 'nope'"),
    "generate seed": (
        ["generate.py", "--checkpoint", "{t}", "--prompt", "x", "--seed", "-1"],
        "--seed must be in [0, 2**64)",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_script_mistakes_are_one_line_and_exit_2(places, name):
    argv, message = CASES[name]
    argv = [a.format(t=places) for a in argv]
    line = one_line_error(run([SCRIPTS / argv[0], *argv[1:]]))
    assert message.format(t=places) in line
    assert sorted(p.name for p in places.iterdir()) == ["empty", "file", "full"]  # nothing written


def test_preflight_and_launcher_report_through_the_same_wrapper():
    line = one_line_error(run(["-m", "torchtitan.preflight"], env={"WORLD_SIZE": "two"}))
    assert line.startswith("error: WORLD_SIZE='two' must be the number of processes")
    line = one_line_error(run(["-m", "torchtitan.launch", "--", "--model.flavor", "nope"]))
    assert line.startswith("error: unknown model.flavor 'nope'")
