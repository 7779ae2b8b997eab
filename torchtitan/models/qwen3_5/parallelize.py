"""Qwen3.5's tensor-parallel plan (as data) and the sizes it splits.

Full-attention blocks: the standard block plan (wq column-wise: whole heads with their gates, as
HF's q_proj interleaves them per head) plus the per-head q/k norms as in Qwen3.

Gated DeltaNet blocks, split by head: in_proj_qkv, in_proj_z, in_proj_a and in_proj_b column-wise
(in_proj_qkv's rows are grouped by key head, each with its value heads (model.py), so rank r holds
key heads r*K/tp.. and their value heads r*V/tp.., as in_proj_z/a/b's value heads); the conv weight
by channel (dim 0, the same rows as in_proj_qkv's); A_log and dt_bias by head; the output
norm (one weight for all heads) replicated with its gradient summed, as the q/k norms; out_proj
row-wise into sequence shards.

A mixture-of-experts feed-forward (Qwen3.5-MoE) is token-local as in every family (tp_plan.TokenLocal:
router, routed experts, shared expert and its sigmoid gate replicated, their gradients summed).
"""

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from torchtitan.models.common.tp_plan import (
    TensorParallelPlan,
    decoder_block_tp_plan,
    decoder_top_tp_plan,
    gather_sequence_input,
)


class ShardDim0(ParallelStyle):
    """Every parameter of the module split on dim 0 (heads or channels) over the TP ranks."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, device_mesh, [Shard(0)])))
        return module


def _head_norm() -> SequenceParallel:
    # The input [batch, seq, local heads, d] is sharded on the heads (dim 2); the weight replicated,
    # its per-rank partial gradients summed.
    return SequenceParallel(sequence_dim=2, use_local_output=True)


def block_tp_plan(block: nn.Module) -> dict:
    if not hasattr(block.attention, "in_proj_qkv"):  # full attention
        return {**decoder_block_tp_plan(block), "attention.q_norm": _head_norm(), "attention.k_norm": _head_norm()}
    plan = {name: style for name, style in decoder_block_tp_plan(block).items() if not name.startswith("attention.")}
    plan["attention"] = gather_sequence_input(n_inputs=2)
    for proj in ("qkv", "z", "a", "b"):
        plan[f"attention.in_proj_{proj}"] = ColwiseParallel()
    plan["attention.conv1d"] = ShardDim0()
    plan["attention.heads"] = ShardDim0()
    plan["attention.norm"] = _head_norm()
    plan["attention.out_proj"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


TP_PLAN = TensorParallelPlan(top=decoder_top_tp_plan, block=block_tp_plan)


def tp_sizes(args) -> dict[str, tuple[int, str]]:
    sizes = {
        "n_heads": (args.n_heads, "query heads (with their gates) are split across ranks"),
        "n_kv_heads": (args.kv_heads, "key/value heads are split across ranks"),
        "linear_num_key_heads": (args.linear_num_key_heads, "gated DeltaNet key heads are split across ranks"),
        "linear_num_value_heads": (args.linear_num_value_heads, "gated DeltaNet value heads are split across ranks"),
        "ffn hidden dim": (args.ffn_hidden_dim, "w1/w3 outputs and w2 inputs are split across ranks"),
        "vocab_size": (args.vocab_size, "embedding rows and output logits are split across ranks"),
    }
    if args.moe is not None:  # Qwen3.5-MoE: experts are token-local under TP, not split (tp_plan.decoder_block_tp_plan)
        del sizes["ffn hidden dim"]
    return sizes
