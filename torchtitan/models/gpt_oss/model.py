"""gpt-oss: the standard decoder (torchtitan.models.common.decoder.Transformer, Meta's module names)
with these differences, each as transformers' modeling_gpt_oss computes it:

- attention: grouped-query, biases on wq, wk, wv and wo, and learned per-head **sinks**: one more
  logit per head in the softmax, with no value. The kernel returns the log-sum-exp of the scores
  over the keys a query sees (the attention contract, torchtitan.models.common.attention), so the
  sink's share of the mass is sigmoid(sink - lse) and the output is out * sigmoid(lse - sink), on
  every kernel: SDPA/math, the per-document split, FlexAttention, the context-parallel ring, the KV
  cache. The sinks are a module of their own (`attention.sinks.weight`, [n_heads]) so that tensor
  parallel splits them by head as wq's rows are split;
- sliding windows on the even layers (args.layer_window), full attention on the odd ones;
- rotary: Hugging Face's rotate-half layout, YaRN frequencies, cos and sin scaled by YaRN's
  attention factor (rotary.halves_table);
- feed-forward: a mixture of experts on every layer. The router is a biased linear layer; each token
  takes its top-k experts and weighs them by a softmax over those k logits only. The experts have
  biases on both projections and the clamped SwiGLU: gate clamped above at `limit`, the linear part
  to +-limit, gate * sigmoid(alpha * gate) * (linear + 1). Their tensors are Hugging Face's, with its
  names: gate and linear part fused in gate_up_proj, interleaved (even and odd columns);
- parameters with no matmul share of the standard init: the sinks and the router bias drawn with
  std 0.02 (Hugging Face's initializer_range), the other biases zero.
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common import decoder, moe
from torchtitan.models.common.init import Init, local_part, normal, trunc_normal, zeros
from torchtitan.models.common.layers import Attention, TransformerBlock
from torchtitan.models.common.rotary import HALVES
from torchtitan.models.common.spec import ModelSize, count_parameters


class HeadSinks(nn.Module):
    """One learned logit per attention head (tensor parallel shards `weight` as it shards the heads)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def local(self) -> torch.Tensor:
        """This rank's heads' logits."""
        return local_part(self.weight)


class SinkAttention(Attention):
    """The shared grouped-query attention with biases, turning the kernel's log-sum-exp into sinks."""

    def __init__(self, args, window: int | None):
        super().__init__(args.dim, args.n_heads, args.kv_heads, args.head_dim, HALVES, bias=True, window=window)
        self.sinks = HeadSinks(args.n_heads)

    def attend(self, q, k, v, cache, start_pos, doc_ids):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            out, lse = self.attention_fn(q, k, v, doc_ids=doc_ids, window=self.window, return_lse=True)
        else:
            out, lse = cache.attend(q, k, v, start_pos, self.window, return_lse=True)
        # softmax over [scores, sink] restricted to the scores = softmax(scores) * e^lse / (e^lse + e^sink).
        # A query that sees no key (lse -inf; only a ring's partial block) keeps its zero output.
        keep = torch.sigmoid(lse - self.sinks.local().float()[None, :, None])
        return (out * keep.unsqueeze(-1).to(out.dtype)).transpose(1, 2).flatten(2)


class BiasedTopKRouter(moe.Router):
    """logits = x W^T + b; top-k experts by score (plus the balancing bias, when on); the k weights a
    softmax over the chosen logits. Scores (softmax over all experts) feed the choice and the
    optional auxiliary losses; without a balancing bias the choice is the top-k logits, as Hugging
    Face's GptOssTopKRouter chooses."""

    def __init__(self, dim: int, args: moe.MoEArgs):
        super().__init__(dim, args)
        self.gate = nn.Linear(dim, args.num_experts, bias=True)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None):
        logits = F.linear(x, moe.local_tensor(self.gate.weight), moe.local_tensor(self.gate.bias)).float()
        scores = torch.softmax(logits, dim=-1)
        choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias
        ids = torch.topk(choice, self.args.top_k, dim=-1, sorted=False).indices
        weights = torch.softmax(logits.gather(-1, ids), dim=-1)
        return weights, ids, scores, logits


class ClampedSwiGLUExperts(nn.Module):
    """Routed experts in Hugging Face's layout (GptOssExperts), experts on dim 0 as expert parallel wants
    them: gate_up_proj [experts, dim, 2 x hidden] with the gate in the even columns and the linear part
    in the odd ones, gate_up_proj_bias [experts, 2 x hidden], down_proj [experts, hidden, dim],
    down_proj_bias [experts, dim]; each token computes x @ W[e] + b[e]. The Hugging Face adapter then
    only renames (and a sharded import reads each rank's experts by block)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, limit: float, alpha: float):
        super().__init__()
        self.num_experts = num_experts
        self.grad_scale = 1.0  # set by expert parallel (moe.GroupedExperts says why)
        self.limit, self.alpha = limit, alpha
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: tokens sorted by expert, counts[e] of them for (local) expert e."""
        params = [
            moe.local_tensor(p)
            for p in (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias)
        ]
        if self.grad_scale != 1.0:
            params = [moe.scale_gradient(p, self.grad_scale) for p in params]
        w_in, b_in, w_out, b_out = params
        x = x.to(moe.matmul_dtype(x))
        # Each row's expert (local index), to pick its biases.
        expert_of = torch.repeat_interleave(
            torch.arange(counts.numel(), device=x.device), counts, output_size=x.shape[0]
        )
        gate_up = moe.expert_matmul(x, w_in, counts)
        gate_up = gate_up + b_in[expert_of].to(gate_up.dtype)
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        linear = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        h = gate * torch.sigmoid(gate * self.alpha) * (linear + 1)
        out = moe.expert_matmul(h, w_out, counts)
        return out + b_out[expert_of].to(out.dtype)


class GptOssMoE(moe.MoE):
    """moe.MoE (routing bookkeeping, balancing, expert parallel, metrics) with gpt-oss's router and experts."""

    def __init__(self, dim: int, args):
        super().__init__(dim, args.moe)
        m = args.moe
        self.router = BiasedTopKRouter(dim, m)
        self.experts = ClampedSwiGLUExperts(dim, m.hidden_dim, m.num_experts, args.swiglu_limit, args.swiglu_alpha)


class Transformer(decoder.Transformer):
    rotary = HALVES

    def block(self, layer_id: int) -> nn.Module:
        a = self.args
        return TransformerBlock(layer_id, a, SinkAttention(a, a.layer_window(layer_id)), GptOssMoE(a.dim, a))

    def initializer_for(self, name: str) -> Init:
        local = name.rsplit(".", 1)[-1]
        if name.endswith("attention.sinks.weight") or name.endswith("router.gate.bias"):
            return normal(0.02)
        if local in ("gate_up_proj_bias", "down_proj_bias"):
            return zeros()
        if local == "gate_up_proj":  # an input projection, as the other families' w1 and w3
            return trunc_normal(0.02)
        return super().initializer_for(name)  # down_proj: the block's out_init_std, as w2

    @classmethod
    def model_size(cls, args) -> ModelSize:
        """Parameter counts; a token uses top_k of each block's experts (weights and biases)."""
        total, embedding = count_parameters(cls, args)
        with torch.device("meta"):
            experts = ClampedSwiGLUExperts(args.dim, args.moe.hidden_dim, args.moe.num_experts, 0.0, 0.0)
        per_expert = sum(p.numel() for p in experts.parameters()) // args.moe.num_experts
        idle = args.n_layers * (args.moe.num_experts - args.moe.top_k) * per_expert
        return ModelSize(total=total, active=total - idle, embedding=embedding)


model_size = Transformer.model_size
flops_per_token = Transformer.flops_per_token
