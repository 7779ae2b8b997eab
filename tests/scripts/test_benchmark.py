"""scripts/benchmark.py: its argument handling and summaries in-process, and its plumbing end to end
at tiny sizes (the numbers themselves are not checked: they measure the machine)."""

import os
import re
import subprocess
import sys

import pytest

from helpers.launch import load_script
from helpers.paths import MODEL, REPO

SCRIPT = REPO / "scripts" / "benchmark.py"
TINY = [
    "--job.config_file",
    str(REPO / "train_configs" / "debug_model.toml"),
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "1",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.no-enable_tensorboard",
    "--metrics.device_peak_tflops",
    "1",  # skips the one-second matmul measurement in each process
    "--model.tokenizer_path",
    str(MODEL),
]


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "benchmark")


def run(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_own_options_are_taken_out_and_overrides_keep_their_order(bench):
    opts, rest = bench.split_argv(
        [
            "--nproc=2",
            "--job.config_file",
            "r.toml",
            "--steps",
            "7",
            "--training.compile",
            "--warmup",
            "3",
            "--training.seq_len=64",
        ]
    )
    assert (opts["nproc"], opts["steps"], opts["warmup"], opts["threads"]) == (2, 7, 3, None)
    assert rest == ["--job.config_file", "r.toml", "--training.compile", "--training.seq_len=64"]
    with pytest.raises(ValueError, match="--steps: expected int"):
        bench.split_argv(["--steps", "many"])


def test_forced_framework_settings_win_over_the_users(bench):
    from torchtitan.config import load_config

    argv = bench.framework_argv(TINY + ["--training.steps", "99", "--metrics.log_freq", "10"], 5, "/tmp/x")
    cfg = load_config(argv)
    assert (cfg.training.steps, cfg.metrics.log_freq, cfg.job.dump_folder) == (5, 1, "/tmp/x")
    assert not cfg.checkpoint.enable_checkpoint


def test_summary_is_the_median_after_warmup_and_the_peak_memory(bench):
    steps = [
        {"step": i, "tps": tps, "tflops": tps / 10, "mfu": tps / 100, "memory_gib": mem}
        for i, (tps, mem) in enumerate([(1, 0.5), (100, 0.7), (10, 0.8), (30, 0.8), (20, 0.9)], start=1)
    ]
    s = bench.summarize([{"steps": steps, "peak_tflops": 2.0, "threads": 1}], warmup=2)
    assert (s["tps"], s["tflops"], s["mfu"], s["memory_gib"], s["steps_measured"]) == (20, 2, 0.2, 0.9, 3)
    # Repeats pool their steps after warm-up.
    again = [dict(r, tps=r["tps"] + 1000, memory_gib=0.1) for r in steps]
    s2 = bench.summarize(
        [{"steps": steps, "peak_tflops": 2.0, "threads": 1}, {"steps": again, "peak_tflops": 4.0, "threads": 1}],
        warmup=2,
    )
    assert (s2["tps"], s2["memory_gib"], s2["peak_tflops"], s2["steps_measured"]) == (520, 0.9, 3.0, 6)
    table = bench.format_table(s, dict(s, tps=10))
    assert any(line.startswith("tokens/s per device") and line.endswith("2.000") for line in table)


@pytest.mark.parametrize(
    "mode, option, expected",
    [("none", "2", []), ("full", "2", [0, 1, 2]), ("selective", "2", [0, 2]), ("selective", "3", [0])],
)
def test_bare_loop_checkpoints_the_blocks_the_trainer_does(bench, mode, option, expected):
    import torch

    from torchtitan.config import ActivationCheckpoint
    from torchtitan.models.registry import get_model_spec

    ModelArgs, Transformer = get_model_spec("llama3").args_cls, get_model_spec("llama3").model_cls

    args = ModelArgs(dim=32, n_layers=3, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=8)
    plain, model = Transformer(args), Transformer(args)
    for m in (plain, model):
        m.init_weights(seed=1)
    every = bench.checkpoint_every(ActivationCheckpoint(mode=mode, selective_ac_option=option))
    assert bench.apply_block_options(model, every, compile=False) == len(expected)
    assert [i for i, b in enumerate(model.layers.values()) if "forward" in vars(b)] == expected
    tokens = torch.randint(64, (2, 8))
    plain(tokens).sum().backward()
    model(tokens).sum().backward()  # the recompute in backward must give the same gradients
    for a, b in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_user_mistakes_stop_before_any_launch():
    proc = run("--training.stpes", "3", timeout=60)
    assert proc.returncode == 2 and "did you mean '--training.steps'" in proc.stderr
    proc = run(*TINY, "--steps", "3", "--warmup", "3", timeout=60)
    assert proc.returncode == 2 and "--steps > --warmup" in proc.stderr
    proc = run(
        *TINY,
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
        timeout=60,
    )
    assert proc.returncode == 2 and "checkpoints whole blocks only" in proc.stderr
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        # The bare loop would run FSDP on twice the global batch: unlike work, refused.
        proc = run(*TINY, f"--parallelism.{key}", "2", timeout=60)
        assert proc.returncode == 2 and f"set parallelism.{key} = 1 (it is 2)" in proc.stderr, proc.stderr[-2000:]


def check_report(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"ratio framework/bare: \d+\.\d\d", lines[-1])
    for row in ("tokens/s per device", "TFLOP/s per device", "MFU %", "peak memory GiB"):
        assert any(line.startswith(row) for line in lines), row
    assert "7,212,288 parameters" in proc.stdout
    assert "step-1 losses differ" not in proc.stdout  # the two loops train the same model on the same data


def test_one_process_end_to_end():
    proc = run(*TINY, "--steps", "3", "--warmup", "1", "--repeat", "2")
    check_report(proc)
    # Two repeats, in alternating order.
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if " tokens/s, " in line] == [
        "framework",
        "bare",
        "bare",
        "framework",
    ]


@pytest.mark.slow
def test_two_processes_with_activation_checkpointing():
    check_report(
        run(*TINY, "--nproc", "2", "--steps", "3", "--warmup", "1", "--activation_checkpoint.mode", "full", timeout=300)
    )


def test_muon_is_compared_with_adamw_not_with_the_bare_loop(bench):
    proc = run(*TINY, "--optimizer.name", "Muon", timeout=60)
    assert proc.returncode == 2 and "--optimizers 1" in proc.stderr
    argv = ["--optimizer.muon_lr", "0.02", "--optimizer.lr=1e-3", "--optimizer.muon_nesterov=false", "--x", "1"]
    assert bench.without_muon_keys(argv) == ["--optimizer.lr=1e-3", "--x", "1"]


def test_optimizers_end_to_end():
    # Newton-Schulz in float32: in bf16 it runs ~20x slower on a CPU without native bf16 (AVX2), past the timeout.
    proc = run(
        *TINY,
        "--optimizers",
        "1",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--optimizer.muon_lr",
        "0.01",
        "--optimizer.muon_ns_dtype",
        "float32",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {
        line.split()[0]: line.split()
        for line in proc.stdout.splitlines()
        if line.split()[:1] in (["AdamW"], ["Muon"]) and "tokens/s," not in line
    }
    assert rows.keys() == {"AdamW", "Muon"}
    assert rows["AdamW"][-1] == rows["Muon"][-1]  # the step-1 loss: the same model and data
    assert re.fullmatch(r"step time Muon/AdamW: \d+\.\d\d", proc.stdout.strip().splitlines()[-1])
