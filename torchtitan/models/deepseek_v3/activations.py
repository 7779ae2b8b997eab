"""What a DeepSeek-V3 block keeps for backward per token (torchtitan.models.common.activations):
multi-head latent attention, then SwiGLU or the MoE."""

from torch import nn

from torchtitan.models.common.activations import ActivationCounts, add, moe_counts, swiglu_counts


def mla_counts(attention: nn.Module, seq_len: int) -> ActivationCounts:
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
    fp32 = (2 * dim + 1 + dim + sum(2 * r + 1 for r in ranks)
            + 2 * heads * qk + heads * seq_len + heads * attention.v_dim)
    # The op policy keeps every other aten.mm output: wq_a (or wq), the latent projection, wo; and the
    # block input. (The math attention is made of bmm, which the policy recomputes.)
    op_kept = (q_rank or heads * qk) + attention.kv_lora + dim + dim
    return ActivationCounts(split=split, gathered=gathered, fp32=fp32, int64=0, op_kept=op_kept)


def block_counts(args, block: nn.Module, seq_len: int) -> ActivationCounts:
    ffn = block.feed_forward
    return add(mla_counts(block.attention, seq_len), moe_counts(ffn) if hasattr(ffn, "router") else swiglu_counts(ffn))
