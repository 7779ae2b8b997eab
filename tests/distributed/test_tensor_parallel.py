"""Tensor-parallel plans as data: where each family's parameters end up (on a fake 4-rank process
group, meta tensors, no communication), tied weights kept tied, and the divisibility checks.
Numerics (every TP layout against one process, both families) are in test_data_parallel_parity.py.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.config.errors import UserError
from torchtitan.distributed.fsdp import apply_fsdp
from torchtitan.distributed.tensor_parallel import apply_tp, check_tp_divisibility
from torchtitan.models.registry import get_model_spec

SPEC = get_model_spec("llama3")  # the family the divisibility checks are exercised with
ModelArgs = SPEC.args_cls


@pytest.fixture
def mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    finally:
        dist.destroy_process_group()


def parallelized(name: str, flavor: str, mesh, fsdp: bool):
    spec = get_model_spec(name)
    with torch.device("meta"):
        model = spec.model_cls(spec.args_for_training(flavor, 4096, 64))
    apply_tp(model, mesh["tp"], spec.tp_plan, loss_parallel=True)
    if fsdp:
        apply_fsdp(model, mesh["dp_shard"], "float32", "float32", "default")
    return model, {n: [str(p) for p in t.placements] for n, t in model.named_parameters()}


@pytest.mark.parametrize(
    "name, flavor", [("llama3", "debugmodel"), ("qwen3", "debugmodel"), ("qwen3", "debugmodel_tied")]
)
def test_placements(mesh, name, flavor):
    _, tp_only = parallelized(name, flavor, mesh, fsdp=False)
    # Heads and FFN units split column-wise, their output projections row-wise, norms replicated.
    assert tp_only["layers.0.attention.wq.weight"] == ["S(0)"]
    assert tp_only["layers.0.attention.wo.weight"] == ["S(1)"]
    assert tp_only["layers.0.feed_forward.w2.weight"] == ["S(1)"]
    assert tp_only["layers.0.attention_norm.weight"] == ["R"]
    assert tp_only["tok_embeddings.weight"] == ["S(0)"]
    if name == "qwen3":  # the per-head norms: one replicated weight, applied to this rank's heads
        assert tp_only["layers.0.attention.q_norm.weight"] == tp_only["layers.0.attention.k_norm.weight"] == ["R"]
    # Under FSDP every parameter lives on the 2D (dp_shard, tp) mesh, so one grad norm covers all.
    _, both = parallelized(name, flavor, mesh, fsdp=True)
    assert all(len(p) == 2 for p in both.values())
    assert both["layers.0.feed_forward.w2.weight"] == ["S(0)", "S(1)"]


def test_tied_weights_stay_one_parameter(mesh):
    model, placements = parallelized("qwen3", "debugmodel_tied", mesh, fsdp=False)
    # parallelize_module replaces each module's weight separately; apply_tp ties them again.
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in placements  # named_parameters lists a shared weight once
    model, _ = parallelized("qwen3", "debugmodel_tied", mesh, fsdp=True)
    assert model.output.weight is model.tok_embeddings.weight


SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)


@pytest.mark.parametrize(
    "overrides, tp, seq_len, pattern",
    [
        (dict(n_heads=2, n_kv_heads=2), 4, 32, r"tensor_parallel_degree = 4 does not divide model n_heads = 2"),
        ({}, 4, 32, r"tensor_parallel_degree = 4 does not divide model n_kv_heads = 2"),
        (dict(n_kv_heads=None, multiple_of=1), 4, 32, r"does not divide model ffn hidden dim = 170"),
        (dict(dim=65), 2, 32, r"tensor_parallel_degree = 2 does not divide model dim = 65"),
        (dict(vocab_size=127), 2, 32, r"does not divide model vocab_size = 127"),
        ({}, 2, 33, r"tensor_parallel_degree = 2 does not divide training.seq_len = 33"),
    ],
)
def test_divisibility_errors(overrides, tp, seq_len, pattern):
    with pytest.raises(UserError, match=pattern):
        check_tp_divisibility(SPEC.tp_sizes(ModelArgs(**{**SMALL, **overrides})), tp, seq_len)


def test_divisible_sizes_pass():
    check_tp_divisibility(SPEC.tp_sizes(ModelArgs(**SMALL)), 2, 32)
    # tp = 1 disables the check: nothing is sharded.
    check_tp_divisibility(SPEC.tp_sizes(ModelArgs(**{**SMALL, "vocab_size": 127})), 1, 33)
