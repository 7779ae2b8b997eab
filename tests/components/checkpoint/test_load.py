"""Loading a checkpoint into a run (load.py): RNG states, model-only starts, excluded parts, and
DCP's own read errors."""

import json
import shutil

import pytest
import torch

from torchtitan.config import UserError, load_config
from torchtitan.train import train

from helpers.checkpoints import CHECKPOINT_ARGS, checkpoint_run, copy_step, resume_from
from helpers.launch import losses


def test_rng_state_is_restored_by_effect(tmp_path):
    """Each step draws from the global generator: a resumed run draws what the uninterrupted run drew
    at the same steps (without the restore it would repeat the draws of steps 1-3)."""
    from torchtitan.train import Trainer

    class Drawing(Trainer):
        draws: list[float] = []

        def train_step(self, step, data_iter):
            Drawing.draws.append(torch.rand(()).item())
            return super().train_step(step, data_iter)

    def run_drawing(folder, *extra):
        Drawing.draws = []
        train(
            load_config([*CHECKPOINT_ARGS, "--job.dump_folder", str(folder), "--training.steps", "6", *extra]), Drawing
        )
        return Drawing.draws

    straight_draws = run_drawing(tmp_path / "a")
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-3", tmp_path / "b" / "checkpoint" / "step-3")
    resumed_draws = run_drawing(tmp_path / "b")
    assert resumed_draws == straight_draws[3:], (straight_draws, resumed_draws)
    assert len(set(straight_draws)) == 6


def test_flipped_byte_without_checksums_is_a_clear_error(straight, tmp_path):
    """A checkpoint of format 1 has no checksums; a damaged tensor chunk then fails inside DCP, whose
    CheckpointException (a BaseException) must still become a message, not a traceback."""
    dst = copy_step(straight[0], tmp_path)
    shutil.rmtree(dst / "checksums")
    state = json.loads((dst / "train_state.json").read_text())
    (dst / "train_state.json").write_text(json.dumps(dict(state, format_version=1)))
    data = sorted(dst.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[:64] = b"\xff" * 64  # the first chunk's zip header
    data.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="could not be read: rank 0: "):
        checkpoint_run(tmp_path)


def test_initial_load_path_model_only(straight, tmp_path):
    folder, history = straight
    started = checkpoint_run(tmp_path, "--checkpoint.initial_load_path", str(folder / "checkpoint" / "step-3"), steps=2)
    # Weights of step 3 but a fresh optimizer and schedule at step 1.
    assert [r["step"] for r in started] == [1, 2]
    assert started[0]["loss"] != history[0]["loss"]


def test_exclude_dataloader_restarts_the_data(straight, tmp_path):
    folder, history = straight
    resumed = resume_from(folder, tmp_path, 3, "--checkpoint.exclude_from_loading", "dataloader")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) != losses(history)[3:]
