"""The one-process checkpoint runs of tests/components/checkpoint/ (and of tests/test_train.py): the debug
model saving every 3 steps, and resuming from a copy of a run's saved step."""

import shutil

from helpers.paths import RECIPE

# --- checkpoint tests (tests/components/checkpoint/) ---------------------------------------------
# One-process runs of the debug model that save step-3 and step-6 (interval 3). `straight` is the
# uninterrupted run, run once per session: the tests resume from, or damage, copies of its checkpoints.

CHECKPOINT_ARGS = [
    *RECIPE,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.mixed_precision_param",
    "float32",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.device_peak_tflops",
    "1",
    "--metrics.no-enable_tensorboard",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval",
    "3",
    "--checkpoint.no-last_save_model_only",
]


def checkpoint_run(folder, *overrides, steps=6) -> list[dict]:
    from torchtitan.config import load_config
    from torchtitan.train import train

    return train(
        load_config([*CHECKPOINT_ARGS, "--job.dump_folder", str(folder), "--training.steps", str(steps), *overrides])
    )


def resume_from(straight_folder, tmp_path, step, *overrides):
    (tmp_path / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight_folder / "checkpoint" / f"step-{step}", tmp_path / "checkpoint" / f"step-{step}")
    return checkpoint_run(tmp_path, *overrides)


def copy_step(straight_folder, tmp_path, step=3):
    dst = tmp_path / "checkpoint" / f"step-{step}"
    shutil.copytree(straight_folder / "checkpoint" / f"step-{step}", dst)
    return dst
