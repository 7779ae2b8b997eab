"""Mixtures: several sources, each supplying a set share of the training sequences (training.dataset_mix).

A mixture is a list of `WEIGHT:SOURCE` entries. SOURCE is a dataset name (python_stdlib, c4, c4_test),
`hf:NAME` (a Hugging Face dataset streamed through `datasets`, as training.dataset = "huggingface"),
or a path: a data file or folder of any supported format, or a token folder (scripts/pretokenize.py's
tokens.bin is in it).

Which source each global sample comes from is a deterministic schedule, the one Megatron's blended
datasets use: sample k goes to the source whose count so far lags furthest behind its share of k + 1
samples, weight_i * (k + 1) - count_i (ties: the earlier source). It is exact integer arithmetic on
the weights scaled to integers, so every rank, layout and machine computes the same schedule, and
after k samples each count is within one sample of weight_i * k. With integer weights summing to T
the schedule repeats every T samples (after T samples every count equals its weight). Global
samples are taken in blocks of T: block b holds the first T samples' pattern rotated by an offset
drawn from b, so every block has each source's exact count, any run of samples is within two of its
share, and the source of global sample k is a function of k: a lane (lanes.py) knows the source of
each of its samples without the others' counts, and the schedule needs no state. The rotation keeps
a lane from being tied to one source when T divides the global batch (lane p's samples are k = p
mod G). Windows are equally long, so the share of samples is the share of tokens.
"""

import math
import os
from array import array
from fractions import Fraction

from torchtitan.components.data.shuffle import derived_seed
from torchtitan.components.data.token_folder import PROGRESS, TOKENS
from torchtitan.config.entries import HF_PREFIX
from torchtitan.config.errors import UserError
from torchtitan.config.training_sections import TrainingDataset

NAMED_SOURCES: tuple[TrainingDataset, ...] = ("python_stdlib", "c4", "c4_test")


def integer_weights(weights: list[Fraction]) -> list[int]:
    """The weights scaled to integers with the same ratios (exact: no rounding in the schedule)."""
    scale = math.lcm(*(w.denominator for w in weights))
    return [int(w * scale) for w in weights]


def next_source(weights: list[int], counts: list[int]) -> int:
    """The source of the next sample, given how many samples each source has supplied so far."""
    k1, total = sum(counts) + 1, sum(weights)
    best, lag = 0, None
    for i, (w, c) in enumerate(zip(weights, counts)):
        d = w * k1 - c * total  # how far source i lags behind its share of k + 1 samples, times total
        if lag is None or d > lag:
            best, lag = i, d
    return best


def counts_after(weights: list[int], counts: list[int], samples: int) -> list[int]:
    """Each source's count after `samples` more samples of the schedule."""
    counts = list(counts)
    for _ in range(samples):
        counts[next_source(weights, counts)] += 1
    return counts


def schedule(weights: list[int]) -> array:
    """The source of global samples 0 .. T-1 (T = sum(weights)); sample k's is schedule[k % T]."""
    counts, pattern = [0] * len(weights), array("H")
    for _ in range(sum(weights)):
        i = next_source(weights, counts)
        counts[i] += 1
        pattern.append(i)
    return pattern


def _rotation(block: int, period: int) -> int:
    return derived_seed(block, 0) % period


def source_at(pattern: array, k: int) -> int:
    """The source of global sample k (`pattern`: schedule(weights))."""
    block, j = divmod(k, len(pattern))
    return pattern[(j + _rotation(block, len(pattern))) % len(pattern)]


def counts_at(weights: list[int], pattern: array, samples: int) -> list[int]:
    """Each source's count among global samples 0 .. samples-1."""
    blocks, rest = divmod(samples, len(pattern))
    start = _rotation(blocks, len(pattern))
    head = (pattern + pattern)[start : start + rest]
    return [blocks * w + head.count(i) for i, w in enumerate(weights)]


def source_kind(spec: str) -> tuple[TrainingDataset, str | None]:
    """(training.dataset, dataset_path) that a mixture's SOURCE names: a dataset name, `hf:NAME`, a token
    folder (a folder with a meta.json) or local files. A path that does not exist is refused."""
    if spec.startswith(HF_PREFIX):
        name = spec[len(HF_PREFIX) :]
        if not name:
            raise UserError(f"mixture source {spec!r} names no dataset; write hf:ORG/NAME or hf:/a/local/folder")
        return "huggingface", name
    if spec in NAMED_SOURCES and not os.path.exists(spec):
        return spec, None
    if not os.path.exists(spec):
        raise UserError(
            f"mixture source {spec!r} does not exist: a source is a path (a data file or folder, or a token folder), "
            f"a dataset name ({', '.join(NAMED_SOURCES)}) or hf:NAME (a Hugging Face dataset)"
        )
    if any(os.path.isfile(os.path.join(spec, name)) for name in (TOKENS, PROGRESS)):
        return "tokens", spec  # written by scripts/pretokenize.py (complete or not: the token reader explains)
    return "local", spec
