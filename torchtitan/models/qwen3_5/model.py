"""Qwen3.5 (dense, text): a hybrid decoder of gated DeltaNet layers and gated full-attention layers
(layer i is full attention when (i + 1) % full_attention_interval == 0; args.layer_types), each
followed by SwiGLU, as transformers' Qwen3_5ForCausalLM computes it. Every block is the shared
pre-norm layers.TransformerBlock; its `attention` is one of:

- `GatedAttention` (HF self_attn): grouped-query attention through the project's attention contract
  (`attention_fn`, so block-causal masks and every kernel apply), with
  - wq twice as wide: per head, head_dim query features then head_dim gate features (HF's q_proj
    layout, so tensor parallel splits whole heads with their gates);
  - per-head RMSNorm on q and k before the rotary embedding;
  - rotary (rotate-half) on the first rotary_dim = head_dim x partial_rotary_factor features only;
  - the output multiplied by sigmoid(gate) before wo.
- `GatedDeltaNet` (HF linear_attn): in_proj_qkv (q, k and v), in_proj_z (the output gate), in_proj_a
  (decay input), in_proj_b (write strength); a depthwise causal conv (`conv1d`, kernel conv_kernel) +
  SiLU on q, k and v that does not reach across a document start. in_proj_qkv's rows and conv1d's
  channels are grouped by key head: for key head h, its query, its key, then the values of the value
  heads it serves (HF stores all queries, all keys, all values: the adapter permutes the rows, a fixed
  permutation of the model's sizes), so that tensor parallel's column-wise split gives each rank whole
  key heads with their value heads and the conv channels split the same way; q and k
  L2-normalized (q scaled by dk^-0.5); g = -exp(A_log) * softplus(a + dt_bias) in float32, beta =
  sigmoid(b); q/k heads repeated up to the value heads (each key head serves consecutive value
  heads); the chunked gated delta rule (models/common/delta_rule.py) restarting at every document;
  an RMSNorm over each head's output gated by silu(z); out_proj.

Norm weights: Hugging Face's Qwen3.5 RMSNorms (the block norms, the final norm, q_norm, k_norm) scale
by (1 + weight) and store weight - 1; ours are plain nn.RMSNorm (weight 1 at init); the adapter adds or
subtracts 1. The DeltaNet output norm is a plain one in both.

Context parallel: the attention layers through the run's method; the DeltaNet layers head-parallel by
all-to-all (GatedDeltaNet.set_head_exchange). Decoding with a cache (layers.KVCache): the attention
layers cache keys and values, the DeltaNet layers their conv window and recurrent state (`states`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common import decoder, delta_rule
from torchtitan.models.common.attention import AttentionFn
from torchtitan.models.common.init import Init, local_part
from torchtitan.models.common.layers import Attention, TransformerBlock
from torchtitan.models.common.rotary import HALVES
from torchtitan.models.common.spec import transformer_flops_per_token


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in float32 (Hugging Face's / flash-linear-attention's)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedAttention(Attention):
    def __init__(self, args):
        super().__init__(args.dim, args.n_heads, args.kv_heads, args.head_dim, HALVES, qk_norm_eps=args.norm_eps)
        self.wq = nn.Linear(args.dim, 2 * args.n_heads * args.head_dim, bias=False)  # query and gate per head
        self.rotary_dim = args.rotary_dim

    def rotate_part(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([self.rotate(x[..., :r], rope), x[..., r:]], dim=-1)

    def forward(self, x, rope, cache=None, start_pos=0, doc_ids=None):
        bs, seq, _ = x.shape
        q, gate = self.wq(x).view(bs, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        assert self.q_norm is not None and self.k_norm is not None  # built with qk_norm_eps
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate_part(q, rope), self.rotate_part(k, rope)
        out = self.attend(q, k, v, cache, start_pos, doc_ids)
        return self.wo(out * torch.sigmoid(gate.reshape(bs, seq, -1)))


class CausalConv(nn.Module):
    """The depthwise causal convolution's weight [channels, kernel] (HF's conv1d.weight [channels, 1,
    kernel]); tensor parallel splits the channels (dim 0) as it splits the projection before it.
    GatedDeltaNet applies it (delta_rule.causal_conv) to the channels of the heads it computes."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))


class HeadParams(nn.Module):
    """The per-value-head decay parameters: A_log and dt_bias [value heads] (split by head under TP)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))


class GatedDeltaNet(nn.Module):
    def __init__(self, args):
        super().__init__()
        nk, nv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.chunk, self.kernel = args.delta_chunk, args.delta_rule_kernel
        self.per_key = nv // nk  # value heads per key head
        group = 2 * self.dk + self.per_key * self.dv  # one key head's rows: q, k, its values
        self.in_proj_qkv = nn.Linear(args.dim, nk * group, bias=False)
        self.in_proj_z = nn.Linear(args.dim, nv * self.dv, bias=False)
        self.in_proj_a = nn.Linear(args.dim, nv, bias=False)
        self.in_proj_b = nn.Linear(args.dim, nv, bias=False)
        self.conv1d = CausalConv(nk * group, args.conv_kernel)
        self.heads = HeadParams(nv)
        self.norm = nn.RMSNorm(self.dv, eps=args.norm_eps)
        self.out_proj = nn.Linear(nv * self.dv, args.dim, bias=False)
        # The trainer sets every block's attention kernel at the spec's cp_attention path; the recurrence
        # uses none. Under context parallel it goes head-parallel instead (set_head_exchange).
        self.attention_fn: AttentionFn | None = None
        self.exchange = None

    def set_head_exchange(self, exchange) -> None:
        """Context parallel (distributed.context_parallel.apply_cp, any method): the projections run on
        this rank's tokens; one all-to-all (exchange.to_heads) gives each rank the whole sequence for
        1 / cp of the key heads with their value heads, on which the conv, the decay and the recurrence
        run as on one process (with the gathered document ids, so they restart at every document),
        and a second brings the normalized output of every head back to the rank's own tokens for
        the gate and out_proj. Chosen over passing each rank's final state down the ranks (a prefix
        scan): no rank waits for the one before it, the conv needs no halo, the kernel is unchanged,
        and the load-balanced token order needs nothing more than Ulysses attention's exchange."""
        self.exchange = exchange

    def forward(self, x, rope, cache=None, start_pos=0, doc_ids=None):
        bs = x.shape[0]
        group = 2 * self.dk + self.per_key * self.dv  # one key head's channels: q, k, its values
        qkv, a, b = self.in_proj_qkv(x), self.in_proj_a(x), self.in_proj_b(x)
        conv_w = local_part(self.conv1d.weight)
        a_log, dt_bias = local_part(self.heads.A_log), local_part(self.heads.dt_bias)
        ex, docs = self.exchange, doc_ids
        if ex is not None:
            qkv, a, b = (
                _to_heads(ex, t, heads)
                for t, heads in ((qkv, conv_w.shape[0] // group), (a, a.shape[-1]), (b, b.shape[-1]))
            )
            # Rank j of the group computes the j-th contiguous group of this (TP) rank's key heads.
            conv_w, a_log, dt_bias = (t.chunk(ex.cp)[ex.rank] for t in (conv_w, a_log, dt_bias))
            docs = ex.gathered_docs(doc_ids) if doc_ids is not None else None
        seq = qkv.shape[1]
        state = None
        if cache is not None:
            # Decoding (layers.KVCache): the tokens continue the cached ones. The conv sees the last
            # kernel - 1 inputs before them, and the recurrence starts from the cached state.
            if start_pos == 0:
                cache.states.clear()
            window = conv_w.shape[-1] - 1
            before = cache.states.get("conv", qkv.new_zeros(bs, 0, qkv.shape[-1]))
            joined = torch.cat([before, qkv], dim=1)
            cache.states["conv"] = joined[:, joined.shape[1] - window :] if window else joined[:, :0]
            qkv = delta_rule.causal_conv(joined, conv_w)[:, before.shape[1] :]
            state = cache.states.get("state")
        else:
            qkv = delta_rule.causal_conv(qkv, conv_w, docs)
        qkv = F.silu(qkv)
        # [batch, seq, key heads (this rank's), q | k | values of its value heads]
        q, k, v = qkv.view(bs, seq, -1, group).split([self.dk, self.dk, self.per_key * self.dv], dim=-1)
        v = v.reshape(bs, seq, -1, self.dv)  # value head h * per_key + j is key head h's j-th
        q, k = l2norm(q) * self.dk**-0.5, l2norm(k)
        if self.per_key > 1:
            q, k = q.repeat_interleave(self.per_key, dim=2), k.repeat_interleave(self.per_key, dim=2)
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
        if self.kernel == "fla" and cache is None:  # training on CUDA with flash-linear-attention's kernel
            out, state = delta_rule.fla_chunked(q, k, v, g, torch.sigmoid(b), doc_ids=docs)
        else:
            out, state = delta_rule.chunked(q, k, v, g, torch.sigmoid(b), chunk=self.chunk, state=state, doc_ids=docs)
        if cache is not None:
            cache.states["state"] = state
        out = self.norm(out.to(x.dtype))  # per head: the same before or after the exchange back
        if ex is not None:
            out = ex.to_tokens(out.transpose(1, 2)).transpose(1, 2)  # [batch, local tokens, heads, dv]
        z = self.in_proj_z(x).view(bs, x.shape[1], -1, self.dv)
        return self.out_proj((out * F.silu(z)).flatten(2))


def _to_heads(exchange, x: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, local tokens, heads x d] -> [batch, whole sequence, heads / cp x d] (exchange.to_heads)."""
    bs, seq, _ = x.shape
    return exchange.to_heads(x.view(bs, seq, heads, -1).transpose(1, 2)).transpose(1, 2).flatten(2)


def _uniform(low: float, high: float) -> Init:
    return lambda t, g: torch.nn.init.uniform_(t, low, high, generator=g)


def _log_uniform(low: float, high: float) -> Init:
    def fill(t, g):
        torch.nn.init.uniform_(t, low, high, generator=g)
        t.log_()

    return fill


class Transformer(decoder.Transformer):
    rotary = HALVES
    qk_norm = True
    input_projections = decoder.Transformer.input_projections + ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")

    def block(self, layer_id: int) -> nn.Module:
        a = self.args
        mixer = GatedAttention(a) if a.is_full_attention(layer_id) else GatedDeltaNet(a)
        return TransformerBlock(layer_id, a, mixer, decoder.feed_forward(a.dim, a.hidden_dim, a.moe))

    def rotary_table(self) -> torch.Tensor:
        a = self.args
        return self.rotary.table(a.rotary_dim, a.max_seq_len, a.rope_theta)

    def initializer_for(self, name: str) -> Init:
        if name.endswith(".A_log"):  # A uniform in [0.01, 16], as Hugging Face draws it
            return _log_uniform(0.01, 16.0)
        if name.endswith(".dt_bias"):
            return lambda t, g: torch.nn.init.ones_(t)
        if name.endswith(".conv1d.weight"):
            bound = self.args.conv_kernel**-0.5  # nn.Conv1d's default for a depthwise conv: 1/sqrt(fan_in)
            return _uniform(-bound, bound)
        return super().initializer_for(name)

    @classmethod
    def flops_per_token(cls, args, doc_lengths: int | list[int]) -> float:
        """6 per matmul parameter, attention pairs of the full-attention layers only, and per DeltaNet
        layer the recurrence: per value head and token, reading the state (k^T S), writing it (k w^T)
        and the output (S^T q), 2 dk dv FLOPs each forward, twice that backward: 18 dk dv."""
        full: list[int | None] = [None] * sum(args.is_full_attention(i) for i in range(args.n_layers))
        size = cls.model_size(args)
        base = transformer_flops_per_token(
            decoder.matmul_parameters(size, args), args.n_heads * args.head_dim, full, doc_lengths
        )
        linear = args.n_layers - len(full)
        return base + linear * 18 * args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim


model_size = Transformer.model_size
flops_per_token = Transformer.flops_per_token
