"""Qwen3 (dense): the shared decoder (torchtitan.models.common.decoder) with RMSNorm, rotary embeddings,
grouped-query attention and a SwiGLU feed-forward, laid out with Llama 3's module names so the shared
tensor-parallel plan and pipeline layout apply. What differs from Llama 3:

- per-head RMSNorm on queries and keys (`attention.q_norm`, `attention.k_norm`, weight [head_dim]),
  after the projections and before the rotary embedding, as in Hugging Face's Qwen3;
- `head_dim` is its own argument, so n_heads x head_dim need not equal dim;
- the rotary embedding uses Hugging Face's `rotate_half` layout (feature i pairs with feature
  i + head_dim/2), so the Hugging Face adapter only renames; the rotary table is one real buffer
  [max_seq_len, 2 x head_dim] holding cos then sin;
- the feed-forward width is given outright (`hidden_dim`, HF's intermediate_size);
- optionally tied embeddings (the shared decoder's, torchtitan.models.common.decoder).

The code knows nothing of parallelism: attention reshapes with -1 heads so that the same code runs on
tensor-parallel shards.
"""

import torch
from torch import nn

from torchtitan.models.common.attention import sdpa_attention
from torchtitan.models.common.decoder import Decoder, matmul_parameters
from torchtitan.models.common.layers import FeedForward, KVCache
from torchtitan.models.common.moe import MoE, count_moe_parameters, moe_layers
from torchtitan.models.common.init import normal, ones, trunc_normal
from torchtitan.models.qwen3.args import ModelArgs
from torchtitan.models.common.rotary import inv_frequencies
from torchtitan.models.common.spec import ModelSize, count_parameters, transformer_flops_per_token


def rope_table(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """[end, 2 x head_dim]: cos then sin of each position's angles, the head_dim/2 angles written twice
    along the features (Hugging Face's layout), computed in float32 as Hugging Face does."""
    angles = torch.outer(torch.arange(end, dtype=torch.float32), inv_frequencies(head_dim, theta))
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_emb(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim]; rope: the table's first `seq` rows (or this rank's positions)."""
    cos, sin = rope[: x.shape[1]].view(1, x.shape[1], 1, -1).chunk(2, dim=-1)
    x_ = x.float()  # rotate in float32 whatever the activation dtype
    x1, x2 = x_.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # rotate_half: feature i pairs with i + head_dim/2
    return (x_ * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int | None = None):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # One weight shared by all heads; normalizes each head's features separately.
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        # A plain function, replaceable from outside: the trainer puts the chosen kernel here and
        # context parallelism its ring attention (torchtitan.models.common.attention). SDPA's default scale
        # 1/sqrt(head_dim) is Qwen3's.
        self.attention_fn = sdpa_attention
        self.window = window  # this layer's sliding window (None: every earlier position)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 heads: under tensor parallel the projections hold this rank's heads only.
        q = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, rope), apply_rotary_emb(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            out = self.attention_fn(q, k, v, doc_ids=doc_ids, window=self.window)
        else:
            out = cache.attend(q, k, v, start_pos, self.window)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args, args.layer_window(layer_id))
        # Qwen3-MoE: the same block with a mixture of experts in place of the dense feed-forward.
        self.feed_forward = MoE(args.dim, args.moe) if args.moe else FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_init_std = 0.02 / (2 * depth) ** 0.5  # residual-branch outputs start small, deeper ones smaller

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, cache: KVCache | None = None, start_pos: int = 0,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Only decoding passes the cache: a tensor-parallel plan prepares exactly the training inputs
        # (the document ids are a keyword: the plan leaves them as they are).
        if cache is None:
            h = x + self.attention(self.attention_norm(x), rope, doc_ids=doc_ids)
        else:
            h = x + self.attention(self.attention_norm(x), rope, cache, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(Decoder):
    def block(self, layer_id: int) -> nn.Module:
        return TransformerBlock(layer_id, self.args)

    def rotary_table(self) -> torch.Tensor:
        return rope_table(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None):
        super().init_weights(seed, buffer_device)
        for _, moe in moe_layers(self):
            moe.reset_buffers(buffer_device)

    def init_for(self, name: str):
        parts = name.split(".")
        if name.endswith("norm.weight"):  # also q_norm / k_norm
            return ones()
        if parts[0] == "tok_embeddings":
            return normal(1.0)
        if parts[0] == "output":
            return trunc_normal(self.args.dim**-0.5, cutoff=3.0)
        block = self.layers[parts[1]]
        # The projection's name: wq ... w3, also for the experts' 3-D weights; "gate": the MoE router.
        if name.removesuffix(".weight").rsplit(".", 1)[-1] in ("wq", "wk", "wv", "w1", "gate"):
            return trunc_normal(0.02)
        return trunc_normal(block.out_init_std)  # wo, w2, w3


def model_size(args: ModelArgs) -> ModelSize:
    total, embedding = count_parameters(Transformer, args)
    active = total
    if args.moe is not None:  # a token uses top_k of the routed experts
        moe_total, moe_active = count_moe_parameters(args.moe, args.dim)
        active -= args.n_layers * (moe_total - moe_active)
    return ModelSize(total=total, active=active, embedding=embedding)


def flops_per_token(args: ModelArgs, doc_lengths: int | list[int]) -> float:
    windows = [args.layer_window(i) for i in range(args.n_layers)]
    return transformer_flops_per_token(matmul_parameters(model_size(args), args), args.n_heads * args.head_dim,
                                       windows, doc_lengths)
