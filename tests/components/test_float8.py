"""Float8 conversion in one process: which layers are swapped, that names, init and checkpoints do not
depend on the conversion, that the float8 layers train on CPU (torchao's float8 matmul runs there), and
that a DiLoCo sync recomputes the precomputed float8 scales of the weights it writes."""

import logging
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from torchtitan.components.float8 import convert_to_float8, precompute_float8_scales
from torchtitan.config import Float8, UserError
from torchtitan.models.registry import get_model_spec

SPEC = get_model_spec("llama3")  # the family these tests exercise the components with
ModelArgs, Transformer = SPEC.args_cls, SPEC.model_cls

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

# Every dimension a multiple of 16, so only filter_fqns decides what stays high precision.
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, multiple_of=16, max_seq_len=32)
BLOCK_LINEARS = [
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
]
ALL_BUT_OUTPUT = [f"layers.{i}.{name}" for i in range(ARGS.n_layers) for name in BLOCK_LINEARS]
RECIPES = {
    "tensorwise": Float8(),
    "tensorwise_fsdp_all_gather": Float8(enable_fsdp_float8_all_gather=True),
    "rowwise": Float8(recipe_name="rowwise"),
    "rowwise_with_gw_hp": Float8(recipe_name="rowwise_with_gw_hp"),
}


@pytest.fixture(autouse=True)
def one_thread():
    """Each test on one thread, as the trainer's ranks run under `launch` (OMP_NUM_THREADS=1). On a CPU
    for which oneDNN has no float8 kernel, its reference kernel is far slower on two threads than on one
    (a 64 x 64 x 64 torch._scaled_mm: 15 ms against 0.09 ms on a 2-core AVX2 host, measured): this file
    took 31 s on two threads, 12 s on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(cfg: Float8 | None, seed: int = 0, args: ModelArgs = ARGS) -> Transformer:
    """As the trainer does: build on meta, convert, materialize, init."""
    with torch.device("meta"):
        model = Transformer(args)
    if cfg is not None:
        convert_to_float8(model, cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=torch.Generator().manual_seed(seed))


def float8_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def plain(t: torch.Tensor) -> torch.Tensor:
    # torchao's float8 all-gather weight subclass runs every op on its inner tensor, so comparisons
    # and reductions on it see the plain values.
    return t.detach()


def assert_same_weights(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(plain(sa[k]), plain(sb[k])), k


def test_converts_every_linear_but_output_by_default():
    with torch.device("meta"):
        model = Transformer(ARGS)
    converted = convert_to_float8(model, Float8())
    assert converted == ALL_BUT_OUTPUT
    assert float8_names(model) == ALL_BUT_OUTPUT
    assert type(model.output) is nn.Linear
    assert all(p.is_meta for p in model.parameters())  # nothing materialized by the conversion


def test_filter_fqns_keep_layers_in_high_precision(caplog):
    with torch.device("meta"):
        model = Transformer(ARGS)
    with caplog.at_level(logging.INFO, logger="torchtitan.components.float8"):
        converted = convert_to_float8(model, Float8(filter_fqns=["output", "layers.1.feed_forward"]))
    kept = {"output"} | {f"layers.1.feed_forward.{w}" for w in ("w1", "w2", "w3")}
    assert converted == [n for n in ALL_BUT_OUTPUT if n not in kept]
    for name in kept:
        assert type(model.get_submodule(name)) is nn.Linear
        assert any(name in r.message and "filter_fqns" in r.message for r in caplog.records), name


def test_dims_not_divisible_by_16_are_skipped_with_a_log_line(caplog):
    # multiple_of=10 gives a feed-forward width of 170: w1, w2, w3 cannot use float8 matmuls.
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=256, multiple_of=10, max_seq_len=32)
    assert args.ffn_hidden_dim % 16
    with torch.device("meta"):
        model = Transformer(args)
    with caplog.at_level(logging.INFO, logger="torchtitan.components.float8"):
        converted = convert_to_float8(model, Float8())
    assert converted == [f"layers.0.attention.{w}" for w in ("wq", "wk", "wv", "wo")]
    for w in ("w1", "w2", "w3"):
        name = f"layers.0.feed_forward.{w}"
        assert type(model.get_submodule(name)) is nn.Linear
        lines = [r.message for r in caplog.records if name in r.message]
        assert len(lines) == 1 and "multiples of 16" in lines[0], lines


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_names_shapes_and_init_do_not_depend_on_conversion(recipe):
    ref, model = build(None), build(RECIPES[recipe])
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert_same_weights(model, ref)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_forward_backward_on_cpu(recipe):
    ref, model = build(None), build(RECIPES[recipe])
    # One layer shows the float8 rounding plainly (measured 3.8% relative for every recipe; bf16 would be
    # about 0.4%): the layer really computes in float8, not silently in high precision.
    h = torch.randn(2, ARGS.max_seq_len, ARGS.dim, generator=torch.Generator().manual_seed(0))
    layer_error = relative_error(model.layers["0"].feed_forward.w1(h), ref.layers["0"].feed_forward.w1(h))
    assert 0.01 < layer_error < 0.1, layer_error
    # The whole model stays close (measured 4e-4: the high-precision output layer dominates the logits).
    x = tokens()
    out = model(x)
    assert relative_error(out, ref(x)) < 5e-3
    out.float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(plain(p.grad)).all(), name
    assert plain(model.layers["0"].attention.wq.weight.grad).abs().sum() > 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cpu_autocast_still_runs_the_float8_matmul(recipe):
    # Float8Linear only looks at CUDA autocast, so under CPU autocast its input stays fp32; the float8
    # matmul still runs (autocast relabels the float8 operands) and returns bf16. Measured: 0.2% from
    # the fp32-output float8 result, 3.8% from a bf16 nn.Linear.
    ref, model = build(None), build(RECIPES[recipe])
    f8_layer, hp_layer = model.layers["0"].feed_forward.w1, ref.layers["0"].feed_forward.w1
    h = torch.randn(2, ARGS.max_seq_len, ARGS.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp32_out = f8_layer(h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, bf16_out = f8_layer(h), hp_layer(h)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, fp32_out) < 0.01
    assert relative_error(out, bf16_out) > 0.01


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("recipe", ["tensorwise", "tensorwise_fsdp_all_gather", "rowwise"])
def test_state_dict_round_trip(recipe, tmp_path):
    cfg = RECIPES[recipe]
    trained = build(cfg)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    trained(tokens()).float().pow(2).mean().backward()
    optimizer.step()  # weights no longer equal to any fresh init
    x = tokens(1)
    expected = trained(x)

    fresh = build(cfg, seed=1)
    fresh.load_state_dict(trained.state_dict())
    assert_same_weights(fresh, trained)
    assert torch.equal(fresh(x), expected)

    dcp.save(trained.state_dict(), checkpoint_id=tmp_path, no_dist=True)
    fresh = build(cfg, seed=2)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    fresh.load_state_dict(state)
    assert_same_weights(fresh, trained)
    assert torch.equal(fresh(x), expected)

    # The checkpoint holds plain weights: an unconverted model loads it too.
    unconverted = build(None, seed=3)
    state = unconverted.state_dict()
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    unconverted.load_state_dict(state)
    assert_same_weights(unconverted, trained)


def test_precompute_is_a_no_op_without_fsdp():
    model = build(Float8(enable_fsdp_float8_all_gather=True))
    before = {k: plain(v).clone() for k, v in model.state_dict().items()}
    precompute_float8_scales(model)
    assert all(torch.equal(plain(v), before[k]) for k, v in model.state_dict().items())


def test_rowwise_with_fsdp_all_gather_is_a_user_error():
    from torchtitan.config import load_config

    with pytest.raises(UserError, match="float8.enable_fsdp_float8_all_gather works with float8.recipe_name"):
        load_config(
            [
                "--model.converters",
                "float8",
                "--float8.recipe_name",
                "rowwise",
                "--float8.enable_fsdp_float8_all_gather",
            ]
        )


def test_missing_torchao_is_a_user_error(monkeypatch):
    # None in sys.modules makes the import raise ImportError, as if torchao were not installed.
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with torch.device("meta"):
        model = Transformer(ARGS)
    with pytest.raises(UserError, match=r"pip install torchao==0\.18\.0"):
        convert_to_float8(model, Float8())
    assert float8_names(model) == []


def test_moe_router_and_experts_stay_in_high_precision():
    import dataclasses

    qwen = get_model_spec("qwen3")
    args = qwen.flavors["debugmodel_moe"]
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, num_experts=16))  # a 256 x 16 router
    with torch.device("meta"):
        model = qwen.model_cls(args)
    converted = convert_to_float8(model, Float8(), qwen.high_precision)  # the spec names the router
    block = model.layers["0"]
    assert type(block.feed_forward.router.gate) is nn.Linear
    assert isinstance(block.attention.wq, Float8Linear) and "layers.0.attention.wq" in converted
    assert not any("feed_forward" in name for name in converted)
    # Asking for float8 experts is refused with the reason.
    from torchtitan.config import load_config

    with pytest.raises(UserError, match="float8 for the MoE experts"):
        load_config(["--float8.moe_fqns_prototype", "experts"])


def test_a_diloco_sync_recomputes_the_precomputed_float8_scales(tmp_path):
    """With float8 all-gather and precomputed scales, the trainer computes every weight's scale after each
    optimizer step; a DiLoCo sync then overwrites the weights with the outer step's, so it must compute
    them again (torchtitan/components/fault_tolerance.py, DiLoCo.outer_step): else the next all-gather casts
    the new weights with the scales of the old ones. FSDP on a process group of one rank gives the DTensor
    weights the precompute acts on, in this process."""
    import types

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchtitan.components.fault_tolerance import DiLoCo
    from torchtitan.config.parallelism_sections import FaultTolerance

    assert not dist.is_initialized(), "a process group left by an earlier test in this process"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        cfg = Float8(enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
        with torch.device("meta"):
            model = Transformer(ARGS)
        convert_to_float8(model, cfg)
        mesh = init_device_mesh("cpu", (1,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
        assert len(layers) == len(ALL_BUT_OUTPUT)

        def scales() -> list[torch.Tensor]:
            # On the local tensor itself: to_local() returns a new wrapper, without the attribute.
            return [m.weight._local_tensor._precomputed_scale for m in layers]

        def scales_of_the_weights() -> list[torch.Tensor]:
            # torchao's amax_to_scale: the float8 maximum over max |w|, in float64, as float32.
            fmax = torch.finfo(torch.float8_e4m3fn).max
            return [(fmax / plain(m.weight.to_local()).abs().max().double()).float() for m in layers]

        # The trainer's attributes that DiLoCo reads; no checkpoint, so it keeps no diloco/ files.
        no_checkpoint = types.SimpleNamespace(checkpoint=types.SimpleNamespace(enable_checkpoint=False))
        run = types.SimpleNamespace(parts=[model], precompute_float8=True)  # the Trainer's RunContext
        trainer = types.SimpleNamespace(ctx=run, rank=0, cfg=no_checkpoint)
        diloco = DiLoCo(FaultTolerance(enabled=True, group_count=2, sync="diloco", sync_every=2), trainer, 0)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # this group's inner steps since the last sync
            for p in model.parameters():
                p.to_local().add_(0.05 * torch.randn(p.to_local().shape, generator=g))
        precompute_float8_scales(model)  # as the trainer does after each optimizer step
        inner = [s.clone() for s in scales()]
        assert all(torch.equal(a, b) for a, b in zip(inner, scales_of_the_weights()))

        # The other group did not move: the averaged delta is half of this group's.
        diloco.outer_step([d / 2 for d in diloco.deltas()])
        fresh = scales_of_the_weights()
        # The outer step (the defaults: SGD lr 0.7, Nesterov momentum 0.9, so 0.7 x 1.9 x the averaged delta)
        # moves every weight a third of the way back from this group's value to the reference, which raises
        # each scale by 1.38x to 1.55x (measured in this test): a scale left from the inner steps shows.
        assert all(not torch.allclose(a, b, rtol=0.1) for a, b in zip(inner, fresh)), (inner, fresh)
        assert all(torch.equal(a, b) for a, b in zip(scales(), fresh)), (scales(), fresh)

        # The next forward's float8 all-gather with these scales is the one with scales computed from the
        # gathered weights themselves (no precomputed scale), bit for bit.
        x = tokens()
        with torch.no_grad():
            precomputed = model(x)
            for m in layers:
                m.weight._local_tensor._precomputed_scale = None
            computed = model(x)
        assert torch.equal(precomputed, computed)
    finally:
        dist.destroy_process_group()
