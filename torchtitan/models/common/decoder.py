"""The decoder the families share: token embedding -> blocks -> final RMSNorm -> output layer,
with Meta's module names (tok_embeddings, layers.N, norm, output) and optionally tied embeddings;
`Transformer`, the standard one (blocks of layers.Attention and SwiGLU or MoE), configured by a
family's class attributes; `decoder_spec`, its ModelSpec; `moe_hooks`, the spec's MoE hooks.

A family subclasses `Decoder` and gives its blocks (`block(layer_id)`), its rotary table
(`rotary_table()`: one row per position, whatever layout its attention reads) and its
initialization (`initializer_for(name)`). The rest is the same for every family:
- the layers live in a ModuleDict keyed by layer id, so that a pipeline stage can drop layers while
  names stay stable, and each top-level module may be None on a pipeline stage (forward skips it);
- the rotary table is a non-persistent buffer, recomputed by init_weights and by
  set_token_positions (context parallel: rows for the global positions this rank holds);
- tied embeddings (`args.tie_word_embeddings`): `output.weight` IS `tok_embeddings.weight`, one
  Parameter under two names, kept so across `to_empty` / `.to()` by `_apply`; it is drawn once, as
  the embedding, and a pipeline stage holding only the output layer draws its copy the same way.
"""

from typing import Any, cast

import torch
from torch import nn

from torchtitan.models.common import moe
from torchtitan.models.common.activation_memory import standard_block_counts
from torchtitan.models.common.chunked_loss import linear_cross_entropy_sum
from torchtitan.models.common.init import Init, normal, ones, seeded_init_, trunc_normal, zeros
from torchtitan.models.common.layers import Attention, FeedForward, KVCache, TransformerBlock, rotary_rows
from torchtitan.models.common.rotary import PAIRS, Rotary
from torchtitan.models.common.spec import (
    ModelSize,
    ModelSpec,
    MoEHooks,
    count_parameters,
    cross_entropy_sum,
    transformer_flops_per_token,
)

EMBEDDING = "tok_embeddings.weight"


class Decoder(nn.Module):
    # Training with labels given to forward: the output layer and the loss run this many tokens at a
    # time (chunked_loss; the trainer sets it from training.loss_chunk_tokens).
    loss_chunk_tokens: int = 0

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block(i) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if self.tied:
            self.output.weight = self.tok_embeddings.weight
        # Top-level modules a pipeline stage keeps only for another module to use (PipelineLayout.shared):
        # its forward does not apply them in their own place.
        self.borrowed: frozenset[str] = frozenset()
        # Global positions of the tokens this rank holds when sequences are split over ranks (context
        # parallel); None: positions 0, 1, 2, ...
        self.token_positions: torch.Tensor | None = None
        # Not persistent: recomputed by init_weights, never part of a checkpoint.
        self.register_buffer("rope", self._rope(), persistent=False)

    # ---- what a family gives ----

    def block(self, layer_id: int) -> nn.Module:
        """Block `layer_id`: forward(x, rope, cache=None, start_pos=0, doc_ids=None)."""
        raise NotImplementedError

    def rotary_table(self) -> torch.Tensor:
        """The rotary table for positions 0 .. max_seq_len - 1, one row per position."""
        raise NotImplementedError

    def initializer_for(self, name: str) -> Init:
        """The initializer of parameter `name`: how it is drawn (torchtitan.models.common.init). A tied
        embedding is drawn by the decoder instead (_initializer_with_tying)."""
        raise NotImplementedError

    # ---- shared ----

    @property
    def tied(self) -> bool:
        return bool(getattr(self.args, "tie_word_embeddings", False))

    def _rope(self) -> torch.Tensor:
        table = self.rotary_table()
        return table if self.token_positions is None else table[self.token_positions]

    def set_token_positions(self, positions: torch.Tensor | None):
        """Rotary embeddings for tokens at these global positions (in this order) from now on."""
        self.token_positions = positions
        if not self.rope.is_meta:
            self.rope = self._rope().to(self.rope.device)

    def _apply(self, fn, recurse=True):
        # Module._apply (to_empty, .to(), .float(), ...) gives each module its own new Parameter,
        # which would untie the embeddings: tie them again to the embedding's new one.
        super()._apply(fn, recurse)
        if self.tied and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        cache: dict[str, KVCache] | None = None,
        start_pos: int = 0,
        doc_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Training: forward(tokens), or forward(tokens, doc_ids=ids) for block-causal attention
        (attention.document_ids: each token sees only its own document). Decoding: with `cache`
        (layers.kv_caches), the tokens are at positions start_pos, start_pos + 1, ... and their keys
        and values are added to the cache. With `labels` (and loss_chunk_tokens set): instead of the
        logits, the spec's summed loss, computed chunk by chunk (output_loss_sum)."""
        if cache is None:
            h = self.trunk(tokens, doc_ids)
        else:
            h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
            rope = rotary_rows(self.rope, start_pos, tokens.shape[1])
            for layer_id, layer in self.layers.items():
                h = layer(h, rope, cache[layer_id], start_pos)
        h = self.norm(h) if self.norm is not None else h
        if labels is not None and self.output is not None:
            return self.output_loss_sum(h, labels[..., 0] if labels.dim() == 3 else labels)
        return self.output(h) if self.output is not None else h

    def output_loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The output layer and the summed next-token cross entropy of the final norm's output `h`
        against `labels`, loss_chunk_tokens tokens at a time (the [tokens, vocab] logits never whole)."""
        if self.loss_chunk_tokens <= 0:
            raise ValueError("forward(tokens, labels=...) computes the loss chunk by chunk: set loss_chunk_tokens")
        return linear_cross_entropy_sum(h, self.output.weight, labels, self.loss_chunk_tokens)

    def trunk(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The embedding and the blocks of the training forward (each may be absent on a pipeline
        stage, or the embedding borrowed by a later stage): the hidden states before the final norm."""
        embeds = self.tok_embeddings is not None and "tok_embeddings" not in self.borrowed
        h = self.tok_embeddings(tokens) if embeds else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope, doc_ids=doc_ids)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None):
        """Initialize every parameter and buffer in place (after `to_empty`); values depend only on `seed`.
        Buffers go to `buffer_device` (default: where they are), which differs when parameters are offloaded."""
        self.rope = self._rope().to(buffer_device or self.rope.device)
        for name, param in self.named_parameters():
            if self.tied and name == "output.weight":  # a stage without the embedding: its copy
                name = EMBEDDING
            seeded_init_(param, name, seed, self._initializer_with_tying(name))

    def _initializer_with_tying(self, name: str) -> Init:
        """The initializer init_weights draws parameter `name` with: the family's (initializer_for), but
        for a tied embedding, which is the output layer too."""
        if name == EMBEDDING and self.tied:
            # Tied, it is the output layer too, reading the final norm's output, which at init is mostly
            # the input token's own normalized embedding: that token's logit starts at dim x std.
            # Hugging Face's initializer_range 0.02 keeps it moderate (5 at dim 256) and is large enough
            # for Adam's steps of ~lr per element. Measured on Qwen3's debugmodel_tied, 20 steps, whole
            # batch against two accumulated halves: std dim**-0.5 (logit 16, first loss 11.5, grad norm
            # 23) and std 1/dim (Adam moves each weight by 20% per step) both turned rounding
            # differences into loss differences of 1e-2..3e-1; std 0.02 kept them under 1e-5.
            return trunc_normal(0.02, cutoff=3.0)
        return self.initializer_for(name)


def matmul_parameters(size, args) -> int:
    """The parameters a token's forward multiplies with (spec.ModelSize `size` of `args`): the active
    ones but the input embedding, a lookup; a tied output layer is a matmul even though `size`
    counts its weight once, as the embedding."""
    tied = getattr(args, "tie_word_embeddings", False)
    return size.active - size.embedding + (args.vocab_size * args.dim if tied else 0)


def layer_window(args, layer_id: int) -> int | None:
    """Layer `layer_id`'s sliding window: args.layer_window(layer_id) where the args have one, else None."""
    return args.layer_window(layer_id) if hasattr(args, "layer_window") else None


def feed_forward(dim: int, hidden_dim: int, moe_args: moe.MoEArgs | None) -> nn.Module:
    """SwiGLU of width hidden_dim, or, where `moe_args` is set, a mixture of experts in its place."""
    return moe.MoE(dim, moe_args) if moe_args is not None else FeedForward(dim, hidden_dim)


class Transformer(Decoder):
    """The standard decoder: each block grouped-query layers.Attention, then SwiGLU, or a mixture of
    experts where `args.moe` is set. A family subclasses it and sets what differs as class attributes.
    Its args give dim, n_layers, n_heads, kv_heads, head_dim, ffn_hidden_dim, norm_eps, depth_init,
    rope_theta, max_seq_len, vocab_size, and where they have them rope_scaling, moe, tie_word_embeddings
    and layer_window(layer_id)."""

    rotary: Rotary = PAIRS  # the rotary layout: rotary.PAIRS (Meta's complex pairs) or rotary.HALVES
    qk_norm: bool = False  # an RMSNorm per head on queries and keys (Qwen3)
    # Matrices drawn with std 0.02, by their own name (the router's is "gate"); a block's other matrices
    # (wo, w2, w3) with its out_init_std.
    input_projections: tuple[str, ...] = ("wq", "wk", "wv", "w1", "gate", "shared_gate")

    def block(self, layer_id: int) -> nn.Module:
        a = self.args
        attention = Attention(
            a.dim,
            a.n_heads,
            a.kv_heads,
            a.head_dim,
            self.rotary,
            qk_norm_eps=a.norm_eps if self.qk_norm else None,
            window=layer_window(a, layer_id),
        )
        return TransformerBlock(layer_id, a, attention, feed_forward(a.dim, a.ffn_hidden_dim, getattr(a, "moe", None)))

    def rotary_table(self) -> torch.Tensor:
        a = self.args
        return self.rotary.table(a.head_dim, a.max_seq_len, a.rope_theta, getattr(a, "rope_scaling", None))

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None):
        super().init_weights(seed, buffer_device)
        for _, layer in moe.moe_layers(self):  # the balancing bias and token counts start at zero
            layer.reset_buffers(buffer_device)

    def initializer_for(self, name: str) -> Init:
        if name.endswith("norm.weight"):  # also the per-head q/k norms
            return ones()
        if name.endswith(".bias"):
            return zeros()
        if name.startswith("tok_embeddings."):
            return normal(1.0)
        if name.startswith("output."):
            return trunc_normal(self.args.dim**-0.5, cutoff=3.0)
        # The projection's own name, also for the experts' 3-D weights (feed_forward.experts.w1).
        if name.removesuffix(".weight").rsplit(".", 1)[-1] in self.input_projections:
            return trunc_normal(0.02)
        return trunc_normal(cast(float, self._block_of(name).out_init_std))

    def _block_of(self, name: str) -> nn.Module:
        """The block that holds parameter `name`: its nearest enclosing module with an out_init_std."""
        path = name.split(".")[:-1]
        while not hasattr(module := self.get_submodule(".".join(path)), "out_init_std"):
            path.pop()
        return module

    @classmethod
    def model_size(cls, args) -> ModelSize:
        """Parameter counts; a token uses top_k of the routed experts of each MoE block."""
        total, embedding = count_parameters(cls, args)
        moe_args = getattr(args, "moe", None)
        if moe_args is None:
            return ModelSize(total=total, active=total, embedding=embedding)
        with torch.device("meta"):
            blocks = len(moe.moe_layers(cls(args)))
        moe_total, moe_active = moe.count_moe_parameters(moe_args, args.dim)
        return ModelSize(total=total, active=total - blocks * (moe_total - moe_active), embedding=embedding)

    @classmethod
    def flops_per_token(cls, args, doc_lengths: int | list[int]) -> float:
        windows = [layer_window(args, i) for i in range(args.n_layers)]
        return transformer_flops_per_token(
            matmul_parameters(cls.model_size(args), args), args.n_heads * args.head_dim, windows, doc_lengths
        )


def decoder_spec(model_cls: type[Transformer], **fields) -> ModelSpec:
    """The ModelSpec of a family built on `Transformer`: sizes and FLOPs from the class, the standard
    block's activation counts, each block's `attention` for the kernel and context parallel, KV-cache
    decoding, document masks, the output layer left to AdamW under Muon. `fields` give the rest
    (name, args_cls, flavors, tp_plan, tp_sizes, hf, ...) and may replace any of these."""
    # One value type per ModelSpec field: the dict holds them all.
    spec_fields: dict[str, Any] = {
        "model_cls": model_cls,
        "size": model_cls.model_size,
        "flops_per_token": model_cls.flops_per_token,
        "activation_counts": standard_block_counts,  # what a block keeps for backward (the layout planner)
        "cp_attention": "attention",
        "kv_cache": True,
        "document_masks": True,
        "adamw_params": (r"^output\.",),  # Muon leaves the output layer to AdamW
        # Decoder.forward(tokens, labels=...) computes the family's loss chunk by chunk (a family whose
        # loss differs overrides forward to match it, as deepseek_v3 does for multi-token prediction).
        "chunked_loss": fields.get("loss_sum_fn", cross_entropy_sum),
        **fields,
    }
    return ModelSpec(**spec_fields)


def moe_hooks() -> MoEHooks:
    """The spec's MoE hooks (ModelSpec.moe) for a family whose routed experts are moe.MoE blocks: the
    blocks for expert parallel, the router kept out of float8 and left to AdamW under Muon, the
    auxiliary losses' gradient scale set for the layout, the balancing bias moved after each step
    (not by a skipped one), the experts' load as metrics. None of it acts on a model without MoE blocks."""
    return MoEHooks(
        expert_layers=moe.expert_layers,
        high_precision=("router.gate", "shared_gate"),  # the routers and the shared experts' sigmoid gate
        adamw_params=(r"\.router\.gate\.", r"\.shared_gate\."),
        pre_parallelize=moe.configure_moe,
        post_optimizer_step=moe.balance_after_step,
        post_skipped_step=moe.drop_step_counts,
        metrics=moe.expert_load_metrics,
    )
