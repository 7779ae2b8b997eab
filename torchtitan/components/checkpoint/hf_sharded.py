"""Hugging Face weights in and out of a parallelized model, one tensor at a time, on every rank at once.

No rank ever holds the whole model. Under any layout (FSDP, HSDP, TP, PP with any schedule, CP, EP)
each rank's model parts hold DTensor shards or, under PP alone, whole tensors of their stages'
modules; both directions walk those tensors in order through the family's per-tensor conversion
(spec.HFAdapter: hf_names, tensor_from_hf, tensor_to_hf).

Load (`load_hf_into`): everything that can be refused is refused first, from the files' headers
(hf.check_hf_folder). Then each rank reads, for each tensor it holds, only what it needs:
where the rank holds a block of our tensor, just the bytes of that block: of the one Hugging Face
tensor it renames (the adapter returns its input unchanged), or, for a layout change (the rotary
permutation of Llama's q/k, experts stacked from one tensor per expert or sliced from a fused one),
those the family's HFAdapter.block_from_hf reads (the heads' rows, the block's experts). Otherwise (a
shard that is not one block, such as FSDP over TP's rows; a conversion without block_from_hf) the
source tensors of that one tensor, from which the rank keeps its shard. Peak memory above the
model's own shards: about one tensor.

Save (`save_hf_sharded`): the files are planned identically on every rank from the model's shapes:
consecutive tensors up to max_shard_bytes, a file never spanning two pipeline stages. Each file has
one writer among the ranks of its stage (round robin over them, so the stage's ranks write its files
in parallel); for each tensor of a file, the ranks that hold a block of it send their block to the
writer (point to point), so only the writer ever holds it whole. A writer holds at most one file's
tensors and one whole tensor. Rank 0 writes config.json, generation_config.json, the index and the tokenizer's files.
"""

import logging
import math
import os
import shutil
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from torchtitan.components.checkpoint.hf import (
    HF_CONFIG,
    HF_INDEX,
    HFFolder,
    check_hf_folder,
    file_names,
    group_into_files,
)
from torchtitan.components.checkpoint.storage import check_output_folder, open_to_readers, write_json
from torchtitan.components.tokenizer_export import export_tokenizer
from torchtitan.config.errors import UserError
from torchtitan.models.common.init import local_block
from torchtitan.models.common.spec import HFAdapter

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def _owned_tensors(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Our name -> this rank's tensor (a DTensor shard or a whole tensor) of every model part; a
    tensor two names share (tied embeddings) appears under both."""
    return {name: t for part in parts for name, t in part.state_dict().items()}


def load_hf_into(
    parts: list[nn.Module], folder: str | os.PathLike, adapter: HFAdapter, args, expected_shapes: dict[str, tuple]
) -> dict:
    """Fill this rank's model parts from a Hugging Face folder. Returns {bytes_read: by this rank,
    folder_bytes: the folder's tensors, peak_growth: this process's peak resident memory above its
    size when the load began (Linux; None elsewhere)}."""
    check_hf_folder(folder, adapter, expected_shapes)
    hf = HFFolder(folder)
    present = frozenset(hf.shapes)
    read = 0

    def read_block(hf_name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal read
        piece = hf.read(hf_name, offset, shape)
        read += piece.numel() * piece.element_size()
        return piece

    before = restart_peak_rss()
    filled = set()
    with torch.no_grad():
        for name, target in _owned_tensors(parts).items():
            local = target.to_local() if isinstance(target, DTensor) else target
            if local.numel() == 0:
                continue
            sources = adapter.hf_names(name, args, present)
            # Tied embeddings: the output layer is the embedding's own tensor, already filled from
            # the same sources (a stored lm_head.weight makes other sources: tensor_from_hf checks it).
            key = (local.data_ptr(), tuple(local.shape), tuple(sources))
            if key in filled:
                continue
            filled.add(key)
            block = local_block(target) if isinstance(target, DTensor) else None
            piece = None
            if block is not None:
                shape, offset = block
                if len(sources) == 1 and _is_rename(adapter, name, sources[0], hf, args):
                    piece = read_block(sources[0], offset, shape)
                elif sources and adapter.block_from_hf is not None:
                    piece = adapter.block_from_hf(name, read_block, args, present, offset, shape)
            if piece is None:
                inputs = {n: hf.read(n) for n in sources}
                read += sum(t.numel() * t.element_size() for t in inputs.values())
                piece = adapter.tensor_from_hf(name, inputs, args)
                del inputs
                if isinstance(target, DTensor):
                    # No communication: every rank holds the whole tensor and keeps its own shard.
                    piece = distribute_tensor(piece, target.device_mesh, target.placements, src_data_rank=None)
                    piece = piece.to_local()
            local.copy_(piece)
    growth = None if before is None else peak_rss() - before
    return {"bytes_read": read, "folder_bytes": hf.nbytes, "peak_growth": growth}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1])


def restart_peak_rss() -> int | None:
    """Restart the kernel's count of this process's peak resident memory (VmHWM) from its current
    size, which is returned in bytes; None where /proc cannot do that (not Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS:") * 1024
    except (OSError, StopIteration):
        return None


def peak_rss() -> int:
    """This process's peak resident memory in bytes since restart_peak_rss (Linux)."""
    return _status_kib("VmHWM:") * 1024


def _is_rename(adapter: HFAdapter, name: str, source: str, hf: HFFolder, args) -> bool:
    """Whether our tensor `name` is the Hugging Face tensor `source` itself: the adapter returns its
    (meta) input object unchanged, so a block of ours is the same block of the file's."""
    probe = torch.empty(hf.shapes[source], dtype=hf.dtypes[source], device="meta")
    return adapter.tensor_from_hf(name, {source: probe}, args) is probe


def _stage_ranks(mesh: DeviceMesh | None) -> tuple[int, list[list[int]]]:
    """(this rank's pipeline-stage index, the global ranks of each stage). Without a mesh, one stage
    of rank 0; without PP, one stage of every rank."""
    if mesh is None:
        return 0, [[0]]
    ranks = mesh.mesh
    dim_names = mesh.mesh_dim_names or ()
    if "pp" in dim_names:
        pp_dim = dim_names.index("pp")
        ranks = ranks.movedim(pp_dim, 0)
        stages = [r.flatten().tolist() for r in ranks]
        mine = next(i for i, r in enumerate(stages) if dist.get_rank() in r)
        return mine, stages
    return 0, [ranks.flatten().tolist()]


def save_hf_sharded(
    folder: str | os.PathLike,
    parts: list[nn.Module],
    adapter: HFAdapter,
    args,
    model_shapes: dict[str, tuple],
    dtype: torch.dtype,
    mesh: DeviceMesh | None = None,
    max_shard_bytes: int = 5 * 2**30,
    bos_id: int | None = None,
    eos_id: int | None = None,
    tokenizer_path: str | None = None,
) -> dict:
    """Write the model held by every rank's parts as a Hugging Face folder (the hub's layout). All ranks
    call it. `model_shapes`: our name -> shape of the whole model, in model order (the same on every
    rank); `mesh`: the job's DeviceMesh (None: one process). Returns {files: this rank wrote}."""
    folder = Path(folder).resolve()
    check_output_folder(folder)
    # First, on every rank: what the format cannot express (the adapter refuses it) stops the export before a byte
    # is written and on all ranks at once (preflight checks it before launch too: check_hf_export).
    config = adapter.config(args, dtype, bos_id, eos_id)
    rank = dist.get_rank() if dist.is_initialized() else 0
    held = _owned_tensors(parts)
    stage, stage_ranks = _stage_ranks(mesh)
    # Which stage holds each of our tensors: each stage says what it holds (names only).
    holdings = [sorted(held)]
    if len(stage_ranks) > 1:
        assert mesh is not None  # several stages come from the mesh's pp dimension
        gathered: list = [None] * len(stage_ranks)  # all_gather_object fills in each stage's names
        dist.all_gather_object(gathered, sorted(held), group=mesh["pp"].get_group())
        holdings = gathered
    stage_of = {name: s for s, names in enumerate(holdings) for name in names}

    # The plan, identical on every rank: each of our tensors' Hugging Face tensors (meta), grouped into files.
    hf_shapes: dict[str, dict[str, tuple]] = {}
    items = []
    for name, shape in model_shapes.items():
        converted = adapter.tensor_to_hf(name, torch.empty(shape, device="meta", dtype=dtype), args)
        if converted:
            hf_shapes[name] = {k: tuple(v.shape) for k, v in converted.items()}
            items.append((name, sum(v.numel() for v in converted.values()) * dtype.itemsize, stage_of[name]))
    files = group_into_files(items, max_shard_bytes)
    names = file_names(len(files))
    writers = []
    for i, file_items in enumerate(files):
        ranks = stage_ranks[stage_of[file_items[0]]]
        writers.append(ranks[i % len(ranks)])

    tmp = folder.with_name(f".{folder.name}.partial")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left behind by a killed export
        tmp.mkdir(parents=True)
    _barrier()
    written = []
    with torch.no_grad():
        for file, file_items, writer in zip(names, files, writers):
            if stage_of[file_items[0]] != stage:
                continue
            tensors = {}
            for name in file_items:
                whole = _whole_on(held[name], writer, dtype)
                if rank == writer:
                    assert whole is not None  # _whole_on gives the writer the whole tensor
                    tensors.update(
                        {k: v.to("cpu", dtype).contiguous() for k, v in adapter.tensor_to_hf(name, whole, args).items()}
                    )
                del whole
            if rank == writer:
                save_file(tensors, str(tmp / file), metadata={"format": "pt"})
                written.append(file)
    _barrier()
    if rank == 0:
        write_json(tmp / HF_CONFIG, config)
        generation = {k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id)) if v is not None}
        write_json(tmp / GENERATION_CONFIG, generation)
        if len(files) > 1:
            total = sum(n for _, n, _ in items)
            weight_map = {
                hf: file for file, file_items in zip(names, files) for name in file_items for hf in hf_shapes[name]
            }
            write_json(tmp / HF_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        if tokenizer_path is not None:
            try:
                export_tokenizer(tokenizer_path, tmp)
            except UserError as e:  # the weights are still worth publishing
                logger.warning(f"the export {folder} has no tokenizer: {e}")
        open_to_readers(tmp)
        os.replace(tmp, folder)
    _barrier()
    return {"files": written}


def _whole_on(t: torch.Tensor, writer: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The whole of our tensor `t` in `dtype` on rank `writer` (None elsewhere, but for a plain tensor,
    which every rank holding it has whole). A DTensor's ranks each send their own block, cast to
    `dtype` (an export in bf16 of float32 weights sends and holds half the bytes), to the writer, one
    sender per distinct block (coordinate 0 of every dimension it is replicated over), so no other
    rank ever holds the whole; placements that are not plain blocks are all-gathered."""
    if not isinstance(t, DTensor):
        return t.to(dtype)
    mesh, rank = t.device_mesh, dist.get_rank()
    ranks = mesh.mesh.flatten().tolist()
    # Other ranks' blocks are computed from their coordinates, which needs plain placements.
    if not all(type(p) in (Shard, Replicate) for p in t.placements) or writer not in ranks:
        whole = cast(DTensor, t.to(dtype)).full_tensor()  # a collective over t's mesh (DTensor.to keeps a DTensor)
        return whole if rank == writer else None
    replicated = [i for i, p in enumerate(t.placements) if isinstance(p, Replicate)]
    local = t.to_local().to(dtype)
    whole = torch.empty(t.shape, dtype=dtype, device=local.device) if rank == writer else None
    for flat, sender in enumerate(ranks):
        coordinate = list(torch.unravel_index(torch.tensor(flat), tuple(mesh.mesh.shape)))
        coordinate = [int(c) for c in coordinate]
        if any(coordinate[i] != 0 for i in replicated):
            continue
        shape, offset = _compute_local_shape_and_global_offset(
            t.shape, tuple(mesh.mesh.shape), coordinate, t.placements
        )
        if math.prod(shape) == 0 or rank not in (sender, writer):
            continue
        if rank == sender and sender != writer:
            dist.send(local.contiguous(), dst=writer)
            continue
        assert whole is not None  # this rank is the writer
        if sender == writer:
            whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))].copy_(local)
        else:
            block = torch.empty(shape, dtype=dtype, device=local.device)
            dist.recv(block, src=sender)
            whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))].copy_(block)
    return whole


def _barrier():
    if dist.is_initialized():
        dist.barrier()
