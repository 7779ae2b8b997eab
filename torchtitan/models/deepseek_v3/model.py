"""DeepSeek-V3: the shared decoder (torchtitan.models.common.decoder) with multi-head latent
attention (MLA) and, after the first n_dense_layers layers, a mixture of experts with shared experts
(torchtitan.models.common.moe: sigmoid scores, group-limited routing, a routed scaling factor and the
bias balancing DeepSeek calls e_score_correction_bias).

MLA, per block: queries come from x through an optional low-rank bottleneck (wq_a, q_norm, wq_b) or
one projection (wq); keys and values from one low-rank latent (wkv_a: kv_lora_rank features plus a
rotary key part shared by all heads; kv_norm; wkv_b: each head's non-rotary key part and its value).
A head's query and key are [nope | rope] (qk_head_dim wide), its value v_head_dim wide, so q/k and v
head dims differ. The rotary parts rotate adjacent feature pairs (DeepSeek's interleaved layout,
`rotate_pairs`) with YaRN frequencies. The attention logits get YaRN's extra factor by scaling the
queries (the kernels' own scale stays 1/sqrt(qk_head_dim)).
"""

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common import decoder
from torchtitan.models.common.decoder import matmul_parameters
from torchtitan.models.common.layers import (
    AttentionBase,
    FeedForward,
    KVCache,
    TransformerBlock,
    rms_norm_as_weight,
    scale_gradient,
)
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rotary import complex_table, rotate_pairs, yarn_softmax_factor
from torchtitan.models.common.spec import IGNORE_INDEX, cross_entropy_sum, transformer_flops_per_token
from torchtitan.models.common.tp_plan import grad_summed, replicated
from torchtitan.models.deepseek_v3.args import ModelArgs


class MLA(AttentionBase):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.nope, self.rope_dim, self.v_dim, self.kv_lora = (
            a.qk_nope_head_dim,
            a.qk_rope_head_dim,
            a.v_head_dim,
            a.kv_lora_rank,
        )
        if a.q_lora_rank:
            self.wq_a = nn.Linear(a.dim, a.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(a.q_lora_rank, eps=a.norm_eps)
            self.wq_b = nn.Linear(a.q_lora_rank, a.n_heads * a.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(a.dim, a.n_heads * a.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(a.dim, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(a.kv_lora_rank, eps=a.norm_eps)
        self.wkv_b = nn.Linear(a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.wo = nn.Linear(a.n_heads * a.v_head_dim, a.dim, bias=False)
        self.query_scale = yarn_softmax_factor(a.rope_scaling)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bs, seq, _ = x.shape
        # The low-rank projections and their norms are computed whole on every TP rank (their
        # weights replicated, read through `replicated`); the per-head projections (wq / wq_b,
        # wkv_b, wo) are split by heads. -1 heads: under TP the projections hold this rank's heads.
        if hasattr(self, "wq_a"):
            q_latent = F.linear(x, replicated(self.wq_a.weight))
            q = self.wq_b(rms_norm_as_weight(q_latent, replicated(self.q_norm.weight), self.q_norm.eps))
        else:
            q = self.wq(x)
        q_nope, q_rope = q.view(bs, seq, -1, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        kv_a = replicated(self.wkv_a.weight)
        latent = F.linear(x, kv_a[: self.kv_lora])
        # The rotary key is shared by all heads: under TP each rank's heads give it a part of its gradient.
        k_rope = grad_summed(F.linear(x, kv_a[self.kv_lora :]), self.wkv_a.weight)
        latent = rms_norm_as_weight(latent, replicated(self.kv_norm.weight), self.kv_norm.eps)
        kv = self.wkv_b(latent).view(bs, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = k_nope.shape[2]
        k_rope = rotate_pairs(k_rope.unsqueeze(2), rope).expand(-1, -1, heads, -1)
        q = torch.cat([q_nope, rotate_pairs(q_rope, rope)], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k = torch.cat([k_nope, k_rope], dim=-1)
        return self.wo(self.attend(q, k, v, cache, start_pos, doc_ids))


class MTPModule(nn.Module):
    """Multi-token prediction, depth k: the previous depth's hidden states and the embedding of the
    token k positions ahead, each normalized, concatenated (embedding first, as the published
    weights expect) and projected back to dim, then one more block; `norm` before the shared output layer."""

    def __init__(self, block: TransformerBlock, a: ModelArgs):
        super().__init__()
        self.enorm, self.hnorm = nn.RMSNorm(a.dim, eps=a.norm_eps), nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.eh_proj = nn.Linear(2 * a.dim, a.dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)

    def forward(
        self, h: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        # The block's residual stream in the trunk's dtype: under autocast the trunk's stays float32
        # (the embedding's; each block adds its bf16 outputs to it), while eh_proj, a matmul, gives
        # bf16. Under FSDP's bf16 policy both are bf16 already.
        return self.block(x.to(h.dtype), rope, doc_ids=doc_ids)


class Transformer(decoder.Transformer):
    # Input projections (and the router, and MTP's eh_proj) are drawn at 0.02, output projections by depth.
    input_projections = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1", "gate", "eh_proj")

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        # After the layers (a pipeline's last stage): module k's block at layer id n_layers + k.
        self.mtp = (
            nn.ModuleDict({str(k): MTPModule(self.block(args.n_layers + k), args) for k in range(args.mtp_depth)})
            if args.mtp_depth
            else None
        )

    def block(self, layer_id: int) -> TransformerBlock:
        a = self.args
        ffn = FeedForward(a.dim, a.inter_dim) if layer_id < a.n_dense_layers else MoE(a.dim, a.moe)
        return TransformerBlock(layer_id, a, MLA(a), ffn)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: dict[str, KVCache] | None = None,
        start_pos: int = 0,
        doc_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        future_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the decoder's; in training with multi-token prediction, the logits of the main output and
        of each MTP depth stacked on dim 2: [batch, seq, 1 + mtp_depth, vocab] (mtp_loss_sum reads
        them). Depth k's logits at position i predict token i + k + 1; their gradient is scaled by
        mtp_loss_weight / mtp_depth. `future_tokens` [batch, seq, mtp_depth] (prepare_window): column
        k - 1 holds the token k positions ahead of each position, which depth k embeds; None: taken
        from `tokens` (a whole window, not a context-parallel share). With `labels` (the decoder's
        chunked loss): mtp_loss_sum's value, each depth's loss computed chunk by chunk."""
        if self.mtp is None or cache is not None or not self.training:
            return super().forward(tokens, cache, start_pos, doc_ids, labels)
        if labels is not None and labels.dim() == 2:
            labels = mtp_labels(labels, self.args.mtp_depth)
        h = self.trunk(tokens, doc_ids)

        def head(x: torch.Tensor, k: int) -> torch.Tensor:  # depth k's logits, or with labels its loss sum
            return self.output(x) if labels is None else self.output_loss_sum(x, labels[..., k])

        outs = [head(self.norm(h), 0)]
        scale = self.args.mtp_loss_weight / self.args.mtp_depth
        if future_tokens is None:
            future_tokens = _ahead(tokens, self.args.mtp_depth)
        for k, module in enumerate(cast(Iterable[MTPModule], self.mtp.values()), start=1):
            h = module(h, self.tok_embeddings(future_tokens[..., k - 1]), self.rope, doc_ids)
            # Scaling a depth's loss scales its logits' gradient alike.
            outs.append(scale_gradient(head(module.norm(h), k), scale))
        return torch.stack(outs, dim=2) if labels is None else _with_mtp(outs[0], outs[1:])

    def rotary_table(self) -> torch.Tensor:
        a = self.args
        return complex_table(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    @classmethod
    def flops_per_token(cls, args: ModelArgs, doc_lengths: int | list[int]) -> float:
        # Attention: scores over qk_head_dim and weighted values over v_head_dim per head, forward and
        # backward: 6 x heads x (qk + v) per attended pair, which transformer_flops_per_token counts as
        # 12 x width: width = heads x (qk + v) / 2. Each MTP depth adds a block's attention and another
        # pass through the (shared) output layer and embedding lookup.
        width = args.n_heads * (args.qk_head_dim + args.v_head_dim) / 2
        matmul = matmul_parameters(cls.model_size(args), args) + args.mtp_depth * args.vocab_size * args.dim
        return transformer_flops_per_token(matmul, width, [None] * (args.n_layers + args.mtp_depth), doc_lengths)


# Parameter counts include the multi-token-prediction modules (the published totals exclude them).
model_size = Transformer.model_size
flops_per_token = Transformer.flops_per_token


def mtp_blocks(model: nn.Module) -> list[nn.Module]:
    """The spec's extra_blocks: the multi-token-prediction modules' blocks (none on a pipeline stage
    without them)."""
    mtp = getattr(model, "mtp", None)  # Transformer.mtp: None, or absent, on a stage without them
    if not isinstance(mtp, nn.ModuleDict):
        return []
    return [module.block for module in cast(Iterable[MTPModule], mtp.values())]


def _shifted(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x [batch, seq] moved k positions to the left, `fill` past the window's end; all `fill` where
    k >= seq (a validation window may be shorter than the training depth)."""
    seq = x.shape[1]
    return F.pad(x[:, min(k, seq) :], (0, min(k, seq)), value=fill)


def _ahead(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """[batch, seq, depth]: column k - 1 holds the token k positions ahead; past the window any id
    (0; its label is ignored)."""
    return torch.stack([_shifted(tokens, k, 0) for k in range(1, depth + 1)], dim=-1)


def mtp_labels(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[batch, seq, 1 + depth]: column 0 the labels, column k depth k's: label i + k at position i,
    counted only where labels i .. i + k all count (the chain stays in its document when
    cross-document labels are ignored, and in the window)."""
    columns, valid = [labels], labels != IGNORE_INDEX
    for k in range(1, depth + 1):
        ahead = _shifted(labels, k, IGNORE_INDEX)
        valid = valid & (ahead != IGNORE_INDEX)
        columns.append(torch.where(valid, ahead, IGNORE_INDEX))
    return torch.stack(columns, dim=-1)


def prepare_window(args: ModelArgs, inputs: torch.Tensor, labels: torch.Tensor):
    """The spec's prepare_window: with multi-token prediction, each depth's labels (mtp_labels) and
    the tokens it embeds (forward's future_tokens), from the whole window: under context parallel a
    rank's positions are not contiguous, so neither can be shifted from its own share."""
    if not args.mtp_depth:
        return labels, {}
    return mtp_labels(labels, args.mtp_depth), {"future_tokens": _ahead(inputs, args.mtp_depth)}


def mtp_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The spec's loss: the next-token cross entropy sum; with multi-token prediction's stacked logits
    (Transformer.forward), plus each depth's sum over its labels (mtp_labels; [batch, seq] labels
    are extended here), added so that it moves the gradient but not the value (the logged loss
    stays the next-token loss). Evaluation's next-token logits read column 0 of stacked labels."""
    if logits.dim() == 3:
        return cross_entropy_sum(logits, labels[..., 0] if labels.dim() == 3 else labels)
    if labels.dim() == 2:
        labels = mtp_labels(labels, logits.shape[2] - 1)
    return _with_mtp(
        cross_entropy_sum(logits[:, :, 0], labels[..., 0]),
        [cross_entropy_sum(logits[:, :, k], labels[..., k]) for k in range(1, logits.shape[2])],
    )


def _with_mtp(total: torch.Tensor, terms: list[torch.Tensor]) -> torch.Tensor:
    """The next-token loss sum `total` plus the MTP depths' `terms`, which move the gradient but not the value."""
    # Summed from the first depth on, not from a plain zero: under loss parallel each term is a DTensor.
    extra = terms[0]
    for term in terms[1:]:
        extra = extra + term
    return total + (extra - extra.detach())
