"""What a block keeps for backward, per token: the counts the layout planner (torchtitan.planner)
needs from a family (its spec's `activation_counts`).

Counts are elements per token (one position of one sequence of `seq_len`) of one block, split by how tensor
parallel (with sequence parallel) divides them:
- `split`: divided by the TP degree (heads, hidden units, sequence-sharded norms and residuals);
- `gathered`: whole on every TP rank (the inputs of column-parallel layers, gathered from the
  sequence shards);
- `fp32`: float32 whatever the compute dtype (RMSNorm's input and normalized values, attention's
  log-sum-exp, router scores), split;
- `int64`: routing indices of a mixture of experts, split;
- `op_kept`: what the per-operator checkpointing policy keeps (torchtitan.distributed.
  activation_checkpoint: attention's output and every other matmul's, counted within the block),
  split, compute dtype; the block's input, which checkpointing also keeps, is the planner's to add;
- `op_fp32`: what that policy keeps in float32 (attention's log-sum-exp), split;
- `autocast_casts`, `autocast_moved`: bf16 under torch.autocast over float32 parameters (the
  trainer's bf16 without FSDP), as measured on CPU: the bf16 copies autocast makes of float32
  tensors, one per matmul that reads them (where the bf16 count has one shared copy; gathered); split
  elements kept in float32 instead of bf16 (ops that autocast leaves alone; none in the shipped
  blocks);
- `outputs`: how many more times the block's result goes through the output layer and the loss (a
  multi-token prediction depth's block: once).
The standard block's counts below are those of its eager forward on CPU: tests/models/
test_activation_counts.py traces a real block's saved tensors and compares.
"""

import dataclasses
from dataclasses import dataclass
from typing import cast

from torch import nn

from torchtitan.models.common.layers import Attention, FeedForward
from torchtitan.models.common.moe import GroupedExperts, MoE


@dataclass(frozen=True)
class ActivationCounts:
    split: float
    gathered: float
    fp32: float
    int64: float
    op_kept: float
    op_fp32: float = 0.0
    autocast_casts: float = 0.0
    autocast_moved: float = 0.0
    outputs: int = 0


def standard_attention_counts(attention: Attention) -> ActivationCounts:
    """Grouped-query attention with Meta's names (wq, wk, wv, wo), optionally q_norm / k_norm per head,
    called after a pre-norm. RMSNorm keeps its input and x * rsqrt in float32 whatever the compute
    dtype; the gathered norm output feeds the projections; attention reads q, k and v (k and v
    repeated to every query head) and keeps its log-sum-exp; wo reads attention's output; the residual
    sum is the next norm's input."""
    q, kv = attention.wq.out_features, attention.wk.out_features
    dim, head_dim = attention.wq.in_features, attention.head_dim
    heads, kv_heads = q // head_dim, kv // head_dim
    split = 3 * q + q
    fp32 = dim + 1 + dim + heads + dim  # the norm's input, rsqrt and x * rsqrt; log-sum-exp; the residual sum
    if getattr(attention, "q_norm", None) is not None:  # per-head norms: input, rsqrt, x * rsqrt
        fp32 += 2 * q + heads + 2 * kv + kv_heads
    # Kept by the op policy: attention's output and log-sum-exp, wq's and wv's outputs (1st and 3rd
    # matmul).
    # Under autocast wq, wk and wv each cast the float32 norm output.
    return ActivationCounts(
        split=split, gathered=dim, fp32=fp32, int64=0, op_kept=q + q + kv, op_fp32=heads, autocast_casts=2 * dim
    )


def swiglu_counts(feed_forward: FeedForward) -> ActivationCounts:
    """SwiGLU (w1, w2, w3) after a pre-norm (whose input the attention counts): the norm's rsqrt and
    x * rsqrt, its gathered output, w1's and w3's outputs, silu's output and the product w2 reads. The
    op policy keeps w1's and w2's outputs (5th and 7th matmul)."""
    dim, hidden = feed_forward.w1.in_features, feed_forward.w1.out_features
    return ActivationCounts(
        split=4 * hidden, gathered=dim, fp32=1 + dim, int64=0, op_kept=hidden + dim, autocast_casts=dim
    )  # w1 and w3 each cast the norm output


def moe_counts(moe: MoE) -> ActivationCounts:
    """torchtitan.models.common.moe.MoE after a pre-norm (token-local under TP: nothing gathered): the
    norm's rsqrt, x * rsqrt and output; the router's scores and routing weights (float32), top-k
    indices and sort orders; per routed assignment the gathered token, w1's, w3's and silu's outputs,
    the product and w2's output (float32); the shared experts as SwiGLU, and where a sigmoid gate
    scales them (Qwen3.5-MoE) its sigmoid and the shared output it multiplies."""
    args = moe.args
    dim = moe.router.gate.in_features
    k, hidden = args.top_k, cast(GroupedExperts, moe.experts).w1.shape[1]
    split = dim + k * (dim + 4 * hidden)
    fp32 = 1 + dim + args.num_experts + 1 + 2 * k + k * dim  # w2's outputs are weighted in float32
    shared = getattr(moe, "shared_experts", None)
    if shared is not None:
        split += 4 * shared.w1.out_features
    gated = getattr(moe, "shared_gate", None) is not None
    if gated:  # sigmoid(gate) and the shared output it scales
        split += 1 + dim
    # The op policy keeps the router's matmul (scores, the 5th after attention's four) and one of the
    # shared experts' SwiGLU projections (which ones is set by how many small matmuls routing made).
    # After them the shared gate's logit is the 9th: kept.
    op_kept = args.num_experts + (shared.w1.out_features if shared is not None else 0) + (1 if gated else 0)
    # Under autocast the routed experts cast their gathered tokens once (moe.matmul_dtype), so they
    # keep what they keep in bf16; the router, the shared experts' w1 and w3 and the shared gate each
    # cast the norm output.
    return ActivationCounts(
        split=split,
        gathered=0,
        fp32=fp32,
        int64=3 * k,
        op_kept=op_kept,
        autocast_casts=(2 * dim if shared is not None else 0) + (dim if gated else 0),
    )


def add(*counts: ActivationCounts) -> ActivationCounts:
    return ActivationCounts(*(sum(getattr(c, f.name) for c in counts) for f in dataclasses.fields(ActivationCounts)))


def standard_block_counts(args, block: nn.Module, seq_len: int) -> ActivationCounts:
    """A pre-norm block: attention (standard_attention_counts) and a SwiGLU or MoE feed-forward."""
    # decoder.Transformer.block's modules: layers.Attention, then FeedForward or MoE (the block types them nn.Module).
    attention, ffn = cast(Attention, block.attention), block.feed_forward
    return add(
        standard_attention_counts(attention),
        moe_counts(cast(MoE, ffn)) if hasattr(ffn, "router") else swiglu_counts(cast(FeedForward, ffn)),
    )
