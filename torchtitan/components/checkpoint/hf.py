"""Hugging Face model folders (config.json + safetensors), model-agnostic: a family's names, layouts
and config.json come from its spec's HFAdapter.

`HFFolder` reads a folder's safetensors headers (what `check_hf_folder` refuses before any weight
is read) and then single tensors or blocks of them; the trainer's sharded load and save build on it
(hf_sharded.py). `save_hf` and `load_hf` move whole state dicts in one process, on CPU tensors.
Exports are written into a hidden sibling folder and renamed into place at the end: a crash never
leaves a half-written folder under the final name. Tensors come only from safetensors files, never
from a pickle.
"""

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from torchtitan.components.checkpoint.storage import existing_folder, staging, write_json
from torchtitan.config.errors import UserError
from torchtitan.models.common.hf_conversion import hf_text_config
from torchtitan.models.common.spec import HFAdapter, ModelSpec

HF_CONFIG = "config.json"
HF_SINGLE_FILE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
LANGUAGE_MODEL = "model.language_model."  # where a multimodal folder keeps its language model


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
    shards = group_into_files([(n, t.numel() * dtype.itemsize, 0) for n, t in hf_sd.items()], max_shard_bytes)
    with staging(folder) as tmp:
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


def group_into_files(items: Sequence[tuple[str, int, object]], max_shard_bytes: int) -> list[list[str]]:
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
    folder = existing_folder(folder, "Hugging Face model folder")
    return _read_json(folder / HF_CONFIG, "is this a Hugging Face model folder (config.json + *.safetensors)?")


# Weights a model can take (cast to its parameters' dtype when loaded).
# U8: packed quantized weights (gpt-oss's MXFP4 blocks and scales), which only a family's adapter that
# dequantizes them may take (check_hf_folder refuses a uint8 tensor that would reach the model as it is).
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "U8": torch.uint8,
}


class HFFolder:
    """The safetensors of a Hugging Face folder, from their headers alone: which file holds each tensor,
    its shape and dtype. Opening checks what can be checked without reading a weight: the index's
    files exist and are readable safetensors, every tensor it lists is in its file, every dtype is
    one a model can take. Tensors are then read one at a time, whole or a slice of one (only those
    bytes), from the file's memory map, which is closed after each read."""

    def __init__(self, folder: str | os.PathLike):
        folder = existing_folder(folder, "Hugging Face model folder")
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
                    for name in f.keys():  # noqa: SIM118 (a safetensors file, not a dict: no `in`)
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
                raise UserError(
                    f"{path} is not a readable safetensors file ({e}); download or export it again"
                ) from None
        if weight_map is not None:
            absent = [n for n, file in weight_map.items() if self.file_of.get(n) != file]
            if absent:
                raise UserError(
                    f"{index} lists tensors missing from their files: {', '.join(absent[:5])}; is the download "
                    "complete?"
                )
        self.stored = {name: name for name in self.file_of}  # the name a tensor is read by -> its name in the file
        if any(name.startswith(LANGUAGE_MODEL) for name in self.file_of):
            self._language_model_only()

    def _language_model_only(self):
        """A multimodal folder (transformers' *ForConditionalGeneration, e.g. Qwen3.5's) keeps its language model
        under model.language_model.: present those tensors as a text model's (model.X) with the ones outside
        model. (lm_head.weight), and leave the rest (the vision tower) unread."""
        kept = {}
        for name in self.file_of:
            if name.startswith(LANGUAGE_MODEL):
                kept["model." + name[len(LANGUAGE_MODEL) :]] = name
            elif not name.startswith("model."):
                kept[name] = name
        self.stored = kept
        self.file_of = {n: self.file_of[s] for n, s in kept.items()}
        self.shapes = {n: self.shapes[s] for n, s in kept.items()}
        self.dtypes = {n: self.dtypes[s] for n, s in kept.items()}

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
                return f.get_tensor(self.stored[name])
            assert shape is not None, "a block is read by its offset and shape"
            return f.get_slice(self.stored[name])[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


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


def check_hf_folder(
    folder: str | os.PathLike, adapter: HFAdapter, expected_shapes: dict[str, tuple] | None = None, args=None
):
    """Everything that can be refused before a weight is read: the config's family, the files, the
    dtypes, the tensor names and shapes (the adapter's conversion for `args`, default the config's,
    run on meta tensors) against `expected_shapes` (our name -> shape). Returns the args of its config.json."""
    # The language model's settings (a multimodal folder's text_config), as spec_for_hf_config and the
    # trainer's vocabulary read them: the adapter gets the text model's config, whatever the layout.
    text = hf_text_config(read_hf_config(folder), str(Path(folder) / HF_CONFIG))
    if text.get("model_type", adapter.model_types[0]) not in adapter.model_types:
        raise UserError(
            f"{Path(folder) / HF_CONFIG} describes model_type {text.get('model_type')!r}, but this model reads "
            f"{' or '.join(map(repr, adapter.model_types))}; choose the matching model.name"
        )
    hf_args = adapter.args_from_config(text)
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


def meta_shapes(spec: ModelSpec, args) -> dict[str, tuple]:
    """Our name -> shape of every tensor in the state dict of a model built with `args`."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in spec.model_cls(args).state_dict().items()}


def check_shapes(
    found: dict[str, tuple],
    expected: dict[str, tuple],
    where: str,
    fix: str = "choose the model flavor they were made for",
):
    """UserError naming the first keys whose presence or shape differs from `expected`."""
    problems = [
        f"{k}: missing" if k not in found else f"{k}: expected {shape}, found {found[k]}"
        for k, shape in expected.items()
        if found.get(k) != shape
    ]
    problems += [f"{k}: not in the model" for k in found if k not in expected]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"the weights in {where} do not fit the model: {'; '.join(problems[:5])}{more}; {fix}")


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
