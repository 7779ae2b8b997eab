"""Worker for test_tensor_parallel.py: trains a tiny llama a few AdamW steps in several tensor-parallel
layouts inside ONE 4-process launch (start-up is the expensive part on CPU), and rank 0 writes each
layout's losses, grad norms and final-weight differences from the single-process run to a JSON file.

    torchrun --nproc_per_node 4 tests/distributed/tp_worker.py out.json

The 4 ranks form a ("dp_shard", "tp") = (2, 2) mesh. The TP-only layouts use the "tp" sub-mesh alone
and feed every rank the whole batch, so each dp pair runs the same TP=2 job; the FSDP x TP layouts
give each dp rank half the batch, identical across the tp ranks of that dp group.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from torchtitan.distributed.fsdp import apply_fsdp
from torchtitan.distributed.tensor_parallel import apply_tp, loss_parallel_context
from torchtitan.distributed.utils import clip_grad_norm_, exit_process
from torchtitan.models.registry import get_model_spec

SPEC = get_model_spec("llama3")  # the family these tests exercise the components with
ModelArgs, Transformer = SPEC.args_cls, SPEC.model_cls

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)
BATCH, SEQ, STEPS = 4, 32, 5
# Small enough that clipping is active on every step (grad norms here stay near 0.73),
# so the clipped path with DTensor gradients is what gets compared.
MAX_NORM = 0.5
LR = 1e-3


def fixed_batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, ARGS.vocab_size, (STEPS, BATCH, SEQ + 1), generator=g)


def build(parallelize) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallelize(model)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def train(model, batches, loss_parallel: bool, dp_mesh=None) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=False, foreach=False)
    losses, norms = [], []
    for tokens in batches:
        if dp_mesh is not None:
            tokens = tokens.chunk(dp_mesh.size())[dp_mesh.get_local_rank()]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with loss_parallel_context(loss_parallel):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
        norm = clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        # Under loss parallel the loss is a replicated DTensor; its local value is the whole loss.
        loss = loss.detach()
        if isinstance(loss, DTensor):
            loss = loss.to_local()
        if dp_mesh is not None:
            dist.all_reduce(loss, group=dp_mesh.get_group())
            loss = loss / dp_mesh.size()
        losses.append(loss.item())
        norms.append(norm.item())
    return {"loss": losses, "grad_norm": norms}


def weights(model) -> dict[str, torch.Tensor]:
    # full_tensor is a collective: every rank must call it, in the same parameter order.
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def main(out_path: str):
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        batches = fixed_batches()

        ref = build(lambda m: None)
        results = {"single": train(ref, batches, loss_parallel=False)}
        ref_weights = weights(ref)

        layouts = {
            "tp2": (False, False),
            "tp2_loss_parallel": (True, False),
            "fsdp2_tp2": (False, True),
            "fsdp2_tp2_loss_parallel": (True, True),
        }
        for name, (lp, fsdp) in layouts.items():

            def parallelize(m, lp=lp, fsdp=fsdp):
                apply_tp(m, mesh["tp"], SPEC.tp_plan, loss_parallel=lp)
                if fsdp:
                    apply_fsdp(m, mesh["dp_shard"], "float32", "float32", "default")

            model = build(parallelize)
            placements = {n: [str(p) for p in t.placements] for n, t in model.named_parameters()}
            results[name] = train(model, batches, lp, dp_mesh=mesh["dp_shard"] if fsdp else None)
            got = weights(model)
            results[name]["max_weight_diff"] = max((got[n] - ref_weights[n]).abs().max().item() for n in ref_weights)
            results[name]["placements"] = placements

        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # skip interpreter finalization, which can abort under gloo
