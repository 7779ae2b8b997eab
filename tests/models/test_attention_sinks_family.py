"""A family defined here, outside the package, whose attention has per-head learned sinks: a softmax
over the visible keys plus one extra learned logit per head (as gpt-oss has). It is Llama 3 with one
difference, its attention module, written with the attention contract of
torchtitan.models.common.attention: the kernel returns the log-sum-exp beside the output, and the
family turns it into sinks itself (out * sigmoid(lse - sink)), whatever the kernel: SDPA, the ring of
context parallel, or the KV cache. No file of torchtitan knows it; the jobs name this file in
experimental.custom_import.

With block-causal masks it trains under FSDP 2, TP 2 (the sinks split by head like the heads) and
CP 2 (the ring) within 1e-5 of one process, its sinks change the losses (so they are applied), and
its KV-cache generation equals its full forward.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.models.common.layers import Attention, kv_caches
from torchtitan.models.common.rotary import PAIRS
from torchtitan.models.common.spec import ModelSize, count_parameters
from torchtitan.models.common.tp_plan import TensorParallelPlan
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.registry import get_model_spec, register_model

# ---- the family ----------------------------------------------------------------------------


class Sinks(nn.Module):
    """One learned logit per attention head."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(n_heads))

    def local(self) -> torch.Tensor:
        """This rank's heads' logits (under tensor parallel, the heads are split over the ranks)."""
        return self.logits.to_local() if isinstance(self.logits, DTensor) else self.logits


class SinkAttention(Attention):
    """Llama 3's attention (the shared module), whose kernel call also returns the log-sum-exp."""

    def __init__(self, args):
        super().__init__(args.dim, args.n_heads, args.kv_heads, args.head_dim, PAIRS)
        self.sinks = Sinks(args.n_heads)

    def attend(self, q, k, v, cache, start_pos, doc_ids):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            out, lse = self.attention_fn(q, k, v, doc_ids=doc_ids, window=self.window, return_lse=True)
        else:
            out, lse = cache.attend(q, k, v, start_pos, self.window, return_lse=True)
        # The sink's share of the softmax's mass: exp(s) / (exp(s) + exp(lse)).
        out = out * torch.sigmoid(lse - self.sinks.local()[None, :, None]).unsqueeze(-1).to(out.dtype)
        return out.transpose(1, 2).flatten(2)


class SinkTransformer(Transformer):
    def block(self, layer_id: int) -> nn.Module:
        block = super().block(layer_id)
        block.attention = SinkAttention(self.args)  # in Llama 3's attention's place (same names)
        return block


class ShardHeads(ParallelStyle):
    """The sinks split over the tensor-parallel ranks as the heads are (wq is column-parallel)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.logits = nn.Parameter(distribute_tensor(module.logits.data, device_mesh, [Shard(0)]))
        return module


def size(args) -> ModelSize:
    total, embedding = count_parameters(SinkTransformer, args)
    return ModelSize(total=total, active=total, embedding=embedding)


LLAMA3 = get_model_spec("llama3")
SPEC = dataclasses.replace(
    LLAMA3,
    name="llama3_sinks",
    model_cls=SinkTransformer,
    size=size,
    tp_plan=TensorParallelPlan(
        top=LLAMA3.tp_plan.top, block=lambda block: {**LLAMA3.tp_plan.block(block), "attention.sinks": ShardHeads()}
    ),
    hf=None,  # Llama 3's Hugging Face names have no sinks
)
register_model(SPEC)


# ---- the tests ------------------------------------------------------------------------------

THIS_FILE = str(Path(__file__).resolve())
FAMILY = ["--experimental.custom_import", THIS_FILE, "--model.name", "llama3_sinks", "--model.flavor", "debugmodel"]


def tiny_model(seed: int = 0) -> SinkTransformer:
    from helpers.tiny_models import materialized

    return materialized(SinkTransformer, SPEC.args_for_training("debugmodel", 4096, 64), seed).eval()


def test_sinks_are_parameters_that_change_the_output():
    model = tiny_model()
    logits = [name for name, _ in model.named_parameters() if name.endswith("sinks.logits")]
    assert len(logits) == model.args.n_layers
    tokens = torch.randint(3, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(tokens)
        for layer in model.layers.values():
            layer.attention.sinks.logits.fill_(2.0)  # more of each head's mass to its sink
        assert (model(tokens) - before).abs().max() > 1e-2


def test_kv_cache_generation_equals_the_full_forward():
    model = tiny_model()
    tokens = torch.randint(3, 4096, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        caches = kv_caches(model, 40)
        steps = [model(tokens[:, :16], cache=caches, start_pos=0)]  # the prompt
        for p in range(16, 40):  # then one token at a time
            steps.append(model(tokens[:, p : p + 1], cache=caches, start_pos=p))
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from helpers.data import short_documents_corpus
    from helpers.launch import launch

    tmp = tmp_path_factory.mktemp("sinks")
    # Several short documents per window, each seeing only itself: the block-causal mask at work.
    BLOCK_CAUSAL = [
        "--training.dataset",
        "local",
        "--training.dataset_path",
        str(short_documents_corpus(tmp / "short_docs.jsonl")),
        "--model.attn_mask_type",
        "block_causal",
        "--model.attn_backend",
        "sdpa",
    ]
    results = launch(
        {
            "single": FAMILY + BLOCK_CAUSAL + ["--training.local_batch_size", "8"],
            "llama3": [
                "--model.name",
                "llama3",
                "--model.flavor",
                "debugmodel",
                *BLOCK_CAUSAL,
                "--training.local_batch_size",
                "8",
            ],
        },
        1,
        tmp,
    )
    results.update(
        launch(
            {
                "fsdp2": FAMILY + BLOCK_CAUSAL + ["--training.local_batch_size", "4"],
                "tp2": FAMILY
                + BLOCK_CAUSAL
                + ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
                "cp2": FAMILY
                + BLOCK_CAUSAL
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


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "cp2"])
def test_parallel_layouts_match_one_process(runs, layout):
    from helpers.launch import losses

    ref, got = losses(runs["single"]), losses(runs[layout])
    assert len(got) == len(ref) == 6
    assert max(abs(a - b) for a, b in zip(ref, got)) < 1e-5, (ref, got)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_sinks_are_trained_and_change_the_losses(runs):
    from helpers.launch import losses

    # Every other parameter is initialized by its name, as Llama 3's: the sinks alone set them apart.
    ref, plain = losses(runs["single"]), losses(runs["llama3"])
    assert ref[-1] < ref[0] - 0.3
    assert min(abs(a - b) for a, b in zip(ref, plain)) > 1e-4, (ref, plain)
