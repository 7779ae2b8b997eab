"""Values combined over every rank of the job (a no-op without a process group): the elementwise maximum
of a tensor, and every rank's picklable object."""

import torch
import torch.distributed as dist


def max_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """In place: the elementwise maximum of `x` over every rank of the job."""
    if dist.is_initialized():
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank; [obj] without a process group."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
