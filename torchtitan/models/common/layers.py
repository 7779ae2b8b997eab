"""Building blocks shared by the model families."""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.attention import math_attention, repeat_kv, sdpa_attention


class KVCache:
    """One layer's keys and values for incremental decoding: [batch, kv_heads, max_len, head_dim] each,
    allocated at the first write with the batch, heads, dtype and device of the keys written.

    A family's attention calls `attend` in place of its `attention_fn` when the model is called with
    caches (`model(tokens, cache=kv_caches(model, n), start_pos=p)`): the tokens given are at
    positions p, p+1, ...; the caller advances p by their number. Training never passes a cache."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int,
               window: int | None = None, return_lse: bool = False):
        """Store k, v (after the rotary embedding) at positions start_pos, ... and return q's causal
        attention over every cached position up to its own (the last `window` of them with a sliding
        window); shapes, and (output, lse) with `return_lse`, as attention.sdpa_attention's."""
        seq = q.shape[2]
        end = start_pos + seq
        if end > self.max_len:
            raise ValueError(f"positions {start_pos}..{end - 1} do not fit a KV cache of {self.max_len} positions")
        if self.k is None:
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
    return {layer_id: KVCache(max_len) for layer_id in model.layers}


def rotary_rows(table: torch.Tensor, start_pos: int, seq: int) -> torch.Tensor:
    """The rows of a rotary table (one per position) for positions start_pos .. start_pos + seq - 1."""
    if start_pos + seq > table.shape[0]:
        raise ValueError(
            f"positions {start_pos}..{start_pos + seq - 1} are beyond the model's {table.shape[0]} (max_seq_len)"
        )
    return table[start_pos:start_pos + seq]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """`x` unchanged, its gradient multiplied by `factor`."""
    return x if factor == 1.0 else _ScaleGradient.apply(x, factor)
