"""Optimizer construction from the [optimizer] section.

Parameter groups are decided by parameter name (FQN) and by the kind of module that owns the
parameter, never by shard or rank, so every parallel layout groups the same parameters alike:
- norm weights (the parameters of normalization modules, and any 1-D or scalar parameter) and biases
  get no weight decay unless optimizer.weight_decay_norms_and_biases;
- embeddings (nn.Embedding weights) get none when optimizer.weight_decay_embeddings = false;
- optimizer.param_groups entries (a regular expression over the names, with an lr multiplier and a
  weight decay) take the parameters they match, the first matching entry winning.
A Parameter reachable under several names (a tied embedding and output layer) is decided once, from
all its names and owning modules. Each group is further split by device mesh (see build_optimizer).

With optimizer.name = "Muon", each group is also split by algorithm: Muon for the hidden matrices (2-D
and stacked, e.g. MoE experts), AdamW for norm weights and biases, embeddings, and the parameters whose
names match the model spec's `adamw_params` (the output layer, MoE routers). See components/muon.py.
"""

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan.config import Optimizer as OptimizerConfig, UserError
from torchtitan.config.entries import parse_param_groups

logger = logging.getLogger(__name__)

# Modules whose parameters are norm weights (torch's normalization layers; batchnorm's base class
# covers the batch and instance norms). Other families' own norm modules have 1-D weights.
NORM_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
# Wrapper modules that insert a component into parameter names (torchtitan's own wrappers do not).
_WRAPPER_PARTS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


@dataclass(frozen=True)
class GroupSettings:
    """A semantic parameter group: the same name and settings in every layout."""

    name: str  # "decay", "no_decay", or an optimizer.param_groups pattern (+ " no_decay")
    lr_mult: float
    weight_decay: float
    algorithm: str = "adamw"  # "muon" or "adamw" with optimizer.name = "Muon"; "adamw" otherwise


def clean_name(name: str) -> str:
    return _WRAPPER_PARTS.sub(r"\1", name)


def _parameters_with_owners(model: nn.Module) -> list[tuple[nn.Parameter, list[str], list[nn.Module]]]:
    """Each Parameter once, with every name it has in `model` and every module that holds it."""
    found: dict[int, tuple[nn.Parameter, list[str], list[nn.Module]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            entry = found.setdefault(id(p), (p, [], []))
            entry[1].append(clean_name(f"{module_name}.{name}" if module_name else name))
            entry[2].append(module)
    return list(found.values())


def classify_parameters(
    model: nn.Module, cfg: OptimizerConfig, adamw_params: tuple[str, ...] = ()
) -> tuple[dict[str, GroupSettings], set[str]]:
    """{every parameter name of `model`: its group}, and the optimizer.param_groups patterns that
    matched a parameter. `adamw_params`: the model spec's patterns of matrices Muon leaves to AdamW."""
    rules = parse_param_groups(cfg.param_groups)
    compiled = [(rule, re.compile(rule.pattern)) for rule in rules]
    adamw_only = [re.compile(pattern) for pattern in adamw_params]
    table: dict[str, GroupSettings] = {}
    matched: set[str] = set()
    for p, names, owners in _parameters_with_owners(model):
        norm_or_bias = (
            p.dim() < 2
            or any(isinstance(m, NORM_MODULES) for m in owners)
            or any(n.rsplit(".", 1)[-1].endswith("bias") for n in names)
        )
        embedding = any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in owners)
        excluded = (norm_or_bias and not cfg.weight_decay_norms_and_biases) or (
            embedding and not cfg.weight_decay_embeddings
        )
        default_decay = 0.0 if excluded else cfg.weight_decay
        rule = next((r for r, regex in compiled if any(regex.search(n) for n in names)), None)
        algorithm = "adamw"
        if cfg.name == "Muon" and not (
            norm_or_bias
            or embedding
            or (rule is not None and rule.adamw)
            or any(regex.search(n) for regex in adamw_only for n in names)
        ):
            algorithm = "muon"
        if rule is None:
            settings = GroupSettings("no_decay" if excluded else "decay", 1.0, default_decay, algorithm)
        else:
            matched.add(rule.pattern)
            if rule.weight_decay is not None:
                settings = GroupSettings(rule.pattern, rule.lr_mult, rule.weight_decay, algorithm)
            else:
                settings = GroupSettings(
                    rule.pattern + (" no_decay" if excluded else ""), rule.lr_mult, default_decay, algorithm
                )
        for n in names:
            table[n] = settings
    return table, matched


def parameter_name_hint(names) -> str:
    """A few parameter names, for a message: those outside layers and of the first layer (index 0)."""
    names = list(dict.fromkeys(names))
    outside = [n for n in names if not re.search(r"(^|\.)\d+\.", n)]
    first = [n for n in names if re.search(r"(^|\.)\d+\.", n) and not re.search(r"(^|\.)[1-9]\d*\.", n)]
    sample = (outside[:4] + first)[:8]
    return ", ".join(sample) + (f", ... ({len(names)} in all)" if len(names) > len(sample) else "")


def check_patterns_matched(cfg: OptimizerConfig, matched: set[str], names) -> None:
    """UserError naming each optimizer.param_groups pattern that matched no parameter of the whole model."""
    missing = [rule.pattern for rule in parse_param_groups(cfg.param_groups) if rule.pattern not in matched]
    if missing:
        raise UserError(
            f"optimizer.param_groups: {', '.join(repr(p) for p in missing)} "
            f"{'matches' if len(missing) == 1 else 'match'} no parameter of the model (patterns are searched in "
            f"the full names, e.g. {parameter_name_hint(names)}); fix or remove "
            f"{'it' if len(missing) == 1 else 'them'}"
        )


def check_param_groups(model: nn.Module, cfg: OptimizerConfig) -> None:
    """Before launch, on the whole model (the meta device is enough): every pattern matches a parameter."""
    if cfg.param_groups:
        table, matched = classify_parameters(model, cfg)
        check_patterns_matched(cfg, matched, table)


def check_muon_supported(cfg: OptimizerConfig, family: str, adamw_params: tuple[str, ...] | None) -> None:
    """Before launch: Muon needs the family to name the matrices that are not hidden layers."""
    if cfg.name == "Muon" and adamw_params is None:
        raise UserError(
            f"optimizer.name = 'Muon' needs to know which matrices of model {family!r} are not hidden layers (its "
            f"output layer, any router), and its spec does not say (ModelSpec.adamw_params); add them to the spec, "
            f"or use AdamW"
        )


def muon_settings(cfg: OptimizerConfig) -> dict:
    """Muon's keys, unset ones at their defaults."""
    from torchtitan.components import muon

    def given(value, default):
        return default if value is None else value

    return dict(
        lr=given(cfg.muon_lr, cfg.lr),
        momentum=given(cfg.muon_momentum, muon.DEFAULT_MOMENTUM),
        nesterov=given(cfg.muon_nesterov, muon.DEFAULT_NESTEROV),
        ns_steps=given(cfg.muon_ns_steps, muon.DEFAULT_NS_STEPS),
        adjust_lr=given(cfg.muon_adjust_lr, muon.DEFAULT_ADJUST_LR),
        ns_dtype=getattr(torch, given(cfg.muon_ns_dtype, "bfloat16")),
    )


def build_optimizer(
    model: nn.Module,
    cfg: OptimizerConfig,
    groups: dict[str, GroupSettings] | None = None,
    adamw_params: tuple[str, ...] = (),
) -> torch.optim.Optimizer:
    """The optimizer of `model` (a whole model, or a pipeline stage given the whole model's `groups`
    by name; without `groups`, `model` is taken as the whole model and every pattern must match).
    `adamw_params`: the model spec's patterns of matrices that Muon leaves to AdamW."""
    own, matched = classify_parameters(model, cfg, adamw_params)
    if groups is None:
        groups = own
        check_patterns_matched(cfg, matched, own)
    # One parameter group per semantic group and device mesh: the fused and foreach kernels take each
    # group's tensors together, and DTensors of different meshes (expert-parallel experts beside the
    # dense weights) cannot meet in one kernel.
    by_group: dict[tuple[GroupSettings, object], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            name = clean_name(name)
            settings = groups.get(name, own[name])
            by_group.setdefault((settings, getattr(p, "device_mesh", None)), []).append(p)
    own_class = cfg.name == "Muon" or cfg.state_dtype != "float32"
    muon = muon_settings(cfg) if cfg.name == "Muon" else {}
    param_groups = []
    for (s, _), params in by_group.items():
        # A Muon group's lr multiplier carries muon_lr / lr: the schedule and a resume (which restore
        # each group's lr as the scheduled lr x its multiplier) then need nothing of their own.
        mult = s.lr_mult * (muon["lr"] / cfg.lr if s.algorithm == "muon" else 1.0)
        group = {"params": params, "name": s.name, "lr": cfg.lr * mult, "lr_mult": mult, "weight_decay": s.weight_decay}
        if own_class:
            group["algorithm"] = s.algorithm
        param_groups.append(group)
    if own_class:
        from torchtitan.components.muon import MuonAdamW

        settings = {k: v for k, v in muon.items() if k != "lr"}
        return MuonAdamW(
            param_groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            implementation=cfg.implementation,
            state_dtype=getattr(torch, cfg.state_dtype),
            **settings,
        )
    impl = {
        "fused": {"fused": True, "foreach": False},
        "foreach": {"fused": False, "foreach": True},
        "for-loop": {"fused": False, "foreach": False},
    }[cfg.implementation]
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    return cls(
        param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **impl
    )


def describe_groups(optimizers: list[torch.optim.Optimizer]) -> str:
    """One line: each semantic group with its parameter count, lr multiplier and weight decay."""
    counts: dict[tuple, int] = {}
    for opt in optimizers:
        for g in opt.param_groups:
            key = (g.get("name", "?"), g.get("algorithm"), g.get("lr_mult", 1.0), g["weight_decay"])
            counts[key] = counts.get(key, 0) + sum(p.numel() for p in g["params"])
    return "; ".join(
        f"{name}{f' ({algo})' if algo else ''}: {n:,} parameters, lr x{mult:g}, weight decay {wd:g}"
        for (name, algo, mult, wd), n in counts.items()
    )


class OptimizerGroup:
    """One optimizer and LR schedule per model part (several pipeline stages on a rank), stepped as
    one. Separate optimizers keep each part's state keyed by the part's own parameter names.
    `whole_model` (e.g. on the meta device): the model the parts were split from, whose names and
    modules decide the parameter groups; None when the parts together are the whole model."""

    def __init__(
        self,
        parts: list[nn.Module],
        cfg: OptimizerConfig,
        lr_cfg,
        total_steps: int,
        whole_model: nn.Module | None = None,
        adamw_params: tuple[str, ...] = (),
    ):
        from torchtitan.components.lr_scheduler import build_lr_scheduler

        if whole_model is not None:
            groups, matched = classify_parameters(whole_model, cfg, adamw_params)
        else:
            groups, matched = {}, set()
            for part in parts:
                table, found = classify_parameters(part, cfg, adamw_params)
                groups.update(table)
                matched |= found
        check_patterns_matched(cfg, matched, groups)
        self.optimizers = [build_optimizer(part, cfg, groups, adamw_params) for part in parts]
        self.schedulers = [build_lr_scheduler(opt, lr_cfg, total_steps) for opt in self.optimizers]
        self.state_dtype = cfg.state_dtype
        self.steps_taken = 0
        logger.info(f"optimizer parameter groups (this rank): {describe_groups(self.optimizers)}")

    def zero_grad(self):
        for opt in self.optimizers:
            opt.zero_grad()

    def step(self):
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            sched.step()
        self.steps_taken += 1
        if self.steps_taken == 1:  # the state exists from the first step on
            from torchtitan.components.muon import state_bytes

            logger.info(
                f"optimizer state ({self.state_dtype}): {state_bytes(self.optimizers) / 2**20:,.2f} MiB on this rank"
            )

    def step_schedulers(self):
        """Advance the learning-rate schedules alone (a skipped step)."""
        for sched in self.schedulers:
            sched.step()

    @property
    def lr(self) -> float:
        """The scheduled learning rate (of the groups without an lr multiplier)."""
        sched = self.schedulers[0]
        groups = sched.optimizer.param_groups
        for lr, group in zip(sched.get_last_lr(), groups):
            if group.get("lr_mult", 1.0) == 1.0:
                return float(lr)  # a float already: the groups' lr is a number, never a tensor
        return sched.get_last_lr()[0] / groups[0]["lr_mult"]
