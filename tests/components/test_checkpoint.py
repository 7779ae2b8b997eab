"""Checkpointing in one process: exact resume, async saves, retention, crash leftovers, and every
bad-input path (corrupt, incomplete, foreign, missing, unwritable, full disk)."""

import json
import logging
import math
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


TRAIN_ARGS = [
    "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
    "--model.tokenizer_path", str(REPO / "assets" / "tokenizer" / "python_stdlib_4k.model"),
    "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.device_peak_tflops", "1",
    "--metrics.no-enable_tensorboard",
    "--checkpoint.enable_checkpoint", "--checkpoint.interval", "3", "--checkpoint.no-last_save_model_only",
]


def run(folder, *overrides, steps=6):
    return train(load_config([*TRAIN_ARGS, "--job.dump_folder", str(folder), "--training.steps", str(steps), *overrides]))


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
        train(load_config([*TRAIN_ARGS, "--job.dump_folder", str(folder), "--training.steps", "6", *extra]), Drawing)
        return Drawing.draws

    straight_draws = run_drawing(tmp_path / "a")
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-3", tmp_path / "b" / "checkpoint" / "step-3")
    resumed_draws = run_drawing(tmp_path / "b")
    assert resumed_draws == straight_draws[3:], (straight_draws, resumed_draws)
    assert len(set(straight_draws)) == 6


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
    # step-4 is the newest full checkpoint: kept beside the weights-only step-5, step-3 purged.
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-4", "step-5"]
    last = ckpt.read_metadata(str(tmp_path / "checkpoint" / "step-5"))
    assert all(k.startswith("model.") for k in last.state_dict_metadata)
    assert last.state_dict_metadata["model.output.weight"].properties.dtype == torch.bfloat16
    # The final model-only checkpoint cannot resume training, and says what to do instead.
    with pytest.raises(UserError, match="holds model weights only.*checkpoint.load_step"):
        run(tmp_path, steps=8)


def test_keep_latest_1_never_deletes_the_last_resumable_checkpoint(tmp_path):
    run(tmp_path, "--checkpoint.keep_latest_k", "1", "--checkpoint.last_save_model_only", steps=6)
    # keep_latest_k = 1 would delete step-3, the only full checkpoint, once the weights-only step-6 exists.
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-3", "step-6"]
    assert not ckpt.read_train_state(str(tmp_path / "checkpoint" / "step-3"))["model_only"]
    # The advice of the model-only error works: load_step continues from step-3.
    resumed = run(tmp_path, "--checkpoint.keep_latest_k", "1", "--checkpoint.load_step", "3", steps=8)
    assert [r["step"] for r in resumed] == [4, 5, 6, 7, 8]
    assert "superseded-step-6" in os.listdir(tmp_path / "checkpoint")


def test_restarting_step_numbers_in_a_used_folder_is_refused(straight, tmp_path):
    folder, _ = straight
    shutil.copytree(folder / "checkpoint", tmp_path / "checkpoint")
    with pytest.raises(UserError, match="exclude_from_loading names train_state.*already holds step-6.*initial_load_path"):
        run(tmp_path, "--checkpoint.exclude_from_loading", "train_state")
    # The suggested way: another dump folder, starting from step-6's full state at step 0.
    started = run(tmp_path / "new", "--checkpoint.initial_load_path", str(tmp_path / "checkpoint" / "step-6"),
                  "--checkpoint.no-initial_load_model_only", "--checkpoint.exclude_from_loading", "train_state", steps=3)
    assert [r["step"] for r in started] == [1, 2, 3]
    assert sorted(os.listdir(tmp_path / "new" / "checkpoint")) == ["step-3"]


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


def _text(s: str) -> bytes:
    import pickle

    raw = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def _call(func: tuple[str, str], *args: bytes) -> bytes:
    """Protocol-4 opcodes for func(*args), func looked up by (module, name) as a pickle does."""
    import pickle

    return _text(func[0]) + _text(func[1]) + pickle.STACK_GLOBAL + pickle.MARK + b"".join(args) + pickle.TUPLE + pickle.REDUCE


ESCAPES = {  # each builds a pickle that creates the file `marker` when a plain unpickler loads it
    # pickle resolves a dotted name as an attribute path from the module: os.system through allowed modules
    "dotted_from_dcp_module": lambda m: _call(("torch.distributed.checkpoint.filesystem", "os.system"), _text(f"touch {m}")),
    "dotted_from_pathlib": lambda m: _call(("pathlib", "os.system"), _text(f"touch {m}")),
    "builtins_eval": lambda m: _call(("builtins", "eval"), _text(f"open({m!r}, 'w')")),
    "builtins_exec": lambda m: _call(("builtins", "exec"), _text(f"open({m!r}, 'w')")),
    # getattr on an allowed class reaches its methods: getattr(PosixPath(marker), "touch")()
    "builtins_getattr": lambda m: _call(("builtins", "getattr"), _call(("pathlib", "PosixPath"), _text(m)), _text("touch"))
    + _pickle_empty_call(),
    # an allowed class given an argument that a harmful call produces
    "allowed_class_harmful_argument": lambda m: _call(("pathlib", "PosixPath"), _call(("os", "system"), _text(f"touch {m}"))),
}


def _pickle_empty_call() -> bytes:
    import pickle

    return pickle.EMPTY_TUPLE + pickle.REDUCE


@pytest.mark.parametrize("escape", sorted(ESCAPES))
def test_code_in_metadata_never_runs(straight, tmp_path, escape):
    import pickle

    marker = tmp_path / "pwned"
    payload = pickle.PROTO + bytes([4]) + ESCAPES[escape](str(marker)) + pickle.STOP
    try:  # the payload is live: a plain unpickler runs it (and may then fail on what it returned)
        pickle.loads(payload)
    except TypeError:
        pass
    assert marker.exists()
    marker.unlink()
    dst = copy_step(straight[0], tmp_path)
    (dst / ".metadata").write_bytes(payload)
    with pytest.raises(UserError, match=r"its \.metadata cannot be read \(checkpoint metadata refers to"):
        ckpt.read_metadata(str(dst))
    with pytest.raises(UserError, match="metadata refers to"):
        run(tmp_path)
    assert not marker.exists()


def test_metadata_allow_list_is_exact_pairs():
    allowed = ckpt._MetadataUnpickler._ALLOWED
    assert all("." not in name for _, name in allowed)
    assert not hasattr(ckpt._MetadataUnpickler, "_ALLOWED_MODULES")
    for module, name in allowed:  # each entry names something that exists (no stale pairs)
        assert getattr(__import__(module, fromlist=[name]), name) is not None


def test_load_step_errors_and_an_older_step_supersedes_newer_ones(straight, tmp_path):
    folder, history = straight
    shutil.copytree(folder / "checkpoint", tmp_path / "checkpoint")
    with pytest.raises(UserError, match="no complete checkpoint step-4 .* available steps: 3, 6"):
        run(tmp_path, "--checkpoint.load_step", "4")
    # An explicit older step continues from it; the newer step-6 is kept under another name.
    resumed = run(tmp_path, "--checkpoint.load_step", "3")
    assert losses(resumed) == losses(history)[3:]
    names = sorted(os.listdir(tmp_path / "checkpoint"))
    assert names == ["step-3", "step-6", "superseded-step-6"]
    ckpt.read_metadata(str(tmp_path / "checkpoint" / "superseded-step-6"))


def flip_byte(file: Path, offset: int):
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped_data_byte", "truncated_data_file", "flipped_state_file", "flipped_rng_file"])
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
    assert ckpt.verify_checkpoint(str(step6)) is not None
    resumed = run(tmp_path)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(history)[3:]
    # Kept (never deleted), out of the step-N namespace; the run then wrote a good step-6.
    assert (tmp_path / "checkpoint" / "corrupt-step-6").is_dir()
    assert ckpt.verify_checkpoint(str(tmp_path / "checkpoint" / "step-6")) is None
    # Explicitly asking for a corrupt step is refused with the reason.
    bad = tmp_path / "checkpoint" / "corrupt-step-6"
    shutil.copytree(bad, tmp_path / "again" / "checkpoint" / "step-6")
    with pytest.raises(UserError, match="is corrupt.*choose another checkpoint.load_step"):
        run(tmp_path / "again", "--checkpoint.load_step", "6")


def test_no_checkpoint_verifies_is_refused_and_nothing_moves(straight, tmp_path):
    dst = copy_step(straight[0], tmp_path)
    flip_byte(sorted(dst.glob("*.distcp"))[0], 5000)
    with pytest.raises(UserError, match="no checkpoint in .* can be loaded: .*checksum mismatch.*Nothing was moved"):
        run(tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-3"]


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
        run(tmp_path)


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
    ckpt.write_checksums(str(dst), rank=0)  # a well-formed checkpoint of another model
    with pytest.raises(UserError, match="holds model 'gpt2'"):
        run(tmp_path)


def test_dump_folder_on_a_filesystem_that_refuses_writes(tmp_path):
    # /proc refuses new entries even to root, for whom a permission check passes.
    with pytest.raises(UserError, match=r"cannot write the config and metrics to /proc/torchtitan-test/run: /proc is not a writable folder"):
        run(Path("/proc/torchtitan-test/run"))


def test_unwritable_folder(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot write the config and metrics to .*a_file is not a folder"):
        run(blocker / "sub")
    with pytest.raises(UserError, match="cannot write checkpoints to .*a_file is not a folder"):
        run(tmp_path, "--checkpoint.folder", "a_file/ckpt")


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

    cmd = [sys.executable, "-m", "torchtitan.train", *TRAIN_ARGS, "--job.dump_folder", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, preexec_fn=limit_file_size, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: saving checkpoint step-3 to" in proc.stderr
    assert "file-size limit (ulimit -f) is 10,485,760 bytes" in proc.stderr
    assert "earlier checkpoints are untouched" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert os.listdir(tmp_path / "checkpoint") == []


def test_seed_checkpoint_starts_every_run(tmp_path):
    run(tmp_path, "--checkpoint.create_seed_checkpoint", "--training.seed", "7")
    assert ckpt.complete_checkpoints(str(tmp_path / "checkpoint")) == [0]
    # A run with another seed starts from the seed checkpoint's weights, not its own init.
    # (Documents in stored order: the seed also sets the shuffled order.)
    from_seed = run(tmp_path, "--training.seed", "3", "--training.no-shuffle_documents", steps=2)
    plain_seed7 = run(tmp_path / "plain", "--training.seed", "7", "--training.no-shuffle_documents", steps=2)
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


def test_hf_import_takes_the_folders_vocabulary_which_must_cover_the_tokenizer(tmp_path, caplog):
    # Published checkpoints pad their vocabulary their own way (Qwen3: 151,936 rows for 151,669 tokens).
    import dataclasses

    from torchtitan.components.hf_checkpoint import read_dcp_model, save_hf
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
        history = run(tmp_path / "run", "--checkpoint.initial_load_path", str(tmp_path / "hf4160"),
                      "--checkpoint.initial_load_in_hf", steps=1)
    assert "vocab 4,160: the sentencepiece tokenizer's 4,096 tokens padded to the initial Hugging Face" in caplog.text
    _, saved_args, _ = read_dcp_model(str(tmp_path / "run" / "checkpoint" / "step-1"), spec)
    assert saved_args.vocab_size == 4160 and math.isfinite(history[0]["loss"])
    with pytest.raises(UserError, match=r"hf4032/config.json has vocab_size 4,032, fewer than the 4,096 tokens"):
        run(tmp_path / "narrow", "--checkpoint.initial_load_path", str(tmp_path / "hf4032"),
            "--checkpoint.initial_load_in_hf", steps=1)
