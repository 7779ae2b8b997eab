"""gpt-oss's tensor-parallel plan (as data) and the sizes it splits.

The standard decoder block's plan (the attention projections, biases included, split by head; the
mixture of experts token-local) plus the sinks, split over the ranks as the heads are: wq is
column-parallel, so rank r holds the query heads r * n_heads / tp, ... and the sinks of exactly
those heads. Each rank trains its heads' sinks (their gradients are local to the heads).
"""

from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.models.common.tp_plan import TensorParallelPlan, decoder_block_tp_plan, decoder_top_tp_plan


class SplitByHead(ParallelStyle):
    """A module whose `weight` has one entry per attention head: shard it on dim 0 over the TP ranks."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        weight = cast(torch.Tensor, module.weight)
        module.weight = nn.Parameter(distribute_tensor(weight.data, device_mesh, [Shard(0)]))
        return module


def block_tp_plan(block: nn.Module) -> dict:
    return {**decoder_block_tp_plan(block), "attention.sinks": SplitByHead()}


TP_PLAN = TensorParallelPlan(top=decoder_top_tp_plan, block=block_tp_plan)


def tp_sizes(args) -> dict[str, tuple[int, str]]:
    """What TP splits: the heads (with their sinks) and the vocabulary; the experts are token-local."""
    heads = {
        "n_heads": (args.n_heads, "query heads (and their sinks) are split across ranks"),
        "n_kv_heads": (args.kv_heads, "key/value heads are split across ranks"),
    }
    return {**heads, "vocab_size": (args.vocab_size, "embedding rows and output logits are split across ranks")}
