"""Llama 3: the standard decoder (torchtitan.models.common.decoder.Transformer): RMSNorm, grouped-query
attention, a SwiGLU feed-forward, rotary embeddings in Meta's layout (adjacent features of a head form
one complex number), with Llama 3.1's long-context scaling when `rope_scaling` is set; Llama 3.2's
small flavors tie the output layer to the embedding.

Parameter names are Meta's (tok_embeddings, layers.N.attention.wq, ..., norm, output), so public
checkpoints map directly; Hugging Face's hold q and k in halves, which its adapter permutes.
"""

from torchtitan.models.common import decoder
from torchtitan.models.common.rotary import PAIRS


class Transformer(decoder.Transformer):
    rotary = PAIRS


model_size = Transformer.model_size
flops_per_token = Transformer.flops_per_token
