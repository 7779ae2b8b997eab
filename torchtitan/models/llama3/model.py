"""Llama 3: a decoder-only transformer with RMSNorm, rotary embeddings (Meta's complex layout),
grouped-query attention and a SwiGLU feed-forward.

Parameter names are Meta's (tok_embeddings, layers.N.attention.wq, ..., norm, output), so public
checkpoints map directly. The code knows nothing of parallelism: attention reshapes with -1 heads so
that the same code runs on tensor-parallel shards, and the layers live in a ModuleDict keyed by layer
id so that a pipeline stage can drop layers while names stay stable.
"""

import torch
from torch import nn

from torchtitan.models.attention import sdpa_attention
from torchtitan.models.layers import FeedForward, KVCache, rotary_rows
from torchtitan.models.init import normal, ones, seeded_init_, trunc_normal
from torchtitan.models.llama3.args import ModelArgs
from torchtitan.models.spec import ModelSize, count_parameters, transformer_flops_per_token


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, head_dim // 2), torch.outer(t, freqs))  # complex64 [end, head_dim/2]


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    # Adjacent pairs of features are the real and imaginary parts (Meta's layout, not Hugging Face's halves).
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, -1)
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # A plain function, replaceable from outside: the trainer puts the chosen kernel here and
        # context parallelism its ring attention (torchtitan.models.attention).
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


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Global positions of the tokens this rank holds when sequences are split over ranks (context
        # parallel); None: positions 0, 1, 2, ...
        self.token_positions: torch.Tensor | None = None
        # Not persistent: recomputed by init_weights, never part of a checkpoint.
        self.register_buffer("freqs_cis", self._freqs_cis(), persistent=False)

    def _freqs_cis(self) -> torch.Tensor:
        freqs = precompute_freqs_cis(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        return freqs if self.token_positions is None else freqs[self.token_positions]

    def set_token_positions(self, positions: torch.Tensor | None):
        """Rotary embeddings for tokens at these global positions (in this order) from now on."""
        self.token_positions = positions
        if not self.freqs_cis.is_meta:
            self.freqs_cis = self._freqs_cis().to(self.freqs_cis.device)

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
                h = layer(h, self.freqs_cis, doc_ids=doc_ids)
        else:
            freqs_cis = rotary_rows(self.freqs_cis, start_pos, tokens.shape[1])
            for layer_id, layer in self.layers.items():
                h = layer(h, freqs_cis, cache[layer_id], start_pos)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None):
        """Initialize every parameter and buffer in place (after `to_empty`); values depend only on `seed`.
        Buffers go to `buffer_device` (default: where they are), which differs when parameters are offloaded."""
        self.freqs_cis = self._freqs_cis().to(buffer_device or self.freqs_cis.device)
        for name, param in self.named_parameters():
            seeded_init_(param, name, seed, self._init_for(name))

    def _init_for(self, name: str):
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
    # The output layer is a matmul; the input embedding is a lookup.
    size = model_size(args)
    windows = [None] * args.n_layers
    return transformer_flops_per_token(size.total - size.embedding, args.n_heads * args.head_dim, windows, doc_lengths)
