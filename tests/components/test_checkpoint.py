"""Checkpointing in one process: exact resume, async saves, retention, crash leftovers, and every
bad-input path (corrupt, incomplete, foreign, missing, unwritable, full disk)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchtitan.components import checkpoint as ckpt
from torchtitan.config import UserError, load_config
from torchtitan.train import train

REPO = Path(__file__).resolve().parents[2]


def run(folder, *overrides, steps=6):
    cfg = load_config([
        "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
        "--model.tokenizer_path", str(REPO / "assets" / "tokenizer" / "python_stdlib_4k.model"),
        "--job.dump_folder", str(folder),
        "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(steps),
        "--training.mixed_precision_param", "float32",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.device_peak_tflops", "1",
        "--metrics.no-enable_tensorboard",
        "--checkpoint.enable_checkpoint", "--checkpoint.interval", "3", "--checkpoint.no-last_save_model_only",
        *overrides,
    ])
    return train(cfg)


def losses(history):
    return [r["loss"] for r in history]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A 6-step run that saved step-3 and step-6."""
    folder = tmp_path_factory.mktemp("straight")
    return folder, run(folder)


def resume_from(straight_folder, tmp_path, step, *overrides):
    (tmp_path / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight_folder / "checkpoint" / f"step-{step}", tmp_path / "checkpoint" / f"step-{step}")
    return run(tmp_path, *overrides)


def test_resume_is_bit_identical(straight, tmp_path):
    folder, history = straight
    resumed = resume_from(folder, tmp_path, 3)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(history)[3:]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in history][3:]
    # The resumed run appended to its metrics and saved its own step-6.
    assert (tmp_path / "checkpoint" / "step-6" / "train_state.json").exists()


def test_checkpoint_contents(straight):
    folder, _ = straight
    step3 = folder / "checkpoint" / "step-3"
    state = json.loads((step3 / "train_state.json").read_text())
    assert state["step"] == 3 and state["tokens"] == 3 * 2 * 32 and state["world_size"] == 1
    assert state["model"]["name"] == "llama3" and state["model"]["args"]["dim"] == 256
    assert state["dataloader"]["dataset_state"]["next_sample"] == 6
    assert state["lr_scheduler"]["last_epoch"] == 3
    assert set(load_file(step3 / "rng" / "rank-0.safetensors")) == {"cpu"}
    metadata = ckpt.read_metadata(str(step3))
    keys = set(metadata.state_dict_metadata)
    assert "model.layers.0.attention.wq.weight" in keys
    assert "optimizer.state.layers.0.attention.wq.weight.exp_avg" in keys
    # No pickled objects beside DCP's metadata: every stored item is a tensor.
    assert all(type(v).__name__ == "TensorStorageMetadata" for v in metadata.state_dict_metadata.values())


def test_async_saves_publish_and_resume_identically(straight, tmp_path):
    folder, history = straight
    run(tmp_path / "a", "--checkpoint.async_mode", "async")
    assert ckpt.complete_checkpoints(str(tmp_path / "a" / "checkpoint")) == [3, 6]
    state = json.loads((tmp_path / "a" / "checkpoint" / "step-3" / "train_state.json").read_text())
    assert state["step"] == 3
    (tmp_path / "b" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-3", tmp_path / "b" / "checkpoint" / "step-3")
    assert losses(run(tmp_path / "b")) == losses(history)[3:]


def test_keep_latest_k_and_last_save_model_only(tmp_path):
    run(tmp_path, "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2", "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype", "bfloat16", steps=5)
    assert ckpt.complete_checkpoints(str(tmp_path / "checkpoint")) == [4, 5]
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-4", "step-5"]
    last = ckpt.read_metadata(str(tmp_path / "checkpoint" / "step-5"))
    assert all(k.startswith("model.") for k in last.state_dict_metadata)
    assert last.state_dict_metadata["model.output.weight"].properties.dtype == torch.bfloat16
    # The final model-only checkpoint cannot resume training, and says what to do instead.
    with pytest.raises(UserError, match="holds model weights only"):
        run(tmp_path, steps=8)


def test_partial_folders_are_never_loaded_and_are_cleared(straight, tmp_path):
    folder, history = straight
    (tmp_path / "checkpoint").mkdir()
    shutil.copytree(folder / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-3")
    # What a run killed while saving step 6 leaves: a half-written folder under a partial name.
    shutil.copytree(folder / "checkpoint" / "step-6", tmp_path / "checkpoint" / ".step-6.partial")
    (tmp_path / "checkpoint" / ".step-6.partial" / "train_state.json").unlink()
    resumed = run(tmp_path)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert not (tmp_path / "checkpoint" / ".step-6.partial").exists()


def copy_step(straight_folder, tmp_path, step=3):
    dst = tmp_path / "checkpoint" / f"step-{step}"
    shutil.copytree(straight_folder / "checkpoint" / f"step-{step}", dst)
    return dst


def test_truncated_data_file_is_reported(straight, tmp_path):
    dst = copy_step(straight[0], tmp_path)
    data = sorted(dst.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(UserError, match=r"is corrupt: data file .* \(truncated\)"):
        run(tmp_path)
    assert data.exists()  # nothing already saved is deleted


def test_missing_metadata_and_bad_state_file(straight, tmp_path):
    dst = copy_step(straight[0], tmp_path)
    (dst / ".metadata").unlink()
    with pytest.raises(UserError, match="not a complete checkpoint: its DCP .metadata file is missing"):
        run(tmp_path)
    dst2 = copy_step(straight[0], tmp_path / "other")
    (dst2 / "train_state.json").write_text("{not json")
    with pytest.raises(UserError, match="train_state.json cannot be read"):
        run(tmp_path / "other")


def test_foreign_pickle_in_metadata_is_refused(straight, tmp_path):
    import pickle

    dst = copy_step(straight[0], tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (dst / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UserError, match="metadata refers to posix.system"):
        run(tmp_path)


def test_load_step_errors(straight, tmp_path):
    folder, _ = straight
    shutil.copytree(folder / "checkpoint", tmp_path / "checkpoint")
    with pytest.raises(UserError, match="no complete checkpoint step-4 .* available steps: 3, 6"):
        run(tmp_path, "--checkpoint.load_step", "4")
    with pytest.raises(UserError, match="would overwrite the newer checkpoints step-6"):
        run(tmp_path, "--checkpoint.load_step", "3")


def test_checkpoint_of_another_model_names_keys_and_shapes(straight, tmp_path):
    dst = copy_step(straight[0], tmp_path)
    metadata = ckpt.read_metadata(str(dst))
    model_sd = {"tok_embeddings.weight": torch.empty(4096, 128), "layers.0.attention.wq.weight": torch.empty(256, 256),
                "extra.weight": torch.empty(3)}
    with pytest.raises(UserError) as err:
        ckpt.check_model_matches(str(dst), metadata, model_sd)
    message = str(err.value)
    assert "tok_embeddings.weight: checkpoint (4096, 256) vs model (4096, 128)" in message
    assert "model keys not in the checkpoint, e.g. extra.weight" in message
    assert "checkpoint keys not in the model" in message
    state = json.loads((dst / "train_state.json").read_text())
    state["model"]["name"] = "gpt2"
    (dst / "train_state.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match="holds model 'gpt2'"):
        run(tmp_path)


def test_unwritable_folder(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot write the config and metrics to .*a_file is not a writable folder"):
        run(blocker / "sub")
    with pytest.raises(UserError, match="cannot write checkpoints to .*a_file is not a writable folder"):
        run(tmp_path, "--checkpoint.folder", "a_file/ckpt")


def test_full_disk_during_save_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    real_save = ckpt.dcp.save
    calls = []

    def failing_save(state, checkpoint_id, **kwargs):
        calls.append(checkpoint_id)
        if len(calls) == 2:  # the step-6 save
            raise OSError(28, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(ckpt.dcp, "save", failing_save)
    with pytest.raises(UserError, match="saving checkpoint step-6 .* No space left on device; earlier checkpoints are untouched"):
        run(tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-3"]


def test_seed_checkpoint_starts_every_run(tmp_path):
    run(tmp_path, "--checkpoint.create_seed_checkpoint", "--training.seed", "7")
    assert ckpt.complete_checkpoints(str(tmp_path / "checkpoint")) == [0]
    # A run with another seed starts from the seed checkpoint's weights, not its own init.
    from_seed = run(tmp_path, "--training.seed", "3", steps=2)
    plain_seed7 = run(tmp_path / "plain", "--training.seed", "7", steps=2)
    assert losses(from_seed)[0] == losses(plain_seed7)[0]


def test_initial_load_path_model_only(straight, tmp_path):
    folder, history = straight
    started = run(tmp_path, "--checkpoint.initial_load_path", str(folder / "checkpoint" / "step-3"), steps=2)
    # Weights of step 3 but a fresh optimizer and schedule at step 1.
    assert [r["step"] for r in started] == [1, 2]
    assert started[0]["loss"] != history[0]["loss"]


def test_exclude_dataloader_restarts_the_data(straight, tmp_path):
    folder, history = straight
    resumed = resume_from(folder, tmp_path, 3, "--checkpoint.exclude_from_loading", "dataloader")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) != losses(history)[3:]


@pytest.mark.parametrize(
    "model, flavor, hf_class, extra",
    [("llama3", "debugmodel", "LlamaForCausalLM", []), ("qwen3", "debugmodel", "Qwen3ForCausalLM", []),
     ("qwen3", "debugmodel_tied", "Qwen3ForCausalLM", []),
     # Qwen3-MoE's format has no routing bias: exported exactly when the bias stays zero.
     ("qwen3", "debugmodel_moe", "Qwen3MoeForCausalLM", ["--moe.load_balance_coeff", "0"])],
)
def test_hf_export_at_last_step_and_import_as_initial_weights(tmp_path, model, flavor, hf_class, extra):
    transformers = pytest.importorskip("transformers")
    from torchtitan.components.hf_checkpoint import read_dcp_model
    from torchtitan.models.registry import get_model_spec

    family = ["--model.name", model, "--model.flavor", flavor, *extra]
    run(tmp_path / "a", "--checkpoint.last_save_in_hf", *family, steps=2)
    hf_dir = tmp_path / "a" / "checkpoint" / "step-2-hf"
    assert (hf_dir / "config.json").exists()
    # transformers loads the export as its own class and computes our model's logits (weights from
    # the DCP step-2 save).
    spec = get_model_spec(model)
    sd, args, _ = read_dcp_model(str(tmp_path / "a" / "checkpoint" / "step-2"), spec)
    ours = spec.model_cls(args)
    ours.load_state_dict(sd)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    assert type(theirs).__name__ == hf_class
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff < 1e-4
    # Starting from the export (Hugging Face import) or from the DCP save gives the same first step.
    from_hf = run(tmp_path / "b", "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_in_hf",
                  *family, steps=1)
    from_dcp = run(tmp_path / "c", "--checkpoint.initial_load_path", str(tmp_path / "a" / "checkpoint" / "step-2"),
                   *family, steps=1)
    assert from_hf[0]["loss"] == pytest.approx(from_dcp[0]["loss"], abs=1e-6)
    fresh = run(tmp_path / "d", *family, steps=1)
    assert abs(fresh[0]["loss"] - from_hf[0]["loss"]) > 1e-3  # the imported weights were used


def test_resume_with_another_global_batch_is_refused_before_training(straight, tmp_path):
    copy_step(straight[0], tmp_path)
    with pytest.raises(UserError, match="saved with training.global_batch_size = 2, but this job has 4"):
        run(tmp_path, "--training.local_batch_size", "4")
    with pytest.raises(UserError, match="saved with training.seq_len = 32, but this job has 64"):
        run(tmp_path, "--training.seq_len", "64")
