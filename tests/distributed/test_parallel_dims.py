import pytest

from torchtitan.config import Parallelism, UserError
from torchtitan.distributed.parallel_dims import ParallelDims


def dims(world, replicate=1, shard=-1, tp=1):
    return ParallelDims.from_config(
        Parallelism(
            data_parallel_replicate_degree=replicate, data_parallel_shard_degree=shard, tensor_parallel_degree=tp
        ),
        world,
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
        (8, 2, 3, "multiply to 12 .* x tensor_parallel_degree 2"),
        (6, 1, -1, "x tensor_parallel_degree 4 = 4 does not divide the world size 6"),
    ],
)
def test_degrees_that_do_not_match_the_world(world, replicate, shard, message):
    tp = 2 if "tensor_parallel_degree 2" in message else 4 if "degree 4" in message else 1
    with pytest.raises(UserError, match=message):
        dims(world, replicate, shard, tp)


def test_tensor_parallel_fills_innermost():
    d = dims(8, replicate=2, tp=2)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.dp_degree) == (2, 2, 2, 4)
    assert d.describe().startswith("HSDP x TP")
    assert dims(2, tp=2).describe().startswith("TP")


def test_ddp_with_tensor_parallel_is_refused():
    with pytest.raises(UserError, match="DDP .* cannot be combined with tensor_parallel_degree 2"):
        dims(4, replicate=2, shard=1, tp=2)
