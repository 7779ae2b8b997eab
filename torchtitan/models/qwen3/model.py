"""Qwen3 (dense) and Qwen3-MoE: the standard decoder (torchtitan.models.common.decoder.Transformer)
with Llama 3's module names, so the standard tensor-parallel plan and pipeline layout apply. What
differs from Llama 3:

- per-head RMSNorm on queries and keys (`attention.q_norm`, `attention.k_norm`, weight [head_dim]),
  after the projections and before the rotary embedding, as in Hugging Face's Qwen3;
- `head_dim` is its own argument, so n_heads x head_dim need not equal dim;
- the rotary embedding uses Hugging Face's `rotate_half` layout (feature i pairs with feature
  i + head_dim/2), so the Hugging Face adapter only renames; the rotary table is one real buffer
  [max_seq_len, 2 x head_dim] holding cos then sin;
- the feed-forward width is given outright (`hidden_dim`, HF's intermediate_size), or every block
  is a mixture of experts (`moe`, Qwen3-MoE);
- layers max_window_layers and later may attend through a sliding window (`sliding_window`).
"""

from torchtitan.models.common import decoder
from torchtitan.models.common.rotary import HALVES


class Transformer(decoder.Transformer):
    rotary = HALVES
    qk_norm = True


model_size = Transformer.model_size
flops_per_token = Transformer.flops_per_token
