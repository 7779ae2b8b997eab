"""A second family defined here, outside the package: a decoder with a mixture-of-experts class of
its own (not torchtitan's MoE) and attention whose value heads are wider than its query/key heads
(24 against 16, as MLA's are). It reaches expert parallel and context parallel through its spec
alone (its MoE hooks in one value, `moe`: expert_layers and a metrics hook; cp_attention) and
registers itself when imported; the jobs below name this file in experimental.custom_import.

Tests: EP 2 and CP 2 train with the single process's losses within 1e-5, and the spec's metrics
hook shows that expert parallel really split the experts (2 of 4 local per rank, the dispatcher
set): a family whose experts expert parallel did not reach would match the losses too.
"""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.decoder import Decoder, matmul_parameters
from torchtitan.models.common.init import normal, ones
from torchtitan.models.common.moe import local_tensor
from torchtitan.models.common.rotary import inv_frequencies
from torchtitan.models.common.spec import ModelSize, ModelSpec, MoEHooks, count_parameters, transformer_flops_per_token
from torchtitan.models.registry import register_model

# ---- the family ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WideVArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    qk_head_dim: int = 16
    v_head_dim: int = 24
    num_experts: int = 4
    expert_hidden: int = 32
    vocab_size: int = 4096
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on x [batch, seq, heads, d] with table [seq, d] of angles."""
    cos, sin = table[: x.shape[1]].cos()[None, :, None], table[: x.shape[1]].sin()[None, :, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)


class WideVAttention(nn.Module):
    def __init__(self, a: WideVArgs):
        super().__init__()
        self.qk, self.vd = a.qk_head_dim, a.v_head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.qk_head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_heads * a.qk_head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_heads * a.v_head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.v_head_dim, a.dim, bias=False)
        self.attention_fn = None  # set by the trainer (its kernel) or context parallel (its ring)

    def forward(self, x, rope, doc_ids=None):
        b, s, _ = x.shape
        q = rotate(self.wq(x).view(b, s, -1, self.qk), rope).transpose(1, 2)
        k = rotate(self.wk(x).view(b, s, -1, self.qk), rope).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.vd).transpose(1, 2)
        out = self.attention_fn(q, k, v, doc_ids=doc_ids, window=None)  # [b, heads, s, v_head_dim]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class LoopExperts(nn.Module):
    """Experts as one weight per projection, experts first, run one expert at a time."""

    def __init__(self, a: WideVArgs):
        super().__init__()
        self.num_experts = a.num_experts
        self.grad_scale = 1.0
        self.up = nn.Parameter(torch.empty(a.num_experts, a.expert_hidden, a.dim))
        self.down = nn.Parameter(torch.empty(a.num_experts, a.dim, a.expert_hidden))

    def forward(self, x, counts):
        up, down = local_tensor(self.up), local_tensor(self.down)
        # The value of the weight, with its gradient times grad_scale (set by expert parallel).
        up, down = (w * self.grad_scale + (w * (1 - self.grad_scale)).detach() for w in (up, down))
        outs = [F.linear(F.gelu(F.linear(chunk, up[e])), down[e]) for e, chunk in enumerate(x.split(counts.tolist()))]
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


class Top2MoE(nn.Module):
    def __init__(self, a: WideVArgs):
        super().__init__()
        self.router = nn.Linear(a.dim, a.num_experts, bias=False)
        self.experts = LoopExperts(a)
        self.dispatcher = None  # expert parallel's all-to-all, when set

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, ids = torch.softmax(F.linear(tokens, local_tensor(self.router.weight)).float(), -1).topk(2, dim=-1)
        order = torch.argsort(ids.flatten(), stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.experts.num_experts)
        sorted_in = tokens[order // 2]
        out = (
            self.dispatcher(self.experts, sorted_in, counts)
            if self.dispatcher is not None
            else self.experts(sorted_in, counts)
        )
        slots = torch.empty_like(out)
        slots[order] = out
        combined = (slots.view(-1, 2, x.shape[-1]).float() * weights.unsqueeze(-1)).sum(1)
        return combined.to(x.dtype).view_as(x)


class Block(nn.Module):
    def __init__(self, a: WideVArgs):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps), nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.attention = WideVAttention(a)
        self.moe = Top2MoE(a)

    def forward(self, x, rope, cache=None, start_pos=0, doc_ids=None):
        h = x + self.attention(self.attention_norm(x), rope, doc_ids)
        return h + self.moe(self.ffn_norm(h))


class WideVMoE(Decoder):
    def block(self, layer_id):
        return Block(self.args)

    def rotary_table(self):
        a = self.args
        angles = torch.outer(
            torch.arange(a.max_seq_len, dtype=torch.float32), inv_frequencies(a.qk_head_dim, a.rope_theta)
        )
        return torch.cat([angles, angles], dim=-1)

    def initializer_for(self, name):
        if name.endswith("norm.weight"):
            return ones()
        return normal(0.02)


def size(a: WideVArgs) -> ModelSize:
    total, embedding = count_parameters(WideVMoE, a)
    inactive = a.n_layers * (a.num_experts - 2) * 2 * a.dim * a.expert_hidden
    return ModelSize(total=total, active=total - inactive, embedding=embedding)


def experts_seen(parts, inputs) -> dict[str, float]:
    """What expert parallel did to the first expert layer: local experts and whether it dispatches."""
    layer = next(b.moe for part in parts for b in part.layers.values())
    return {
        "moe/local_experts": float(local_tensor(layer.experts.up).shape[0]),
        "moe/dispatched": float(layer.dispatcher is not None),
    }


SPEC = ModelSpec(
    name="wide_v_moe",
    args_cls=WideVArgs,
    flavors={"debug": WideVArgs()},
    model_cls=WideVMoE,
    size=size,
    flops_per_token=lambda a, docs: transformer_flops_per_token(
        matmul_parameters(size(a), a), a.n_heads * a.qk_head_dim, [None] * a.n_layers, docs
    ),
    tp_plan=None,
    tp_sizes=lambda a: {},
    cp_attention="attention",
    moe=MoEHooks(expert_layers=lambda model: [block.moe for block in model.layers.values()], metrics=experts_seen),
)
register_model(SPEC)


# ---- the tests ------------------------------------------------------------------------------

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

BASE = [
    "--experimental.custom_import",
    str(Path(__file__).resolve()),
    "--model.name",
    "wide_v_moe",
    "--model.flavor",
    "debug",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from helpers.launch import launch

    tmp = tmp_path_factory.mktemp("custom_moe_family")
    results = launch({"single": BASE + ["--training.local_batch_size", "8"]}, 1, tmp)
    results.update(
        launch(
            {
                "ep2": BASE + ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"],
                "cp2": BASE + ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"],
                "cp2_alltoall": BASE
                + [
                    "--training.local_batch_size",
                    "8",
                    "--parallelism.context_parallel_degree",
                    "2",
                    "--parallelism.context_parallel_rotate_method",
                    "alltoall",
                ],
            },
            2,
            tmp,
        )
    )
    return results


def test_the_family_learns(runs):
    from helpers.launch import losses

    ref = losses(runs["single"])
    assert len(ref) == 6 and ref[-1] < ref[0] - 0.2


@pytest.mark.parametrize("name", ["ep2", "cp2", "cp2_alltoall"])
def test_parallel_layouts_match_one_process(runs, name):
    from helpers.launch import losses

    diffs = [abs(a - b) for a, b in zip(losses(runs["single"]), losses(runs[name]))]
    assert len(diffs) == 6 and max(diffs) < 1e-5, diffs


def test_expert_parallel_split_the_family_s_own_experts(runs):
    assert runs["single"][-1]["moe/local_experts"] == 4 and runs["single"][-1]["moe/dispatched"] == 0
    assert runs["ep2"][-1]["moe/local_experts"] == 2 and runs["ep2"][-1]["moe/dispatched"] == 1
