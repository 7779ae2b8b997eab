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
    opt = build_optimizer(model, Optimizer(name=name, implementation=impl, lr=1e-2, beta1=0.8, beta2=0.9,
                                           eps=1e-6, weight_decay=0.05))
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
