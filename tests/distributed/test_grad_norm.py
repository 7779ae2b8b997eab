import torch

from torchtitan.distributed.grad_norm import clip_grad_norm_


def params_with_grads(*grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def test_clip_to_max_norm():
    params = params_with_grads(torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0]))
    norm = clip_grad_norm_(params, max_norm=1.0)
    assert norm.item() == 5.0  # the norm before clipping
    clipped = torch.cat([p.grad for p in params])
    torch.testing.assert_close(clipped.norm(), torch.tensor(1.0), rtol=1e-5, atol=1e-6)


def test_below_max_norm_is_untouched_and_zero_disables():
    params = params_with_grads(torch.tensor([0.3, 0.4]))
    assert clip_grad_norm_(params, max_norm=1.0).item() == 0.5
    assert torch.equal(params[0].grad, torch.tensor([0.3, 0.4]))
    params = params_with_grads(torch.tensor([30.0, 40.0]))
    assert clip_grad_norm_(params, max_norm=0).item() == 50.0
    assert torch.equal(params[0].grad, torch.tensor([30.0, 40.0]))


def test_params_without_grads_are_skipped():
    params = params_with_grads(torch.tensor([1.0])) + [torch.nn.Parameter(torch.ones(3))]
    assert clip_grad_norm_(params, max_norm=10.0).item() == 1.0
