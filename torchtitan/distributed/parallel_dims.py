"""Parallel degrees: resolved and checked against the world size before any collective runs,
then turned into a DeviceMesh with named dimensions."""

from dataclasses import dataclass

from torchtitan.config import Parallelism, UserError


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @staticmethod
    def from_config(cfg: Parallelism, world_size: int) -> "ParallelDims":
        replicate, shard = cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree
        tp = cfg.tensor_parallel_degree
        if shard == -1:
            if world_size % (replicate * tp):
                raise UserError(
                    f"data_parallel_replicate_degree {replicate} x tensor_parallel_degree {tp} = {replicate * tp} "
                    f"does not divide the world size {world_size}; choose degrees whose product divides {world_size}."
                )
            shard = world_size // (replicate * tp)
        if replicate * shard * tp != world_size:
            raise UserError(
                f"parallel degrees multiply to {replicate * shard * tp} (data_parallel_replicate_degree {replicate} "
                f"x data_parallel_shard_degree {shard} x tensor_parallel_degree {tp}) but the job has {world_size} "
                f"processes; make the product equal the number of processes (NGPU / --nproc_per_node), or set "
                f"data_parallel_shard_degree = -1 to fill the remaining ranks."
            )
        if replicate > 1 and shard == 1 and tp > 1:
            # Composable DDP all-reduces plain gradients; with TP the gradients are DTensors and come out wrong.
            raise UserError(
                f"DDP (data_parallel_replicate_degree {replicate} with data_parallel_shard_degree 1) cannot be "
                f"combined with tensor_parallel_degree {tp}; shard instead: set data_parallel_shard_degree = "
                f"{replicate} and data_parallel_replicate_degree = 1 (FSDP x TP)"
            )
        return ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=tp, world_size=world_size)

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def describe(self) -> str:
        if self.fsdp_enabled and self.dp_replicate > 1:
            kind = "HSDP"
        elif self.fsdp_enabled:
            kind = "FSDP"
        elif self.ddp_enabled:
            kind = "DDP"
        elif self.tp_enabled:
            kind = "TP"
        else:
            kind = "single process"
        if self.tp_enabled and kind != "TP":
            kind += " x TP"
        return (
            f"{kind}: dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} = "
            f"{self.world_size} ranks"
        )

    def build_mesh(self, device_type: str):
        """A mesh with dims (dp_replicate, dp_shard, tp), tp innermost so tensor-parallel peers are
        neighbours (same node), and 'dp' flattening the data-parallel dims; None for one process."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
        )
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh
