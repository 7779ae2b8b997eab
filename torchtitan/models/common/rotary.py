"""Rotary frequencies shared by the families, with Llama 3.1's long-context scaling.

Each family lays the rotary table out as its attention reads it (Meta's complex pairs, or Hugging
Face's rotate-half halves); the frequencies underneath are the same: inv_freq[i] = theta^(-2i/d) for
the d/2 feature pairs of a head.

Llama 3.1 / 3.2 ("rope_type": "llama3" in config.json) stretch the long wavelengths for a context
`factor` times the one trained on (original_max_position_embeddings): a pair whose wavelength is
longer than original / low_freq_factor turns `factor` times slower; one shorter than
original / high_freq_factor is kept; in between, the frequency moves linearly (in
original / wavelength) from the slowed to the kept one.

YaRN (DeepSeek-V2/V3, Kimi K2: "rope_type": "yarn") blends, per feature pair, the frequency
interpolated `factor` times slower and the original one, by how many turns the pair makes over the
original context: pairs with more than beta_fast turns keep their frequency, pairs with fewer than
beta_slow are interpolated, a linear ramp over the pair index lies between (the bounds rounded
outwards). The rotation's magnitude is `attention_factor` (mscale ratio), and MLA models scale the
attention logits by mscale(factor, mscale_all_dim)^2 as well (`yarn_softmax_factor`).

Two layouts of the rotation (`Rotary`: a table and the rotation that reads it): adjacent feature pairs
as complex numbers (`PAIRS`: Meta's, DeepSeek's; `complex_table` + `rotate_pairs`), or halves
(`HALVES`: Hugging Face's rotate_half, feature i with feature i + d/2; `halves_table` + `rotate_halves`).
A model in one layout imports Hugging Face weights of the other by permuting the q/k rows of each head.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary scaling (config.json rope_scaling with rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's rotary scaling (config.json rope_scaling with rope_type "yarn")."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # Round the ramp's bounds outwards to whole pairs (Hugging Face's "truncate", default true);
    # gpt-oss publishes false: the ramp runs between the fractional bounds.
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _turns_to_pair_index(turns: float, head_dim: int, theta: float, context: int) -> float:
    """The (fractional) pair index whose wavelength fits `turns` times into `context` positions."""
    return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))


def yarn_frequencies(head_dim: int, theta: float, y: YarnScaling) -> tuple[torch.Tensor, float]:
    """([head_dim / 2] float32 frequencies, the rotation's magnitude) under YaRN."""
    pairs = torch.arange(0, head_dim, 2, dtype=torch.float32)[: head_dim // 2] / head_dim
    original = 1.0 / theta**pairs
    low = _turns_to_pair_index(y.beta_fast, head_dim, theta, y.original_max_position_embeddings)
    high = _turns_to_pair_index(y.beta_slow, head_dim, theta, y.original_max_position_embeddings)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    # 0 at pair `low` and before (original frequency kept), 1 from pair `high` on (interpolated).
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    keep = 1 - ramp
    inv_freq = original / y.factor * (1 - keep) + original * keep
    if y.mscale and y.mscale_all_dim:
        magnitude = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    else:
        magnitude = yarn_mscale(y.factor)
    return inv_freq, float(magnitude)


def yarn_softmax_factor(y: YarnScaling | None) -> float:
    """What MLA multiplies its attention logits by, beyond 1/sqrt(head dim)."""
    if y is None or not y.mscale_all_dim:
        return 1.0
    return yarn_mscale(y.factor, y.mscale_all_dim) ** 2


def complex_table(
    head_dim: int, end: int, theta: float, scaling: "RopeScaling | YarnScaling | None" = None
) -> torch.Tensor:
    """complex64 [end, head_dim / 2]: each position's rotation of each feature pair (its magnitude
    YaRN's attention factor, else 1)."""
    freqs, magnitude = frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.full_like(angles, magnitude), angles)


def frequencies(
    head_dim: int, theta: float, scaling: "RopeScaling | YarnScaling | None" = None
) -> tuple[torch.Tensor, float]:
    """([head_dim / 2] float32 frequencies, the rotation's magnitude: YaRN's attention factor, else 1)."""
    if isinstance(scaling, YarnScaling):
        return yarn_frequencies(head_dim, theta, scaling)
    return inv_frequencies(head_dim, theta, scaling), 1.0


def rotate_pairs(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, d] by the first `seq` rows of a complex_table (or this rank's
    positions), adjacent features (2i, 2i+1) forming one complex number; in float32."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * table[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return rotated.type_as(x)


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """[head_dim / 2] float32 angular frequencies of the feature pairs, scaled when `scaling` is set."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)[: head_dim // 2] / head_dim))
    if scaling is None:
        return inv_freq
    s = scaling
    wavelength = 2 * math.pi / inv_freq
    # 0 where the wavelength is long (slowed), 1 where it is short (kept), linear in between.
    ramp = (s.original_max_position_embeddings / wavelength - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    ramp = ramp.clamp(0.0, 1.0)
    return (1 - ramp) * inv_freq / s.factor + ramp * inv_freq


def halves_table(
    head_dim: int, end: int, theta: float, scaling: "RopeScaling | YarnScaling | None" = None
) -> torch.Tensor:
    """[end, 2 x head_dim]: cos then sin of each position's angles, the head_dim/2 angles written twice
    along the features (Hugging Face's layout), computed in float32 as Hugging Face does; under YaRN
    both multiplied by its attention factor (the rotation's magnitude), as Hugging Face does."""
    freqs, magnitude = frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return table if magnitude == 1.0 else table * magnitude


def rotate_halves(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, d] by the first `seq` rows of a halves_table (or this rank's
    positions), feature i paired with feature i + d/2 (rotate_half); in float32."""
    cos, sin = table[: x.shape[1]].view(1, x.shape[1], 1, -1).chunk(2, dim=-1)
    x_ = x.float()  # rotate in float32 whatever the activation dtype
    x1, x2 = x_.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_ * cos + rotated * sin).type_as(x)


@dataclass(frozen=True)
class Rotary:
    """One layout: table(head_dim, end, theta, scaling) -> one row per position, and rotate(x, rows)."""

    table: Callable[..., torch.Tensor]
    rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


PAIRS = Rotary(complex_table, rotate_pairs)
HALVES = Rotary(halves_table, rotate_halves)
