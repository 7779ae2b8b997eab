"""Weight initialization whose values do not depend on the parallel layout.

Each parameter is drawn from its own generator, seeded by (training seed, parameter name). The full
tensor is generated and every rank keeps the part it holds, so a parameter gets the same values
whether it is whole, sharded by FSDP over any number of ranks, or placed on any pipeline stage, and
whatever order the parameters are initialized in. This is what lets every layout be compared with
the single-process run step by step without a seed checkpoint. The cost is one full parameter in
memory at a time.
"""

import hashlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# How a parameter is drawn: fill(full tensor, generator) fills the tensor in place. What it returns is
# not used (torch.nn.init's functions return the tensor).
Init = Callable[[torch.Tensor, torch.Generator], object]


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view: in-place updates write through; gradients flow to this
    part only), or `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def stable_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def local_block(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(shape, global offset) of this rank's block of DTensor `t`, when its local tensor is one block
    of the whole; None otherwise. Plain Shard and Replicate placements always give one block; other
    shardings of a dimension (_StridedShard: FSDP over tensor- or expert-parallel shards of the same
    dimension) often do too, which DTensor's own placement of a small index probe per dimension shows."""
    if all(type(p) in (Shard, Replicate) for p in t.placements):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(shape), tuple(offset)
    shape, offset = [], []
    for dim, size in enumerate(t.shape):
        # Placements of other dimensions leave this one whole; a 1-D probe along it stands for the tensor.
        placements = [p if getattr(p, "dim", None) == dim else Replicate() for p in t.placements]
        probe = torch.arange(size).view([size if d == dim else 1 for d in range(t.dim())])
        held = distribute_tensor(probe, t.device_mesh, placements, src_data_rank=None).to_local().flatten().cpu()
        start = int(held[0]) if held.numel() else 0
        if not torch.equal(held, torch.arange(start, start + held.numel())):
            return None
        shape.append(held.numel())
        offset.append(start)
    return tuple(shape), tuple(offset)


@torch.no_grad()
def seeded_init_(param: torch.Tensor, key: str, seed: int, fill: Init):
    """Fill `param` with `fill(full_tensor, generator)`, keeping only this rank's part of it."""
    if isinstance(param, DTensor):
        full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
        fill(full, torch.Generator(device=full.device).manual_seed(stable_seed(seed, key)))
        block = local_block(param)
        if block is not None:  # a view of the full tensor: no copy but the one into the parameter
            shape, offset = block
            param.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
            return
        # src_data_rank=None: every rank already holds the identical full tensor, so no scatter is needed.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        fill(param, torch.Generator(device=param.device).manual_seed(stable_seed(seed, key)))


def trunc_normal(std: float, cutoff: float = 2.0) -> Init:
    return lambda t, g: torch.nn.init.trunc_normal_(t, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std, generator=g)


def normal(std: float) -> Init:
    return lambda t, g: torch.nn.init.normal_(t, mean=0.0, std=std, generator=g)


def ones() -> Init:
    return lambda t, g: torch.nn.init.ones_(t)


def zeros() -> Init:
    return lambda t, g: torch.nn.init.zeros_(t)
