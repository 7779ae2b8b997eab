"""Attention shared by the model families."""

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [batch, heads, seq, head_dim]; k, v [batch, kv_heads, seq, head_dim] (grouped-query attention:
    each KV head serves heads / kv_heads query heads). The default `attention_fn` of a family's
    attention module; context parallel replaces it with its ring attention of the same signature."""
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
