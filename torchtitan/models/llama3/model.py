"""Llama 3: the shared decoder (torchtitan.models.common.decoder) with RMSNorm, rotary embeddings (Meta's
complex layout, with Llama 3.1's long-context scaling when `rope_scaling` is set), grouped-query
attention and a SwiGLU feed-forward; Llama 3.2's small flavors tie the output layer to the embedding.

Parameter names are Meta's (tok_embeddings, layers.N.attention.wq, ..., norm, output), so public
checkpoints map directly. The code knows nothing of parallelism: attention reshapes with -1 heads so
that the same code runs on tensor-parallel shards.
"""

import torch
from torch import nn

from torchtitan.models.common.attention import sdpa_attention
from torchtitan.models.common.decoder import Decoder, matmul_parameters
from torchtitan.models.common.layers import FeedForward, KVCache
from torchtitan.models.common.init import normal, ones, trunc_normal
from torchtitan.models.llama3.args import ModelArgs
from torchtitan.models.common.rotary import RopeScaling, complex_table, rotate_pairs
from torchtitan.models.common.spec import ModelSize, count_parameters, transformer_flops_per_token


def precompute_freqs_cis(head_dim: int, end: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    return complex_table(head_dim, end, theta, scaling)  # complex64 [end, head_dim/2]


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    # Adjacent pairs of features are the real and imaginary parts (Meta's layout, not Hugging Face's halves).
    return rotate_pairs(xq, freqs_cis), rotate_pairs(xk, freqs_cis)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # A plain function, replaceable from outside: the trainer puts the chosen kernel here and
        # context parallelism its ring attention (torchtitan.models.common.attention).
        self.attention_fn = sdpa_attention
        self.window: int | None = None  # Llama 3 attends to every earlier position

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            out = self.attention_fn(q, k, v, doc_ids=doc_ids, window=self.window)
        else:
            out = cache.attend(q, k, v, start_pos, self.window)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_init_std = 0.02 / (2 * depth) ** 0.5  # residual-branch outputs start small, deeper ones smaller

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Only decoding passes the cache: a tensor-parallel plan prepares exactly the training inputs
        # (the document ids are a keyword: the plan leaves them as they are).
        if cache is None:
            h = x + self.attention(self.attention_norm(x), freqs_cis, doc_ids=doc_ids)
        else:
            h = x + self.attention(self.attention_norm(x), freqs_cis, cache, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(Decoder):
    def block(self, layer_id: int) -> nn.Module:
        return TransformerBlock(layer_id, self.args)

    def rotary_table(self) -> torch.Tensor:
        return precompute_freqs_cis(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta,
                                    self.args.rope_scaling)

    def init_for(self, name: str):
        parts = name.split(".")
        if name.endswith("norm.weight"):
            return ones()
        if parts[0] == "tok_embeddings":
            return normal(1.0)
        if parts[0] == "output":
            return trunc_normal(self.args.dim**-0.5, cutoff=3.0)
        block = self.layers[parts[1]]
        if parts[-2] in ("wq", "wk", "wv", "w1"):
            return trunc_normal(0.02)
        return trunc_normal(block.out_init_std)  # wo, w2, w3


def model_size(args: ModelArgs) -> ModelSize:
    total, embedding = count_parameters(Transformer, args)
    return ModelSize(total=total, active=total, embedding=embedding)


def flops_per_token(args: ModelArgs, doc_lengths: int | list[int]) -> float:
    windows = [None] * args.n_layers
    return transformer_flops_per_token(matmul_parameters(model_size(args), args), args.n_heads * args.head_dim,
                                       windows, doc_lengths)
