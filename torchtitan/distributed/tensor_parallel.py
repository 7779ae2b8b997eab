"""Tensor parallelism with sequence parallelism for decoders, applied from outside the model by a
plan that each model family gives as data (`TensorParallelPlan`).

Between blocks the residual stream is a plain local tensor holding this rank's slice of the sequence
(dim 1). Norms run on that slice (SequenceParallel); each attention / feed-forward input is
all-gathered to the full sequence, its first projections are split by output features (heads, ffn
hidden units) and its last projection by input features, whose partial sums are reduce-scattered
back to sequence slices. The model code never sees a DTensor inside attention: heads are reshaped
with -1, so the local shard holds n_heads / tp heads.

With loss parallel the output layer keeps the logits sharded on the vocabulary and returns a
DTensor; cross entropy must then run (forward AND backward) inside `loss_parallel_context(True)`,
and the loss it returns is a replicated DTensor: take `.to_local()` before adding it to a plain
tensor (that raises). Every parameter becomes a DTensor on the tp mesh (2D once FSDP is applied on
top), so gradient clipping combines one kind of gradient into one global norm.
"""

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
# Renamed: apply_tp's `loss_parallel` argument would shadow it.
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan.config.errors import UserError


def check_tp_divisibility(sizes: dict[str, tuple[int, str]], tp: int, seq_len: int) -> None:
    """Raise UserError before any collective when a sharded size is not a multiple of `tp`.

    `sizes` ({name: (size, why it is split)}) comes from the model spec. DTensor would accept uneven
    shards in places, but the attention reshape needs whole heads per rank and sequence parallelism
    needs equal sequence slices, so uneven sizes are refused here.
    """
    if tp <= 1:
        return
    for name, (size, why) in sizes.items():
        if size % tp:
            raise UserError(
                f"parallelism.tensor_parallel_degree = {tp} does not divide model {name} = {size} ({why}); "
                f"choose a tensor_parallel_degree that divides {size}."
            )
    if seq_len % tp:
        raise UserError(
            f"parallelism.tensor_parallel_degree = {tp} does not divide training.seq_len = {seq_len} "
            f"(sequence parallelism gives each rank an equal slice of the sequence); choose a seq_len that "
            f"is a multiple of {tp}."
        )


def decoder_top_plan(loss_parallel_enabled: bool) -> dict:
    """The plan of a decoder's top-level modules (tok_embeddings, norm, output)."""
    return {
        # Row-wise on the embedding splits the vocabulary; the partial sums are reduce-scattered
        # straight into sequence slices, so the first norm already runs sequence-parallel.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Loss parallel keeps logits split on the vocabulary (a DTensor for the loss); otherwise the
        # full logits are gathered to a plain tensor so the ordinary cross entropy works. Both this
        # and the embedding shard their weight on dim 0 (vocabulary rows), so a tied weight stays
        # one DTensor.
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel_enabled else Replicate(),
            use_local_output=not loss_parallel_enabled,
        ),
    }


def decoder_block_plan(block: nn.Module | None = None) -> dict:
    """The plan of a pre-norm decoder block with Meta's module names: attention_norm, attention
    (wq, wk, wv, wo; called with the residual stream and a rotary table), ffn_norm, feed_forward
    (SwiGLU w1, w2, w3). A family adds to it what its blocks have besides."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": gather_sequence_input(n_inputs=2),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gather_sequence_input(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def gather_sequence_input(n_inputs: int = 1) -> PrepareModuleInput:
    """A module whose first input is the sequence-sharded residual stream and whose other inputs (e.g.
    a rotary table) are plain tensors: gather the sequence and hand local tensors to the module, so
    its reshapes with -1 heads see this rank's heads only."""
    rest = (None,) * (n_inputs - 1)
    return PrepareModuleInput(
        input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest), use_local_output=True
    )


class TokenLocal(ParallelStyle):
    """For a module that computes token by token (a mixture of experts): it runs on this rank's slice
    of the sequence, with no communication in forward. Its parameters become DTensors replicated
    over the TP ranks (buffers stay plain tensors); since each rank's gradient covers its own tokens
    only, the module must read them through `torchtitan.models.moe.local_tensor`, which declares
    those gradients partial, so that they are summed over the ranks."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def replicate_parameters(_name, submodule, mesh):
            for name, param in list(submodule.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):  # expert parallel placed the routed experts already
                    submodule.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def local_tokens(_module, inputs, _mesh):
            return tuple(x.to_local() if isinstance(x, DTensor) else x for x in inputs)

        return distribute_module(module, device_mesh, replicate_parameters, input_fn=local_tokens)


@dataclass(frozen=True)
class TensorParallelPlan:
    """A family's TP plan as data: styles keyed by module name, for the top-level modules (given
    whether loss parallel is on) and for a block (given the block; names relative to it)."""

    top: Callable[[bool], dict] = decoder_top_plan
    block: Callable[[nn.Module], dict] = decoder_block_plan


def apply_tp(model: nn.Module, tp_mesh, plan: TensorParallelPlan, loss_parallel: bool) -> None:
    """Shard `model` (on meta or materialized) in place over the 1D `tp_mesh` following `plan`.

    Apply before activation checkpointing, compile and FSDP: those wrap the blocks, and the plan is
    keyed by the blocks' original submodule names. Weights shared between modules (tied embeddings)
    are shared again afterwards: parallelize_module replaces each module's parameter separately.
    """
    shared = _shared_parameter_names(model)
    # Modules absent on a pipeline stage are None and simply skipped.
    top = {name: style for name, style in plan.top(loss_parallel).items() if getattr(model, name, None) is not None}
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan.block(block))
    for names in shared:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            param = model.get_parameter(name)
            if getattr(param, "placements", None) != getattr(first, "placements", None):
                raise ValueError(
                    f"tied parameters {names[0]} and {name} got different tensor-parallel placements "
                    f"({getattr(first, 'placements', None)} vs {getattr(param, 'placements', None)}); "
                    "the TP plan must shard them alike"
                )
            setattr(model.get_submodule(owner), attr, first)


def _shared_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of names that refer to one parameter object (more than one name each)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def loss_parallel_context(enabled: bool):
    """Wrap forward, loss and backward: loss parallel's cross entropy and its gradient both need it."""
    return _torch_loss_parallel() if enabled else nullcontext()
