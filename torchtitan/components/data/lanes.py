"""Lanes: every source split so that each data-parallel rank reads only its share of it.

Global sample k is sample s = k // G of lane p = k % G, G being the global batch size in samples: lane
p supplies position p of every step. Data-parallel rank r of D owns positions [r*G/D, (r+1)*G/D) of
each step, so it owns those lanes and reads nothing else. Lanes depend on G alone, so the samples are
the same under every layout and data-worker count, and a state (every lane's position) loads under
any of them.

Each source is cut into units: a source read as a stream, into its files, or into pieces of them when
there are fewer files than lanes (files.FilesSource.units; a datasets stream into G splits); a source
with random access, into UNITS_PER_LANE x G ranges of documents, so that a lane's share is spread over
the whole source while the bytes it touches stay its own. The units are permuted once per cycle of G
epochs (seeded by (seed, e // G); stored order without a shuffle), and in epoch e lane p takes those
at positions q, q + G, q + 2G, ..., q = (p + e) mod G: each unit is read by one lane per epoch, and
in a cycle a lane takes every position class once, so it reads the whole source once. With fewer
units than lanes, the lanes on one unit share its documents round robin.

A lane's documents in an epoch are its units' documents in order. Shuffled, a lane with random access
reads them in the order of a seeded permutation; a streamed one in consecutive blocks of shuffle_block
documents, each read in the order of a permutation seeded by (seed, epoch, lane, block). A resume reads
its block again: the order needs no state of its own.
"""

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from torchtitan.components.data.shuffle import Permutation, derived_seed

UNITS_PER_LANE = 16  # ranges of documents per lane of a source with random access


def document_ranges(n: int, target: int) -> list[range]:
    """range(n) cut into min(n, target) consecutive ranges of (nearly) equal length."""
    k = max(1, min(n, target))
    return [range(i * n // k, (i + 1) * n // k) for i in range(k)]


@dataclass(frozen=True)
class Share:
    """What a lane reads of a source in one epoch: units (indices into the source's unit list) and,
    of a unit it shares with other lanes, the documents phase, phase + stride, ..."""

    units: tuple[int, ...]
    stride: int = 1
    phase: int = 0


def lane_share(lane: int, lanes: int, epoch: int, num_units: int, seed: int | None) -> Share:
    q = (lane + epoch) % lanes
    # One order per cycle of `lanes` epochs: in a cycle each lane takes every position class once, so it
    # reads the whole source once (what packing's "too small" rule relies on).
    order = Permutation(num_units, seed, epoch // lanes) if seed is not None else range(num_units)
    if num_units >= lanes:
        return Share(tuple(order[j] for j in range(q, num_units, lanes)))
    return Share((order[q % num_units],), len(range(q % num_units, lanes, num_units)), q // num_units)


def source_units(source, lanes: int) -> list:
    """The units of a source for `lanes` lanes: ranges of documents with random access, else the
    source's own (files, pieces of files, stream splits)."""
    if source.random_access:
        return document_ranges(source.num_documents(), UNITS_PER_LANE * lanes)
    return source.units(lanes)


class LaneView:
    """Lane `lane` of `lanes`' share of `source`, epoch by epoch, as documents (texts, or token lists
    of a token folder) for a packing.TokenStream. `units`: source_units(source, lanes), shared by the
    lanes of a source. `seed`: shuffled (None: stored order); `block`: a streamed lane's shuffle block."""

    def __init__(self, source, units: list, lane: int, lanes: int, seed: int | None, block: int):
        self.source, self.units, self.lane, self.lanes = source, units, lane, lanes
        self.seed, self.block = seed, block
        self.name = source.name
        self.random_access = source.random_access
        self._index: tuple | None = None  # (epoch, its ranges, their ends, its permutation or None)

    def share(self, epoch: int) -> Share:
        return lane_share(self.lane, self.lanes, epoch, len(self.units), self.seed)

    def documents(self, epoch: int, start: int) -> Iterator:
        """The lane's documents of epoch `epoch`, in its order, from position `start`."""
        if self.random_access:
            for j in range(start, self.count(epoch)):
                yield self.source.document(self.document_index(epoch, j))
            return
        if self.seed is None:
            yield from self._stream(epoch, start)
            return
        first = start // self.block
        docs = self._stream(epoch, first * self.block)
        block_seed = derived_seed(derived_seed(self.seed, epoch), self.lane)
        for b in itertools.count(first):
            texts = list(itertools.islice(docs, self.block))
            if not texts:
                return
            order = Permutation(len(texts), block_seed, b)
            for j in range(start - first * self.block if b == first else 0, len(texts)):
                yield texts[order[j]]

    # --- random access: the epoch's documents by index ---

    def _epoch_index(self, epoch: int) -> tuple:
        if self._index is None or self._index[0] != epoch:
            share = self.share(epoch)
            ranges = [self.units[u][share.phase :: share.stride] for u in share.units]
            ends = list(itertools.accumulate(len(r) for r in ranges))
            n = ends[-1] if ends else 0
            order = Permutation(n, derived_seed(derived_seed(self.seed, epoch), self.lane), 0) if (
                self.seed is not None and n) else None
            self._index = (epoch, ranges, ends, order)
        return self._index

    def count(self, epoch: int) -> int:
        """The lane's number of documents in epoch `epoch` (random access only)."""
        ends = self._epoch_index(epoch)[2]
        return ends[-1] if ends else 0

    def document_index(self, epoch: int, j: int) -> int:
        """The source's index of the document at position j of the lane's epoch (random access only)."""
        _, ranges, ends, order = self._epoch_index(epoch)
        i = order[j] if order is not None else j
        c = bisect.bisect_right(ends, i)
        return ranges[c][i - (ends[c - 1] if c else 0)]

    # --- streams: units read in order, units before the position skipped by their counts ---

    def _stream(self, epoch: int, start: int) -> Iterator:
        share = self.share(epoch)
        for u in share.units:
            unit = self.units[u]
            known = self.source.unit_count(unit)
            if known is not None and len(range(share.phase, known, share.stride)) <= start:
                start -= len(range(share.phase, known, share.stride))  # skipped without reading it
                continue
            texts = self.source.unit_texts(unit, share.phase + start * share.stride)
            for n, text in enumerate(texts):
                if n % share.stride == 0:
                    yield text
            count = self.source.unit_count(unit)  # known now: counted by reading it
            start = max(0, start - len(range(share.phase, count, share.stride)))
