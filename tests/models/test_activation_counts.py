"""Each family's activation counts (spec.activation_counts, read by the layout planner) against what a
real block keeps for backward: its saved tensors, traced on CPU in float32, parameters and the
rotary table left out, in float32 and in bfloat16 (where norms and some attention tensors stay float32).
Within 1% for every block kind of every family (dense, MoE, qk-norm, MLA, sinks, gated DeltaNet and
gated attention). The per-operator checkpointing policy's counts against what a checkpointed block
leaves allocated after its forward, read from the CPU allocator's events: within 1%."""

import dataclasses

import pytest
import torch

from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.registry import get_model_spec
from torchtitan.planner.allocations import kept_by

CASES = [
    ("llama3", "debugmodel", "1"),
    ("qwen3", "debugmodel", "1"),
    ("qwen3", "debugmodel_moe", "1"),
    ("deepseek_v3", "debugmodel", "0"),
    ("deepseek_v3", "debugmodel", "1"),
    ("gpt_oss", "debugmodel", "0"),
    ("gpt_oss", "debugmodel", "1"),  # a windowed layer, a full one
    ("qwen3_5", "debugmodel", "0"),
    ("qwen3_5", "debugmodel", "3"),  # gated DeltaNet, gated full attention
    ("qwen3_5", "debugmodel_moe", "0"),
    ("qwen3_5", "debugmodel_moe", "3"),
]  # the same with MoE (shared gate)


def traced_bytes_per_token(model, layer: str, batch: int, seq: int, dtype) -> float:
    """Bytes the block's forward saves for backward, per token (each storage once)."""
    x = torch.randn(batch, seq, model.args.dim, dtype=dtype, requires_grad=True)
    return saved_bytes(model, lambda: model.layers[layer](x, model.rope[:seq])) / (batch * seq)


def saved_bytes(model, forward) -> int:
    """Bytes `forward` saves for backward, each storage once, the parameters and rotary table left out."""
    constant = {p.untyped_storage().data_ptr() for p in model.parameters()} | {model.rope.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in constant:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())


SEQ = 128  # a multiple of Qwen3.5's delta-rule chunk (64), as its counts assume


def block_and_counts(name: str, flavor: str, layer: str, dtype, **overrides):
    """(a real model in `dtype`, its args, the spec's counts for `layer`)."""
    spec = get_model_spec(name)
    args = dataclasses.replace(spec.args_for_training(flavor, 4096, SEQ), **overrides)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights(seed=0)
    model.to(dtype)
    return model, args, spec.activation_counts(args, model.layers[layer], SEQ)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,flavor,layer", CASES)
def test_counts_match_a_traced_block(name, flavor, layer, dtype):
    model, args, counts = block_and_counts(name, flavor, layer, dtype)
    act = torch.finfo(dtype).bits // 8
    estimated = act * (counts.split + counts.gathered) + 4 * counts.fp32 + 8 * counts.int64
    assert estimated == pytest.approx(traced_bytes_per_token(model, layer, 2, SEQ, dtype), rel=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,flavor,layer", CASES)
def test_op_policy_counts_match_a_checkpointed_block(name, flavor, layer, dtype):
    """What the "op" policy keeps (op_kept, op_fp32): the block's input is the caller's, its output
    is left out."""
    model, args, counts = block_and_counts(name, flavor, layer, dtype)
    apply_ac(model, "selective", "op")
    batch = 2
    x = torch.randn(batch, SEQ, args.dim, dtype=dtype, requires_grad=True)
    rope = model.rope[:SEQ]
    kept, out = kept_by(lambda: model.layers[layer](x, rope))
    measured = (kept - out.untyped_storage().nbytes()) / (batch * SEQ)
    act = torch.finfo(dtype).bits // 8
    assert act * counts.op_kept + 4 * counts.op_fp32 == pytest.approx(measured, rel=0.01)


def test_float8_blocks_keep_what_bfloat16_ones_do():
    """torchao's float8 linears (tensorwise, emulated: the same casts, the matmul upcast) keep their
    high-precision inputs for backward, so the planner counts a float8 block as a bfloat16 one."""
    pytest.importorskip("torchao")
    from torchtitan.components.float8 import convert_to_float8
    from torchtitan.config.model_sections import Float8

    model, args, counts = block_and_counts("llama3", "debugmodel", "1", torch.bfloat16)
    assert convert_to_float8(model, Float8(emulate=True))
    estimated = 2 * (counts.split + counts.gathered) + 4 * counts.fp32
    assert estimated == pytest.approx(traced_bytes_per_token(model, "1", 2, SEQ, torch.bfloat16), rel=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_multi_token_prediction_module_keeps_its_block_and_glue(dtype):
    """DeepSeek-V3's MTP module: its block's counts plus its input norms and their concatenation
    (deepseek_v3.activation_memory.mtp_counts), against the whole module's saved tensors; and it counts one
    more pass through the output layer."""
    model, args, _ = block_and_counts("deepseek_v3", "debugmodel", "0", dtype, mtp_depth=1)
    module = model.mtp["0"]
    counts = get_model_spec("deepseek_v3").activation_counts(args, module.block, SEQ)
    assert counts.outputs == 1
    batch = 2
    h = torch.randn(batch, SEQ, args.dim, dtype=dtype, requires_grad=True)
    embedded = torch.randn(batch, SEQ, args.dim, dtype=dtype, requires_grad=True)
    measured = saved_bytes(model, lambda: module(h, embedded, model.rope[:SEQ])) / (batch * SEQ)
    act = torch.finfo(dtype).bits // 8
    estimated = act * (counts.split + counts.gathered) + 4 * counts.fp32 + 8 * counts.int64
    assert estimated == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("name,flavor,layer", CASES)
def test_autocast_counts_match_a_traced_block(name, flavor, layer):
    """bf16 under torch.autocast over float32 parameters (training without FSDP): per token, from two
    batch sizes (autocast's bf16 copies of the weights are the same for both; the planner counts them
    with the parameters)."""
    model, args, counts = block_and_counts(name, flavor, layer, torch.float32)

    def saved(batch: int) -> int:
        x = torch.randn(batch, SEQ, args.dim, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return saved_bytes(model, lambda: model.layers[layer](x, model.rope[:SEQ]))

    measured = (saved(4) - saved(2)) / (2 * SEQ)
    bf16 = counts.split - counts.autocast_moved + counts.gathered + counts.autocast_casts
    fp32 = counts.fp32 + counts.autocast_moved
    assert 2 * bf16 + 4 * fp32 + 8 * counts.int64 == pytest.approx(measured, rel=0.01)
