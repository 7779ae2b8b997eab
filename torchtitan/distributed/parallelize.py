"""The order in which parallelisms are applied to a model (or a pipeline stage of one), for every
family: what to apply where comes from the model's spec (its TP plan, where its blocks call
attention, its expert layers), and its blocks live in `model.layers`.

Order: the family's pre_parallelize -> expert parallel -> tensor parallel -> context parallel ->
activation checkpointing -> compile -> FSDP (or DDP). Expert parallel places the routed experts'
weights first (TP then replicates what remains of an MoE block); TP goes before the wrappers
because its plan is keyed by the blocks' own submodule names; checkpointing goes inside compile so
the compiled graph includes the recomputation; FSDP goes last because it must wrap the final form
of each block to shard its parameters.
"""

from typing import cast

from torch import nn

from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.expert_parallel import apply_ep
from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims, submesh
from torchtitan.distributed.pipeline_parallel import apply_fsdp_to_stage
from torchtitan.distributed.tensor_parallel import apply_tp
from torchtitan.models.common.spec import ModelSpec, ParallelizeInputs


def parallelize_model(model: nn.Module, inputs: ParallelizeInputs, spec: ModelSpec) -> nn.Module:
    """Apply every enabled parallelism to `model` in place, as `spec` describes it."""
    if spec.pre_parallelize is not None:
        spec.pre_parallelize(model, inputs)
    # The trainer hands over its ParallelDims; the spec types it by what the models read (ParallelDegrees).
    dims = cast(ParallelDims, inputs.parallel_dims)
    mesh, parallelism, training = inputs.mesh, inputs.parallelism, inputs.training
    experts, expert_dp_mesh = (), None
    if dims.ep_enabled:
        if spec.expert_layers is None:
            raise ValueError(f"model {spec.name} has no experts (its spec has no expert_layers)")
        em = inputs.expert_mesh
        assert em is not None, "expert parallel needs ParallelDims.build_expert_mesh's mesh"
        experts = tuple(apply_ep(spec.expert_layers(model), em, dims.tp))
        expert_dp_mesh = em["dp_replicate", "dp_shard_mod_ep"] if dims.dp_replicate > 1 else em["dp_shard_mod_ep"]
    # A degree above 1 means more than one process, hence a mesh (the asserts below).
    if dims.tp_enabled:
        if spec.tp_plan is None:
            raise ValueError(f"model {spec.name} has no tensor-parallel plan in its spec")
        assert mesh is not None
        apply_tp(
            model,
            mesh["tp"],
            spec.tp_plan,
            loss_parallel=not parallelism.disable_loss_parallel,
            blocks=spec.blocks(model),
        )
        if parallelism.enable_async_tensor_parallel:
            _enable_async_tp(mesh["tp"])
    if dims.cp_enabled:
        if spec.cp_attention is None:
            raise ValueError(f"model {spec.name} does not support context parallel (its spec has no cp_attention)")
        assert mesh is not None
        apply_cp(
            model,
            mesh["cp"],
            training.seq_len,
            parallelism.context_parallel_rotate_method,
            spec.cp_attention,
            spec.blocks(model),
            parallelism.context_parallel_method,
            parallelism.context_parallel_ring_overlap,
        )
    ac = inputs.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option)
    if training.compile:
        # Context-parallel attention communicates, so it runs eagerly between two compiled graphs.
        apply_compile(model, fullgraph=not dims.cp_enabled)
    if dims.fsdp_enabled:
        # HSDP when there is a replicate dimension: a 2D mesh; plain FSDP: the shard dimension alone.
        # Context-parallel ranks join the shard dimension (mesh "dp_shard_cp").
        dp_mesh = (
            submesh(mesh, "dp_replicate", "dp_shard_cp") if dims.dp_replicate > 1 else submesh(mesh, "dp_shard_cp")
        )
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
        assert mesh is not None
        apply_ddp(model, mesh["dp_replicate"])
    return model


def _enable_async_tp(tp_mesh):
    """Let inductor fuse TP collectives with the matmuls around them (symmetric memory, CUDA only)."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
