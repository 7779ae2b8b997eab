"""The order in which parallelisms are applied to a decoder (or a pipeline stage of one), shared by
every family whose blocks live in `model.layers`; a family hands over its TP plan and where its
attention is called.

Order: expert parallel -> tensor parallel -> context parallel -> activation checkpointing -> compile ->
FSDP (or DDP). Expert parallel places the routed experts' weights first (TP then replicates what
remains of an MoE block); TP goes before the wrappers because its plan is keyed by the blocks' own
submodule names; checkpointing goes
inside compile so the compiled graph includes the recomputation; FSDP goes last because it must
wrap the final form of each block to shard its parameters.
"""

from torch import nn

from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.expert_parallel import apply_ep
from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp
from torchtitan.distributed.pipeline_parallel import apply_fsdp_to_stage
from torchtitan.distributed.tensor_parallel import TensorParallelPlan, apply_tp
from torchtitan.models.moe import moe_layers


def parallelize_decoder(model: nn.Module, inputs, tp_plan: TensorParallelPlan, cp_attention: str | None) -> nn.Module:
    """Apply every enabled parallelism to `model` in place; `inputs` is a models.spec.ParallelizeInputs."""
    dims, mesh, parallelism, training = inputs.parallel_dims, inputs.mesh, inputs.parallelism, inputs.training
    experts, expert_dp_mesh = (), None
    if dims.ep_enabled:
        experts = tuple(apply_ep([m for _, m in moe_layers(model)], inputs.expert_mesh, dims.tp))
        em = inputs.expert_mesh
        expert_dp_mesh = em["dp_replicate", "dp_shard_mod_ep"] if dims.dp_replicate > 1 else em["dp_shard_mod_ep"]
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"], tp_plan, loss_parallel=not parallelism.disable_loss_parallel)
        if parallelism.enable_async_tensor_parallel:
            _enable_async_tp(mesh["tp"])
    if dims.cp_enabled:
        if cp_attention is None:
            raise ValueError("this model does not support context parallel (its spec has no cp_attention)")
        apply_cp(model, mesh["cp"], training.seq_len, parallelism.context_parallel_rotate_method, cp_attention)
    ac = inputs.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option)
    if training.compile:
        # Context-parallel attention communicates, so it runs eagerly between two compiled graphs.
        apply_compile(model, fullgraph=not dims.cp_enabled)
    if dims.fsdp_enabled:
        # HSDP when there is a replicate dimension: a 2D mesh; plain FSDP: the shard dimension alone.
        # Context-parallel ranks join the shard dimension (mesh "dp_shard_cp").
        dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else mesh["dp_shard_cp"]
        if dims.pp_enabled:  # a pipeline stage: the schedule decides when blocks may reshard
            return apply_fsdp_to_stage(
                model,
                dp_mesh,
                parallelism.pipeline_parallel_schedule,
                training.mixed_precision_param,
                training.mixed_precision_reduce,
                parallelism.fsdp_reshard_after_forward,
                training.enable_cpu_offload,
                parallelism.pipeline_parallel_schedule_csv,
                experts,
                expert_dp_mesh,
            )
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=training.mixed_precision_param,
            reduce_dtype=training.mixed_precision_reduce,
            reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
            cpu_offload=training.enable_cpu_offload,
            sharded_apart=experts,
            apart_mesh=expert_dp_mesh,
        )
    elif dims.ddp_enabled:
        apply_ddp(model, mesh["dp_replicate"])
    return model


def _enable_async_tp(tp_mesh):
    """Let inductor fuse TP collectives with the matmuls around them (symmetric memory, CUDA only)."""
    import torch
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
