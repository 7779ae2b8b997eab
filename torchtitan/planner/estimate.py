"""The estimate of one layout: its memory per rank (planner.memory) and step time (planner.timing),
from what every layout of a recipe shares (`RecipeFacts`). The trainer's preflight checks
[memory_estimation] with it; the layout planner (planner.search) ranks layouts by it.
"""

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchtitan.config import JobConfig, UserError
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.spec import ModelSpec, meta_model
from torchtitan.planner.memory import (
    GiB,
    MemoryEstimate,
    Shard,
    estimate_memory,
    missing_counts,
    optimizer_states,
    param_shards,
)
from torchtitan.planner.timing import Hardware, StepTime, step_time


@dataclass(frozen=True)
class Estimate:
    cfg: JobConfig  # this layout's
    dims: ParallelDims
    memory: MemoryEstimate
    time: StepTime
    tokens_per_s: float  # per device
    mfu: float

    @property
    def step_time(self) -> float:
        return self.time.total

    def layout(self) -> str:
        d = self.dims
        parts = [
            f"pp{d.pp}" if d.pp > 1 else "",
            f"rep{d.dp_replicate}" if d.dp_replicate > 1 else "",
            f"fsdp{d.dp_shard}" if d.dp_shard > 1 else "",
            self._cp(),
            f"tp{d.tp}" if d.tp > 1 else "",
            f"ep{d.ep}" if d.ep > 1 else "",
        ]
        return "x".join(p for p in parts if p) or "single"

    def _cp(self) -> str:
        """cp2 (the gathered ring), cp2r (the rotating ring) or cp2u (Ulysses)."""
        if self.dims.cp == 1:
            return ""
        p = self.cfg.parallelism
        if p.context_parallel_method == "ulysses":
            return f"cp{self.dims.cp}u"
        return f"cp{self.dims.cp}" + ("r" if p.context_parallel_rotate_method == "alltoall" else "")

    def ac(self) -> str:
        ac = self.cfg.activation_checkpoint
        return ac.mode if ac.mode != "selective" else f"selective {ac.selective_ac_option}"


def default_hardware(device_type: str, gpus_per_node: int, cfg) -> Hardware:
    """CUDA: H100/H200 figures (989 dense bf16 TFLOP/s; 450 GB/s NVLink, 50 GB/s per GPU across nodes),
    40% of the peak. CPU (this machine; a "device" is one of `gpus_per_node` processes on the host):
    the matmul peak measured now in the training dtype with the threads a process gets (torchrun
    gives each of several processes one, OMP_NUM_THREADS=1; more processes than cores share them),
    the efficiency calibrated for that dtype, and gloo's bandwidth between processes of one host."""
    if device_type == "cuda":
        peak = cfg.metrics.device_peak_tflops * 1e12 if cfg.metrics.device_peak_tflops > 0 else 989e12
        return Hardware(peak, 0.40, 450e9, 50e9, gpus_per_node)
    import torch

    dtype = cfg.training.mixed_precision_param
    threads = torch.get_num_threads() if gpus_per_node == 1 else 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    peak = _cpu_matmul_peak(dtype, threads) * min(1.0, cores / (gpus_per_node * threads))
    return Hardware(peak, CPU_EFFICIENCY[dtype], CPU_BANDWIDTH, CPU_BANDWIDTH, gpus_per_node)


@functools.cache
def _cpu_matmul_peak(dtype: str, threads: int) -> float:
    import torch

    from torchtitan.components.metrics import measure_matmul_tflops

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_matmul_tflops(getattr(torch, dtype), seconds=0.3) * 1e12
    finally:
        torch.set_num_threads(before)


# The fraction of the measured matmul peak a training step reaches on a CPU, by training dtype,
# calibrated by scripts/validate_memory_estimate.py (its single-process float32 and FSDP 2 rows; the
# figures are in docs/benchmarks.md#memory-and-step-time-estimates). In bfloat16 the CPU's matrix units make
# matmuls fast and the rest of the step (elementwise, norms, attention) dominates.
CPU_EFFICIENCY = {"float32": 0.44, "bfloat16": 0.061, "float16": 0.061}
CPU_BANDWIDTH = 1.0e9


@dataclass
class RecipeFacts:
    """What every layout of one recipe shares, computed once: the spec, the args, the meta model, the
    FLOPs per token, and the parameter shards of each (degrees, pipeline split) seen."""

    spec: ModelSpec
    args: Any  # the family's args dataclass (typed Any as in ModelSpec)
    model: nn.Module  # on the meta device
    flops_per_token: float
    moe_blocks: int  # blocks with routed experts
    states: dict[str, int]  # optimizer state tensors per parameter element, by name (memory.optimizer_states)
    # param_shards' results by (degrees, the [parallelism] settings that decide the split)
    shards: dict[tuple, dict[int, dict[str, Shard]]] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, spec, args, cfg) -> "RecipeFacts":
        """For the model `spec` builds from `args` (preflight.model_args_for_run) under `cfg`."""
        model = meta_model(spec, args)
        moe_blocks = len(spec.expert_layers(model)) if spec.expert_layers is not None else 0
        return cls(
            spec,
            args,
            model,
            spec.flops_per_token(args, cfg.training.seq_len),
            moe_blocks,
            optimizer_states(spec, model, cfg.optimizer),
        )

    def param_shards(self, dims, par):
        key = (
            dims,
            par.pipeline_parallel_schedule,
            par.disable_loss_parallel,
            par.pipeline_parallel_layers_per_stage,
            tuple(par.pipeline_parallel_split_points),
            tuple(map(tuple, par.module_fqns_per_model_part)),
            par.pipeline_parallel_first_stage_less_layers,
            par.pipeline_parallel_last_stage_less_layers,
        )
        if key not in self.shards:
            self.shards[key] = param_shards(self.spec, self.model, dims, par)
        return self.shards[key]


def estimate_layout(cfg, world_size: int, device_type: str, p: RecipeFacts, hw: Hardware | None = None) -> Estimate:
    """Memory and step time of `cfg`'s own layout on `world_size` ranks."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    shards = p.param_shards(dims, cfg.parallelism)
    memory = estimate_memory(p.spec, p.model, p.args, dims, cfg, device_type, shards, p.states)
    gathered = sum(s.gathered for s in shards[memory.pp_rank].values())
    moe_blocks = p.moe_blocks // dims.pp
    hw = hw or default_hardware(device_type, world_size, cfg)
    time = step_time(p.flops_per_token, p.args, dims, cfg, gathered, moe_blocks, hw)
    t = cfg.training
    global_batch, _ = dims.batch(t.local_batch_size, t.global_batch_size)
    tokens = global_batch * t.seq_len / world_size / time.total
    mfu = tokens * p.flops_per_token / hw.peak_flops
    return Estimate(cfg, dims, memory, time, tokens, mfu)


FIXES = {
    "params": "more FSDP or pipeline ranks (shard the parameters further)",
    "grads": "more FSDP or pipeline ranks",
    "optimizer": "more FSDP or pipeline ranks (the optimizer state is sharded with the parameters)",
    "activations": "activation checkpointing, a smaller micro-batch, or more TP / CP ranks",
    "logits": "training.loss_chunk_tokens (the output layer and the loss a chunk of tokens at a time), tensor "
    "parallel with loss parallel (splits the vocabulary), or a smaller micro-batch",
    "buffers": "resharding after forward (parallelism.fsdp_reshard_after_forward = 'always') or more TP ranks",
}


def device_memory(device_type: str, processes_per_node: int) -> tuple[float, str]:
    """(bytes one rank may use, what that is): a GPU's memory, or on CPU this node's memory shared by
    its processes."""
    if device_type == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory), "the GPU's memory"
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    return total / processes_per_node, f"the host's memory over its {processes_per_node} process(es)"


def check_memory(cfg, world_size: int, device_type: str, processes_per_node: int, p: RecipeFacts) -> str:
    """[memory_estimation]: the estimate of `cfg`'s own layout as one line; UserError when it cannot fit."""
    missing_counts(p.spec)
    # The step time is not reported here: no matmul peak is measured before launch.
    hw = Hardware(1e12, 1.0, 1e9, 1e9, processes_per_node)
    e = estimate_layout(cfg, world_size, device_type, p, hw)
    capacity, what = device_memory(device_type, processes_per_node)
    terms = ", ".join(f"{name} {value / GiB:.2f}" for name, value in e.memory.terms().items() if value)
    line = (
        f"memory estimate for {e.layout()} with AC {e.ac()}: {e.memory.total / GiB:.2f} GiB per rank (largest, "
        f"pipeline rank {e.memory.pp_rank}; {terms} GiB) of {capacity / GiB:.2f} GiB, {what}"
    )
    if e.memory.total > capacity:
        largest = e.memory.largest()
        raise UserError(
            f"memory_estimation: {e.layout()} needs an estimated {e.memory.total / GiB:.2f} GiB per rank, "
            f"more than the {capacity / GiB:.2f} GiB of {what}; the largest term is {largest} "
            f"({e.memory.terms()[largest] / GiB:.2f} GiB): {FIXES[largest]} (scripts/plan.py compares "
            f"every layout)"
        )
    return line
