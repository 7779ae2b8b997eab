"""A checkpoint's files (storage.py): their contents, reading them without trusting them (truncated,
missing, corrupt and foreign files, code planted in DCP's .metadata), and the folders writes go to."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchtitan.components.checkpoint import storage
from torchtitan.config import UserError

from helpers.checkpoints import checkpoint_run, copy_step


def test_checkpoint_contents(straight):
    folder, _ = straight
    step3 = folder / "checkpoint" / "step-3"
    state = json.loads((step3 / "train_state.json").read_text())
    assert state["step"] == 3 and state["tokens"] == 3 * 2 * 32 and state["world_size"] == 1
    assert state["model"]["name"] == "llama3" and state["model"]["args"]["dim"] == 256
    assert state["dataloader"]["dataset_state"]["next_sample"] == 6
    assert state["lr_scheduler"]["last_epoch"] == 3
    assert set(load_file(step3 / "rng" / "rank-0.safetensors")) == {"cpu"}
    metadata = storage.read_metadata(str(step3))
    keys = set(metadata.state_dict_metadata)
    assert "model.layers.0.attention.wq.weight" in keys
    assert "optimizer.state.layers.0.attention.wq.weight.exp_avg" in keys
    # No pickled objects beside DCP's metadata: every stored item is a tensor.
    assert all(type(v).__name__ == "TensorStorageMetadata" for v in metadata.state_dict_metadata.values())


def test_truncated_data_file_is_reported(straight, tmp_path):
    dst = copy_step(straight[0], tmp_path)
    data = sorted(dst.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(UserError, match=r"is corrupt: data file .* \(truncated\)"):
        checkpoint_run(tmp_path)
    assert data.exists()  # nothing already saved is deleted


def test_missing_metadata_and_bad_state_file(straight, tmp_path):
    dst = copy_step(straight[0], tmp_path)
    (dst / ".metadata").unlink()
    with pytest.raises(UserError, match="not a complete checkpoint: its DCP .metadata file is missing"):
        checkpoint_run(tmp_path)
    dst2 = copy_step(straight[0], tmp_path / "other")
    (dst2 / "train_state.json").write_text("{not json")
    with pytest.raises(UserError, match="train_state.json cannot be read"):
        checkpoint_run(tmp_path / "other")


def _text(s: str) -> bytes:
    import pickle

    raw = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def _call(func: tuple[str, str], *args: bytes) -> bytes:
    """Protocol-4 opcodes for func(*args), func looked up by (module, name) as a pickle does."""
    import pickle

    return (
        _text(func[0])
        + _text(func[1])
        + pickle.STACK_GLOBAL
        + pickle.MARK
        + b"".join(args)
        + pickle.TUPLE
        + pickle.REDUCE
    )


ESCAPES = {  # each builds a pickle that creates the file `marker` when a plain unpickler loads it
    # pickle resolves a dotted name as an attribute path from the module: os.system through allowed modules
    "dotted_from_dcp_module": lambda m: _call(
        ("torch.distributed.checkpoint.filesystem", "os.system"), _text(f"touch {m}")
    ),
    "dotted_from_pathlib": lambda m: _call(("pathlib", "os.system"), _text(f"touch {m}")),
    "builtins_eval": lambda m: _call(("builtins", "eval"), _text(f"open({m!r}, 'w')")),
    "builtins_exec": lambda m: _call(("builtins", "exec"), _text(f"open({m!r}, 'w')")),
    # getattr on an allowed class reaches its methods: getattr(PosixPath(marker), "touch")()
    "builtins_getattr": lambda m: (
        _call(("builtins", "getattr"), _call(("pathlib", "PosixPath"), _text(m)), _text("touch")) + _pickle_empty_call()
    ),
    # an allowed class given an argument that a harmful call produces
    "allowed_class_harmful_argument": lambda m: _call(
        ("pathlib", "PosixPath"), _call(("os", "system"), _text(f"touch {m}"))
    ),
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
        storage.read_metadata(str(dst))
    with pytest.raises(UserError, match="metadata refers to"):
        checkpoint_run(tmp_path)
    assert not marker.exists()


def test_metadata_allow_list_is_exact_pairs():
    allowed = storage._MetadataUnpickler._ALLOWED
    assert all("." not in name for _, name in allowed)
    assert not hasattr(storage._MetadataUnpickler, "_ALLOWED_MODULES")
    for module, name in allowed:  # each entry names something that exists (no stale pairs)
        assert getattr(__import__(module, fromlist=[name]), name) is not None


def test_checkpoint_of_another_model_names_keys_and_shapes(straight, tmp_path):
    dst = copy_step(straight[0], tmp_path)
    metadata = storage.read_metadata(str(dst))
    model_sd = {
        "tok_embeddings.weight": torch.empty(4096, 128),
        "layers.0.attention.wq.weight": torch.empty(256, 256),
        "extra.weight": torch.empty(3),
    }
    with pytest.raises(UserError) as err:
        storage.check_model_matches(str(dst), metadata, model_sd)
    message = str(err.value)
    assert "tok_embeddings.weight: checkpoint (4096, 256) vs model (4096, 128)" in message
    assert "model keys not in the checkpoint, e.g. extra.weight" in message
    assert "checkpoint keys not in the model" in message
    state = json.loads((dst / "train_state.json").read_text())
    state["model"]["name"] = "gpt2"
    (dst / "train_state.json").write_text(json.dumps(state))
    storage.write_checksums(str(dst), rank=0)  # a well-formed checkpoint of another model
    with pytest.raises(UserError, match="holds model 'gpt2'"):
        checkpoint_run(tmp_path)


def test_dump_folder_on_a_filesystem_that_refuses_writes(tmp_path):
    # /proc refuses new entries even to root, for whom a permission check passes.
    with pytest.raises(
        UserError,
        match=r"cannot write the config and metrics to /proc/torchtitan-test/run: /proc is not a writable folder",
    ):
        checkpoint_run(Path("/proc/torchtitan-test/run"))


def test_unwritable_folder(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot write the config and metrics to .*a_file is not a folder"):
        checkpoint_run(blocker / "sub")
    with pytest.raises(UserError, match="cannot write checkpoints to .*a_file is not a folder"):
        checkpoint_run(tmp_path, "--checkpoint.folder", "a_file/ckpt")
