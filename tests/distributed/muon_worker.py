"""Worker for test_muon.py's spread orthogonalization: Muon on DTensors against Muon on whole tensors.

    torchrun --nproc_per_node 4 tests/distributed/muon_worker.py OUT.json

For each case (a mesh, placements, parameter shapes, some uneven or with ranks holding nothing),
every rank builds the same seeded parameters and gradients, distributes them, and takes 3 Muon steps
with the Newton-Schulz spread over the ranks, and 3 with it repeated on every rank (spread=False).
Rank 0 writes OUT.json: {case: {"equal_spread": this rank's parameters after the spread steps equal
their part of one process's, bit for bit, on every rank; "equal_repeated": the same without
spreading; "calls": [Newton-Schulz calls per rank with spreading]; "calls_repeated": [without]}}.
"""

import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import torchtitan.components.muon as muon
from torchtitan.distributed.process_group import destroy_distributed, exit_process

# name: (mesh shape, placements, parameter shapes)
CASES = {
    "fsdp4_rows": ((4,), [Shard(0)], [(16, 8), (10, 6), (6, 10), (3, 5), (8, 16)]),
    "tp4_cols": ((4,), [Shard(1)], [(16, 8), (10, 6), (6, 10), (8, 16)]),
    "fsdp4_experts": ((4,), [Shard(1)], [(3, 10, 6), (2, 8, 8)]),
    "hsdp2x2": ((2, 2), [Replicate(), Shard(0)], [(16, 8), (9, 6), (6, 10), (8, 16)]),
    "ep2_fsdp2": ((2, 2), [Shard(0), Shard(1)], [(4, 10, 6), (2, 8, 8)]),
    "rows_and_cols": ((2, 2), [Shard(0), Shard(1)], [(16, 8), (9, 6)]),  # split over two mesh dims: repeated
}


def counted_newton_schulz(counter: list):
    plain = muon.newton_schulz

    def run(x, steps, dtype=torch.bfloat16):
        counter[0] += 1
        return plain(x, steps, dtype)

    return run


def steps(params, grads, spread: bool, counter: list) -> list[torch.Tensor]:
    opt = muon.MuonAdamW([{"params": params, "algorithm": "muon"}], lr=0.02, weight_decay=0.1, spread=spread)
    for g in grads:
        for p, grad in zip(params, g):
            p.grad = grad
        opt.step()
    return params


def case(mesh_shape, placements, shapes) -> dict:
    mesh = init_device_mesh("cpu", mesh_shape)
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    counter = [0]
    muon.newton_schulz = counted_newton_schulz(counter)
    reference = steps([torch.nn.Parameter(w.clone()) for w in whole], grads, False, [0])
    out = {}
    for spread in (True, False):
        counter[0] = 0
        params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, placements)) for w in whole]
        sharded = [[distribute_tensor(g, mesh, placements) for g in step] for step in grads]
        steps(params, sharded, spread, counter)
        equal = all(
            torch.equal(p.to_local(), distribute_tensor(r.detach(), mesh, placements).to_local())
            for p, r in zip(params, reference)
        )
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, (equal, counter[0]))
        suffix = "spread" if spread else "repeated"
        out[f"equal_{suffix}"] = all(f[0] for f in flags)
        out["calls" if spread else "calls_repeated"] = [f[1] for f in flags]
    return out


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    results = {name: case(*spec) for name, spec in CASES.items()}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    destroy_distributed()
    exit_process(0)
