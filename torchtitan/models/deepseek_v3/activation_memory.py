"""What a DeepSeek-V3 block keeps for backward per token (torchtitan.models.common.activation_memory):
multi-head latent attention, then SwiGLU or the MoE."""

import dataclasses
from typing import cast

from torch import nn

from torchtitan.models.common.activation_memory import ActivationCounts, add, moe_counts, swiglu_counts
from torchtitan.models.common.layers import FeedForward
from torchtitan.models.common.moe import MoE
from torchtitan.models.deepseek_v3.model import MLA


def mla_counts(attention: MLA, seq_len: int) -> ActivationCounts:
    """MLA after a pre-norm: the norm's input, rsqrt and x * rsqrt (float32) and its output; each
    low-rank projection's norm the same (computed whole on every TP rank: `gathered`); the q, k, v and
    probabilities of the math attention kernel (q/k and v head sizes differ, which the CPU flash kernel
    refuses; on CPU these are float32: the rotary table promotes them), attention's output that wo
    reads, the residual sum (float32: the next norm's input)."""
    dim = attention.wkv_a.in_features
    heads = attention.wkv_b.out_features // (attention.nope + attention.v_dim)
    qk = attention.nope + attention.rope_dim
    q_rank = attention.wq_a.out_features if hasattr(attention, "wq_a") else 0
    ranks = [r for r in (q_rank, attention.kv_lora) if r]
    split = heads * attention.v_dim
    gathered = dim + sum(ranks)
    fp32 = (
        2 * dim + 1 + dim + sum(2 * r + 1 for r in ranks) + 2 * heads * qk + heads * seq_len + heads * attention.v_dim
    )
    # The op policy keeps every other aten.mm output (the math attention is bmm, recomputed): with a
    # query rank, wq_a's, the latent's and wkv_b's (1st, 3rd, 5th of 6); without, wq's, the rotary
    # key's and wo's (1st, 3rd, 5th of 5).
    if q_rank:
        op_kept = q_rank + attention.kv_lora + heads * (attention.nope + attention.v_dim)
    else:
        op_kept = heads * qk + attention.rope_dim + dim
    # Under autocast the three projections of the block input each cast it.
    return ActivationCounts(split=split, gathered=gathered, fp32=fp32, int64=0, op_kept=op_kept, autocast_casts=2 * dim)


def mtp_counts(dim: int) -> ActivationCounts:
    """What a multi-token prediction module keeps besides its block: its two input norms (input,
    rsqrt and x * rsqrt, float32) and their concatenation, which eh_proj reads; its result goes
    through the output layer and the loss once more (the norm before it counted there)."""
    return ActivationCounts(split=0, gathered=2 * dim, fp32=2 * (2 * dim + 1), int64=0, op_kept=0, outputs=1)


def block_counts(args, block: nn.Module, seq_len: int) -> ActivationCounts:
    # Transformer.block's modules: MLA, then FeedForward or MoE (the block types them nn.Module).
    ffn, attention = block.feed_forward, cast(MLA, block.attention)
    if hasattr(ffn, "router"):
        counts = moe_counts(cast(MoE, ffn))
    else:
        ffn = cast(FeedForward, ffn)
        counts = swiglu_counts(ffn)
        if not hasattr(attention, "wq_a"):  # five matmuls before it: SwiGLU's w3 is the odd one kept, alone
            counts = dataclasses.replace(counts, op_kept=ffn.w3.out_features)
    counts = add(mla_counts(attention, seq_len), counts)
    if block.layer_id >= args.n_layers:  # a multi-token prediction module's block
        counts = add(counts, mtp_counts(args.dim))
    return counts
