"""Qwen3 (dense): a decoder-only transformer with RMSNorm, rotary embeddings, grouped-query attention
and a SwiGLU feed-forward, laid out with Llama 3's module names so the shared tensor-parallel plan
and pipeline layout apply. What differs from Llama 3:

- per-head RMSNorm on queries and keys (`attention.q_norm`, `attention.k_norm`, weight [head_dim]),
  after the projections and before the rotary embedding, as in Hugging Face's Qwen3;
- `head_dim` is its own argument, so n_heads x head_dim need not equal dim;
- the rotary embedding uses Hugging Face's `rotate_half` layout (feature i pairs with feature
  i + head_dim/2), so the Hugging Face adapter only renames; the rotary table is one real buffer
  [max_seq_len, 2 x head_dim] holding cos then sin;
- the feed-forward width is given outright (`hidden_dim`, HF's intermediate_size);
- optionally tied embeddings: `output.weight` IS `tok_embeddings.weight` (one Parameter under two
  names), kept so across `to_empty` / `.to()` by `_apply`, and initialized once.

The code knows nothing of parallelism: attention reshapes with -1 heads so that the same code runs on
tensor-parallel shards, and the layers live in a ModuleDict keyed by layer id so that a pipeline
stage can drop layers while names stay stable.
"""

import torch
from torch import nn

from torchtitan.models.attention import sdpa_attention
from torchtitan.models.layers import FeedForward, KVCache, rotary_rows
from torchtitan.models.moe import MoE, count_moe_parameters, moe_layers
from torchtitan.models.init import normal, ones, seeded_init_, trunc_normal
from torchtitan.models.qwen3.args import ModelArgs
from torchtitan.models.spec import ModelSize, count_parameters, transformer_flops_per_token


def rope_table(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """[end, 2 x head_dim]: cos then sin of each position's angles, the head_dim/2 angles written twice
    along the features (Hugging Face's layout), computed in float32 as Hugging Face does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32), inv_freq)
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
        # context parallelism its ring attention (torchtitan.models.attention). SDPA's default scale
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


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Global positions of the tokens this rank holds when sequences are split over ranks (context
        # parallel); None: positions 0, 1, 2, ...
        self.token_positions: torch.Tensor | None = None
        # Not persistent: recomputed by init_weights, never part of a checkpoint.
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    def _rope_cache(self) -> torch.Tensor:
        table = rope_table(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        return table if self.token_positions is None else table[self.token_positions]

    def set_token_positions(self, positions: torch.Tensor | None):
        """Rotary embeddings for tokens at these global positions (in this order) from now on."""
        self.token_positions = positions
        if not self.rope_cache.is_meta:
            self.rope_cache = self._rope_cache().to(self.rope_cache.device)

    def _apply(self, fn, recurse=True):
        # Module._apply (to_empty, .to(), .float(), ...) gives each module its own new Parameter,
        # which would untie the embeddings: tie them again to the embedding's new one.
        super()._apply(fn, recurse)
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        return self

    def forward(
        self, tokens: torch.Tensor, cache: dict[str, KVCache] | None = None, start_pos: int = 0,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Training: forward(tokens), or forward(tokens, doc_ids=ids) for block-causal attention
        (attention.document_ids: each token sees only its own document). Decoding: with `cache`
        (layers.kv_caches), the tokens are at positions start_pos, start_pos + 1, ... and their keys
        and values are added to the cache."""
        # Each part may be absent on a pipeline stage.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if cache is None:
            for layer in self.layers.values():
                h = layer(h, self.rope_cache, doc_ids=doc_ids)
        else:
            rope = rotary_rows(self.rope_cache, start_pos, tokens.shape[1])
            for layer_id, layer in self.layers.items():
                h = layer(h, rope, cache[layer_id], start_pos)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None):
        """Initialize every parameter and buffer in place (after `to_empty`); values depend only on `seed`.
        Buffers go to `buffer_device` (default: where they are), which differs when parameters are offloaded.
        A tied weight appears once in named_parameters (as tok_embeddings.weight), so it is drawn once."""
        self.rope_cache = self._rope_cache().to(buffer_device or self.rope_cache.device)
        for name, param in self.named_parameters():
            seeded_init_(param, name, seed, self._init_for(name))
        for _, moe in moe_layers(self):
            moe.reset_buffers(buffer_device)

    def _init_for(self, name: str):
        parts = name.split(".")
        if name.endswith("norm.weight"):  # also q_norm / k_norm
            return ones()
        if parts[0] == "tok_embeddings":
            # Tied, it is the output layer too, reading the final norm's output, which at init is mostly
            # the input token's own normalized embedding: that token's logit starts at dim x std.
            # Hugging Face's initializer_range 0.02 keeps it moderate (5 at dim 256) and is large enough
            # for Adam's steps of ~lr per element. Measured on debugmodel_tied, 20 steps, whole batch
            # against two accumulated halves: std dim**-0.5 (logit 16, first loss 11.5, grad norm 23)
            # and std 1/dim (Adam moves each weight by 20% per step) both turned rounding differences
            # into loss differences of 1e-2..3e-1; std 0.02 kept them under 1e-5.
            return trunc_normal(0.02, cutoff=3.0) if self.args.tie_word_embeddings else normal(1.0)
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
    # The input embedding is a lookup; the output layer is a matmul even when it reuses the
    # embedding's weight, which `total` then counts once only.
    size = model_size(args)
    matmul = size.active - size.embedding + (args.vocab_size * args.dim if args.tie_word_embeddings else 0)
    windows = [args.layer_window(i) for i in range(args.n_layers)]
    return transformer_flops_per_token(matmul, args.n_heads * args.head_dim, windows, doc_lengths)
