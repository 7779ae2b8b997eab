"""Rotary frequencies shared by the families, with Llama 3.1's long-context scaling.

Each family lays the rotary table out as its attention reads it (Meta's complex pairs, or Hugging
Face's rotate-half halves); the frequencies underneath are the same: inv_freq[i] = theta^(-2i/d) for
the d/2 feature pairs of a head.

Llama 3.1 / 3.2 ("rope_type": "llama3" in config.json) stretch the long wavelengths for a context
`factor` times the one trained on (original_max_position_embeddings): a pair whose wavelength is
longer than original / low_freq_factor turns `factor` times slower; one shorter than
original / high_freq_factor is kept; in between, the frequency moves linearly (in
original / wavelength) from the slowed to the kept one.
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary scaling (config.json rope_scaling with rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """[head_dim / 2] float32 angular frequencies of the feature pairs, scaled when `scaling` is set."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)[: head_dim // 2] / head_dim))
    if scaling is None:
        return inv_freq
    s = scaling
    wavelength = 2 * math.pi / inv_freq
    # 0 where the wavelength is long (slowed), 1 where it is short (kept), linear in between.
    ramp = (s.original_max_position_embeddings / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    ramp = ramp.clamp(0.0, 1.0)
    return (1 - ramp) * inv_freq / s.factor + ramp * inv_freq
