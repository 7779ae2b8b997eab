"""Per-block torch.compile: same losses as eager, same names, and it composes with activation
checkpointing and FSDP2 in parallelize_model's order (AC -> compile -> FSDP).

Slow: each test compiles one model, 10-25 s cold on this 2-core machine (inductor's on-disk cache
makes reruns faster). Tolerance: 1e-5 on fp32 losses over 3 AdamW steps; inductor may fuse and
reorder elementwise work (measured difference on torch 2.13 CPU: 0).
"""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp
from torchtitan.models.registry import get_model_spec

from helpers.tiny_models import llama3_and_batch, materialized

SPEC = get_model_spec("llama3")  # the family these tests exercise the components with
Transformer = SPEC.model_cls

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.compile]

ARGS, TOKENS = llama3_and_batch()
TOL = 1e-5


def build():
    return materialized(Transformer, ARGS)


def train(model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(TOKENS[:, :-1]).flatten(0, 1), TOKENS[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def eager():
    model = build()
    return train(model), list(model.state_dict()), [n for n, _ in model.named_parameters()]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_compiled_blocks_match_eager(eager, fresh_dynamo):
    ref_losses, ref_keys, ref_names = eager
    model = build()
    apply_compile(model)
    # Compiled in place: no `_orig_mod.` in any name.
    assert list(model.state_dict()) == ref_keys
    assert [n for n, _ in model.named_parameters()] == ref_names
    losses = train(model)
    torch.testing.assert_close(losses, ref_losses, atol=TOL, rtol=0)
    # Identical blocks share one graph: no recompiles per block.
    assert counters["stats"]["unique_graphs"] == 1


def test_checkpointing_compile_and_fsdp_together(eager, fresh_dynamo):
    ref_losses, ref_keys, ref_names = eager
    # A one-process group is enough to run FSDP2's hooks around the compiled, checkpointed blocks.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build()
        apply_ac(model, "selective", "op")
        apply_compile(model)
        apply_fsdp(model, init_device_mesh("cpu", (1,)), "float32", "float32", "default")
        assert list(model.state_dict()) == ref_keys
        assert [n for n, _ in model.named_parameters()] == ref_names
        losses = train(model)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(losses, ref_losses, atol=TOL, rtol=0)
    assert counters["stats"]["unique_graphs"] == 1
