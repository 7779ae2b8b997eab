"""Model weights on disk outside the training loop: Hugging Face folders (config.json + safetensors)
and model-only reads/writes of our distributed checkpoints (DCP step-N folders + train_state.json).
Model-agnostic: a family's names, layouts and config.json come from its spec's HFAdapter.

Everything here runs in one process on full (unsharded) CPU tensors; DCP is called with
no_dist=True, so no process group is needed. Step-N folders are read with the trainer's own checks
(torchtitan.components.checkpoint: completeness, format version, an allow-list unpickler for DCP's
.metadata) and written in its train_state.json format. Exports are written into a hidden sibling
folder and renamed into place at the end: a crash never leaves a half-written folder under the
final name. Tensors come only from safetensors or DCP data files, never from a pickle.
"""

import json
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.components import checkpoint
from torchtitan.config.errors import UserError
from torchtitan.models.spec import HFAdapter, ModelSpec

HF_CONFIG = "config.json"
HF_SINGLE_FILE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
TRAIN_STATE = checkpoint.STATE_FILE


# ---- Hugging Face folders ----


def save_hf(
    folder: str | os.PathLike,
    sd: dict[str, torch.Tensor],
    adapter: HFAdapter,
    args,
    dtype: torch.dtype,
    max_shard_bytes: int = 5 * 2**30,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> Path:
    """Write `sd` (our names) as a folder that `transformers` loads as the class its config names."""
    hf_sd = adapter.to_hf(sd, args)
    shards = _plan_shards(hf_sd, dtype, max_shard_bytes)
    with _staging(folder) as tmp:
        _write_json(tmp / HF_CONFIG, adapter.config(args, dtype, bos_id, eos_id))
        files = [HF_SINGLE_FILE] if len(shards) == 1 else [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]
        for file, names in zip(files, shards):
            # Cast one shard at a time so that at most one shard's copy is in memory.
            tensors = {n: hf_sd[n].detach().to("cpu", dtype).contiguous() for n in names}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        if len(shards) > 1:
            total = sum(t.numel() for t in hf_sd.values()) * dtype.itemsize
            weight_map = {n: file for file, names in zip(files, shards) for n in names}
            _write_json(tmp / HF_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return Path(folder)


def _plan_shards(hf_sd: dict[str, torch.Tensor], dtype: torch.dtype, max_shard_bytes: int) -> list[list[str]]:
    """Consecutive groups of names of at most max_shard_bytes each (a larger tensor gets a shard of its own)."""
    shards, size = [[]], 0
    for name, t in hf_sd.items():
        nbytes = t.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def read_hf_config(folder: str | os.PathLike) -> dict:
    folder = _existing_folder(folder, "Hugging Face model folder")
    return _read_json(folder / HF_CONFIG, "is this a Hugging Face model folder (config.json + *.safetensors)?")


def load_hf(
    folder: str | os.PathLike, adapter: HFAdapter, expected_shapes: dict[str, tuple] | None = None
) -> tuple[dict[str, torch.Tensor], object]:
    """Read a Hugging Face folder into our names, in the stored dtype, with the args of its
    config.json. With `expected_shapes` (our name -> shape), every tensor must fit them."""
    config = read_hf_config(folder)
    if config.get("model_type", adapter.model_types[0]) not in adapter.model_types:
        raise UserError(
            f"{Path(folder) / HF_CONFIG} describes model_type {config.get('model_type')!r}, but this model reads "
            f"{' or '.join(map(repr, adapter.model_types))}; choose the matching model.name"
        )
    hf_args = adapter.args_from_config(config)
    sd = adapter.from_hf(_read_safetensors(Path(folder)), hf_args)
    if expected_shapes is not None:
        check_shapes({k: tuple(v.shape) for k, v in sd.items()}, expected_shapes, str(folder))
    return sd, hf_args


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / HF_INDEX).is_file():
        weight_map = _read_json(folder / HF_INDEX, "re-export the model").get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{folder / HF_INDEX} has no 'weight_map' object; re-export the model")
        files = sorted(set(weight_map.values()))
    elif (folder / HF_SINGLE_FILE).is_file():
        weight_map, files = None, [HF_SINGLE_FILE]
    elif any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise UserError(
            f"{folder} holds pickled weights (*.bin / *.pt), which are never loaded for safety; "
            "convert them to safetensors first (save_pretrained(..., safe_serialization=True))"
        )
    else:
        raise UserError(f"{folder} has neither {HF_SINGLE_FILE} nor {HF_INDEX}; is the download complete?")

    sd = {}
    for file in files:
        path = folder / file
        if not path.is_file():
            raise UserError(f"{folder / HF_INDEX} names {file}, which does not exist; is the download complete?")
        try:
            sd.update(load_file(str(path)))
        except SafetensorError as e:
            raise UserError(f"{path} is not a readable safetensors file ({e}); download or export it again") from None
    if weight_map is not None:
        absent = [n for n in weight_map if n not in sd]
        if absent:
            raise UserError(f"{folder / HF_INDEX} lists tensors missing from their files: {', '.join(absent[:5])}")
    return sd


# ---- our distributed checkpoints, model part only ----


def meta_shapes(spec: ModelSpec, args) -> dict[str, tuple]:
    """Our name -> shape of every tensor in the state dict of a model built with `args`."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in spec.model_cls(args).state_dict().items()}


def dcp_model_name(folder: str | os.PathLike) -> str:
    """The model family recorded in a step-N checkpoint's train_state.json."""
    folder = str(_existing_folder(folder, "checkpoint folder"))
    name = checkpoint.read_train_state(folder).get("model", {}).get("name")
    if not isinstance(name, str):
        raise UserError(f"{folder}/{TRAIN_STATE} names no model; was it written by torchtitan's trainer?")
    return name


def read_dcp_model(folder: str | os.PathLike, spec: ModelSpec) -> tuple[dict[str, torch.Tensor], object, dict]:
    """Load the model part of a step-N checkpoint of `spec`'s family into full CPU tensors (stored
    dtypes); also return the args recorded in its train_state.json and that whole JSON object."""
    folder = str(_existing_folder(folder, "checkpoint folder"))
    # The trainer's readers check completeness and format, and unpickle .metadata with an allow-list.
    metadata = checkpoint.read_metadata(folder).state_dict_metadata
    train_state = checkpoint.read_train_state(folder)
    args = model_args_from_train_state(train_state, spec, os.path.join(folder, TRAIN_STATE))
    stored = {
        key.removeprefix("model."): md
        for key, md in metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    check_shapes({k: tuple(md.size) for k, md in stored.items()}, meta_shapes(spec, args), folder,
                 f"its {TRAIN_STATE} describes another model; the checkpoint is damaged")
    sd = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in stored.items()}
    with _single_process_dcp():  # reads only the model's tensors, never the optimizer's
        dcp.load({"model": sd}, storage_reader=checkpoint.SafeFileSystemReader(folder), no_dist=True)
    return sd, args, train_state


def write_dcp_model(folder: str | os.PathLike, sd: dict[str, torch.Tensor], spec: ModelSpec, args, flavor: str = "custom") -> Path:
    """Write a model-only step-0 checkpoint (DCP files + train_state.json) that the trainer can start from."""
    with _staging(folder) as tmp:
        with _single_process_dcp():
            dcp.save({"model": sd}, checkpoint_id=str(tmp), no_dist=True)
        train_state = checkpoint.train_state_record(
            step=0, tokens=0, model_only=True, world_size=1,
            model={"name": spec.name, "flavor": flavor, "args": asdict(args)},
            dtype=str(next(iter(sd.values())).dtype).removeprefix("torch."),
        )
        _write_json(tmp / TRAIN_STATE, train_state)
        checkpoint.write_checksums(str(tmp), rank=0)
    return Path(folder)


def model_args_from_train_state(train_state: dict, spec: ModelSpec, where):
    model = train_state.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("args"), dict):
        raise UserError(f"{where} has no 'model.args' object; was it written by torchtitan's trainer?")
    if model.get("name") != spec.name:
        raise UserError(f"{where} is for model '{model.get('name')}', not '{spec.name}'")
    try:
        return spec.args_from_dict(model["args"])
    except (KeyError, TypeError) as e:
        raise UserError(f"{where}: model args do not fit model '{spec.name}' ({e}); it was written by another "
                        "torchtitan version") from None


def check_shapes(
    found: dict[str, tuple], expected: dict[str, tuple], where: str, fix: str = "choose the model flavor they were made for"
):
    """UserError naming the first keys whose presence or shape differs from `expected`."""
    problems = [f"{k}: missing" if k not in found else f"{k}: expected {shape}, found {found[k]}"
                for k, shape in expected.items() if found.get(k) != shape]
    problems += [f"{k}: not in the model" for k in found if k not in expected]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"the weights in {where} do not fit the model: {'; '.join(problems[:5])}{more}; {fix}")


# ---- helpers ----


@contextmanager
def _staging(folder: str | os.PathLike) -> Iterator[Path]:
    """A fresh hidden sibling of `folder`, renamed to `folder` when the block succeeds, deleted if not."""
    folder = Path(folder).resolve()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UserError(f"{folder} already exists and is not empty; choose a new output folder or delete it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left behind by a killed run that had the same pid
    tmp.mkdir()
    try:
        yield tmp
        os.replace(tmp, folder)  # also replaces an existing empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def _single_process_dcp():
    # DCP warns about running without a process group even when asked to with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _existing_folder(folder: str | os.PathLike, what: str) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{what} {folder} does not exist or is not a folder")
    return folder


def _read_json(path: Path, fix: str) -> dict:
    if not path.is_file():
        raise UserError(f"{path} not found; {fix}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a JSON {type(obj).__name__}, not an object; {fix}")
    return obj


def _write_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
