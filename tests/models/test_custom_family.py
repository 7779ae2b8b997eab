"""A model family defined here, outside the package, plugged in through the spec alone: a tiny
GPT-2-style decoder without position embeddings (causal attention still tells positions apart),
LayerNorm with biases, biased projections, a GELU feed-forward, and module names of its own. It
registers itself when imported: the jobs below name this file in experimental.custom_import, and
torchtitan is not edited to know it.

It trains under FSDP 2 and TP 2 with the single-process losses, and checkpoints and resumes
(3 steps + resume + 3 steps = 6 straight steps). Its post_optimizer_step hook counts optimizer
steps in a buffer that is saved with the model, so the count after the resumed run (6) shows the
hook ran on every step and that the buffer was restored.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from torchtitan.models.common.init import normal, ones, seeded_init_
from torchtitan.models.common.spec import (
    ModelSize,
    ModelSpec,
    PipelineLayout,
    count_parameters,
    transformer_flops_per_token,
)
from torchtitan.models.common.tp_plan import TensorParallelPlan, decoder_top_tp_plan, gather_sequence_input
from torchtitan.models.registry import register_model

# ---- the family ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 128
    vocab_size: int = 4096
    max_seq_len: int = 64


class Attention(nn.Module):
    def __init__(self, args: TinyArgs):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.q, self.k, self.v = (nn.Linear(args.dim, args.dim) for _ in range(3))
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, args: TinyArgs):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.attn = Attention(args)
        self.mlp = nn.Sequential()
        self.mlp.fc = nn.Linear(args.dim, args.hidden_dim)
        self.mlp.act = nn.GELU()
        self.mlp.proj = nn.Linear(args.hidden_dim, args.dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyDecoder(nn.Module):
    def __init__(self, args: TinyArgs):
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Counted by the post_optimizer_step hook; persistent, so checkpoints carry it.
        self.register_buffer("optimizer_steps", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens):
        h = self.wte(tokens) if self.wte is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.ln_f(h) if self.ln_f is not None else h
        return self.lm_head(h) if self.lm_head is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device=None):
        self.optimizer_steps = torch.zeros((), dtype=torch.int64, device=buffer_device or self.optimizer_steps.device)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                fill = lambda t, g: torch.nn.init.zeros_(t)  # noqa: E731
            elif ".ln_" in name or name.startswith("ln_f"):
                fill = ones()
            else:
                fill = normal(0.02 if not name.endswith("proj.weight") else 0.02 / math.sqrt(2 * self.args.n_layers))
            seeded_init_(param, name, seed, fill)


def top_tp_plan(loss_parallel: bool) -> dict:
    standard = decoder_top_tp_plan(loss_parallel)
    return {"wte": standard["tok_embeddings"], "ln_f": standard["norm"], "lm_head": standard["output"]}


def block_tp_plan(block) -> dict:
    return {
        "ln_1": SequenceParallel(),
        "attn": gather_sequence_input(),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(),
        "mlp": gather_sequence_input(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }


TP_PLAN = TensorParallelPlan(top=top_tp_plan, block=block_tp_plan)


def size(args: TinyArgs) -> ModelSize:
    total, embedding = count_parameters(TinyDecoder, args)
    return ModelSize(total=total, active=total, embedding=embedding)


def flops(args: TinyArgs, seq_len: int) -> float:
    s = size(args)
    return transformer_flops_per_token(s.total - s.embedding, args.dim, [None] * args.n_layers, seq_len)


def count_step(parts: list[nn.Module], inputs) -> None:
    for part in parts:
        part.optimizer_steps += 1


SPEC = ModelSpec(
    name="tiny_nope",
    args_cls=TinyArgs,
    flavors={"debug": TinyArgs()},
    model_cls=TinyDecoder,
    size=size,
    flops_per_token=flops,
    tp_plan=TP_PLAN,
    tp_sizes=lambda a: {
        "n_heads": (a.n_heads, "heads"),
        "hidden_dim": (a.hidden_dim, "fc"),
        "vocab_size": (a.vocab_size, "vocab"),
    },
    pipeline=PipelineLayout(before=("wte",), after=("ln_f", "lm_head")),
    cp_attention=None,
    post_optimizer_step=count_step,
)
register_model(SPEC)


# ---- the tests ------------------------------------------------------------------------------

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

THIS_FILE = str(Path(__file__).resolve())
BASE = ["--experimental.custom_import", THIS_FILE, "--model.name", "tiny_nope", "--model.flavor", "debug"]
CKPT = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "3", "--checkpoint.no-last_save_model_only"]
FSDP2 = ["--training.local_batch_size", "4"]
TP2 = ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]


def first3(tmp, src, dst):
    return {"copy": [str(tmp / src / "checkpoint" / "step-3"), str(tmp / dst / "checkpoint" / "step-3")]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from helpers.launch import launch

    tmp = tmp_path_factory.mktemp("custom_family")
    results = launch({"single": BASE + ["--training.local_batch_size", "8"]}, 1, tmp)
    results.update(
        launch(
            {
                "fsdp2": BASE + FSDP2 + CKPT,
                "copy1": first3(tmp, "fsdp2", "fsdp2_resumed"),
                "fsdp2_resumed": BASE + FSDP2 + CKPT,
                "tp2": BASE + TP2 + CKPT,
                "copy2": first3(tmp, "tp2", "tp2_resumed"),
                "tp2_resumed": BASE + TP2 + CKPT,
                # Saved under FSDP 2, resumed under TP 2: the names are the family's own, the layout another.
                "copy3": first3(tmp, "fsdp2", "fsdp2_to_tp2"),
                "fsdp2_to_tp2": BASE + TP2 + CKPT,
            },
            2,
            tmp,
        )
    )
    return tmp, results


def test_the_family_learns(runs):
    from helpers.launch import losses

    ref = losses(runs[1]["single"])
    assert len(ref) == 6 and ref[-1] < ref[0] - 0.3


@pytest.mark.parametrize("name", ["fsdp2", "tp2"])
def test_parallel_layouts_match_one_process(runs, name):
    from helpers.launch import losses

    diffs = [abs(a - b) for a, b in zip(losses(runs[1]["single"]), losses(runs[1][name]))]
    assert len(diffs) == 6 and max(diffs) < 1e-5, diffs


@pytest.mark.parametrize(
    "straight, resumed", [("fsdp2", "fsdp2_resumed"), ("tp2", "tp2_resumed"), ("fsdp2", "fsdp2_to_tp2")]
)
def test_checkpoint_resume_continues_the_run(runs, straight, resumed):
    from helpers.launch import losses

    got = runs[1][resumed]
    assert [r["step"] for r in got] == [4, 5, 6]
    diffs = [abs(a - b) for a, b in zip(losses(runs[1][straight])[3:], losses(got))]
    assert max(diffs) < 1e-5, diffs


def test_hook_ran_every_step_and_its_buffer_was_checkpointed(runs):
    from torchtitan.components.checkpoint import read_dcp_model

    tmp, _ = runs
    for name in ("fsdp2_resumed", "tp2_resumed"):
        sd, args, state = read_dcp_model(tmp / name / "checkpoint" / "step-6", SPEC)
        assert args == TinyArgs(max_seq_len=64) and state["model"]["name"] == "tiny_nope"
        assert sd["optimizer_steps"].item() == 6
