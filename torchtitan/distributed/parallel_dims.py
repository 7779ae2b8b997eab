"""Parallel degrees: resolved and checked against the world size before any collective runs,
then turned into a DeviceMesh with named dimensions."""

from dataclasses import dataclass

from torchtitan.config import Parallelism, UserError


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int

    @staticmethod
    def from_config(cfg: Parallelism, world_size: int) -> "ParallelDims":
        replicate, shard = cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree
        if shard == -1:
            if world_size % replicate:
                raise UserError(
                    f"parallelism.data_parallel_replicate_degree = {replicate} does not divide the world "
                    f"size {world_size}; choose a divisor of {world_size}."
                )
            shard = world_size // replicate
        if replicate * shard != world_size:
            raise UserError(
                f"parallel degrees multiply to {replicate * shard} (data_parallel_replicate_degree {replicate} "
                f"x data_parallel_shard_degree {shard}) but the job has {world_size} processes; make the "
                f"product equal the number of processes (NGPU / --nproc_per_node), or set "
                f"data_parallel_shard_degree = -1 to fill the remaining ranks."
            )
        return ParallelDims(dp_replicate=replicate, dp_shard=shard, world_size=world_size)

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard == 1

    def describe(self) -> str:
        if self.fsdp_enabled and self.dp_replicate > 1:
            kind = "HSDP"
        elif self.fsdp_enabled:
            kind = "FSDP"
        elif self.ddp_enabled:
            kind = "DDP"
        else:
            kind = "single process"
        return f"{kind}: dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} = {self.world_size} ranks"

    def build_mesh(self, device_type: str):
        """A mesh with dims (dp_replicate, dp_shard) and their flattening 'dp'; None for one process."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh
