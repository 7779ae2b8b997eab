"""Worker for test_pipeline_parallel.py: trains a tiny llama 5 AdamW steps under several pipeline
schedules inside ONE launch (start-up is the expensive part on CPU); rank 0 writes, per case, the
losses, grad norms and largest final-weight difference from a single-process run to a JSON file.

    torchrun --nproc_per_node 2 tests/distributed/pp_worker.py pp out.json
    torchrun --nproc_per_node 4 tests/distributed/pp_worker.py pp_fsdp out.json

"pp": the 2 ranks form the pp group; every schedule, plus one read from a CSV file.
"pp_fsdp": a ("pp", "dp_shard") = (2, 2) mesh; each dp rank gets half the batch.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from torchtitan.distributed.grad_norm import clip_grad_norm_
from torchtitan.distributed.pipeline_parallel import (
    StepLoss,
    apply_fsdp_to_stage,
    broadcast_loss,
    build_pipeline_schedule,
    build_stage_model,
    build_stages,
    last_stage_rank,
    num_microbatches,
    pipeline_step,
    resolve_num_stages,
    schedule_style,
    split_module_names,
    stage_ids_for_rank,
)
from torchtitan.distributed.process_group import exit_process
from torchtitan.models.registry import get_model_spec

SPEC = get_model_spec("llama3")  # the family these tests exercise the components with
ModelArgs, Transformer = SPEC.args_cls, SPEC.model_cls

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)
BATCH, SEQ, STEPS = 8, 32, 5
MAX_NORM = 0.5  # below the grad norms here, so every step is clipped and clipping is compared
LR = 1e-3


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def fixed_batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, ARGS.vocab_size, (STEPS, BATCH, SEQ + 1), generator=g)


def meta_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(ARGS)


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, foreach=False, fused=False)


def train_single(batches) -> tuple[dict, dict]:
    model = meta_model()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    opt = optimizer(model.parameters())
    losses, norms = [], []
    for tokens in batches:
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        norms.append(clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"loss": losses, "grad_norm": norms}, weights


def write_csv_schedule(path: Path, n_mb: int):
    """A hand-written 4-stage, 2-rank schedule (loop placement): all forwards, then the backwards;
    stage 3 splits its backward into input (I) and weight (W) steps to exercise both action kinds."""
    rows = []
    for rank in range(2):
        lo, hi = rank, rank + 2
        row = [f"{lo}F{m}" for m in range(n_mb)] + [f"{hi}F{m}" for m in range(n_mb)]
        if hi == 3:
            row += [f"3I{m}" for m in range(n_mb)] + [f"3W{m}" for m in range(n_mb)]
        else:
            row += [f"{hi}B{m}" for m in range(n_mb)]
        row += [f"{lo}B{m}" for m in range(n_mb)]
        rows.append(",".join(row))
    path.write_text("\n".join(rows) + "\n")


def train_pp(batches, schedule, pp_mesh, dp_mesh=None, csv_path=None, fsdp_policy=None, stages_per_rank=None):
    pp_group, pp_rank, pp = pp_mesh.get_group(), pp_mesh.get_local_rank(), pp_mesh.size()
    style = "loop" if csv_path else schedule_style(schedule)
    num_stages = pp * stages_per_rank if stages_per_rank else resolve_num_stages(ARGS.n_layers, pp, schedule)
    parts = split_module_names(SPEC.pipeline, ARGS.n_layers, num_stages)
    ids = stage_ids_for_rank(pp_rank, pp, num_stages, style)
    meta = meta_model()
    models = []
    for i in ids:
        m = build_stage_model(meta, SPEC.pipeline, parts[i])
        if dp_mesh is not None:
            if fsdp_policy == "root_only":
                from torch.distributed.fsdp import fully_shard

                fully_shard(m, mesh=dp_mesh, reshard_after_forward=False)
            elif fsdp_policy == "blocks_reshard":
                from torchtitan.distributed.fsdp import apply_fsdp

                # The layout the notes found silently wrong with zero-bubble schedules.
                apply_fsdp(m, dp_mesh, "float32", "float32", "always")
            else:
                apply_fsdp_to_stage(m, dp_mesh, schedule)
        m.to_empty(device="cpu")
        m.init_weights(seed=0)
        models.append(m)
    local_batch = BATCH // (dp_mesh.size() if dp_mesh is not None else 1)
    n_mb = num_microbatches(local_batch, 2 if dp_mesh is None else 1)
    stages = build_stages(models, ids, num_stages, "cpu", pp_group)
    # The schedule adds up the microbatch gradients (scale_grads=False): each microbatch's loss is
    # its summed token loss over the local batch's token count, as the trainer's StepLoss makes it.
    step_loss = StepLoss(
        lambda logits, labels: F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    )
    step_loss.scale = torch.tensor(1.0 / (local_batch * SEQ))
    sched = build_pipeline_schedule(stages, schedule, n_mb, step_loss, csv_path=csv_path)
    is_first, is_last = 0 in ids, num_stages - 1 in ids
    params = [p for m in models for p in m.parameters()]
    opt = optimizer(params)
    losses, norms = [], []
    for tokens in batches:
        if dp_mesh is not None:
            tokens = tokens.chunk(dp_mesh.size())[dp_mesh.get_local_rank()]
        loss = pipeline_step(sched, tokens[:, :-1], tokens[:, 1:], is_first, is_last)
        norms.append(clip_grad_norm_(params, MAX_NORM, pp_group).item())
        opt.step()
        opt.zero_grad()
        loss = broadcast_loss(loss, pp_group, last_stage_rank(pp, num_stages, style))
        if dp_mesh is not None:
            dist.all_reduce(loss, group=dp_mesh.get_group())
            loss = loss / dp_mesh.size()
        losses.append(loss.item())
    return {"loss": losses, "grad_norm": norms}, models


def max_weight_diff(models, ref_weights, pp_group) -> float:
    worst = torch.zeros(())
    names = set()
    for m in models:
        for n, p in m.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            worst = torch.maximum(worst, (full.detach() - ref_weights[n]).abs().max())
            names.add(n)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pp_group)
    # Every FQN of the full model must live on exactly one stage.
    counts = torch.tensor([sum(n in names for n in ref_weights)], dtype=torch.float32)
    dist.all_reduce(counts, group=pp_group)
    if int(counts.item()) != len(ref_weights):
        return float("inf")
    return worst.item()


def main(mode: str, out_path: str):
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    try:
        batches = fixed_batches()
        ref, ref_weights = train_single(batches)
        results = {"single": ref}
        if mode == "pp":
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
            dp = None
            csv = Path(out_path).with_suffix(".schedule.csv")
            if dist.get_rank() == 0:
                write_csv_schedule(csv, n_mb=4)
            dist.barrier()
            cases = {
                "GPipe": dict(schedule="GPipe"),
                "1F1B": dict(schedule="1F1B"),
                "Interleaved1F1B": dict(schedule="Interleaved1F1B"),
                "LoopedBFS": dict(schedule="LoopedBFS"),
                "InterleavedZeroBubble": dict(schedule="InterleavedZeroBubble"),
                "ZBVZeroBubble": dict(schedule="ZBVZeroBubble"),
                "DualPipeV": dict(schedule="DualPipeV"),
                "csv": dict(schedule="", csv_path=str(csv), stages_per_rank=2),
            }
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
            dp = mesh["dp_shard"]
            cases = {
                "fsdp_1F1B": dict(schedule="1F1B"),
                "fsdp_Interleaved1F1B": dict(schedule="Interleaved1F1B"),
                "fsdp_ZBVZeroBubble": dict(schedule="ZBVZeroBubble"),
                "fsdp_InterleavedZeroBubble": dict(schedule="InterleavedZeroBubble"),
                "fsdp_root_only_ZBVZeroBubble": dict(schedule="ZBVZeroBubble", fsdp_policy="root_only"),
                # Diagnostic only (not asserted): per-block resharding after forward.
                "fsdp_blocks_reshard_ZBVZeroBubble": dict(schedule="ZBVZeroBubble", fsdp_policy="blocks_reshard"),
            }
        pp_mesh = mesh["pp"]
        for name, kw in cases.items():
            res, models = train_pp(batches, pp_mesh=pp_mesh, dp_mesh=dp, **kw)
            res["max_weight_diff"] = max_weight_diff(models, ref_weights, pp_mesh.get_group())
            results[name] = res
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)  # skip interpreter finalization, which can abort under gloo
