"""Tensor parallelism with sequence parallelism for decoders, applied from outside the model by a
plan that each model family gives as data (torchtitan.models.common.tp_plan: `TensorParallelPlan`
and the standard decoder's plan).

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

from contextlib import nullcontext

from torch import nn

# Renamed: apply_tp's `loss_parallel` argument would shadow it.
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel, parallelize_module

from torchtitan.config.errors import UserError
from torchtitan.models.common.spec import layers_of
from torchtitan.models.common.tp_plan import TensorParallelPlan


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


def apply_tp(model: nn.Module, tp_mesh, plan: TensorParallelPlan, loss_parallel: bool, blocks=None) -> None:
    """Shard `model` (on meta or materialized) in place over the 1D `tp_mesh` following `plan`: its
    top-level plan, then the block plan on each of `blocks` (default the model's layers; the spec's
    `blocks(model)` adds blocks outside them, e.g. multi-token prediction's). A block object met twice
    is sharded once.

    Apply before activation checkpointing, compile and FSDP: those wrap the blocks, and the plan is
    keyed by the blocks' original submodule names. Weights shared between modules (tied embeddings)
    are shared again afterwards: parallelize_module replaces each module's parameter separately.
    """
    shared = _shared_parameter_names(model)
    # Modules absent on a pipeline stage are None and simply skipped (a key may reach into one: "mtp.*.norm").
    top = {
        name: style
        for name, style in plan.top(loss_parallel).items()
        if getattr(model, name.split(".")[0], None) is not None
    }
    if top:
        parallelize_module(model, tp_mesh, top)
    done = set()
    for block in layers_of(model).values() if blocks is None else blocks:
        if id(block) not in done:
            done.add(id(block))
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
