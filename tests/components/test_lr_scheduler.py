import math

import pytest
import torch

from torchtitan.components.lr_scheduler import build_lr_scheduler, lr_factor
from torchtitan.config import LRScheduler


def factors(total, **kw):
    cfg = LRScheduler(**kw)
    return [lr_factor(i, cfg, total) for i in range(total)]


def test_linear_warmup_then_linear_decay_to_zero():
    f = factors(10, warmup_steps=4, decay_type="linear")
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # 6 decay steps end exactly at min_lr_factor (0) on the last step
    assert f[4:] == pytest.approx([5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0])


def test_warmup_stable_decay():
    f = factors(20, warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.1)
    assert f[:2] == pytest.approx([0.5, 1.0])
    decay_start = 20 - round(0.5 * 18)  # 11
    assert f[2:decay_start] == pytest.approx([1.0] * (decay_start - 2))
    assert f[decay_start] < 1.0
    assert f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[decay_start:], f[decay_start + 1 :]))


@pytest.mark.parametrize(
    "decay_type, midpoint",
    [("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5 * (1 + math.cos(math.pi * 0.5)))],
)
def test_decay_shapes(decay_type, midpoint):
    f = factors(11, warmup_steps=1, decay_type=decay_type)
    # decay over steps 1..10, progress 0.5 at index 5
    assert f[5] == pytest.approx(midpoint)
    assert f[-1] == pytest.approx(0.0)


def test_cosine_with_floor_and_no_warmup():
    f = factors(5, warmup_steps=0, decay_type="cosine", min_lr_factor=0.2)
    assert f[0] < 1.0 and f[-1] == pytest.approx(0.2)
    assert min(f) >= 0.2 - 1e-12


def test_decay_ratio_zero_holds_the_peak():
    assert factors(6, warmup_steps=2, decay_ratio=0.0) == pytest.approx([0.5, 1, 1, 1, 1, 1])


def test_warmup_longer_than_run():
    f = factors(3, warmup_steps=10)
    assert f == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=2), total_steps=4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([5e-4, 1e-3, 5e-4, 0.0])


def test_step_past_the_end_and_no_decay_phase():
    # LambdaLR evaluates the factor once more after the last step; it must not fail.
    assert lr_factor(6, LRScheduler(warmup_steps=2, decay_ratio=0.0), 6) == 1.0
    assert lr_factor(10, LRScheduler(warmup_steps=2), 10) == pytest.approx(0.0)
