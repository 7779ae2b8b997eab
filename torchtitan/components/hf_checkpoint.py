"""Model weights on disk outside the training loop: Hugging Face folders (config.json + safetensors)
and model-only reads/writes of our distributed checkpoints (DCP step-N folders + train_state.json).
Model-agnostic: a family's names, layouts and config.json come from its spec's HFAdapter.

`HFFolder` reads a folder's safetensors headers (what `check_hf_folder` refuses before any weight
is read) and then single tensors or blocks of them; the trainer's sharded load and save build on it
(hf_sharded.py). Everything else here runs in one process on CPU tensors, without a process group
(DCP with no_dist=True): whole state dicts (save_hf, load_hf, read_dcp_model, write_dcp_model), or
one tensor at a time (dcp_to_hf, hf_to_dcp: scripts/convert_checkpoint.py). Step-N folders are read with the trainer's own checks
(torchtitan.components.checkpoint: completeness, format version, an allow-list unpickler for DCP's
.metadata) and written in its train_state.json format. Exports are written into a hidden sibling
folder and renamed into place at the end: a crash never leaves a half-written folder under the
final name. Tensors come only from safetensors or DCP data files, never from a pickle.
"""

import json
import math
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.components import checkpoint
from torchtitan.config.errors import UserError
from torchtitan.models.common.spec import HFAdapter, ModelSpec

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
    shards = plan_files([(n, t.numel() * dtype.itemsize, 0) for n, t in hf_sd.items()], max_shard_bytes)
    with _staging(folder) as tmp:
        write_json(tmp / HF_CONFIG, adapter.config(args, dtype, bos_id, eos_id))
        files = file_names(len(shards))
        for file, names in zip(files, shards):
            # Cast one shard at a time so that at most one shard's copy is in memory.
            tensors = {n: hf_sd[n].detach().to("cpu", dtype).contiguous() for n in names}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        if len(shards) > 1:
            total = sum(t.numel() for t in hf_sd.values()) * dtype.itemsize
            weight_map = {n: file for file, names in zip(files, shards) for n in names}
            write_json(tmp / HF_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return Path(folder)


def plan_files(items: list[tuple[str, int, object]], max_shard_bytes: int) -> list[list[str]]:
    """Files of consecutive (name, bytes, group) items: at most max_shard_bytes each (a larger tensor
    gets a file of its own), and never two groups in one file (a group: a pipeline stage's tensors)."""
    shards, size, group = [[]], 0, None
    for name, nbytes, item_group in items:
        if shards[-1] and (size + nbytes > max_shard_bytes or item_group != group):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
        group = item_group
    return shards


def file_names(count: int) -> list[str]:
    """The hub's file names for `count` safetensors files."""
    if count == 1:
        return [HF_SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def read_hf_config(folder: str | os.PathLike) -> dict:
    folder = _existing_folder(folder, "Hugging Face model folder")
    return _read_json(folder / HF_CONFIG, "is this a Hugging Face model folder (config.json + *.safetensors)?")


# Weights a model can take (cast to its parameters' dtype when loaded).
# U8: packed quantized weights (gpt-oss's MXFP4 blocks and scales), which only a family's adapter that
# dequantizes them may take (check_hf_folder refuses a uint8 tensor that would reach the model as it is).
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                       "U8": torch.uint8}


class HFFolder:
    """The safetensors of a Hugging Face folder, from their headers alone: which file holds each tensor,
    its shape and dtype. Opening checks what can be checked without reading a weight: the index's
    files exist and are readable safetensors, every tensor it lists is in its file, every dtype is
    one a model can take. Tensors are then read one at a time, whole or a slice of one (only those
    bytes), from the file's memory map, which is closed after each read."""

    def __init__(self, folder: str | os.PathLike):
        folder = _existing_folder(folder, "Hugging Face model folder")
        self.folder = folder
        index = folder / HF_INDEX
        if index.is_file():
            weight_map = _read_json(index, "re-export the model").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise UserError(f"{index} has no 'weight_map' object of tensor name -> file; re-export the model")
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
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise UserError(f"{index} names {', '.join(missing[:3])}, which does not exist; is the download complete?")
        self.file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for file in files:
            path = folder / file
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        piece = f.get_slice(name)
                        kind = piece.get_dtype()
                        if kind not in _SAFETENSORS_DTYPES:
                            raise UserError(
                                f"{path}: tensor {name} is stored as {kind}, which a model cannot take (float32, "
                                f"bfloat16, float16 or float64, or uint8 packed weights that the family dequantizes); "
                                f"convert the weights to one of those first"
                            )
                        self.file_of[name] = file
                        self.shapes[name] = tuple(piece.get_shape())
                        self.dtypes[name] = _SAFETENSORS_DTYPES[kind]
            except SafetensorError as e:
                raise UserError(f"{path} is not a readable safetensors file ({e}); download or export it again") from None
        if weight_map is not None:
            absent = [n for n, file in weight_map.items() if self.file_of.get(n) != file]
            if absent:
                raise UserError(
                    f"{index} lists tensors missing from their files: {', '.join(absent[:5])}; is the download "
                    "complete?"
                )

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * self.dtypes[n].itemsize for n, shape in self.shapes.items())

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor as a meta tensor of its shape and dtype (for checks that read no weight)."""
        return {n: torch.empty(shape, dtype=self.dtypes[n], device="meta") for n, shape in self.shapes.items()}

    def read(self, name: str, offset: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None):
        """Tensor `name`, or its block of `shape` starting at `offset` (only those bytes are read)."""
        with safe_open(str(self.folder / self.file_of[name]), framework="pt") as f:
            if offset is None:
                return f.get_tensor(name)
            return f.get_slice(name)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def load_hf(
    folder: str | os.PathLike, adapter: HFAdapter, expected_shapes: dict[str, tuple] | None = None
) -> tuple[dict[str, torch.Tensor], object]:
    """Read a Hugging Face folder into our names, in the stored dtype, with the args of its
    config.json, in one process (the whole model in memory: scripts/convert_checkpoint.py). With
    `expected_shapes` (our name -> shape), every tensor must fit them."""
    hf_args = check_hf_folder(folder, adapter, expected_shapes)
    hf = HFFolder(folder)
    sd = adapter.from_hf({name: hf.read(name) for name in hf.shapes}, hf_args)
    return sd, hf_args


def check_hf_folder(folder: str | os.PathLike, adapter: HFAdapter, expected_shapes: dict[str, tuple] | None = None,
                    args=None):
    """Everything that can be refused before a weight is read: the config's family, the files, the
    dtypes, the tensor names and shapes (the adapter's conversion for `args`, default the config's,
    run on meta tensors) against `expected_shapes` (our name -> shape). Returns the args of its config.json."""
    config = read_hf_config(folder)
    if config.get("model_type", adapter.model_types[0]) not in adapter.model_types:
        raise UserError(
            f"{Path(folder) / HF_CONFIG} describes model_type {config.get('model_type')!r}, but this model reads "
            f"{' or '.join(map(repr, adapter.model_types))}; choose the matching model.name"
        )
    hf_args = adapter.args_from_config(config)
    ours = adapter.from_hf(HFFolder(folder).meta(), args if args is not None else hf_args)
    packed = [name for name, t in ours.items() if not t.is_floating_point()]
    if packed:
        raise UserError(
            f"{folder}: our {packed[0]} would be read from packed integer (uint8) data, which this family's import "
            f"does not dequantize; convert the weights to float32 or bfloat16 first"
        )
    if expected_shapes is not None:
        check_shapes({k: tuple(v.shape) for k, v in ours.items()}, expected_shapes, str(folder))
    return hf_args


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
    stored, args, train_state = _dcp_model_metadata(folder, spec)
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
        write_json(tmp / TRAIN_STATE, train_state)
        checkpoint.write_checksums(str(tmp), rank=0)
    return Path(folder)


def dcp_to_hf(checkpoint_dir: str | os.PathLike, output: str | os.PathLike, spec: ModelSpec, dtype: torch.dtype,
              max_shard_bytes: int = 5 * 2**30, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """Export the model part of a step-N checkpoint as a Hugging Face folder, one tensor at a time:
    each tensor is read from the checkpoint when its file is written, so the peak memory is about
    one file's tensors. Returns the checkpoint's train_state.json."""
    folder = str(_existing_folder(checkpoint_dir, "checkpoint folder"))
    stored, args, train_state = _dcp_model_metadata(folder, spec)
    items, hf_names = [], {}
    for name, md in stored.items():
        converted = spec.hf.tensor_to_hf(name, torch.empty(md.size, dtype=dtype, device="meta"), args)
        if converted:
            hf_names[name] = list(converted)
            items.append((name, sum(t.numel() for t in converted.values()) * dtype.itemsize, 0))
    files = plan_files(items, max_shard_bytes)
    names = file_names(len(files))
    with _staging(output) as tmp:
        write_json(tmp / HF_CONFIG, spec.hf.config(args, dtype, bos_id, eos_id))
        for file, file_items in zip(names, files):
            tensors = {}
            for name in file_items:
                whole = _read_dcp_tensor(folder, name, stored[name])
                tensors.update({k: v.to(dtype).contiguous() for k, v in spec.hf.tensor_to_hf(name, whole, args).items()})
                del whole
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            del tensors
        if len(files) > 1:
            weight_map = {hf: file for file, file_items in zip(names, files) for n in file_items for hf in hf_names[n]}
            write_json(tmp / HF_INDEX, {"metadata": {"total_size": sum(n for _, n, _ in items)},
                                        "weight_map": weight_map})
    return train_state


def hf_to_dcp(hf_folder: str | os.PathLike, output: str | os.PathLike, spec: ModelSpec, flavor: str = "custom"):
    """Write a Hugging Face folder as a model-only step-0 checkpoint, one tensor at a time: DCP asks
    for each tensor as it writes it (_StreamingSavePlanner), which is read and converted then. Returns
    (the number of tensors, the args)."""
    args = check_hf_folder(hf_folder, spec.hf)
    hf = HFFolder(hf_folder)
    present = frozenset(hf.shapes)
    shapes = spec.hf.from_hf(hf.meta(), args)  # our names -> meta tensors of the right shape and dtype

    def load(name: str) -> torch.Tensor:
        sources = spec.hf.hf_names(name, args, present)
        return spec.hf.tensor_from_hf(name, {n: hf.read(n) for n in sources}, args).contiguous()

    placeholders = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in shapes.items()}
    with _staging(output) as tmp:
        with _single_process_dcp():
            # One file per tensor: DCP keeps a file's tensors until the file is written.
            writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False)
            dcp.save({"model": placeholders}, storage_writer=writer, planner=_StreamingSavePlanner(load), no_dist=True)
        dtypes = {str(t.dtype).removeprefix("torch.") for t in placeholders.values() if t.is_floating_point()}
        train_state = checkpoint.train_state_record(
            step=0, tokens=0, model_only=True, world_size=1,
            model={"name": spec.name, "flavor": flavor, "args": asdict(args)},
            dtype=sorted(dtypes)[0] if len(dtypes) == 1 else "mixed",
        )
        write_json(tmp / TRAIN_STATE, train_state)
        checkpoint.write_checksums(str(tmp), rank=0)
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
    return stored, args, train_state


def _read_dcp_tensor(folder: str, name: str, md) -> torch.Tensor:
    """One tensor of a step-N folder's model part (only its bytes are read)."""
    t = torch.empty(md.size, dtype=md.properties.dtype)
    with _single_process_dcp():
        dcp.load({"model": {name: t}}, storage_reader=checkpoint.SafeFileSystemReader(folder), no_dist=True)
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


def write_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
