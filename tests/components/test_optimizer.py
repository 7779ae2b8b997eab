import pytest
import torch

from torchtitan.components.optimizer import build_optimizer
from torchtitan.config import Optimizer


@pytest.mark.parametrize(
    "name, impl, cls, fused, foreach",
    [
        ("AdamW", "fused", torch.optim.AdamW, True, False),
        ("AdamW", "foreach", torch.optim.AdamW, False, True),
        ("Adam", "for-loop", torch.optim.Adam, False, False),
    ],
)
def test_builds_the_configured_optimizer(name, impl, cls, fused, foreach):
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(
        model, Optimizer(name=name, implementation=impl, lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05)
    )
    assert type(opt) is cls
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-2, (0.8, 0.9), 1e-6, 0.05)
    assert bool(group["fused"]) is fused and bool(group["foreach"]) is foreach
    model(torch.ones(2, 4)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.weight)


def test_implementations_agree():
    results = []
    for impl in ("fused", "foreach", "for-loop"):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        opt = build_optimizer(model, Optimizer(implementation=impl))
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 8)).pow(2).sum().backward()
            opt.step()
        results.append(model.weight.detach())
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], results[2])


# --- parameter groups ---------------------------------------------------------------------------

import copy  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from torch import nn  # noqa: E402

from torchtitan.components.optimizer import OptimizerGroup, check_param_groups  # noqa: E402
from torchtitan.config import LRScheduler, UserError, load_config  # noqa: E402
from torchtitan.config.entries import parse_param_groups  # noqa: E402

from helpers.paths import RECIPE, REPO  # noqa: E402


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(4)  # weight and bias
        self.proj = nn.Linear(4, 4)  # weight and bias
        self.gain = nn.Parameter(torch.ones(4))  # a custom norm's 1-D weight


class Tiny(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(8, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(4)
        self.output = nn.Linear(4, 8, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for block in self.layers:
            h = h + block.proj(block.ln(h)) * block.gain
        return self.output(self.norm(h))


def decay_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, float]:
    by_param = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    return {name: by_param[id(p)] for name, p in model.named_parameters()}


def test_norm_weights_and_biases_are_not_decayed_by_default():
    model = Tiny()
    decay = decay_of(model, build_optimizer(model, Optimizer(weight_decay=0.1)))
    no_decay = {
        "layers.0.ln.weight",
        "layers.0.ln.bias",
        "layers.0.proj.bias",
        "layers.0.gain",
        "layers.1.ln.weight",
        "layers.1.ln.bias",
        "layers.1.proj.bias",
        "layers.1.gain",
        "norm.weight",
    }
    assert {n for n, wd in decay.items() if wd == 0.0} == no_decay
    assert {n for n, wd in decay.items() if wd == 0.1} == set(decay) - no_decay  # embeddings decayed


def test_the_keys_restore_decaying_everything_and_exclude_embeddings():
    model = Tiny()
    everything = decay_of(
        model, build_optimizer(model, Optimizer(weight_decay=0.1, weight_decay_norms_and_biases=True))
    )
    assert set(everything.values()) == {0.1}
    no_embeddings = decay_of(
        model,
        build_optimizer(
            model, Optimizer(weight_decay=0.1, weight_decay_embeddings=False, weight_decay_norms_and_biases=True)
        ),
    )
    assert {n for n, wd in no_embeddings.items() if wd == 0.0} == {"tok_embeddings.weight"}


def test_a_tied_embedding_is_decided_once_from_all_its_names():
    model = Tiny(tied=True)
    opt = build_optimizer(model, Optimizer(weight_decay_embeddings=False))
    assert decay_of(model, opt)["tok_embeddings.weight"] == 0.0
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    # A pattern on either name takes the one parameter.
    opt = build_optimizer(model, Optimizer(param_groups=["^output\\. lr_mult=0.5"]))
    (group,) = [g for g in opt.param_groups if g["name"] == "^output\\."]
    assert group["params"] == [model.tok_embeddings.weight] and group["lr"] == Optimizer().lr * 0.5


def test_llama3_norms_are_found_by_module_type():
    from torchtitan.models.registry import get_model_args, get_model_spec

    spec, args = get_model_spec("llama3"), get_model_args("llama3", "debugmodel")
    with torch.device("meta"):
        model = spec.model_cls(args)
    decay = decay_of(model, build_optimizer(model, Optimizer(implementation="for-loop")))
    assert {n for n, wd in decay.items() if wd == 0.0} == {n for n in decay if "norm" in n}


def test_groups_are_split_by_device_mesh():
    model = Tiny()
    model.layers[1].proj.weight.device_mesh = "experts"  # as expert-parallel DTensors carry another mesh
    opt = build_optimizer(model, Optimizer())
    decay_groups = [g for g in opt.param_groups if g["name"] == "decay"]
    assert len(decay_groups) == 2 and [model.layers[1].proj.weight] in [g["params"] for g in decay_groups]


def test_a_regex_group_steps_as_adamw_with_its_lr_and_decay():
    torch.manual_seed(0)
    model = Tiny()
    cfg = Optimizer(
        lr=1e-2,
        weight_decay=0.1,
        param_groups=["^layers\\.0\\.proj\\.weight$ lr_mult=0.5 weight_decay=0"],
        implementation="for-loop",
    )
    reference = copy.deepcopy(model)
    opt = build_optimizer(model, cfg)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([[1, 2, 3, 4]])
    model(ids).square().sum().backward()
    reference(ids).square().sum().backward()
    opt.step()
    params = dict(model.named_parameters())
    # By hand: AdamW's first step moves by lr * g / (|g| + eps) (bias-corrected m = g, v = g^2), after
    # decaying by lr * weight_decay; the group trains at half the lr and without decay.
    grad = params["layers.0.proj.weight"].grad
    torch.testing.assert_close(
        params["layers.0.proj.weight"].detach(), before["layers.0.proj.weight"] - 0.5e-2 * grad / (grad.abs() + cfg.eps)
    )
    grad = params["layers.1.proj.weight"].grad
    torch.testing.assert_close(
        params["layers.1.proj.weight"].detach(),
        before["layers.1.proj.weight"] * (1 - 1e-2 * 0.1) - 1e-2 * grad / (grad.abs() + cfg.eps),
    )
    # And against torch's AdamW on a copy, one parameter at a time with the expected lr and decay.
    expectations = [
        ("layers.0.proj.weight", 0.5e-2, 0.0),
        ("layers.1.proj.weight", 1e-2, 0.1),
        ("layers.0.ln.weight", 1e-2, 0.0),
        ("tok_embeddings.weight", 1e-2, 0.1),
    ]
    for name, lr, wd in expectations:
        p = reference.get_parameter(name)
        torch.optim.AdamW([p], lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=wd).step()
        torch.testing.assert_close(params[name], p, rtol=0, atol=1e-7, msg=name)


def test_the_first_matching_pattern_wins():
    model = Tiny()
    opt = build_optimizer(model, Optimizer(param_groups=["proj lr_mult=0.5", "layers\\.0\\. lr_mult=0.25"]))
    names = {id(p): g["name"] for g in opt.param_groups for p in g["params"]}
    assert names[id(model.layers[0].proj.weight)] == "proj"
    assert names[id(model.layers[0].ln.weight)] == "layers\\.0\\. no_decay"  # decay as without the entry
    assert names[id(model.layers[1].proj.weight)] == "proj"
    lr_of = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lr_of["layers\\.0\\. no_decay"] == Optimizer().lr * 0.25


def test_lr_multipliers_survive_the_schedule():
    model = Tiny()
    group = OptimizerGroup(
        [model], Optimizer(lr=1e-2, param_groups=["proj lr_mult=0.5"]), LRScheduler(warmup_steps=2), total_steps=5
    )
    opt = group.optimizers[0]
    for _ in range(5):
        base = group.lr
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(base * g["lr_mult"], rel=1e-12)
        assert {g["lr_mult"] for g in opt.param_groups} == {1.0, 0.5}
        model(torch.tensor([[1, 2]])).sum().backward()
        group.step()
    assert group.lr == pytest.approx(0.0, abs=1e-12)  # the schedule's end


def test_a_pattern_that_matches_nothing_is_an_error_naming_it():
    with pytest.raises(UserError) as e:
        build_optimizer(Tiny(), Optimizer(param_groups=["proj lr_mult=0.5", "attention lr_mult=2"]))
    msg = str(e.value)
    assert "'attention' matches no parameter" in msg and "tok_embeddings.weight" in msg and "\n" not in msg
    check_param_groups(Tiny(), Optimizer(param_groups=["proj"]))  # matches


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_pattern_that_matches_nothing_is_refused_before_launch(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan.preflight",
            *RECIPE,
            "--job.dump_folder",
            str(tmp_path / "out"),
            "--optimizer.param_groups",
            "^layers\\.0\\. lr_mult=0.5,mlp lr_mult=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip()
    assert (
        error.startswith("error: optimizer.param_groups: 'mlp' matches no parameter of the model") and "\n" not in error
    )
    assert "layers.0.attention.wq.weight" in error and "layers\\.0\\." not in error


@pytest.mark.parametrize(
    "entry, problem",
    [
        ("proj lr_mult=0", "lr_mult must be greater than 0, got 0"),
        ("proj lr_mult=-1", "lr_mult must be greater than 0"),
        ("proj lr_mult=nan", "lr_mult = 'nan' is not a number"),
        ("proj weight_decay=-0.1", "weight_decay must be 0 or more, got -0.1"),
        ("proj lr=0.5", "'lr=0.5' is not an option"),
        ("proj lr_mult=x", "lr_mult = 'x' is not a number"),
        ("proj lr_mult=1 lr_mult=2", "lr_mult is given twice"),
        ("layers.(0 lr_mult=2", "'layers.(0' is not a regular expression"),
    ],
)
def test_bad_group_entries_are_config_errors(entry, problem):
    problems = Optimizer(param_groups=[entry]).check()
    assert len(problems) == 1 and problems[0].startswith("optimizer.param_groups: ") and problem in problems[0]
    with pytest.raises(UserError, match="optimizer.param_groups"):
        load_config(["--optimizer.param_groups", entry])


def test_group_entries_from_the_command_line_and_toml(tmp_path):
    cli = load_config(["--optimizer.param_groups", "tok_embeddings lr_mult=0.5 weight_decay=0, norm weight_decay=0.01"])
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[optimizer]\nparam_groups = ["tok_embeddings lr_mult=0.5 weight_decay=0", "norm weight_decay=0.01"]\n'
    )
    toml = load_config(["--job.config_file", str(recipe)])
    assert cli.optimizer.param_groups == toml.optimizer.param_groups
    rules = parse_param_groups(cli.optimizer.param_groups)
    assert [(r.pattern, r.lr_mult, r.weight_decay) for r in rules] == [
        ("tok_embeddings", 0.5, 0.0),
        ("norm", 1.0, 0.01),
    ]
    assert Optimizer(lr=float("inf")).check() == ["optimizer.lr must be a finite number, got inf"]
    assert "appears more than once" in Optimizer(param_groups=["a", "a lr_mult=2"]).check()[0]


def test_resume_restores_each_groups_lr(tmp_path):
    """A run with an lr multiplier on its first group (the embedding): the old resume gave every group
    the first group's lr; each group must continue at its own."""
    from torchtitan.train import train

    args = [
        *RECIPE,
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "5",
        "--training.mixed_precision_param",
        "float32",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--metrics.device_peak_tflops",
        "1",
        "--metrics.no-enable_tensorboard",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "3",
        "--checkpoint.no-last_save_model_only",
        "--optimizer.param_groups",
        "tok_embeddings lr_mult=0.3,layers\\.1\\. lr_mult=3 weight_decay=0",
    ]
    straight = train(load_config(args + ["--job.dump_folder", str(tmp_path / "straight")]))
    (tmp_path / "resumed" / "checkpoint").mkdir(parents=True)
    import shutil

    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-3", tmp_path / "resumed" / "checkpoint" / "step-3")
    resumed = train(load_config(args + ["--job.dump_folder", str(tmp_path / "resumed")]))
    assert [r["step"] for r in resumed] == [4, 5]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight][3:]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in straight][3:]
