"""Apply parallelism to a Llama 3 model from outside; the model code stays untouched.

Order (more techniques join in later issues): tensor parallel -> activation checkpointing ->
compile -> FSDP, since FSDP must wrap the final form of each block to shard its parameters.
"""

from torch import nn

from torchtitan.config import Parallelism, Training
from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims


def parallelize_llama(
    model: nn.Module, parallel_dims: ParallelDims, mesh, parallelism: Parallelism, training: Training
) -> nn.Module:
    if parallel_dims.fsdp_enabled:
        # HSDP when there is a replicate dimension: a 2D mesh; plain FSDP: the shard dimension alone.
        dp_mesh = mesh["dp_replicate", "dp_shard"] if parallel_dims.dp_replicate > 1 else mesh["dp_shard"]
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=training.mixed_precision_param,
            reduce_dtype=training.mixed_precision_reduce,
            reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        )
    elif parallel_dims.ddp_enabled:
        apply_ddp(model, mesh["dp_replicate"])
    return model
