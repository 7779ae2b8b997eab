"""Data parallelism: FSDP2 (fully_shard) per transformer block and at the root, HSDP on a 2D
(replicate, shard) mesh, and DDP (composable replicate) when parameters are not sharded."""

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from torchtitan.distributed.dtypes import DTYPES
from torchtitan.models.common.spec import layers_of


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward_policy: str,
    cpu_offload: bool = False,
    sharded_apart: tuple[nn.Module, ...] = (),
    apart_mesh=None,
):
    """FSDP2 per block and at the root. Modules in `sharded_apart` (expert-parallel experts, whose
    weights live on another mesh) get a fully_shard of their own over `apart_mesh` first."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    # Offload keeps sharded parameters, gradients and optimizer state in host memory (CUDA jobs).
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    reshard_blocks = reshard_after_forward_policy != "never"
    for module in sharded_apart:
        fully_shard(module, mesh=apart_mesh, mp_policy=mp, reshard_after_forward=reshard_blocks, offload_policy=offload)
    for block in layers_of(model).values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_blocks, offload_policy=offload)
    # The root holds the embedding, final norm and output layer; backward needs the output layer first,
    # so by default keep the root's parameters gathered instead of all-gathering them again at once.
    reshard_root = reshard_after_forward_policy == "always"
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_root, offload_policy=offload)
    return model


def apply_ddp(model: nn.Module, dp_mesh):
    from torch.distributed._composable.replicate import replicate

    # Buckets sized as DDP's default; gradients are averaged over dp_mesh after each backward.
    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=25)
    return model
