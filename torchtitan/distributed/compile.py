"""torch.compile per transformer block.

What is unusual: each block is compiled in place with `nn.Module.compile`, not replaced by the
`OptimizedModule` that `torch.compile(block)` returns, which would insert `_orig_mod.` into every
parameter name and state_dict key. Blocks are compiled one by one (not the whole model) so that all
blocks share one compiled graph and FSDP can still shard per block around them; `fullgraph=True`
turns any graph break into an error instead of a silent slowdown.
"""

import torch
import torch._dynamo
from torch import nn

from torchtitan.models.common.spec import layers_of

# Compiled variants of one code object before dynamo gives up and runs it eagerly (default 8).
# Identical blocks share one graph (measured: 4 blocks, 1 graph), but every block class or shape
# adds a variant: selective checkpointing makes two classes, and other techniques may add more.
_RECOMPILE_LIMIT = 64


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    """Compile every block of `model.layers` in place; apply after activation checkpointing.
    fullgraph=False where a block deliberately runs a part eagerly (context-parallel attention)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    for block in layers_of(model).values():
        block.compile(fullgraph=fullgraph)
