"""Optimizer construction from the [optimizer] section."""

import torch
from torch import nn

from torchtitan.config import Optimizer as OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    impl = {
        "fused": {"fused": True, "foreach": False},
        "foreach": {"fused": False, "foreach": True},
        "for-loop": {"fused": False, "foreach": False},
    }[cfg.implementation]
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    # One parameter group per device mesh: the fused and foreach kernels take each group's tensors
    # together, and DTensors of different meshes (expert-parallel experts beside the dense weights)
    # cannot meet in one kernel.
    groups: dict[object, list] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    param_groups = [{"params": params} for params in groups.values()]
    return cls(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
               **impl)


class OptimizerGroup:
    """One optimizer and LR schedule per model part (several pipeline stages on a rank), stepped as
    one. Separate optimizers keep each part's state keyed by the part's own parameter names."""

    def __init__(self, parts: list[nn.Module], cfg: OptimizerConfig, lr_cfg, total_steps: int):
        from torchtitan.components.lr_scheduler import build_lr_scheduler

        self.optimizers = [build_optimizer(part, cfg) for part in parts]
        self.schedulers = [build_lr_scheduler(opt, lr_cfg, total_steps) for opt in self.optimizers]

    def zero_grad(self):
        for opt in self.optimizers:
            opt.zero_grad()

    def step(self):
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            sched.step()

    def step_schedulers(self):
        """Advance the learning-rate schedules alone (a skipped step)."""
        for sched in self.schedulers:
            sched.step()

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]
