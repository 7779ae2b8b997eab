"""The repository's files the tests use (its root, the shipped tokenizer, the debug recipe) and the argument
lists of a small, fast job that most command lines and configs start from."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_JOBS = REPO / "tests" / "distributed" / "run_jobs.py"
MODEL = REPO / "assets" / "tokenizer" / "python_stdlib_4k.model"  # the shipped tokenizer (sentencepiece, 4,096 tokens)
PYTHON_DIR = str(Path(sys.executable).parent)  # put first on PATH, so that scripts' `python` is this interpreter

# The debug model's recipe with the shipped tokenizer: the start of most command lines and configs.
RECIPE = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--model.tokenizer_path", str(MODEL)]

# A small, fast, deterministic job: the debug model at short sequences, fp32, one log line per step.
TINY = [
    "--job.config_file",
    str(REPO / "train_configs" / "debug_model.toml"),
    "--training.seq_len",
    "64",
    "--training.steps",
    "6",
    "--training.global_batch_size",
    "8",
    "--training.mixed_precision_param",
    "float32",
    "--training.deterministic",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.no-enable_tensorboard",
    "--metrics.device_peak_tflops",
    "1",
    "--model.tokenizer_path",
    str(MODEL),
]
