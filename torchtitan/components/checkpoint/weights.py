"""Model weights of our checkpoints outside the training loop, in one process on CPU tensors
(DCP with no_dist=True, no process group): the model part of a step-N folder read or written whole
(read_dcp_model, write_dcp_model), or converted to and from a Hugging Face folder one tensor at a
time (dcp_to_hf, hf_to_dcp: scripts/convert_checkpoint.py). Step-N folders are read with the
trainer's own checks (storage.py: completeness, format version, an allow-list unpickler for DCP's
.metadata) and written in its train_state.json format, into a hidden sibling folder renamed into
place at the end. Tensors come only from safetensors or DCP data files, never from a pickle.
"""

import os
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.components.checkpoint.hf import (
    HF_CONFIG,
    HF_INDEX,
    HFFolder,
    check_hf_folder,
    check_shapes,
    file_names,
    group_into_files,
    meta_shapes,
)
from torchtitan.components.checkpoint.storage import (
    STATE_FILE,
    SafeFileSystemReader,
    existing_folder,
    read_metadata,
    read_train_state,
    staging,
    train_state_record,
    write_checksums,
    write_json,
)
from torchtitan.config.errors import UserError
from torchtitan.models.common.spec import HFAdapter, ModelSpec


def dcp_model_name(folder: str | os.PathLike) -> str:
    """The model family recorded in a step-N checkpoint's train_state.json."""
    folder = str(existing_folder(folder, "checkpoint folder"))
    name = read_train_state(folder).get("model", {}).get("name")
    if not isinstance(name, str):
        raise UserError(f"{folder}/{STATE_FILE} names no model; was it written by torchtitan's trainer?")
    return name


def read_dcp_model(folder: str | os.PathLike, spec: ModelSpec) -> tuple[dict[str, torch.Tensor], object, dict]:
    """Load the model part of a step-N checkpoint of `spec`'s family into full CPU tensors (stored
    dtypes); also return the args recorded in its train_state.json and that whole JSON object."""
    folder = str(existing_folder(folder, "checkpoint folder"))
    stored, args, train_state = _dcp_model_metadata(folder, spec)
    sd = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in stored.items()}
    with _single_process_dcp():  # reads only the model's tensors, never the optimizer's
        dcp.load({"model": sd}, storage_reader=SafeFileSystemReader(folder), no_dist=True)
    return sd, args, train_state


def write_dcp_model(
    folder: str | os.PathLike, sd: dict[str, torch.Tensor], spec: ModelSpec, args, flavor: str = "custom"
) -> Path:
    """Write a model-only step-0 checkpoint (DCP files + train_state.json) that the trainer can start from."""
    with staging(folder) as tmp:
        with _single_process_dcp():
            dcp.save({"model": sd}, checkpoint_id=str(tmp), no_dist=True)
        train_state = train_state_record(
            step=0,
            tokens=0,
            model_only=True,
            world_size=1,
            model={"name": spec.name, "flavor": flavor, "args": asdict(args)},
            dtype=str(next(iter(sd.values())).dtype).removeprefix("torch."),
        )
        write_json(tmp / STATE_FILE, train_state)
        write_checksums(str(tmp), rank=0)
    return Path(folder)


def _hf_adapter(spec: ModelSpec) -> HFAdapter:
    # The callers (scripts/convert_checkpoint.py) refuse a family without an adapter first.
    assert spec.hf is not None, f"model '{spec.name}' has no Hugging Face adapter"
    return spec.hf


def dcp_to_hf(
    checkpoint_dir: str | os.PathLike,
    output: str | os.PathLike,
    spec: ModelSpec,
    dtype: torch.dtype,
    max_shard_bytes: int = 5 * 2**30,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> dict:
    """Export the model part of a step-N checkpoint as a Hugging Face folder, one tensor at a time:
    each tensor is read from the checkpoint when its file is written, so the peak memory is about
    one file's tensors. Returns the checkpoint's train_state.json."""
    adapter = _hf_adapter(spec)
    folder = str(existing_folder(checkpoint_dir, "checkpoint folder"))
    stored, args, train_state = _dcp_model_metadata(folder, spec)
    items, hf_names = [], {}
    for name, md in stored.items():
        converted = adapter.tensor_to_hf(name, torch.empty(md.size, dtype=dtype, device="meta"), args)
        if converted:
            hf_names[name] = list(converted)
            items.append((name, sum(t.numel() for t in converted.values()) * dtype.itemsize, 0))
    files = group_into_files(items, max_shard_bytes)
    names = file_names(len(files))
    with staging(output) as tmp:
        write_json(tmp / HF_CONFIG, adapter.config(args, dtype, bos_id, eos_id))
        for file, file_items in zip(names, files):
            tensors = {}
            for name in file_items:
                whole = _read_dcp_tensor(folder, name, stored[name])
                tensors.update(
                    {k: v.to(dtype).contiguous() for k, v in adapter.tensor_to_hf(name, whole, args).items()}
                )
                del whole
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            del tensors
        if len(files) > 1:
            weight_map = {hf: file for file, file_items in zip(names, files) for n in file_items for hf in hf_names[n]}
            write_json(
                tmp / HF_INDEX, {"metadata": {"total_size": sum(n for _, n, _ in items)}, "weight_map": weight_map}
            )
    return train_state


def hf_to_dcp(hf_folder: str | os.PathLike, output: str | os.PathLike, spec: ModelSpec, flavor: str = "custom"):
    """Write a Hugging Face folder as a model-only step-0 checkpoint, one tensor at a time: DCP asks
    for each tensor as it writes it (_StreamingSavePlanner), which is read and converted then. Returns
    (the number of tensors, the args)."""
    adapter = _hf_adapter(spec)
    args = check_hf_folder(hf_folder, adapter)
    hf = HFFolder(hf_folder)
    present = frozenset(hf.shapes)
    shapes = adapter.from_hf(hf.meta(), args)  # our names -> meta tensors of the right shape and dtype

    def load(name: str) -> torch.Tensor:
        sources = adapter.hf_names(name, args, present)
        return adapter.tensor_from_hf(name, {n: hf.read(n) for n in sources}, args).contiguous()

    placeholders = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in shapes.items()}
    with staging(output) as tmp:
        with _single_process_dcp():
            # One file per tensor: DCP keeps a file's tensors until the file is written.
            writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False)
            dcp.save({"model": placeholders}, storage_writer=writer, planner=_StreamingSavePlanner(load), no_dist=True)
        dtypes = {str(t.dtype).removeprefix("torch.") for t in placeholders.values() if t.is_floating_point()}
        train_state = train_state_record(
            step=0,
            tokens=0,
            model_only=True,
            world_size=1,
            model={"name": spec.name, "flavor": flavor, "args": asdict(args)},
            dtype=sorted(dtypes)[0] if len(dtypes) == 1 else "mixed",
        )
        write_json(tmp / STATE_FILE, train_state)
        write_checksums(str(tmp), rank=0)
    return len(placeholders), args


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's planner over a state dict of meta placeholders: each tensor is made (`load(our name)`)
    only when DCP writes it."""

    def __init__(self, load):
        super().__init__()
        self.load = load

    def lookup_object(self, index):
        return self.load(index.fqn.removeprefix("model."))


def _dcp_model_metadata(folder: str, spec: ModelSpec):
    """(our name -> stored TensorStorageMetadata of the model part, args, train_state) of a step-N
    folder, checked against the args it records."""
    # The trainer's readers check completeness and format, and unpickle .metadata with an allow-list.
    metadata = read_metadata(folder).state_dict_metadata
    train_state = read_train_state(folder)
    args = model_args_from_train_state(train_state, spec, os.path.join(folder, STATE_FILE))
    stored = {
        key.removeprefix("model."): md
        for key, md in metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    check_shapes(
        {k: tuple(md.size) for k, md in stored.items()},
        meta_shapes(spec, args),
        folder,
        f"its {STATE_FILE} describes another model; the checkpoint is damaged",
    )
    return stored, args, train_state


def _read_dcp_tensor(folder: str, name: str, md) -> torch.Tensor:
    """One tensor of a step-N folder's model part (only its bytes are read)."""
    t = torch.empty(md.size, dtype=md.properties.dtype)
    with _single_process_dcp():
        dcp.load({"model": {name: t}}, storage_reader=SafeFileSystemReader(folder), no_dist=True)
    return t


def model_args_from_train_state(train_state: dict, spec: ModelSpec, where):
    model = train_state.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("args"), dict):
        raise UserError(f"{where} has no 'model.args' object; was it written by torchtitan's trainer?")
    if model.get("name") != spec.name:
        raise UserError(f"{where} is for model '{model.get('name')}', not '{spec.name}'")
    try:
        return spec.args_from_dict(model["args"])
    except (KeyError, TypeError) as e:
        raise UserError(
            f"{where}: model args do not fit model '{spec.name}' ({e}); it was written by another torchtitan version"
        ) from None


@contextmanager
def _single_process_dcp():
    # DCP warns about running without a process group even when asked to with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
