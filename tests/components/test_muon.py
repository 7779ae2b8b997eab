"""Muon (optimizer.name = "Muon") in one process: the update equals torch.optim.Muon's, the AdamW groups
torch.optim.AdamW's, the hidden matrices are told apart from the rest by module type, dimension and the
model spec's adamw_params, stacked experts are orthogonalized one expert at a time, optimizer.state_dtype
= bfloat16 halves the state and tracks float32, and bad keys are refused before launch.
(Every parallel layout against one process: tests/distributed/test_data_parallel_parity.py.)"""

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz

from torchtitan.components.muon import NS_COEFFICIENTS, MuonAdamW, adjusted_lr, newton_schulz, state_bytes
from torchtitan.components.optimizer import OptimizerGroup, build_optimizer, check_muon_supported
from torchtitan.config import LRScheduler, Optimizer, UserError, load_config
from torchtitan.models.registry import get_model_spec

from helpers.launch import run_script
from helpers.paths import RECIPE, REPO


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (24, 24)])
def test_newton_schulz_is_torchs(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    expected = _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7)
    torch.testing.assert_close(newton_schulz(g, 5), expected, rtol=0, atol=0)
    # About orthogonal: singular values near 1 (the quintic leaves them in roughly [0.7, 1.2]).
    s = torch.linalg.svdvals(newton_schulz(g, 5).float())
    assert s.min() > 0.5 and s.max() < 1.3


def test_a_stack_is_orthogonalized_matrix_by_matrix():
    x = torch.randn(4, 32, 8, generator=torch.Generator().manual_seed(1))
    x[2] *= 100  # each matrix is normalized by its own norm, not the stack's
    torch.testing.assert_close(newton_schulz(x, 5), torch.stack([newton_schulz(m, 5) for m in x]), rtol=0, atol=0)


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_steps_equal_torch_muon(adjust, nesterov):
    gen = torch.Generator().manual_seed(0)
    ours = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(32, 16), (16, 48)]]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = MuonAdamW(
        [{"params": ours, "algorithm": "muon"}],
        lr=0.02,
        weight_decay=0.1,
        momentum=0.9,
        nesterov=nesterov,
        adjust_lr=adjust,
    )
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
    for _ in range(4):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
        torch.testing.assert_close(opt.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"], rtol=0, atol=0)


def test_ns_dtype_float32_runs_the_iterations_in_float32():
    """optimizer.muon_ns_dtype = float32: the step is the float32 Newton-Schulz's (exactly), not bf16's."""
    gen = torch.Generator().manual_seed(0)
    start = torch.zeros(32, 16)  # p = -lr x update, rounded once
    grad = torch.randn(32, 16, generator=gen)
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        p = nn.Parameter(start.clone())
        opt = MuonAdamW(
            [{"params": [p], "algorithm": "muon"}],
            lr=1.0,
            weight_decay=0.0,
            nesterov=False,
            adjust_lr="none",
            ns_dtype=dtype,
        )
        p.grad = grad.clone()
        opt.step()
        moved[dtype] = start - p.detach()
    # One step from a zero buffer: the update is (1 - momentum) g, orthogonalized.
    expected = newton_schulz(grad * (1 - 0.95), 5, torch.float32)
    torch.testing.assert_close(moved[torch.float32], expected, rtol=0, atol=0)
    assert (moved[torch.bfloat16] - expected).abs().max() > 1e-4  # bf16's rounding shows (entries about 0.2)
    with pytest.raises(ValueError, match="ns_dtype"):
        MuonAdamW([{"params": [p], "algorithm": "muon"}], lr=0.02, ns_dtype=torch.float16)


def test_lr_adjustments():
    assert adjusted_lr(1.0, "match_rms_adamw", 256, 1024) == pytest.approx(0.2 * 32)
    assert adjusted_lr(1.0, "original", 1024, 256) == pytest.approx(2.0)
    assert adjusted_lr(1.0, "original", 256, 1024) == 1.0
    assert adjusted_lr(0.5, "none", 3, 4) == 0.5


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_adamw_groups_equal_torch_adamw(impl):
    gen = torch.Generator().manual_seed(0)
    ours = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(8, 4), (4,)]]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    kernel = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}[impl]
    opt = MuonAdamW(
        [{"params": ours[:1], "algorithm": "adamw"}, {"params": ours[1:], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.8, 0.9),
        eps=1e-6,
        weight_decay=0.1,
        implementation=impl,
    )
    ref = torch.optim.AdamW(
        [{"params": theirs[:1]}, {"params": theirs[1:], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.8, 0.9),
        eps=1e-6,
        weight_decay=0.1,
        **kernel,
    )
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert opt.state[a].keys() == ref.state[b].keys()  # the same state as AdamW's, for checkpoints


def meta_model(family: str, flavor: str):
    spec = get_model_spec(family)
    with torch.device("meta"):
        return spec, spec.model_cls(spec.args_for_training(flavor, 4096, 64))


def algorithms(model, opt) -> dict[str, str]:
    by_param = {id(p): g["algorithm"] for g in opt.param_groups for p in g["params"]}
    return {name: by_param[id(p)] for name, p in model.named_parameters()}


def test_hidden_matrices_go_to_muon_the_rest_to_adamw():
    spec, model = meta_model("qwen3", "debugmodel_moe")
    algo = algorithms(model, build_optimizer(model, Optimizer(name="Muon"), adamw_params=spec.adamw_params))
    adamw = {n for n, a in algo.items() if a == "adamw"}
    assert {
        "tok_embeddings.weight",
        "output.weight",
        "norm.weight",
        "layers.0.feed_forward.router.gate.weight",
        "layers.0.attention.q_norm.weight",
        "layers.0.ffn_norm.weight",
    } <= adamw
    assert all(
        n.endswith("norm.weight") or n.endswith("gate.weight")
        for n in adamw - {"tok_embeddings.weight", "output.weight"}
    )
    muon = set(algo) - adamw
    assert {
        "layers.0.attention.wq.weight",
        "layers.0.attention.wo.weight",
        "layers.0.feed_forward.experts.w1",
        "layers.0.feed_forward.experts.w2",
    } <= muon
    assert all(model.get_parameter(n).ndim in (2, 3) for n in muon)


def test_param_groups_can_give_matrices_to_adamw():
    """optimizer=AdamW in an optimizer.param_groups entry: the matched matrices train by AdamW (two
    moments, which the planner counts), the others by Muon; lr_mult still applies."""
    from torchtitan.planner.memory import optimizer_states

    spec, model = meta_model("llama3", "debugmodel")
    cfg = Optimizer(name="Muon", param_groups=["^layers\\.0\\.attention\\. optimizer=AdamW lr_mult=0.5"])
    opt = build_optimizer(model, cfg, adamw_params=spec.adamw_params)
    algo = algorithms(model, opt)
    assert algo["layers.0.attention.wq.weight"] == algo["layers.0.attention.wo.weight"] == "adamw"
    assert algo["layers.0.feed_forward.w1.weight"] == algo["layers.1.attention.wq.weight"] == "muon"
    mult = {id(p): g["lr_mult"] for g in opt.param_groups for p in g["params"]}
    assert mult[id(model.get_parameter("layers.0.attention.wq.weight"))] == 0.5
    states = optimizer_states(spec, model, cfg)
    assert states["layers.0.attention.wq.weight"] == 2 and states["layers.1.attention.wq.weight"] == 1


def test_a_tied_output_layer_is_an_embedding():
    spec, model = meta_model("qwen3", "debugmodel_tied")
    algo = algorithms(model, build_optimizer(model, Optimizer(name="Muon"), adamw_params=()))
    assert algo["tok_embeddings.weight"] == "adamw"


def test_muon_groups_train_at_muon_lr_through_the_schedule():
    spec, model = meta_model("llama3", "debugmodel")
    cfg = Optimizer(name="Muon", lr=1e-3, muon_lr=2e-2, param_groups=["layers\\.0\\. lr_mult=0.5"])
    group = OptimizerGroup([model], cfg, LRScheduler(warmup_steps=2), total_steps=5, adamw_params=spec.adamw_params)
    opt = group.optimizers[0]
    peaks = {(g["name"], g["algorithm"]): g["initial_lr"] for g in opt.param_groups}
    assert peaks[("decay", "muon")] == pytest.approx(2e-2) and peaks[("decay", "adamw")] == pytest.approx(1e-3)
    assert peaks[("layers\\.0\\.", "muon")] == pytest.approx(1e-2)
    for g in opt.param_groups:  # the multiplier a resume restores each group's lr with
        assert g["lr"] == pytest.approx(group.lr * g["lr_mult"], rel=1e-12)


def test_muon_needs_the_family_to_name_its_non_hidden_matrices():
    check_muon_supported(Optimizer(name="Muon"), "llama3", get_model_spec("llama3").adamw_params)
    check_muon_supported(Optimizer(), "custom", None)  # AdamW needs nothing
    with pytest.raises(UserError, match=r"model 'custom'.*ModelSpec\.adamw_params"):
        check_muon_supported(Optimizer(name="Muon"), "custom", None)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, 64)
        self.experts = nn.Parameter(torch.randn(4, 16, 64) * 0.1)
        self.out = nn.Linear(16, 32, bias=False)

    def forward(self, ids):
        h = torch.relu(self.hidden(self.emb(ids)))
        h = torch.einsum("bsh,edh->bsd", h, self.experts)
        return self.out(h)


def train(name: str, state_dtype: str, steps: int = 5) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    opt = build_optimizer(
        model,
        Optimizer(name=name, lr=1e-2, state_dtype=state_dtype, implementation="for-loop"),
        adamw_params=(r"^out\.",),
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 32, (4, 8), generator=gen)
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_bf16_state_is_half(name):
    _, full_opt = train(name, "float32")
    _, half_opt = train(name, "bfloat16")
    assert type(half_opt) is MuonAdamW
    dtypes = {t.dtype for s in half_opt.state.values() for k, t in s.items() if k != "step"}
    assert dtypes == {torch.bfloat16}
    full, half = state_bytes([full_opt]), state_bytes([half_opt])
    steps = 4 * len([s for s in half_opt.state.values() if "step" in s])  # AdamW's float32 step counts
    assert half - steps == (full - steps) / 2


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_bf16_state_tracks_float32(name):
    # The same gradients into both (a trained model's trajectories part chaotically within a few steps):
    # 20 steps at lr 1e-2 move each weight by up to 0.2; bf16 state stays within 2e-3 of float32's.
    models, gen = [], torch.Generator().manual_seed(1)
    opts = []
    for state_dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        models.append(Net())
        opts.append(
            build_optimizer(
                models[-1],
                Optimizer(name=name, lr=1e-2, state_dtype=state_dtype, implementation="for-loop"),
                adamw_params=(r"^out\.",),
            )
        )
    for _ in range(20):
        for ps in zip(*(m.parameters() for m in models)):
            grad = torch.randn(ps[0].shape, generator=gen) * 1e-3
            for p in ps:
                p.grad = grad.clone()
        for opt in opts:
            opt.step()
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert not torch.equal(a, b), n
        torch.testing.assert_close(b, a, rtol=0, atol=2e-3, msg=n)


def test_bf16_adamw_is_torchs_formula_in_float32():
    # With state that bf16 holds exactly (gradients of a few bits), the bf16 path is torch's AdamW.
    gen = torch.Generator().manual_seed(0)
    ours = nn.Parameter(torch.randn(8, 8, generator=gen))
    theirs = nn.Parameter(ours.detach().clone())
    opt = MuonAdamW([{"params": [ours]}], lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16)
    ref = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    ours.grad = torch.randint(-4, 4, (8, 8), generator=gen).float() / 4
    theirs.grad = ours.grad.clone()
    opt.step()
    ref.step()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optimizer.name", "Lion"], "optimizer.name: expected one of 'AdamW', 'Adam', 'Muon'"),
        (
            ["--optimizer.muon_lr", "0.02"],
            "optimizer.muon_lr applies to optimizer.name = 'Muon' only, and it is 'AdamW'",
        ),
        (
            ["--optimizer.name", "Adam", "--optimizer.muon_momentum", "0.9", "--optimizer.muon_nesterov", "false"],
            "optimizer.muon_momentum, optimizer.muon_nesterov apply to optimizer.name = 'Muon' only",
        ),
        (["--optimizer.name", "Muon", "--optimizer.muon_lr", "0"], "optimizer.muon_lr must be a finite number"),
        (["--optimizer.name", "Muon", "--optimizer.muon_lr", "inf"], "optimizer.muon_lr must be a finite number"),
        (["--optimizer.name", "Muon", "--optimizer.muon_momentum", "1"], "optimizer.muon_momentum must be in [0, 1)"),
        (["--optimizer.name", "Muon", "--optimizer.muon_momentum", "-0.5"], "optimizer.muon_momentum must be in"),
        (["--optimizer.name", "Muon", "--optimizer.muon_ns_steps", "0"], "optimizer.muon_ns_steps must be between"),
        (
            ["--optimizer.name", "Muon", "--optimizer.muon_adjust_lr", "rms"],
            "optimizer.muon_adjust_lr: expected one of",
        ),
        (["--optimizer.name", "Adam", "--optimizer.state_dtype", "bfloat16"], "works with optimizer.name = 'AdamW' or"),
        (["--optimizer.lr", "-1"], "optimizer.lr must be greater than 0"),
        (
            ["--optimizer.param_groups", "wq optimizer=AdamW"],
            "optimizer=AdamW ('wq') chooses between Muon and AdamW, and optimizer.name is 'AdamW'",
        ),
        (
            ["--optimizer.name", "Muon", "--optimizer.param_groups", "wq optimizer=SGD"],
            "optimizer = 'SGD' is not an option; optimizer=AdamW",
        ),
        (
            ["--optimizer.name", "Muon", "--optimizer.param_groups", "wq optimizer=AdamW optimizer=adamw"],
            "optimizer = 'adamw' is given twice",
        ),
    ],
)
def test_bad_keys_are_refused(argv, message):
    with pytest.raises(UserError) as e:
        load_config(argv)
    assert message in str(e.value)


def test_muon_keys_with_muon_load():
    cfg = load_config(
        [
            "--optimizer.name",
            "Muon",
            "--optimizer.muon_lr",
            "0.02",
            "--optimizer.muon_nesterov",
            "false",
            "--optimizer.muon_adjust_lr",
            "original",
            "--optimizer.state_dtype",
            "bfloat16",
        ]
    ).optimizer
    assert (cfg.muon_lr, cfg.muon_nesterov, cfg.muon_adjust_lr, cfg.muon_momentum) == (0.02, False, "original", None)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_muon_options_with_adamw_exit_2_before_launch(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan.preflight",
            *RECIPE,
            "--job.dump_folder",
            str(tmp_path / "out"),
            "--optimizer.muon_momentum",
            "0.9",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "optimizer.muon_momentum applies to optimizer.name = 'Muon' only" in proc.stderr


def test_a_copy_keeps_muon_state_keys():
    _, opt = train("Muon", "float32", steps=1)
    keys = {k for s in opt.state.values() for k in s}
    assert keys == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    copy.deepcopy(opt.state_dict())  # plain tensors and numbers: what DCP flattens by parameter name


@pytest.mark.multiprocess
@pytest.mark.slow
def test_spread_orthogonalization_equals_one_process_and_shares_the_work(tmp_path):
    """tests/distributed/muon_worker.py on 4 processes: 3 Muon steps of sharded parameters (FSDP's rows,
    TP's columns, experts split inside their matrices, HSDP, EP x FSDP, uneven and empty pieces) equal
    one process's bit for bit, with the Newton-Schulz spread over the ranks and with it repeated; spread,
    each rank runs a share of the iterations; split over two mesh dims, every rank runs them all."""
    run_script(REPO / "tests" / "distributed" / "muon_worker.py", [str(tmp_path / "out.json")], 4, tmp_path)
    results = __import__("json").loads((tmp_path / "out.json").read_text())
    for name, r in results.items():
        assert r["equal_spread"] and r["equal_repeated"], (name, r)
        repeated = r["calls_repeated"]
        assert len(set(repeated)) == 1, (name, r)  # without spreading, every rank runs every matrix
        if name == "rows_and_cols":
            assert r["calls"] == repeated, r
        else:
            # Each matrix's iterations once per group of ranks along the split dim: the shares sum to
            # the repeated count (times the groups: 2 under HSDP's replicas, EP's expert groups).
            groups = 2 if name in ("hsdp2x2", "ep2_fsdp2") else 1
            assert sum(r["calls"]) == repeated[0] * groups, (name, r)
            assert max(r["calls"]) < repeated[0], (name, r)
