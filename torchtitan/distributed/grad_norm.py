"""Gradient clipping by the global norm over every rank, for plain tensors and DTensors alike (FSDP/TP
shards, expert-parallel meshes, pipeline stages)."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None, not_counted=()) -> torch.Tensor:
    """Clip gradients by their global 2-norm over all ranks; returns the norm before clipping.

    Sharded (DTensor) gradients give a DTensor norm whose full value is the norm over every FSDP/TP
    shard. With pipeline stages, each rank holds other parameters: the squares of the stage norms
    are summed over `pp_group`. `not_counted`: parameters clipped but left out of the norm (the
    copies of a weight shared across stages, which another copy counts). max_norm = 0 only
    measures the norm.
    """
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in not_counted}
    # Gradients on different meshes (expert-parallel experts beside the dense weights) cannot meet in
    # one norm kernel: take each mesh's norm, then combine them.
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        # Every p has a gradient (params); the test narrows the type.
        counted = [p.grad for p in group if id(p) not in skip and p.grad is not None]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        total = norms[0]
    elif norms:
        total = torch.stack([n.float() for n in norms]).square().sum().sqrt()
    else:  # nothing counted here (a stage holding only copies counted elsewhere, or no gradients)
        total = torch.zeros((), dtype=torch.float32, device=params[0].grad.device if params else None)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        squares = total.float() ** 2
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=pp_group)
        total = squares.sqrt()
    if max_norm > 0 and params:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
