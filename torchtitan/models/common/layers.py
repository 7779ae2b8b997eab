"""Building blocks shared by the model families: the KV cache, SwiGLU, the configurable attention
module and the pre-norm transformer block that every family's blocks are."""

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.attention import AttentionFn, math_attention, repeat_kv, sdpa_attention
from torchtitan.models.common.rotary import Rotary


class KVCache:
    """One layer's keys and values for incremental decoding: [batch, kv_heads, max_len, head_dim] each,
    allocated at the first write with the batch, heads, dtype and device of the keys written.

    A family's attention calls `attend` in place of its `attention_fn` when the model is called with
    caches (`model(tokens, cache=kv_caches(model, n), start_pos=p)`): the tokens given are at
    positions p, p+1, ...; the caller advances p by their number. Training never passes a cache.
    A layer that carries a state along the sequence instead (a linear-attention recurrence, its conv
    window) keeps it in `states` between calls."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.states: dict[str, torch.Tensor] = {}

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start_pos: int,
        window: int | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (after the rotary embedding) at positions start_pos, ... and return q's causal
        attention over every cached position up to its own (the last `window` of them with a sliding
        window); shapes, and (output, lse) with `return_lse`, as attention.sdpa_attention's."""
        seq = q.shape[2]
        end = start_pos + seq
        if end > self.max_len:
            raise ValueError(f"positions {start_pos}..{end - 1} do not fit a KV cache of {self.max_len} positions")
        if self.k is None or self.v is None:  # the first write (they are allocated together)
            self.k = k.new_zeros(*k.shape[:2], self.max_len, k.shape[-1])
            self.v = v.new_zeros(*v.shape[:2], self.max_len, v.shape[-1])
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        if start_pos == 0:  # a prompt: the training path's very computation
            return sdpa_attention(q, self.k[:, :, :end], self.v[:, :, :end], window=window, return_lse=return_lse)
        keys, values = repeat_kv(q, self.k[:, :, :end], self.v[:, :, :end])
        # Query i is at position start_pos + i and sees positions 0 .. start_pos + i (one new token: all).
        mask = None if seq == 1 else torch.ones(seq, end, dtype=torch.bool, device=q.device).tril(start_pos)
        if window is not None:
            q_pos = torch.arange(start_pos, end, device=q.device)[:, None]
            recent = q_pos - torch.arange(end, device=q.device)[None, :] < window
            mask = recent if mask is None else mask & recent
        if return_lse:
            out, lse = math_attention(q, keys, values, mask)
            return out.to(q.dtype), lse
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def kv_caches(model: nn.Module, max_len: int) -> dict[str, KVCache]:
    """An empty cache for each block of `model.layers` (keyed by layer id), for up to max_len positions."""
    return {layer_id: KVCache(max_len) for layer_id in cast(nn.ModuleDict, model.layers)}


def rotary_rows(table: torch.Tensor, start_pos: int, seq: int) -> torch.Tensor:
    """The rows of a rotary table (one per position) for positions start_pos .. start_pos + seq - 1."""
    if start_pos + seq > table.shape[0]:
        raise ValueError(
            f"positions {start_pos}..{start_pos + seq - 1} are beyond the model's {table.shape[0]} (max_seq_len)"
        )
    return table[start_pos : start_pos + seq]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class AttentionBase(nn.Module):
    """What every attention module of a block has: `attention_fn`, the kernel (a plain function that the
    trainer sets and context parallel replaces with its ring; torchtitan.models.common.attention),
    this layer's sliding `window` (None: every earlier position), and `attend`."""

    def __init__(self, window: int | None = None):
        super().__init__()
        self.attention_fn: AttentionFn = sdpa_attention
        self.window = window

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache | None,
        start_pos: int,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """q, k, v [batch, seq, heads, d] (k, v may have fewer heads) -> [batch, seq, heads x v_dim]: the
        kernel in training, the KV cache in decoding. A subclass that changes what attention computes
        overrides this (e.g. sinks, from the kernel's log-sum-exp)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            out = self.attention_fn(q, k, v, doc_ids=doc_ids, window=self.window)
        else:
            out = cache.attend(q, k, v, start_pos, self.window)
        # Without return_lse both return the output alone.
        return cast(torch.Tensor, out).transpose(1, 2).flatten(2)


def rms_norm_as_weight(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """RMS norm of x over its last dim, computed in the dtype of `weight` and returned in x's: under autocast a bf16
    projection meets a float32 norm weight, which torch's rms_norm takes only through its unfused path, with a
    warning at every call; this gives the same values (that path computes in float32 and rounds to bf16 too)
    through the fused one."""
    return F.rms_norm(x.to(weight.dtype), x.shape[-1:], weight, eps).to(x.dtype)


class HeadNorm(nn.RMSNorm):
    """An RMSNorm computed as rms_norm_as_weight computes it: the per-head query and key norms, which meet a bf16
    projection under autocast. A module, not a function call, so a tensor-parallel plan's hooks on it still run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_as_weight(x, self.weight, self.eps)


class Attention(AttentionBase):
    """Grouped-query attention with Meta's names (wq, wk, wv, wo) and the knobs the families use:
    - `rotary`: the layout of the rotary embedding (rotary.PAIRS or rotary.HALVES);
    - `qk_norm_eps`: when set, an RMSNorm over each head's features of q and of k (`q_norm`, `k_norm`,
      one weight [head_dim] for all heads), after the projections and before the rotary (Qwen3);
    - `bias`: biases on the four projections;
    - `window`: this layer's sliding window.
    Reshapes use -1 heads: under tensor parallel the projections hold this rank's heads only."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rotary: Rotary,
        qk_norm_eps: float | None = None,
        bias: bool = False,
        window: int | None = None,
    ):
        super().__init__(window)
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        norms = qk_norm_eps is not None
        self.q_norm = HeadNorm(head_dim, eps=qk_norm_eps) if norms else None
        self.k_norm = HeadNorm(head_dim, eps=qk_norm_eps) if norms else None
        self.rotate = rotary.rotate

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bs, seq, _ = x.shape
        q, k, v = (w(x).view(bs, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm_eps)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, rope), self.rotate(k, rope)
        return self.wo(self.attend(q, k, v, cache, start_pos, doc_ids))


class TransformerBlock(nn.Module):
    """A pre-norm block: h = x + attention(attention_norm(x)), then h + feed_forward(ffn_norm(h)).
    `attention` is called as attention(x, rope, cache, start_pos, doc_ids=...) (Attention, or a
    family's own such as MLA); `feed_forward` is SwiGLU or a mixture of experts. `args` give dim,
    norm_eps, n_layers and depth_init."""

    def __init__(self, layer_id: int, args, attention: nn.Module, feed_forward: nn.Module):
        super().__init__()
        self.layer_id = layer_id
        self.attention = attention
        self.feed_forward = feed_forward
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # The std of the output projections' init: residual-branch outputs start small, deeper ones
        # smaller (depth_init), or all as the deepest.
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_init_std = 0.02 / (2 * depth) ** 0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Only decoding passes the cache: a tensor-parallel plan prepares exactly the training inputs
        # (the document ids are a keyword: the plan leaves them as they are).
        if cache is None:
            h = x + self.attention(self.attention_norm(x), rope, doc_ids=doc_ids)
        else:
            h = x + self.attention(self.attention_norm(x), rope, cache, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); one per output
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """`x` unchanged, its gradient multiplied by `factor`."""
    return x if factor == 1.0 else _ScaleGradient.apply(x, factor)
