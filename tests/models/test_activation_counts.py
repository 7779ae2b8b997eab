"""Each family's activation counts (spec.activation_counts, read by the layout planner) against what a
real block keeps for backward: its saved tensors, traced on CPU in float32, parameters and the
rotary table left out, in float32 and in bfloat16 (where norms and some attention tensors stay float32).
Within 1% for every block kind of every family (dense, MoE, qk-norm, MLA)."""

import pytest
import torch

from torchtitan.models.registry import get_model_spec

CASES = [("llama3", "debugmodel", "1"), ("qwen3", "debugmodel", "1"), ("qwen3", "debugmodel_moe", "1"),
         ("deepseek_v3", "debugmodel", "0"), ("deepseek_v3", "debugmodel", "1")]


def traced_bytes_per_token(model, layer: str, batch: int, seq: int, dtype) -> float:
    """Bytes the block's forward saves for backward, per token (each storage once)."""
    block = model.layers[layer]
    constant = {p.untyped_storage().data_ptr() for p in model.parameters()} | {model.rope.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in constant:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(batch, seq, model.args.dim, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, model.rope[:seq])
    return sum(saved.values()) / (batch * seq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,flavor,layer", CASES)
def test_counts_match_a_traced_block(name, flavor, layer, dtype):
    spec = get_model_spec(name)
    seq = 128
    args = spec.args_for_training(flavor, 4096, seq)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights(seed=0)
    model.to(dtype)
    counts = spec.activation_counts(args, model.layers[layer], seq)
    act = torch.finfo(dtype).bits // 8
    estimated = act * (counts.split + counts.gathered) + 4 * counts.fp32 + 8 * counts.int64
    assert estimated == pytest.approx(traced_bytes_per_token(model, layer, 2, seq, dtype), rel=0.01)
