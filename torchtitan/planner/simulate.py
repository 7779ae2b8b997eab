"""A layout applied for real at the target world size, in this one process: torch's fake process
group (collectives return without moving data) under the project's own mesh building, pipeline
split and parallelize_model, on a meta model. What it proves: the plan is valid (meshes, degrees,
divisibility, the schedule's stage placement), and each rank's parameter shards have the sizes the
analytic model (torchtitan.planner.memory.param_shards) counts.

One rank per pipeline rank is simulated (coordinate 0 of the other mesh dimensions), each in its own
fake process group, since a rank only builds its own stages."""

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.distributed.parallelize import parallelize_model
from torchtitan.distributed.pipeline_parallel import split_for_rank
from torchtitan.models.common.spec import ParallelizeInputs


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the simulation needs a process without a process group of its own")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_elements(model: nn.Module) -> dict[str, int]:
    """{parameter name: elements of this rank's shard}, each Parameter once."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = local.numel()
    return out


def simulate_rank(spec, args, dims, cfg, pp_rank: int) -> dict[str, int]:
    """The parameter shards of the rank at pipeline rank `pp_rank` (other coordinates 0), after the
    real parallelization of its stages for `cfg`'s layout (ParallelDims `dims`)."""
    rank = pp_rank * (dims.world_size // dims.pp)
    with fake_process_group(rank, dims.world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = spec.model_cls(args)
        parts = [model]
        if dims.pp > 1:
            parts, _ = split_for_rank(model, spec.pipeline, cfg.parallelism, mesh["pp"])
        expert_mesh = dims.build_expert_mesh("cpu") if dims.ep > 1 else None
        inputs = ParallelizeInputs(dims, mesh, cfg.parallelism, cfg.training, cfg.activation_checkpoint, expert_mesh)
        held: dict[str, int] = {}
        for part in parts:
            held.update(local_elements(parallelize_model(part, inputs, spec)))
        return held


def simulate(spec, args, dims, cfg, pp_ranks=None) -> dict[int, dict[str, int]]:
    """{pp rank: {parameter name: elements}} from the real parallelization of these pipeline ranks
    (default: all)."""
    return {r: simulate_rank(spec, args, dims, cfg, r) for r in (range(dims.pp) if pp_ranks is None else pp_ranks)}
