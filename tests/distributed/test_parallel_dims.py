import pytest

from torchtitan.config import Parallelism, UserError
from torchtitan.distributed.parallel_dims import ParallelDims


def dims(world, replicate=1, shard=-1):
    return ParallelDims.from_config(
        Parallelism(data_parallel_replicate_degree=replicate, data_parallel_shard_degree=shard), world
    )


def test_shard_minus_one_fills_the_world():
    d = dims(8, replicate=2)
    assert (d.dp_replicate, d.dp_shard, d.dp_degree) == (2, 4, 8)
    assert d.fsdp_enabled and not d.ddp_enabled
    assert d.describe().startswith("HSDP")


def test_kinds():
    assert dims(1).describe().startswith("single process")
    assert dims(4).describe().startswith("FSDP")
    ddp = dims(4, replicate=4, shard=1)
    assert ddp.ddp_enabled and not ddp.fsdp_enabled and ddp.describe().startswith("DDP")


@pytest.mark.parametrize(
    "world, replicate, shard, message",
    [
        (4, 2, 3, "multiply to 6 .* but the job has 4 processes"),
        (3, 2, -1, "does not divide the world size 3"),
        (2, 1, 4, "multiply to 4"),
    ],
)
def test_degrees_that_do_not_match_the_world(world, replicate, shard, message):
    with pytest.raises(UserError, match=message):
        dims(world, replicate, shard)
