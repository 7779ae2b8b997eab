"""The checkpoint folder (folders.py): retention (keep_latest_k), what killed runs leave, and
failed writes that leave no half-written checkpoint."""

import os
import shutil

import pytest
import torch

from torchtitan.components.checkpoint import read_metadata, read_train_state
from torchtitan.config import UserError

from helpers.checkpoints import CHECKPOINT_ARGS, checkpoint_run
from helpers.paths import REPO


def test_keep_latest_k_and_last_save_model_only(tmp_path):
    checkpoint_run(
        tmp_path,
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "2",
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",
        "bfloat16",
        steps=5,
    )
    # step-4 is the newest full checkpoint: kept beside the weights-only step-5, step-3 purged.
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-4", "step-5"]
    last = read_metadata(str(tmp_path / "checkpoint" / "step-5"))
    assert all(k.startswith("model.") for k in last.state_dict_metadata)
    assert last.state_dict_metadata["model.output.weight"].properties.dtype == torch.bfloat16
    # The final model-only checkpoint cannot resume training, and says what to do instead.
    with pytest.raises(UserError, match="holds model weights only.*checkpoint.load_step"):
        checkpoint_run(tmp_path, steps=8)


def test_keep_latest_1_never_deletes_the_last_resumable_checkpoint(tmp_path):
    checkpoint_run(tmp_path, "--checkpoint.keep_latest_k", "1", "--checkpoint.last_save_model_only", steps=6)
    # keep_latest_k = 1 would delete step-3, the only full checkpoint, once the weights-only step-6 exists.
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-3", "step-6"]
    assert not read_train_state(str(tmp_path / "checkpoint" / "step-3"))["model_only"]
    # The advice of the model-only error works: load_step continues from step-3.
    resumed = checkpoint_run(tmp_path, "--checkpoint.keep_latest_k", "1", "--checkpoint.load_step", "3", steps=8)
    assert [r["step"] for r in resumed] == [4, 5, 6, 7, 8]
    assert "superseded-step-6" in os.listdir(tmp_path / "checkpoint")


def test_partial_folders_are_never_loaded_and_are_cleared(straight, tmp_path):
    folder, history = straight
    (tmp_path / "checkpoint").mkdir()
    shutil.copytree(folder / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-3")
    # What a run killed while saving step 6 leaves: a half-written folder under a partial name.
    shutil.copytree(folder / "checkpoint" / "step-6", tmp_path / "checkpoint" / ".step-6.partial")
    (tmp_path / "checkpoint" / ".step-6.partial" / "train_state.json").unlink()
    resumed = checkpoint_run(tmp_path)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert not (tmp_path / "checkpoint" / ".step-6.partial").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_write_errors_below_dcp_stop_the_run_with_a_message(tmp_path):
    """A real write error from the kernel inside DCP's writer (the file-size limit: EFBIG), in a
    subprocess: exit 2, one message, no traceback, no half-written folder left."""
    import resource
    import signal
    import subprocess
    import sys

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (10 * 2**20, 10 * 2**20))

    cmd = [sys.executable, "-m", "torchtitan.train", *CHECKPOINT_ARGS, "--job.dump_folder", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, preexec_fn=limit_file_size, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: saving checkpoint step-3 to" in proc.stderr
    assert "file-size limit (ulimit -f) is 10,485,760 bytes" in proc.stderr
    assert "earlier checkpoints are untouched" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert os.listdir(tmp_path / "checkpoint") == []
