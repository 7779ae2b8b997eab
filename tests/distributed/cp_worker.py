"""Context-parallel attention against single-process causal attention, forward and backward, for
both rotate methods, on a 4-rank CP group and on the 2-rank CP groups of a 2 x 2 mesh, with
grouped-query heads. Rank 0 writes {case: max abs diff of output and of the q, k, v gradients}.

    torchrun --nproc_per_node 4 tests/distributed/cp_worker.py OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.distributed.context_parallel import ContextParallelAttention, local_positions
from torchtitan.distributed.utils import exit_process
from torchtitan.models.attention import sdpa_attention as causal_attention


def compare(cp_mesh, method: str) -> float:
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    torch.manual_seed(0)  # the same full tensors on every rank
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 8 * cp, 16
    q = torch.randn(batch, heads, seq, dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, requires_grad=True)
    grad_out = torch.randn(batch, heads, seq, dim)
    causal_attention(q, k, v).backward(grad_out)
    ref_out = causal_attention(q, k, v).detach()

    pos = local_positions(seq, cp, rank)
    local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = ContextParallelAttention(cp_mesh, method)(*local)
    out.backward(grad_out[:, :, pos])
    diffs = [(out - ref_out[:, :, pos]).abs().max()]
    diffs += [(mine.grad - full.grad[:, :, pos]).abs().max() for mine, full in zip(local, (q, k, v))]
    worst = torch.stack(diffs).max()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def main(out_path: str):
    dist.init_process_group("gloo")
    results = {}
    mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    mesh2x2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    for method in ("allgather", "alltoall"):
        results[f"cp4_{method}"] = compare(mesh4["cp"], method)
        results[f"cp2_{method}"] = compare(mesh2x2["cp"], method)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)
