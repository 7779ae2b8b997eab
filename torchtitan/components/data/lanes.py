"""Lanes: every source split so that each data-parallel rank reads only its share of it.

Global sample k is sample s = k // G of lane p = k % G, G being the global batch size in samples: lane
p supplies position p of every step. Data-parallel rank r of D owns positions [r*G/D, (r+1)*G/D) of
each step, so it owns those lanes and reads nothing else. Lanes depend on G alone, so the samples are
the same under every layout and data-worker count, and a state (every lane's position) loads under
any of them.

Each source is cut into units: a source read as a stream, into its files, or into pieces of them when
there are fewer files than lanes (files.FilesSource.units; a datasets stream into its shards); a
source with random access, into UNITS_PER_LANE x G ranges of documents, so that a lane's share is
spread over the whole source while the bytes it touches stay its own. The units are permuted once per
cycle of G epochs (seeded by (seed, e // G); stored order without a shuffle), and in epoch e lane p
takes those at positions q, q + G, q + 2G, ..., q = (p + e) mod G: each unit is read by one lane per
epoch, and in a cycle a lane takes every position class once, so it reads the whole source once.

With fewer units than lanes, the k lanes on one unit each take a different part of it, so that no two
lanes read the same tokens in an epoch (two lanes that started one document together would emit the
same windows, step after step):
- a unit of k or more documents is dealt round robin: part j reads its documents j, j + k, ...;
- a smaller one (one .txt file, a one-row parquet file, a corpus of fewer documents than lanes) is
  tokenized whole, once per process (kept in memory as int32 while the source is read), and its token
  stream is cut into k contiguous parts of equal length; part j is one document of the lane's epoch.
  Shuffled, the cut points rotate by a seeded offset each epoch (the parts wrap around the stream's
  end), so a lane's windows start elsewhere every epoch; in stored order they stay.

A lane's documents in an epoch are its units' documents in order. Shuffled, a lane with random access
reads them in the order of a seeded permutation; a streamed one in consecutive blocks of shuffle_block
documents, each read in the order of a permutation seeded by (seed, epoch, lane, block). A resume reads
its block again: the order needs no state of its own.
"""

import bisect
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from torchtitan.components.data.shuffle import Permutation, derived_seed

logger = logging.getLogger(__name__)

UNITS_PER_LANE = 16  # ranges of documents per lane of a source with random access


def document_ranges(n: int, target: int) -> list[range]:
    """range(n) cut into min(n, target) consecutive ranges of (nearly) equal length."""
    k = max(1, min(n, target))
    return [range(i * n // k, (i + 1) * n // k) for i in range(k)]


@dataclass(frozen=True)
class Share:
    """What a lane reads of a source in one epoch: units (indices into the source's unit list) and, of
    a unit it shares with other lanes (sharers > 1), part `part` of `sharers`."""

    units: tuple[int, ...]
    sharers: int = 1
    part: int = 0


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
    source's own (files, pieces of files, stream shards)."""
    if source.random_access:
        return document_ranges(source.num_documents(), UNITS_PER_LANE * lanes)
    return source.units(lanes)


def token_part(tokens: torch.Tensor, part: int, parts: int, offset: int) -> torch.Tensor:
    """Part `part` of `parts` contiguous parts of equal length (within a token) of a token stream whose
    cut points are moved `offset` tokens on, wrapping around its end."""
    n = len(tokens)
    lo, hi = offset + part * n // parts, offset + (part + 1) * n // parts
    if hi <= n:
        return tokens[lo:hi]
    if lo >= n:
        return tokens[lo - n : hi - n]
    return torch.cat([tokens[lo:], tokens[: hi - n]])


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


class SharedUnits:
    """A source's units for `lanes` lanes, and the token streams of those units that lanes share by
    tokens (fewer documents than sharers), tokenized once per process and kept while it reads them."""

    def __init__(self, source, lanes: int, encode: Callable, window_len: int):
        self.source, self.lanes, self.encode, self.window_len = source, lanes, encode, window_len
        self.units = source_units(source, lanes)
        self._tokens: dict[int, torch.Tensor] = {}
        self._by_tokens: dict[int, bool] = {}  # unit -> shared by tokens (else round robin by documents)
        # Whether a data state of version 4 reads the same here: no unit is shared, and the units are cut
        # as they were then.
        self.same_as_v4 = len(self.units) >= lanes and not getattr(source, "units_differ_from_v4", False)

    def describe(self) -> str:
        """How the source is cut, for the first log lines."""
        n, lanes = len(self.units), self.lanes
        if n >= lanes:
            return (
                f"{_count(n, 'unit')} for {_count(lanes, 'lane')} "
                f"(each lane reads whole units, about {n / lanes:.3g} per epoch)"
            )
        k = -(-lanes // n)
        how = (
            f"each lane reads a 1/{k} part of a document's tokens"
            if self.source.random_access
            else f"each lane reads every {k}-th document of its unit, or a 1/{k} part of its tokens if it holds fewer "
            "documents"
        )
        return f"{_count(n, 'unit')} for {lanes} lanes: up to {k} lanes share a unit ({how})"

    def by_tokens(self, u: int, sharers: int) -> bool:
        """Whether unit u is shared by tokens: it holds fewer documents than the lanes sharing it."""
        if u not in self._by_tokens:
            unit = self.units[u]
            if self.source.random_access:
                count = len(unit)
            else:
                count = self.source.unit_count(unit)
                if count is None:  # a stream: read as far as the answer needs
                    texts = self.source.unit_texts(unit, 0)
                    count = sum(1 for _ in itertools.islice(texts, sharers))
                    texts.close()
            self._by_tokens[u] = count < sharers
        return self._by_tokens[u]

    def tokens(self, u: int, sharers: int) -> torch.Tensor:
        """Unit u's documents, each encoded, as one token stream."""
        if u not in self._tokens:
            unit = self.units[u]
            if self.source.random_access:
                docs = (self.source.document(i) for i in unit)
            else:
                docs = self.source.unit_texts(unit, 0)
            pieces = [torch.tensor(self.encode(doc), dtype=torch.int32) for doc in docs]  # a copy: never the memory map
            tokens = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
            self._tokens[u] = tokens
            if 0 < len(tokens) < sharers * self.window_len:
                logger.warning(
                    "dataset %s is small for its lanes: a unit of %d tokens is shared by %d lanes, %d tokens each per "
                    "epoch, less than one sequence of seq_len + 1 = %d: each sample spans several epochs, and a step "
                    "repeats the unit's tokens about %.1f times; add data, or lower training.seq_len or the global "
                    "batch size",
                    self.source.name,
                    len(tokens),
                    sharers,
                    len(tokens) // sharers,
                    self.window_len,
                    sharers * self.window_len / len(tokens),
                )
        return self._tokens[u]


class LaneView:
    """Lane `lane` of `lanes`' share of a source, epoch by epoch, as documents of tokens (lists, or
    tensors of a token folder or of a shared unit's part) for a packing.TokenStream. `shared`: the
    source's SharedUnits, common to its lanes in a process; `encode`: a document to its tokens.
    `seed`: shuffled (None: stored order); `block`: a streamed lane's shuffle block."""

    def __init__(self, shared: SharedUnits, lane: int, lanes: int, seed: int | None, block: int):
        self.shared, self.lane, self.lanes = shared, lane, lanes
        self.source, self.units, self.encode = shared.source, shared.units, shared.encode
        self.seed, self.block = seed, block
        self.name = self.source.name
        self._index: tuple | None = None  # (epoch, its ranges, their ends, its permutation or None)

    def share(self, epoch: int) -> Share:
        return lane_share(self.lane, self.lanes, epoch, len(self.units), self.seed)

    def documents(self, epoch: int, start: int) -> Iterator:
        """The lane's documents of epoch `epoch`, in its order, from position `start`."""
        share = self.share(epoch)
        if share.sharers > 1 and self.shared.by_tokens(share.units[0], share.sharers):
            yield from self._part(epoch, share)[start:]
        elif self.source.random_access:
            for j in range(start, self.count(epoch)):
                yield self.encode(self.source.document(self.document_index(epoch, j)))
        else:
            yield from map(self.encode, self._shuffled_stream(epoch, start))

    def _part(self, epoch: int, share: Share) -> list:
        """The lane's part of a unit it shares by tokens, as its one document of the epoch (none if empty)."""
        u = share.units[0]
        tokens = self.shared.tokens(u, share.sharers)
        offset = 0
        if self.seed is not None and len(tokens):  # the same for every lane of the unit in this epoch
            offset = derived_seed(derived_seed(self.seed, epoch), u) % len(tokens)
        part = token_part(tokens, share.part, share.sharers, offset)
        return [part] if len(part) else []

    def _shuffled_stream(self, epoch: int, start: int) -> Iterator:
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
            ranges = [self.units[u][share.part :: share.sharers] for u in share.units]
            ends = list(itertools.accumulate(len(r) for r in ranges))
            n = ends[-1] if ends else 0
            order = (
                Permutation(n, derived_seed(derived_seed(self.seed, epoch), self.lane), 0)
                if (self.seed is not None and n)
                else None
            )
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
        stride, phase = share.sharers, share.part  # a shared unit of enough documents: dealt round robin
        for u in share.units:
            unit = self.units[u]
            known = self.source.unit_count(unit)
            if known is not None and len(range(phase, known, stride)) <= start:
                start -= len(range(phase, known, stride))  # skipped without reading it
                continue
            texts = self.source.unit_texts(unit, phase + start * stride)
            for n, text in enumerate(texts):
                if n % stride == 0:
                    yield text
            count = self.source.unit_count(unit)  # known now: counted by reading it
            start = max(0, start - len(range(phase, count, stride)))
