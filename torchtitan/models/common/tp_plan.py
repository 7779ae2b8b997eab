"""Tensor-parallel plans as data: the vocabulary a family describes its plan with
(`TensorParallelPlan`, the standard decoder's top-level and block plans with Meta's module names,
`gather_sequence_input`, `TokenLocal`). torchtitan.distributed.tensor_parallel applies a plan; the
layout between blocks is described there.
"""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan.models.common.moe import MoE


def decoder_top_tp_plan(loss_parallel_enabled: bool) -> dict:
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


def decoder_block_tp_plan(block: nn.Module | None = None) -> dict:
    """The plan of a pre-norm decoder block with Meta's module names: attention_norm, attention
    (wq, wk, wv, wo; called with the residual stream and a rotary table), ffn_norm, feed_forward
    (SwiGLU w1, w2, w3, or, in a `block` whose feed_forward is a mixture of experts, token-local).
    A family adds to it what its blocks have besides."""
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": gather_sequence_input(n_inputs=2),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if isinstance(getattr(block, "feed_forward", None), MoE):
        # Experts work token by token: each rank routes its own slice of the sequence, with
        # replicated weights whose gradients are summed over the TP ranks (same router everywhere).
        return {**plan, "feed_forward": TokenLocal()}
    return {
        **plan,
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
    only, the module must read them through `torchtitan.models.common.moe.local_tensor`, which declares
    those gradients partial, so that they are summed over the ranks."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def replicate_parameters(_name, submodule, mesh):
            for name, param in list(submodule.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):  # expert parallel placed the routed experts already
                    submodule.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def local_tokens(_module, inputs, _mesh):
            return tuple(x.to_local() if isinstance(x, DTensor) else x for x in inputs)

        return distribute_module(module, device_mesh, replicate_parameters, input_fn=local_tokens)  # pyrefly: ignore[bad-argument-type]  # torch types input_fn -> None; a pre-hook's result replaces the inputs


@dataclass(frozen=True)
class TensorParallelPlan:
    """A family's TP plan as data: styles keyed by module name, for the top-level modules (given
    whether loss parallel is on) and for a block (given the block; names relative to it)."""

    top: Callable[[bool], dict] = decoder_top_tp_plan
    block: Callable[[nn.Module], dict] = decoder_block_tp_plan


class ReplicatedParams(ParallelStyle):
    """For a module whose weight a model reads itself (through `replicated` / `grad_summed`) to
    compute the same values on every TP rank, e.g. MLA's low-rank projections: its parameters
    become DTensors replicated over the TP ranks; inputs and outputs are left alone."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def replicate_parameters(_name, submodule, mesh):
            for name, param in list(submodule.named_parameters(recurse=False)):
                submodule.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        return distribute_module(module, device_mesh, replicate_parameters)


def replicated(weight):
    """A weight as a plain tensor for a computation every TP rank repeats whole (same inputs, same
    gradients): its gradient is the full one on each rank. A plain tensor is returned as it is."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def grad_summed(t, like):
    """`t`, whose gradient will be summed over the ranks `like` (a replicated DTensor weight) is
    replicated on: for a value every rank computes whole but each rank's heads use differently
    (MLA's rotary key, shared by all heads). Without tensor parallel (`like` a plain tensor): `t`."""
    if not isinstance(like, DTensor):
        return t
    from torch.distributed.tensor import Partial

    mesh = like.device_mesh
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False).to_local(
        grad_placements=[Partial()] * mesh.ndim
    )
