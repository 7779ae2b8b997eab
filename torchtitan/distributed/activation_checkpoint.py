"""Activation checkpointing of transformer blocks: every block, every N-th block, or per operator.

What is unusual: blocks are not wrapped in a new module. `checkpoint_wrapper` would put each block
under `_checkpoint_wrapped_module.`, changing every parameter name and state_dict key. Instead the
block object stays where it is and its class is swapped for a subclass, made on the fly, whose
forward runs the original forward under `torch.utils.checkpoint.checkpoint` (FSDP2's fully_shard
swaps classes the same way, and composes with this). Names, state_dict keys and the module tree
seen by compile and FSDP are those of the plain model, so checkpoints load either way.

Which blocks ("selective" with an integer N): the blocks at positions 0, N, 2N, ... in the order of
`model.layers` (positions, not layer ids, so a pipeline stage holding layers 8..15 checkpoints its
own first block and every N-th after it). N = 1 is the same as "full".

The per-operator policy ("selective" with "op") recomputes the whole block in backward except the
outputs of expensive operators, which are kept from forward:
- attention (every SDPA kernel: flash, memory-efficient, cuDNN, the fused "overrideable" one and
  the CPU flash kernel): the most expensive op per byte of output;
- matmuls (`aten.mm`, and `aten.addmm` for a linear layer with a bias), but only every other one
  (the 1st, 3rd, ... in each block), which halves the memory that saving all of them would cost
  while still sparing half of the recompute FLOPs;
- `aten.max` (the amax of float8 scaling: a scalar, so free to keep) and the reduce-scatter of
  sequence parallelism (recomputing it would repeat communication).
Everything else (norms, rotary embedding, activations, elementwise ops) is recomputed.
"""

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from torchtitan.models.common.spec import layers_of

MODES = ("none", "selective", "full")

_aten = torch.ops.aten
# A linear layer with a bias is one addmm: a matmul like the others.
_MATMULS = (_aten.mm.default, _aten.addmm.default)
_SAVED_OPS = {
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten.max.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str = "") -> None:
    """Checkpoint the blocks of `model.layers` in place, as configured by `[activation_checkpoint]`
    (whose values the config validator has checked and explained)."""
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; one of {', '.join(MODES)}")
    if mode == "none":
        return
    if mode == "full":
        every, context_fn = 1, None
    else:
        every, context_fn = _parse_selective_option(selective_ac_option)
    for position, block in enumerate(layers_of(model).values()):
        if position % every == 0:
            _checkpoint_block(block, context_fn)


def _parse_selective_option(option) -> tuple[int, object]:
    # TOML may give an integer or a string; a bool is an int in Python but never a sensible N.
    text = "" if isinstance(option, bool) else str(option).strip()
    if text == "op":
        return 1, op_policy_context
    if text.isascii() and text.isdigit() and int(text) > 0:
        return int(text), None
    raise ValueError(f"selective activation checkpointing takes a positive integer or 'op', got {option!r}")


def _run_profiler_marks_in_recompute() -> None:
    """FSDP's hooks on a module inside a checkpointed block (the experts under expert parallel) mark
    their work with record_function, a different number of times in forward and in the recompute,
    and torch's selective checkpointing matches every op of the recompute to one of the forward's
    ("invocation index 3 encountered during backward but not found in storage"). A profiler mark
    has nothing to save or reuse: it runs each time, as torch already does for detach."""
    from torch.utils import checkpoint as torch_checkpoint

    profiler = torch.ops.profiler
    torch_checkpoint.SAC_IGNORED_OPS.update(
        {
            profiler._record_function_enter_new.default,
            profiler._record_function_enter.default,
            profiler._record_function_exit.default,
            profiler._record_function_exit._RecordFunction,
        }
    )


def op_policy_context():
    """A fresh (forward, recompute) context pair per checkpointed call, as `checkpoint` expects."""
    _run_profiler_marks_in_recompute()
    # The same policy function serves forward and recompute; each phase counts its own matmuls so
    # that both agree on which ones were saved.
    mm_count = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in _MATMULS:
            mm_count[ctx.is_recompute] += 1
            odd = mm_count[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if odd else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def is_checkpointed(block: nn.Module) -> bool:
    return getattr(type(block), "_ac_checkpointed", False)


def _checkpoint_block(block: nn.Module, context_fn) -> None:
    if not is_checkpointed(block):
        block.__class__ = _checkpointed_class(type(block))
    # Kept on the instance (not the class) so that blocks of one class can use different policies;
    # None means plain checkpointing.
    block._ac_context_fn = context_fn


@functools.cache
def _checkpointed_class(cls: type) -> type:
    def forward(self, *args, **kwargs):
        # context_fn is passed only when there is a policy: dynamo (torch 2.13) fails on an explicit
        # noop_context_fn. preserve_rng_state=False: the blocks draw no random numbers (no dropout),
        # so snapshotting the RNG state per block per step would be pure cost.
        policy = {} if self._ac_context_fn is None else {"context_fn": self._ac_context_fn}
        return checkpoint(
            functools.partial(cls.forward, self),
            *args,
            use_reentrant=False,
            preserve_rng_state=False,
            **policy,
            **kwargs,
        )

    attrs = {"forward": forward, "_ac_checkpointed": True, "__module__": cls.__module__}
    return type(f"Checkpointed{cls.__name__}", (cls,), attrs)
