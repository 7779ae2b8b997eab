"""models/common/layers.py: the query and key norms under autocast compute what torch's unfused rms_norm did (for a
bf16 input and a float32 weight), through the fused one, which warns nowhere; no family hands rms_norm an input of
another dtype than its weight under bf16 autocast (the single-process bf16 run's precision)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.layers import HeadNorm
from torchtitan.models.registry import get_model_spec, model_names


def test_a_bf16_input_to_a_float32_norm_gives_the_unfused_values():
    torch.manual_seed(0)
    norm, ours = nn.RMSNorm(64, eps=1e-6), HeadNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    ours.load_state_dict(norm.state_dict())
    x = torch.randn(3, 32, 8, 64).to(torch.bfloat16)
    assert ours(x).dtype == torch.bfloat16 and torch.equal(ours(x), norm(x))  # norm(x): torch's mixed-dtype path
    same = nn.RMSNorm(64, eps=1e-6).to(torch.bfloat16)  # FSDP's bf16 parameters: nothing to cast
    assert torch.equal(HeadNorm(64, eps=1e-6).to(torch.bfloat16)(x), same(x))


@pytest.mark.parametrize(
    "name, flavor",
    [(name, flavor) for name in model_names() for flavor in get_model_spec(name).flavors if flavor.startswith("debug")],
)
def test_no_family_gives_rms_norm_mixed_dtypes_under_bf16_autocast(name, flavor, monkeypatch):
    """torch's rms_norm warns (once per process, "Mismatch dtype between input and weight") and takes its unfused
    path when they differ: checked at every call, since the warning itself shows only once."""
    mixed = []
    rms_norm = F.rms_norm

    def checked(x, shape, weight=None, eps=None):
        if weight is not None and x.dtype != weight.dtype:
            mixed.append((tuple(shape), x.dtype, weight.dtype))
        return rms_norm(x, shape, weight, eps)

    monkeypatch.setattr(F, "rms_norm", checked)
    spec = get_model_spec(name)
    args = spec.args_for_training(flavor, 512, 32)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens)
    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    assert not mixed, mixed
