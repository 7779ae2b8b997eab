"""Activation checkpointing: same numbers, same names, less memory, and real recomputation.

Memory is measured with torch's MemTracker (torch.distributed._tools), which follows every tensor
storage allocated and freed on CPU. Summing what autograd's saved-tensor hooks see would not do:
checkpoint keeps each block's input and the op policy's saved outputs itself, out of their sight,
so that measure would credit the op policy with the savings of full checkpointing.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.registry import get_model_spec

from helpers.tiny_models import llama3_and_batch, materialized

SPEC = get_model_spec("llama3")  # the family these tests exercise the components with
Transformer = SPEC.model_cls

ARGS, TOKENS = llama3_and_batch()
TOL = 1e-6  # fp32; recomputation replays the same kernels, so the runs in fact agree bit for bit

CONFIGS = {
    "full": ("full", ""),
    "every2": ("selective", "2"),
    "op": ("selective", "op"),
}


def build(mode="none", option=""):
    model = materialized(Transformer, ARGS)
    apply_ac(model, mode, option)
    return model


def loss_of(model):
    logits = model(TOKENS[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), TOKENS[:, 1:].flatten())


def train(model, steps=3):
    """Losses and gradients of each step of AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for _ in range(steps):
        loss = loss_of(model)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


@pytest.fixture(scope="module")
def reference():
    return train(build())


@pytest.mark.parametrize("config", CONFIGS)
def test_training_matches_no_checkpointing(config, reference):
    losses, grads = train(build(*CONFIGS[config]))
    ref_losses, ref_grads = reference
    torch.testing.assert_close(losses, ref_losses, atol=TOL, rtol=0)
    for step, (got, want) in enumerate(zip(grads, ref_grads)):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=0, msg=f"step {step} {name}")


@pytest.mark.parametrize("config", CONFIGS)
def test_names_and_state_dict_unchanged(config):
    plain, checkpointed = build(), build(*CONFIGS[config])
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    # The block keeps its slot and stays a TransformerBlock; a plain model's checkpoint loads strictly.
    block_cls = type(Transformer(ARGS).layers["0"])
    assert all(isinstance(block, block_cls) for block in checkpointed.layers.values())
    checkpointed.load_state_dict(plain.state_dict(), strict=True)


def attention_calls_per_block(model):
    """Forward calls of each block's attention during one forward + backward."""
    calls = {key: 0 for key in model.layers}
    hooks = []
    for key, block in model.layers.items():

        def count(*_, key=key):
            calls[key] += 1

        hooks.append(block.attention.register_forward_hook(count))
    loss_of(model).backward()
    for hook in hooks:
        hook.remove()
    return [calls[key] for key in model.layers]


@pytest.mark.parametrize(
    "config, expected",
    [("none", [1, 1, 1, 1]), ("full", [2, 2, 2, 2]), ("every2", [2, 1, 2, 1]), ("op", [2, 2, 2, 2])],
)
def test_checkpointed_blocks_are_recomputed_in_backward(config, expected):
    # Selective N=2 checkpoints the blocks at positions 0 and 2. The op policy reruns the whole
    # block too, replaying saved outputs for the matmuls and attention it kept.
    model = build(*CONFIGS.get(config, ("none", "")))
    assert attention_calls_per_block(model) == expected


def activation_memory(model):
    """(bytes held for backward at the end of forward, peak bytes during forward + backward), both
    above what was allocated before (parameters and buffers)."""
    cpu = torch.device("cpu")
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        loss = loss_of(model)
        held = tracker.get_tracker_snapshot("current")[cpu]["Total"] - before
        loss.backward()
        del loss
    peak = tracker.get_tracker_snapshot("peak")[cpu]["Total"] - before
    return held, peak


def test_checkpointing_reduces_activation_memory():
    # Measured on torch 2.13 CPU (bytes held after forward / peak of forward + backward):
    # none 28.6M / 30.1M, full 2.4M / 12.7M, every2 15.5M / 17.7M, op 10.8M / 16.9M.
    # The peak includes the gradients (4.2 MB) allocated in backward, the same in every mode.
    mem = {
        name: activation_memory(build(*CONFIGS.get(name, ("none", "")))) for name in ("none", "full", "every2", "op")
    }
    held = {name: h / mem["none"][0] for name, (h, _) in mem.items()}
    peak = {name: p / mem["none"][1] for name, (_, p) in mem.items()}
    print({name: f"held {h} peak {p}" for name, (h, p) in mem.items()})
    assert held["full"] < 0.15  # only block inputs and the layers outside the blocks remain
    assert 0.4 < held["every2"] < 0.7  # half the blocks keep everything
    assert held["full"] < held["op"] < held["every2"]  # op keeps attention and half the matmuls
    assert peak["full"] < 0.5
    assert peak["full"] < peak["op"] < peak["every2"] < 0.7


@pytest.fixture(scope="module")
def untouched():
    """One model for the error cases: a rejected config must leave it as it was."""
    model = build()
    yield model
    assert all(type(block) is type(Transformer(ARGS).layers["0"]) for block in model.layers.values())


@pytest.mark.parametrize("mode", ["partial", "Full", "", "selective_op"])
def test_invalid_mode(mode, untouched):
    with pytest.raises(ValueError, match=r"mode .*one of none, selective, full"):
        apply_ac(untouched, mode, "")


@pytest.mark.parametrize("option", ["", "0", "-1", "1.5", "ops", "x", True, None])
def test_invalid_selective_option(option, untouched):
    with pytest.raises(ValueError, match=r"positive integer or 'op'"):
        apply_ac(untouched, "selective", option)


def test_integer_option_from_toml():
    model = build("selective", 3)  # TOML gives an int; blocks at positions 0 and 3
    assert attention_calls_per_block(model) == [2, 1, 1, 2]
