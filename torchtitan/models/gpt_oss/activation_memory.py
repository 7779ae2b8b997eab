"""What a gpt-oss block keeps for backward per token (torchtitan.models.common.activation_memory): attention
with sinks through the math kernel (the one that returns the log-sum-exp on every device but
FlexAttention's), then the biased router and the clamped SwiGLU experts."""

from typing import cast

from torch import nn

from torchtitan.models.common.activation_memory import ActivationCounts, add
from torchtitan.models.gpt_oss.model import ClampedSwiGLUExperts, GptOssMoE, SinkAttention


def sink_attention_counts(attention: SinkAttention, seq_len: int) -> ActivationCounts:
    """After a pre-norm (its input, rsqrt and x * rsqrt in float32; its gathered output, which wq, wk
    and wv read): math_attention in float32 keeps q, k and v repeated to every query head, the scores
    and their exponentials ([heads, seq] per token), the unnormalized output and five per-head values
    (row max, the two clamped totals, the log-sum-exp's, the sink's sigmoid); then the output in the
    compute dtype with the sink factor's cast, the flattened product wo reads, and the residual sum
    (float32: the next norm's input). The op policy keeps wq's and wv's outputs (the 1st and 3rd
    matmul; the math kernel's are bmm, recomputed)."""
    q, kv = attention.wq.out_features, attention.wk.out_features
    dim, heads = attention.wq.in_features, q // attention.head_dim
    fp32 = (2 * dim + 1) + 4 * q + heads * seq_len + 4 * heads + dim
    # Under autocast wq, wk and wv each cast the float32 norm output.
    return ActivationCounts(
        split=2 * q + heads, gathered=dim, fp32=fp32, int64=0, op_kept=q + kv, autocast_casts=2 * dim
    )


def clamped_moe_counts(moe: GptOssMoE) -> ActivationCounts:
    """The MoE after a pre-norm (token-local under TP, nothing gathered): the norm's rsqrt and
    x * rsqrt (float32) and output, which the biased router reads; the router's logits and softmax
    scores (float32, per expert), the top-k ids, the chosen weights and their sorted copy; per routed
    assignment the gathered token, gate_up (gate and linear part, 2 x hidden), the clamped gate, its
    sigmoid, their product and linear + 1 (4 x hidden), the product down_proj reads, and the expert
    output upcast to float32 for the weighting; the ids, the token and expert of each assignment and
    the sort order in int64. The op policy keeps the router's logits (the 5th matmul; the experts'
    are grouped matmuls, recomputed)."""
    args = moe.args
    dim = moe.router.gate.in_features
    k, hidden = args.top_k, cast(ClampedSwiGLUExperts, moe.experts).down_proj.shape[1]
    split = dim + k * (dim + 7 * hidden)
    fp32 = 1 + dim + 2 * args.num_experts + 2 * k + k * dim
    return ActivationCounts(split=split, gathered=0, fp32=fp32, int64=4 * k, op_kept=args.num_experts)


def block_counts(args, block: nn.Module, seq_len: int) -> ActivationCounts:
    # Transformer.block's modules (the block types them nn.Module).
    attention, moe = cast(SinkAttention, block.attention), cast(GptOssMoE, block.feed_forward)
    return add(sink_attention_counts(attention, seq_len), clamped_moe_counts(moe))
