"""Apply parallelism to a Llama 3 model from outside; the model code stays untouched.

Order: tensor parallel -> context parallel -> activation checkpointing -> compile -> FSDP. Checkpointing
goes inside compile so the compiled graph includes the recomputation; FSDP goes last because it
must wrap the final form of each block to shard its parameters.
"""

from torch import nn

from torchtitan.config import ActivationCheckpoint, Parallelism, Training
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import apply_fsdp_to_stage
from torchtitan.distributed.tensor_parallel import apply_tp


def parallelize_llama(
    model: nn.Module,
    parallel_dims: ParallelDims,
    mesh,
    parallelism: Parallelism,
    training: Training,
    activation_checkpoint: ActivationCheckpoint,
) -> nn.Module:
    if parallel_dims.tp_enabled:
        apply_tp(model, mesh["tp"], loss_parallel=not parallelism.disable_loss_parallel)
        if parallelism.enable_async_tensor_parallel:
            _enable_async_tp(mesh["tp"])
    if parallel_dims.cp_enabled:
        apply_cp(model, mesh["cp"], training.seq_len, parallelism.context_parallel_rotate_method)
    apply_ac(model, activation_checkpoint.mode, activation_checkpoint.selective_ac_option)
    if training.compile:
        # Context-parallel attention communicates, so it runs eagerly between two compiled graphs.
        apply_compile(model, fullgraph=not parallel_dims.cp_enabled)
    if parallel_dims.fsdp_enabled:
        # HSDP when there is a replicate dimension: a 2D mesh; plain FSDP: the shard dimension alone.
        # Context-parallel ranks join the shard dimension (mesh "dp_shard_cp").
        dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if parallel_dims.dp_replicate > 1 else mesh["dp_shard_cp"]
        if parallel_dims.pp_enabled:  # a pipeline stage: the schedule decides when blocks may reshard
            apply_fsdp_to_stage(
                model,
                dp_mesh,
                parallelism.pipeline_parallel_schedule,
                training.mixed_precision_param,
                training.mixed_precision_reduce,
                parallelism.fsdp_reshard_after_forward,
                training.enable_cpu_offload,
                parallelism.pipeline_parallel_schedule_csv,
            )
            return model
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=training.mixed_precision_param,
            reduce_dtype=training.mixed_precision_reduce,
            reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
            cpu_offload=training.enable_cpu_offload,
        )
    elif parallel_dims.ddp_enabled:
        apply_ddp(model, mesh["dp_replicate"])
    return model


def _enable_async_tp(tp_mesh):
    """Let inductor fuse TP collectives with the matmuls around them (symmetric memory, CUDA only)."""
    import torch
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
