"""Differentiable collectives shared by the parallelisms (expert parallel's token dispatch, Ulysses
context parallel's head exchange)."""

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int] | None, recv: list[int] | None, group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); one per output
        # An all-to-all's transpose is the same exchange with the splits swapped.
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send, recv, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x) if recv is None else x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def all_to_all(x: torch.Tensor, group, send: list[int] | None = None, recv: list[int] | None = None) -> torch.Tensor:
    """Rows (dim 0) of `x` split among the group's ranks, `send[j]` rows to rank j (None: equal parts), and
    the rows received, `recv[j]` from rank j (None: equal parts), in rank order; its backward sends the
    gradients back the same way."""
    return _AllToAll.apply(x, send, recv, group)
