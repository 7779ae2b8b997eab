"""What a Qwen3.5 block keeps for backward per token (torchtitan.models.common.activation_memory): a gated
DeltaNet block (the chunked gated delta rule, torchtitan.models.common.delta_rule) or a gated
full-attention block, each followed by SwiGLU. Derived from the eager forward on CPU and checked
against a real block's saved tensors in float32, bfloat16 and bf16 autocast, and against what the
per-operator checkpointing policy leaves allocated (tests/models/test_activation_counts.py).

Two encodings beyond the plain fields, because ActivationCounts has no field for a tensor that one
compute dtype keeps and another does not:
- a tensor of X elements that the float32 forward keeps (in float32) and the bf16 one does not is
  counted as 2X `split` and -X `fp32`: 4X bytes in float32, none in bf16 (the planner's meta model
  cannot say which dtype will run); under autocast `autocast_moved` puts its 4X bytes back where
  autocast keeps it;
- under autocast the delta rule's batched matmuls keep bf16 casts of their float32 operands (and
  the products in bf16), where the other forwards keep float32 tensors: a negative `autocast_moved`
  (elements kept in bf16 instead of float32), plus the states' two casts each.
"""

from typing import cast

from torch import nn

from torchtitan.models.common.activation_memory import ActivationCounts, add, moe_counts, swiglu_counts
from torchtitan.models.common.layers import FeedForward
from torchtitan.models.common.moe import MoE
from torchtitan.models.qwen3_5.model import GatedAttention, GatedDeltaNet


def delta_rule_counts(heads: int, dk: int, dv: int, chunk: int, seq_len: int) -> tuple[float, float]:
    """(float32 elements, autocast_moved) per token that delta_rule.chunked keeps, the inputs q, k
    and the value copy left to the caller, for `heads` value heads over a sequence of seq_len
    tokens in chunks of `chunk`. Assumes seq_len is a multiple of the chunk (the last partial chunk
    is padded, which adds padded copies of every input: not counted). Per token:
    - the document mask of each chunk (a bool per pair: chunk / 4 float32) and two float32 masks;
    - per head, [chunk] per token: the decay, its strict part, beta * strict, k k^T, the unit
      triangular system, q k^T and the scores (7);
    - per head, [dk]: the contiguous copies of k and k^T, and of q and k^T, that the batched
      matmuls make (4), k, q (the repeated ones) and wk (the solve for the state) (7); where there
      is more than one chunk, q * exp(G) (the first chunk starts from a zero state that needs no
      gradient) and what each chunk's last token keeps of k (with one chunk only the final state
      reads it, which the block drops: autograd frees that branch when the forward returns);
    - per head, [dv]: u (the solve for the values) and w (the chunk's writes);
    - per head: the exps of the cumulative decay and their masked factors (6); per chunk: the last
      token's decay and mask (and its product beyond the first chunk);
    - the state carried into every chunk: heads x dk x dv per chunk, dk x dv / chunk per token and
      head.
    Under autocast the matmuls keep bf16: k k^T and q k^T and their operands' copies, the scores
    and what the chunk's last token keeps in bf16 casts, each state in two casts besides float32,
    and the casts of q * exp(G) and wk chunk by chunk beyond the first. Counted as traced (every
    tensor saved during the forward, as tests/models/test_activation_counts.py measures): under
    autocast the last chunk's update of the final state keeps casts of its w and keep and the
    float32 state before it, which autograd frees when the block drops that state, so the counts
    are over by (2 dk + 2 dv) / n + 4 dk dv / seq_len bytes per token and head (1.6% of the
    debug model's block at 128 tokens, nothing much at thousands)."""
    n = max(seq_len // chunk, 1)
    more = 1.0 if n > 1 else 0.0
    fp32 = (
        chunk / 4
        + 2
        + 7 * heads * chunk
        + (7 + 2 * more) * heads * dk
        + 2 * heads * dv
        + 6 * heads
        + (heads + 1 + more * heads) / chunk
        + heads * dk * dv / chunk
    )
    moved = -3 * heads * chunk - (4 + more) * heads * dk - more * 2 * heads * dk / n + 2 * heads * dk * dv / chunk
    return fp32, moved


def gated_deltanet_counts(mixer: GatedDeltaNet, seq_len: int) -> ActivationCounts:
    """A GatedDeltaNet after a pre-norm (its input, rsqrt and x * rsqrt in float32; its gathered
    output, which in_proj_qkv, in_proj_z, in_proj_a and in_proj_b read):
    - the causal conv keeps its input and its kernel - 1 shifted copies (channels each: every key
      head's q and k, every value head's v; each a view of the input padded by its shift), SiLU its
      input;
    - l2norm keeps q and k in float32 and their rsqrt per key head; the float32 forward keeps the
      whole SiLU output there (q and k are views of it): its value part is a float32-only tensor
      where each key head serves several value heads (with one, v is a view of it too);
    - the decay keeps softplus's input and output per value head (float32), beta its sigmoid; the
      values are copied to float32 once;
    - the gated delta rule (delta_rule_counts);
    - the output norm keeps its input, rsqrt and x * rsqrt (float32); the gate keeps z, silu(z), the
      norm's output and their product, which out_proj reads; the residual sum (float32: the next
      norm's input).
    Under autocast the conv's output (bf16 input, float32 weight) and the output norm's are float32.
    The op policy keeps in_proj_qkv's, in_proj_b's and out_proj's outputs (the 1st, 3rd and 5th
    matmul; the delta rule's are batched, recomputed). Not counted: the conv's document masks
    under block-causal masks (1 per token and shift), the float32 copy of beta in bf16 (1 per token
    and head)."""
    dim = mixer.in_proj_qkv.in_features
    channels = mixer.in_proj_qkv.out_features
    heads, dk, dv = mixer.in_proj_a.out_features, mixer.dk, mixer.dv
    key_heads = mixer.in_proj_qkv.out_features // (2 * dk + mixer.per_key * dv)
    kernel = mixer.conv1d.weight.shape[-1]
    values = heads * dv
    # The float32 forward's SiLU output holds the values (a float32-only tensor, the module docstring)
    # where a key head serves several value heads; with one, the values are views of it, not copied.
    only32 = values if mixer.per_key > 1 else 0
    rule_fp32, rule_moved = delta_rule_counts(heads, dk, dv, mixer.chunk, seq_len)
    # The shifted copies are views of x padded by s rows (s = 1 .. kernel - 1): kernel (kernel - 1) / 2 rows
    # more per sequence.
    shifted = (kernel - 1 + kernel * (kernel - 1) / (2 * seq_len)) * channels
    split = 2 * channels + shifted + heads + 4 * values + 2 * only32
    fp32 = 2 * dim + 1 + dim + 2 * key_heads * (dk + 1) - only32 + values + 2 * heads + rule_fp32 + 2 * values + heads
    moved = channels + 2 * only32 + values + rule_moved
    return ActivationCounts(
        split=split,
        gathered=dim,
        fp32=fp32,
        int64=0,
        op_kept=channels + heads + dim,
        autocast_casts=3 * dim,
        autocast_moved=moved,
    )


def gated_attention_counts(attention: GatedAttention) -> ActivationCounts:
    """A GatedAttention after a pre-norm (its input, rsqrt and x * rsqrt in float32; its gathered
    output, which wq, wk and wv read): q_norm and k_norm keep their inputs, rsqrt per head and
    x * rsqrt in float32 (the float32 forward keeps the whole of wq's output as q_norm's input: its
    gate half is a float32-only tensor); attention (SDPA's flash kernel, as the common counts)
    reads q, k and v (repeated to every query head) and keeps its output and log-sum-exp; the gate
    keeps its sigmoid and the product wo reads; the residual sum (float32). The rotary part reads the
    table only. The op policy keeps wq's output (query and gate) and wv's (the 1st and 3rd matmul)
    and attention's output and log-sum-exp."""
    width, kv = attention.wq.out_features, attention.wk.out_features
    q = width // 2
    dim, head_dim = attention.wq.in_features, attention.head_dim
    heads, kv_heads = q // head_dim, kv // head_dim
    split = 4 * q + 2 * q + 2 * q  # the last: float32-only (the module docstring)
    fp32 = 2 * dim + 1 + dim + heads + (2 * q + heads - q) + 2 * kv + kv_heads
    return ActivationCounts(
        split=split, gathered=dim, fp32=fp32, int64=0, op_kept=width + kv + q, op_fp32=heads, autocast_casts=2 * dim
    )


def block_counts(args, block: nn.Module, seq_len: int) -> ActivationCounts:
    """A Qwen3.5 block: its mixer's counts and SwiGLU's, or (Qwen3.5-MoE) the common mixture of
    experts' (moe_counts, its sigmoid-gated shared expert included). After a DeltaNet mixer's five
    matmuls the op policy keeps SwiGLU's w3 output (the 7th) where after attention's four it keeps w1's
    and w2's."""
    # Transformer.block's modules: GatedDeltaNet or GatedAttention, then FeedForward or MoE (the block
    # types them nn.Module).
    mixer, feed_forward = block.attention, block.feed_forward
    if hasattr(feed_forward, "router"):
        moe = cast(MoE, feed_forward)
        ffn = moe_counts(moe)
        shared = moe.shared_experts
        if hasattr(mixer, "in_proj_qkv") and shared is not None:
            # After five matmuls the router's is the 6th (recomputed); the routed experts' grouped
            # matmuls are not counted; the shared expert's w1 (7th) and w2 (9th) outputs are kept.
            ffn = ActivationCounts(**{**ffn.__dict__, "op_kept": shared.w1.out_features + shared.w2.out_features})
    else:
        swiglu = cast(FeedForward, feed_forward)
        ffn = swiglu_counts(swiglu)
        if hasattr(mixer, "in_proj_qkv"):
            ffn = ActivationCounts(**{**ffn.__dict__, "op_kept": swiglu.w3.out_features})
    if hasattr(mixer, "in_proj_qkv"):
        return add(gated_deltanet_counts(cast(GatedDeltaNet, mixer), seq_len), ffn)
    return add(gated_attention_counts(cast(GatedAttention, mixer)), ffn)
