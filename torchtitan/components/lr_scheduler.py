"""Learning-rate schedule: linear warmup, an optional stable phase, then linear/sqrt/cosine decay
(warmup-stable-decay when decay_ratio < 1)."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.config import LRScheduler


def lr_factor(step: int, cfg: LRScheduler, total_steps: int) -> float:
    """Multiplier of the peak LR for the optimizer step with 0-based index `step`.

    Warmup reaches the peak on its last step; decay reaches min_lr_factor on the last training step.
    """
    warmup = min(cfg.warmup_steps, total_steps)
    after_warmup = total_steps - warmup
    decay = after_warmup if cfg.decay_ratio is None else round(cfg.decay_ratio * after_warmup)
    decay_start = total_steps - decay
    if step < warmup:
        return (step + 1) / warmup
    if step < decay_start or decay == 0:
        return 1.0
    progress = min((step - decay_start + 1) / decay, 1.0)
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


def build_lr_scheduler(optimizer: Optimizer, cfg: LRScheduler, total_steps: int) -> LambdaLR:
    """Every parameter group follows the schedule from its own initial lr: the peak times the group's
    lr multiplier (optimizer.param_groups), so the multipliers hold at every step."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
