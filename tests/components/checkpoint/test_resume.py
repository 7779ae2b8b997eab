"""Which checkpoint a run continues from (resume.py): the newest that verifies, an explicit
load_step, and what preflight refuses before launch."""

import os
import shutil
from pathlib import Path

import pytest

from torchtitan.components.checkpoint import read_metadata, verify_checkpoint
from torchtitan.config import UserError

from helpers.checkpoints import checkpoint_run, copy_step, resume_from
from helpers.launch import losses


def test_resume_is_bit_identical(straight, tmp_path):
    folder, history = straight
    resumed = resume_from(folder, tmp_path, 3)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(history)[3:]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in history][3:]
    # The resumed run appended to its metrics and saved its own step-6.
    assert (tmp_path / "checkpoint" / "step-6" / "train_state.json").exists()


def test_restarting_step_numbers_in_a_used_folder_is_refused(straight, tmp_path):
    folder, _ = straight
    shutil.copytree(folder / "checkpoint", tmp_path / "checkpoint")
    with pytest.raises(
        UserError, match="exclude_from_loading names train_state.*already holds step-6.*initial_load_path"
    ):
        checkpoint_run(tmp_path, "--checkpoint.exclude_from_loading", "train_state")
    # The suggested way: another dump folder, starting from step-6's full state at step 0.
    started = checkpoint_run(
        tmp_path / "new",
        "--checkpoint.initial_load_path",
        str(tmp_path / "checkpoint" / "step-6"),
        "--checkpoint.no-initial_load_model_only",
        "--checkpoint.exclude_from_loading",
        "train_state",
        steps=3,
    )
    assert [r["step"] for r in started] == [1, 2, 3]
    assert sorted(os.listdir(tmp_path / "new" / "checkpoint")) == ["step-3"]


def test_load_step_errors_and_an_older_step_supersedes_newer_ones(straight, tmp_path):
    folder, history = straight
    shutil.copytree(folder / "checkpoint", tmp_path / "checkpoint")
    with pytest.raises(UserError, match="no complete checkpoint step-4 .* available steps: 3, 6"):
        checkpoint_run(tmp_path, "--checkpoint.load_step", "4")
    # An explicit older step continues from it; the newer step-6 is kept under another name.
    resumed = checkpoint_run(tmp_path, "--checkpoint.load_step", "3")
    assert losses(resumed) == losses(history)[3:]
    names = sorted(os.listdir(tmp_path / "checkpoint"))
    assert names == ["step-3", "step-6", "superseded-step-6"]
    read_metadata(str(tmp_path / "checkpoint" / "superseded-step-6"))


def flip_byte(file: Path, offset: int):
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage", ["flipped_data_byte", "truncated_data_file", "flipped_state_file", "flipped_rng_file"]
)
def test_corrupt_newest_checkpoint_falls_back_to_the_newest_that_verifies(straight, tmp_path, damage):
    folder, history = straight
    shutil.copytree(folder / "checkpoint", tmp_path / "checkpoint")
    step6 = tmp_path / "checkpoint" / "step-6"
    data = sorted(step6.glob("*.distcp"))[0]
    if damage == "flipped_data_byte":  # same size, one bit: only the checksum can tell
        flip_byte(data, data.stat().st_size // 2)
    elif damage == "truncated_data_file":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "flipped_state_file":  # still valid JSON: "step": 6 -> "step": 7
        state = (step6 / "train_state.json").read_text()
        (step6 / "train_state.json").write_text(state.replace('"step": 6', '"step": 7'))
    else:
        flip_byte(step6 / "rng" / "rank-0.safetensors", 200)
    assert verify_checkpoint(str(step6)) is not None
    resumed = checkpoint_run(tmp_path)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(history)[3:]
    # Kept (never deleted), out of the step-N namespace; the run then wrote a good step-6.
    assert (tmp_path / "checkpoint" / "corrupt-step-6").is_dir()
    assert verify_checkpoint(str(tmp_path / "checkpoint" / "step-6")) is None
    # Explicitly asking for a corrupt step is refused with the reason.
    bad = tmp_path / "checkpoint" / "corrupt-step-6"
    shutil.copytree(bad, tmp_path / "again" / "checkpoint" / "step-6")
    with pytest.raises(UserError, match="is corrupt.*choose another checkpoint.load_step"):
        checkpoint_run(tmp_path / "again", "--checkpoint.load_step", "6")


def test_no_checkpoint_verifies_is_refused_and_nothing_moves(straight, tmp_path):
    dst = copy_step(straight[0], tmp_path)
    flip_byte(sorted(dst.glob("*.distcp"))[0], 5000)
    with pytest.raises(UserError, match="no checkpoint in .* can be loaded: .*checksum mismatch.*Nothing was moved"):
        checkpoint_run(tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-3"]


def test_resume_with_another_global_batch_is_refused_before_training(straight, tmp_path):
    copy_step(straight[0], tmp_path)
    with pytest.raises(UserError, match="saved with training.global_batch_size = 2, but this job has 4"):
        checkpoint_run(tmp_path, "--training.local_batch_size", "4")
    with pytest.raises(UserError, match="saved with training.seq_len = 32, but this job has 64"):
        checkpoint_run(tmp_path, "--training.seq_len", "64")
