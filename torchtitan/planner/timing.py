"""Step time of a layout: FLOPs over a stated peak with an efficiency factor, communication volume
over stated bandwidths, and the pipeline bubble of the schedule.

- compute: the spec's training FLOPs per token (6 per matmul parameter plus attention) for the global
  batch, spread over all ranks, plus the forward recomputed by activation checkpointing (a third of a
  block's FLOPs for full, a sixth for the op policy, a third over N for every N-th block); at
  `efficiency` x `peak_flops`.
- communication, per rank and step, with the ring algorithms' (n - 1) / n factors, each over the
  intra-node bandwidth when its group fits in a node (its ranks are consecutive in the mesh), else
  the inter-node one:
  FSDP: all-gather of the stage's parameters in forward (and again in backward when resharded after
  forward) per micro-batch of gradient accumulation, reduce-scatter of the gradients;
  TP (sequence parallel): per block and micro-batch 4 collectives of the block's input in forward and
  4 in backward;
  CP: per block, ring: the keys and values gathered (or rotated) in forward, their gradients
  reduce-scattered (rotated back) in backward; Ulysses: q, k, v and the output through all-to-alls in
  forward and backward (cp_volume);
  EP: per MoE block 2 all-to-alls of the routed tokens in forward, 2 in backward;
  PP: each micro-batch's activations sent forward and their gradients back, per stage boundary.
  FSDP's traffic overlaps compute (only what exceeds it counts); the others are exposed.
- bubble: (pp - 1) / micro-batches for GPipe and 1F1B, half that for the interleaved schedules (two
  stages per rank), a third for the zero-bubble ones (a stated approximation of their
  weight-gradient filling).
"""

import math
from dataclasses import dataclass

from torchtitan.config.parallelism_sections import ZERO_BUBBLE_SCHEDULES
from torchtitan.distributed.pipeline_parallel import is_single_stage_schedule
from torchtitan.planner.memory import DTYPE_BYTES


@dataclass(frozen=True)
class Hardware:
    peak_flops: float  # per device, training dtype
    efficiency: float  # the fraction of the peak that the model's matmuls reach
    intra_node_bandwidth: float  # bytes/s per device within a node
    inter_node_bandwidth: float  # bytes/s per device across nodes
    gpus_per_node: int


@dataclass(frozen=True)
class StepTime:
    compute: float
    communication: float  # exposed
    bubble: float  # fraction added by the pipeline schedule
    total: float


def _bandwidth(hw: Hardware, group_span: int) -> float:
    """A group whose ranks lie within `group_span` consecutive ranks: intra-node if that fits a node."""
    return hw.intra_node_bandwidth if group_span <= hw.gpus_per_node else hw.inter_node_bandwidth


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def cp_volume(method: str, args, cp: int, tp: int) -> float:
    """Bytes a rank sends per attention layer for context parallel (forward and backward), in units of its
    hidden activations (local tokens x dim). Ring: its key and value block (2 units) to the next rank cp - 1
    times, and their gradients back. Ulysses: (cp - 1) / cp of its q, k, v (the KV heads, repeated where cp
    does not divide them) and of the output, in forward and again in backward; it moves less than the
    ring from cp = 3 on (and at cp = 2 for grouped-query heads) but waits for its transfers, while the
    rotating ring can overlap them with its blocks' attention (counted as exposed here all the same)."""
    if method != "ulysses":
        return 4 * (cp - 1)
    heads = getattr(args, "n_heads", 1) // max(tp, 1)
    kv = getattr(args, "kv_heads", None) or getattr(args, "n_kv_heads", None) or getattr(args, "n_heads", 1)
    kv = kv // max(tp, 1)
    kv *= cp // math.gcd(kv, cp)  # repeated so that the cp head groups each get whole KV heads
    return 2 * (2 + 2 * min(kv, heads) / heads) * _ring(cp)


def step_time(
    flops_per_token: float, args, dims, cfg, gathered_elements: float, n_moe_blocks_per_stage: int, hw: Hardware
) -> StepTime:
    """Seconds per optimizer step. `flops_per_token`: the spec's training FLOPs per token;
    `gathered_elements`: the stage's parameters after TP and EP (what FSDP all-gathers)."""
    t, par, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    global_batch, accum = dims.batch(t.local_batch_size, t.global_batch_size)
    flops = flops_per_token * global_batch * t.seq_len / dims.world_size
    recompute = {"full": 1 / 3, "none": 0.0}.get(ac.mode)
    if recompute is None:
        recompute = 1 / 6 if ac.selective_ac_option == "op" else 1 / 3 / int(ac.selective_ac_option)
    compute = flops * (1 + recompute) / (hw.peak_flops * hw.efficiency)

    act = DTYPE_BYTES[t.mixed_precision_param] if dims.fsdp_enabled else 4
    reduce = DTYPE_BYTES[t.mixed_precision_reduce] if dims.fsdp_enabled else 4
    layers = args.n_layers / dims.pp
    tokens_per_rank_step = global_batch // dims.dp_degree * t.seq_len // dims.cp  # over all micro-batches
    hidden = tokens_per_rank_step * args.dim * act
    comm = 0.0
    fsdp = 0.0
    if dims.fsdp_enabled:
        n = dims.dp_shard * dims.cp
        gathers = (1 if dims.pp > 1 else accum) * (1 if par.fsdp_reshard_after_forward == "never" or dims.pp > 1 else 2)
        volume = gathered_elements * (gathers * act + reduce) * _ring(n)
        fsdp = volume / _bandwidth(hw, n * dims.tp)
    if dims.dp_replicate > 1:  # HSDP's all-reduce of the shards over the replicas, or DDP's
        shard = gathered_elements / (dims.dp_shard * dims.cp)
        fsdp += 2 * shard * reduce * _ring(dims.dp_replicate) / _bandwidth(hw, dims.world_size // dims.pp)
    if dims.tp > 1:
        comm += 8 * layers * hidden * _ring(dims.tp) / _bandwidth(hw, dims.tp)
    if dims.cp > 1:
        comm += (
            layers
            * cp_volume(par.context_parallel_method, args, dims.cp, dims.tp)
            * hidden
            / dims.tp
            / _bandwidth(hw, dims.cp * dims.tp)
        )
    if dims.ep > 1 and n_moe_blocks_per_stage:
        top_k = args.moe.top_k
        comm += (
            4 * n_moe_blocks_per_stage * hidden / dims.tp * top_k * _ring(dims.ep) / _bandwidth(hw, dims.ep * dims.tp)
        )
    bubble = 0.0
    if dims.pp > 1:
        comm += 2 * hidden / dims.tp / _bandwidth(hw, dims.world_size)
        n_micro = t.local_batch_size * accum // par.pipeline_parallel_microbatch_size
        bubble = (dims.pp - 1) / n_micro
        if par.pipeline_parallel_schedule.lower() in ZERO_BUBBLE_SCHEDULES:
            bubble /= 3
        elif not is_single_stage_schedule(par.pipeline_parallel_schedule):
            bubble /= 2
    exposed = comm + max(0.0, fsdp - compute)
    return StepTime(compute, exposed, bubble, (compute + exposed) * (1 + bubble))
