"""Parallel degrees: resolved and checked against the world size before any collective runs,
then turned into a DeviceMesh with named dimensions."""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config import Parallelism, UserError
from torchtitan.models.common.spec import submesh  # noqa: F401  (the mesh's flattened dims: read here by the rest)


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @staticmethod
    def from_config(cfg: Parallelism, world_size: int) -> "ParallelDims":
        replicate, shard = cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree
        tp, pp, cp = cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree, cfg.context_parallel_degree
        if shard == -1:
            if world_size % (pp * replicate * cp * tp):
                raise UserError(
                    f"pipeline_parallel_degree {pp} x data_parallel_replicate_degree {replicate} x "
                    f"context_parallel_degree {cp} x tensor_parallel_degree {tp} = {pp * replicate * cp * tp} "
                    f"does not divide the world size {world_size}; choose degrees whose product divides "
                    f"{world_size}."
                )
            shard = world_size // (pp * replicate * cp * tp)
        if pp * replicate * shard * cp * tp != world_size:
            raise UserError(
                f"parallel degrees multiply to {pp * replicate * shard * cp * tp} (pipeline_parallel_degree {pp} x "
                f"data_parallel_replicate_degree {replicate} x data_parallel_shard_degree {shard} x "
                f"context_parallel_degree {cp} x tensor_parallel_degree {tp}) but the job has {world_size} "
                f"processes; make the product equal the number of processes (NGPU / --nproc_per_node), or set "
                f"data_parallel_shard_degree = -1 to fill the remaining ranks."
            )
        if replicate > 1 and shard == 1 and cp == 1 and (tp > 1 or pp > 1):
            # Composable DDP all-reduces plain gradients; with TP the gradients are DTensors and come out wrong.
            raise UserError(
                f"DDP (data_parallel_replicate_degree {replicate} with data_parallel_shard_degree 1) cannot be "
                f"combined with tensor_parallel_degree {tp} or pipeline_parallel_degree {pp}; shard instead: set "
                f"data_parallel_shard_degree = {replicate} and data_parallel_replicate_degree = 1"
            )
        ep = cfg.expert_parallel_degree
        if ep > 1 and (shard * cp) % ep:
            raise UserError(
                f"parallelism.expert_parallel_degree = {ep} must divide data_parallel_shard_degree x "
                f"context_parallel_degree = {shard} x {cp} = {shard * cp} (the ranks experts are split over); "
                f"choose an expert_parallel_degree that divides {shard * cp}"
            )
        return ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=tp, world_size=world_size, pp=pp, cp=cp, ep=ep)

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    def batch(self, local_batch_size: int, global_batch_size: int) -> tuple[int, int]:
        """(global batch, gradient-accumulation steps) for training.local_batch_size and
        training.global_batch_size (-1: one micro-batch per data-parallel rank)."""
        per_step = local_batch_size * self.dp_degree
        global_batch = per_step if global_batch_size == -1 else global_batch_size
        if global_batch % per_step:
            raise UserError(
                f"training.global_batch_size = {global_batch} is not a multiple of local_batch_size x "
                f"data-parallel degree = {local_batch_size} x {self.dp_degree} = {per_step}; use a multiple "
                f"of {per_step} (the quotient is the number of gradient-accumulation steps)."
            )
        return global_batch, global_batch // per_step

    @property
    def fsdp_enabled(self) -> bool:
        # Context-parallel ranks hold the same parameters and see different tokens of the same
        # sequences: FSDP shards over them as over data-parallel ranks, and reduces their gradients.
        return self.dp_shard * self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def describe(self) -> str:
        if self.fsdp_enabled and self.dp_replicate > 1:
            kind = "HSDP"
        elif self.fsdp_enabled:
            kind = "FSDP"
        elif self.ddp_enabled:
            kind = "DDP"
        else:
            kind = ""
        parts = (
            (["PP"] if self.pp_enabled else [])
            + ([kind] if kind else [])
            + (["CP"] if self.cp_enabled else [])
            + (["TP"] if self.tp_enabled else [])
            + (["EP"] if self.ep_enabled else [])
        )
        ep = f" (experts: ep={self.ep} of dp_shard x cp)" if self.ep_enabled else ""
        return (
            f"{' x '.join(parts) or 'single process'}: pp={self.pp} x dp_replicate={self.dp_replicate} x "
            f"dp_shard={self.dp_shard} x cp={self.cp} x tp={self.tp} = {self.world_size} ranks{ep}"
        )

    def build_expert_mesh(self, device_type: str) -> DeviceMesh:
        """The experts' mesh over the same ranks (pp, dp_replicate, dp_shard_mod_ep, ep, tp): the
        dp_shard x cp ranks split into ep (inner: an expert group) and the rest, which shard each
        expert group's weights with FSDP. Flattened: 'expert_dp' (dp_replicate x dp_shard_mod_ep)."""
        from torch.distributed.device_mesh import init_device_mesh

        def build():
            rest = self.dp_shard * self.cp // self.ep
            mesh = init_device_mesh(
                device_type,
                (self.pp, self.dp_replicate, rest, self.ep, self.tp),
                mesh_dim_names=("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp"),
            )
            mesh["dp_replicate", "dp_shard_mod_ep"]._flatten("expert_dp")
            return mesh

        return _kept(
            ("experts", device_type, self.pp, self.dp_replicate, self.dp_shard * self.cp, self.ep, self.tp), build
        )

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """A mesh with dims (pp, dp_replicate, dp_shard, cp, tp): tp innermost so tensor-parallel peers are
        neighbours (same node), pp outermost (point-to-point traffic crosses nodes best). Flattened:
        'dp' (data loading: ranks that read different batches), 'dp_shard_cp' (FSDP's shard dimension) and
        'dp_cp' (ranks whose losses are averaged) and 'dp_cp_tp' (all ranks of one pipeline stage).
        None for one process."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        def build():
            mesh = init_device_mesh(
                device_type,
                (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
            )
            # torch deprecates slicing a flattened dim from the root mesh: the flattened meshes are kept on
            # it (submesh reads them), with HSDP's 2D (dp_replicate, dp_shard_cp) mesh unflattened from dp_cp.
            flat: dict[str | tuple[str, ...], DeviceMesh] = {
                "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
                "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
                "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
                "dp_cp_tp": mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp"),
            }
            if hsdp:
                flat["dp_replicate", "dp_shard_cp"] = flat["dp_cp"]._unflatten(
                    0, (self.dp_replicate, self.dp_shard * self.cp), ("hsdp_replicate", "hsdp_shard")
                )
            mesh.titan_flattened = flat  # pyrefly: ignore[missing-attribute]  # our attribute on torch's mesh
            return mesh

        hsdp = self.dp_replicate > 1 and self.fsdp_enabled
        return _kept((device_type, self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp, hsdp), build)


_MESHES: dict = {}  # layout -> (the default process group it was built in, the mesh)


def _kept(layout: tuple, build):
    """The mesh of this layout built earlier in the same process group, else a new one (build()). Jobs run one
    after another in one process group (tests/distributed/run_jobs.py) thus share a layout's mesh: each new mesh
    adds about ten gloo groups, whose threads and connections live as long as the process group and slow every
    later job."""
    import torch.distributed as dist

    world, mesh = _MESHES.get(layout, (None, None))
    if world is None or world is not dist.group.WORLD:
        mesh = build()
        _MESHES[layout] = (dist.group.WORLD, mesh)
    return mesh
