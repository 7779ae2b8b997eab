"""Tensor parallelism with sequence parallelism for Llama 3, applied from outside the model.

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
from torch.distributed.tensor import Replicate, Shard
# Renamed: apply_tp's `loss_parallel` argument would shadow it.
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config.errors import UserError


def check_tp_divisibility(model_args, tp: int, seq_len: int) -> None:
    """Raise UserError before any collective when a sharded size is not a multiple of `tp`.

    DTensor would accept uneven shards in places, but the attention reshape needs whole heads per
    rank and sequence parallelism needs equal sequence slices, so uneven sizes are refused here.
    """
    if tp <= 1:
        return
    sizes = {
        "n_heads": (model_args.n_heads, "query heads are split across ranks"),
        "n_kv_heads": (model_args.kv_heads, "key/value heads are split across ranks"),
        "ffn hidden dim": (model_args.ffn_hidden_dim, "w1/w3 outputs and w2 inputs are split across ranks"),
        "dim": (model_args.dim, "model width"),
        "vocab_size": (model_args.vocab_size, "embedding rows and output logits are split across ranks"),
    }
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


def _top_level_plan(loss_parallel_enabled: bool) -> dict:
    return {
        # Row-wise on the embedding splits the vocabulary; the partial sums are reduce-scattered
        # straight into sequence slices, so the first norm already runs sequence-parallel.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Loss parallel keeps logits split on the vocabulary (a DTensor for the loss); otherwise the
        # full logits are gathered to a plain tensor so the ordinary cross entropy works.
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel_enabled else Replicate(),
            use_local_output=not loss_parallel_enabled,
        ),
    }


def _block_plan() -> dict:
    return {
        "attention_norm": SequenceParallel(),
        # freqs_cis (second positional argument) is a plain buffer, passed through untouched; the
        # attention code gets local tensors so its reshapes see this rank's heads only.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=True,
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_output=True,
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
    """Shard `model` (a llama3 Transformer, on meta or materialized) in place over the 1D `tp_mesh`.

    Apply before activation checkpointing, compile and FSDP: those wrap the blocks, and the plan is
    keyed by the blocks' original submodule names.
    """
    # Modules absent on a pipeline stage are None and simply skipped.
    plan = _top_level_plan(loss_parallel)
    top = {name: style for name, style in plan.items() if getattr(model, name, None) is not None}
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan())


def loss_parallel_context(enabled: bool):
    """Wrap forward, loss and backward: loss parallel's cross entropy and its gradient both need it."""
    return _torch_loss_parallel() if enabled else nullcontext()
