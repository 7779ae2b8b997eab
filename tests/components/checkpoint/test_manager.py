"""Saving through the trainer's CheckpointManager (manager.py): async saves, the seed checkpoint,
Hugging Face exports and imports."""

import json
import logging
import math
import shutil

import pytest
import torch

from torchtitan.components.checkpoint import complete_checkpoints
from torchtitan.config import UserError

from helpers.checkpoints import checkpoint_run
from helpers.launch import losses


def test_async_saves_publish_and_resume_identically(straight, tmp_path):
    folder, history = straight
    checkpoint_run(tmp_path / "a", "--checkpoint.async_mode", "async")
    assert complete_checkpoints(str(tmp_path / "a" / "checkpoint")) == [3, 6]
    state = json.loads((tmp_path / "a" / "checkpoint" / "step-3" / "train_state.json").read_text())
    assert state["step"] == 3
    (tmp_path / "b" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-3", tmp_path / "b" / "checkpoint" / "step-3")
    assert losses(checkpoint_run(tmp_path / "b")) == losses(history)[3:]


def test_seed_checkpoint_starts_every_run(tmp_path):
    checkpoint_run(tmp_path, "--checkpoint.create_seed_checkpoint", "--training.seed", "7")
    assert complete_checkpoints(str(tmp_path / "checkpoint")) == [0]
    # A run with another seed starts from the seed checkpoint's weights, not its own init.
    # (Documents in stored order: the seed also sets the shuffled order.)
    from_seed = checkpoint_run(tmp_path, "--training.seed", "3", "--training.no-shuffle_documents", steps=2)
    plain_seed7 = checkpoint_run(tmp_path / "plain", "--training.seed", "7", "--training.no-shuffle_documents", steps=2)
    assert losses(from_seed)[0] == losses(plain_seed7)[0]


@pytest.mark.hf
@pytest.mark.parametrize(
    "model, flavor, hf_class, extra",
    [
        ("llama3", "debugmodel", "LlamaForCausalLM", []),
        ("qwen3", "debugmodel", "Qwen3ForCausalLM", []),
        ("qwen3", "debugmodel_tied", "Qwen3ForCausalLM", []),
        # Qwen3-MoE's format has no routing bias: exported exactly when the bias stays zero.
        ("qwen3", "debugmodel_moe", "Qwen3MoeForCausalLM", ["--moe.load_balance_coeff", "0"]),
    ],
)
def test_hf_export_at_last_step_and_import_as_initial_weights(tmp_path, model, flavor, hf_class, extra):
    transformers = pytest.importorskip("transformers")
    from torchtitan.components.checkpoint import read_dcp_model
    from torchtitan.models.registry import get_model_spec

    family = ["--model.name", model, "--model.flavor", flavor, *extra]
    checkpoint_run(tmp_path / "a", "--checkpoint.last_save_in_hf", *family, steps=2)
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
    from_hf = checkpoint_run(
        tmp_path / "b",
        "--checkpoint.initial_load_path",
        str(hf_dir),
        "--checkpoint.initial_load_in_hf",
        *family,
        steps=1,
    )
    from_dcp = checkpoint_run(
        tmp_path / "c",
        "--checkpoint.initial_load_path",
        str(tmp_path / "a" / "checkpoint" / "step-2"),
        *family,
        steps=1,
    )
    assert from_hf[0]["loss"] == pytest.approx(from_dcp[0]["loss"], abs=1e-6)
    fresh = checkpoint_run(tmp_path / "d", *family, steps=1)
    assert abs(fresh[0]["loss"] - from_hf[0]["loss"]) > 1e-3  # the imported weights were used


def test_hf_import_takes_the_folders_vocabulary_which_must_cover_the_tokenizer(tmp_path, caplog):
    # Published checkpoints pad their vocabulary their own way (Qwen3: 151,936 rows for 151,669 tokens).
    import dataclasses

    from torchtitan.components.checkpoint import read_dcp_model, save_hf
    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    for vocab in (4160, 4032):  # the tokenizer has 4,096 tokens
        args = dataclasses.replace(spec.args_for_training("debugmodel", 4096, 32), vocab_size=vocab)
        with torch.device("meta"):
            model = spec.model_cls(args)
        model.to_empty(device="cpu")
        model.init_weights(seed=5)
        save_hf(tmp_path / f"hf{vocab}", model.state_dict(), spec.hf, args, torch.float32)
    with caplog.at_level(logging.INFO):
        history = checkpoint_run(
            tmp_path / "run",
            "--checkpoint.initial_load_path",
            str(tmp_path / "hf4160"),
            "--checkpoint.initial_load_in_hf",
            steps=1,
        )
    assert "vocab 4,160: the sentencepiece tokenizer's 4,096 tokens padded to the initial Hugging Face" in caplog.text
    _, saved_args, _ = read_dcp_model(str(tmp_path / "run" / "checkpoint" / "step-1"), spec)
    assert saved_args.vocab_size == 4160 and math.isfinite(history[0]["loss"])
    with pytest.raises(UserError, match=r"hf4032/config.json has vocab_size 4,032, fewer than the 4,096 tokens"):
        checkpoint_run(
            tmp_path / "narrow",
            "--checkpoint.initial_load_path",
            str(tmp_path / "hf4032"),
            "--checkpoint.initial_load_in_hf",
            steps=1,
        )
