"""Each rank's share of every step, as a resumable loader of (inputs, labels) batches."""

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.data.lanes import LaneView, SharedUnits
from torchtitan.components.data.mixing import counts_at, integer_weights, schedule, source_at, source_kind
from torchtitan.components.data.packing import TokenStream, encode_document, too_small
from torchtitan.components.data.sources import build_source
from torchtitan.components.data.workers import LaneWorkers, next_lane
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.entries import parse_mix, split_text_field
from torchtitan.config.errors import UserError
from torchtitan.config.training_sections import Training

logger = logging.getLogger(__name__)

# Version 5: every lane's position (components/data/lanes.py), lanes that share a unit each reading a part
# of it. Version 4 had them share its documents round robin (and cut JSON lines into byte ranges even where
# one held no line): its positions mean the same where no source has fewer units than lanes, and load
# there. Version 2 added the document order, version 3 mixtures; their positions are in one stream per
# source, which lanes do not read.
STATE_VERSION = 5


def _order_name(seed: int | None) -> str:
    return "stored order" if seed is None else f"the order shuffled with seed {seed}"


class Source(Protocol):
    """What the loader reads of a source (sources.py): its documents from an index on, and with
    random_access their number."""

    name: str
    random_access: bool

    def documents(self, start: int) -> Iterator: ...

    def num_documents(self) -> int: ...


@dataclass
class Part:
    """One source of the packed stream, and what names it in a saved state."""

    source: Source  # documents: text (with a tokenizer), or token lists (a token folder)
    tokenizer: Tokenizer | None
    name: str  # training.dataset, or a mixture's SOURCE
    path: str
    shuffle_seed: int | None  # None: stored order
    shuffle_block: int  # a streamed lane's shuffle block
    _units: dict = field(default_factory=dict)  # (lanes, window length) -> the source's SharedUnits
    _logged_epoch: int = 0

    def units(self, lanes: int, seq_len: int) -> SharedUnits:
        """The source's units for `lanes` lanes (shared by its lanes in this process)."""
        if (lanes, seq_len) not in self._units:
            encode = _as_tokens if self.tokenizer is None else functools.partial(encode_document, self.tokenizer)
            self._units[lanes, seq_len] = SharedUnits(self.source, lanes, encode, seq_len + 1)
        return self._units[lanes, seq_len]

    def stream(self, lane: int, lanes: int, seq_len: int) -> TokenStream:
        """The token stream of lane `lane` of `lanes` of this source."""
        view = LaneView(self.units(lanes, seq_len), lane, lanes, self.shuffle_seed, self.shuffle_block)
        stream = TokenStream(view, seq_len + 1)
        stream.on_new_epoch = self._log_epoch
        return stream

    def check_fills_a_window(self, window_len: int, label: str, fix: str = "add data"):
        """Refuse now a source whose tokens do not fill one window of `window_len`. Every lane reads the whole
        source once in each cycle of `lanes` epochs (lanes.lane_share), shuffled or not, so such a source leaves
        every lane without its first sample, for any global batch; packing finds that only after a lane has read
        `lanes` epochs, after launch. This reads documents in stored order only until they fill a window: a
        few documents of a large corpus (a token folder knows its count)."""
        tokens = getattr(self.source, "num_tokens", None)
        if tokens is None:
            encode = _as_tokens if self.tokenizer is None else functools.partial(encode_document, self.tokenizer)
            tokens, documents = 0, self.source.documents(0)
            try:
                for document in documents:
                    tokens += len(encode(document))
                    if tokens >= window_len:
                        return
            finally:
                if hasattr(documents, "close"):
                    documents.close()  # releases an open file
        if tokens < window_len:
            raise too_small(label, tokens, window_len, fix)

    def check_window(self, window: torch.Tensor):
        check = getattr(self.source, "check_window", None)  # a token file's id check
        if check is not None:
            check(window)

    def layout(self) -> dict | None:
        layout = getattr(self.source, "layout", None)
        return layout() if layout is not None else None

    def load_layout(self, layout: dict | None):
        load = getattr(self.source, "load_layout", None)
        if layout and load is not None:
            load(layout)

    def _log_epoch(self, name: str, epoch: int, documents: int):
        if epoch > self._logged_epoch and documents:  # once per epoch and process, by its first lane there
            # (a lane's epoch without a document, on a source of fewer units than lanes, says nothing)
            self._logged_epoch = epoch
            logger.warning(
                "dataset %s: a lane read its share of epoch %d (%d document%s) and starts epoch %d (the data "
                "repeats%s)",
                self.name,
                epoch - 1,
                documents,
                "" if documents == 1 else "s",
                epoch,
                ", in a new order" if self.shuffle_seed is not None else "",
            )


def _as_tokens(document):
    return document  # a token folder's documents are tokens already


def open_part(
    source, tokenizer, name: str, path: str = "", shuffle_seed: int | None = None, shuffle_block: int = 10_000
) -> Part:
    """`source`: a text source, tokenized by `tokenizer`; with tokenizer None, a source of token lists (a
    token file). `shuffle_seed`: each lane reads its share of each epoch shuffled (lanes.py); None: in
    stored order."""
    return Part(source, tokenizer, name or source.name, path, shuffle_seed, shuffle_block)


class Lane:
    """Lane `index` of `lanes`: one token stream per source, and which source each sample comes from
    (sample s of the lane is global sample s * lanes + index; `pattern`: mixing.schedule, read by
    mixing.source_at)."""

    def __init__(self, index: int, streams: list[TokenStream], lanes: int, pattern=None):
        self.index, self.streams, self.lanes, self.pattern = index, streams, lanes, pattern

    @property
    def next_sample(self) -> int:
        return sum(stream.next_sample for stream in self.streams)

    def read(self) -> tuple[int, list[int]]:
        """(source index, window) of the lane's next sample."""
        i = 0 if self.pattern is None else source_at(self.pattern, self.next_sample * self.lanes + self.index)
        return i, self.streams[i].read()

    def position(self) -> list[dict]:
        return [stream.position() for stream in self.streams]

    def seek(self, position: list[dict]):
        for stream, p in zip(self.streams, position):
            stream.seek(p)


class PackedDataset(IterableDataset):
    """This rank's samples of the packed stream, as tensors of seq_len + 1 token ids.

    `parts`: one source, or with `weights` (integers, mixing.integer_weights) and `specs` a mixture.
    The rank reads its lanes (lanes.py): of each step, positions [r*G/D, (r+1)*G/D). `workers`: processes
    that read the lanes (0: this one). `gather`: all ranks' objects from each rank's (an all-gather),
    for a state that holds every lane; None: the state holds this rank's lanes. `document_end_id`: the
    token that ends every document of the stream (the EOS packing writes), where block-causal attention
    reads document boundaries; None: unknown.
    """

    def __init__(
        self,
        parts: list[Part],
        seq_len: int,
        dp_rank: int,
        dp_degree: int,
        global_batch_size: int,
        weights: list[int] | None = None,
        specs: list[str] | None = None,
        workers: int = 0,
        gather: Callable[[object], list] | None = None,
        document_end_id: int | None = None,
    ):
        if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"bad data-parallel rank {dp_rank} of {dp_degree}")
        if global_batch_size < 1 or global_batch_size % dp_degree:
            raise ValueError(f"global batch size {global_batch_size} is not a positive multiple of {dp_degree}")
        if (weights is None) != (len(parts) == 1 and specs is None):
            raise ValueError("one part without weights, or a mixture with weights and specs")
        if workers < 0:
            raise ValueError(f"{workers} data workers")
        self.seq_len, self.global_batch_size, self.dp_degree = seq_len, global_batch_size, dp_degree
        self.parts, self.weights, self.specs = parts, weights, specs
        self.pattern = schedule(weights) if weights is not None else None
        per_rank = global_batch_size // dp_degree
        self.lanes = [
            Lane(p, [part.stream(p, global_batch_size, seq_len) for part in parts], global_batch_size, self.pattern)
            for p in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        ]
        self.workers, self.gather = workers, gather
        self.document_end_id = document_end_id
        if dp_rank == 0:
            for i, part in enumerate(parts):
                source = part.source
                n = source.num_documents() if source.random_access else None
                documents = "" if n is None else f"{n:,} document{'' if n == 1 else 's'}, "
                # A mixture's source says its share of the samples (its weight over the weights' sum).
                share = f" ({weights[i] / sum(weights):.1%} of the samples)" if weights is not None else ""
                logger.info(
                    "data: %s%s: %s%s", part.name, share, documents, part.units(global_batch_size, seq_len).describe()
                )
            # Data-parallel rank 0, and run_train.sh's preflight (which builds rank 0's loader before launch),
            # refuse a source that cannot fill one sequence before any model is built, each of a mixture.
            for part in parts:
                if weights is not None:
                    part.check_fills_a_window(
                        seq_len + 1,
                        f"training.dataset_mix source {part.name!r}",
                        "add data to it, remove it from training.dataset_mix",
                    )
                else:
                    at = f" at {part.path}" if part.path else ""
                    part.check_fills_a_window(seq_len + 1, f"dataset {part.name}{at}")
        self._pool: LaneWorkers | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        # All progress lives in the lanes, so an abandoned iterator costs nothing and a state loaded
        # between two samples is picked up here.
        while True:
            lane = next_lane(self.lanes)
            if self.workers:
                if self._pool is None:
                    self._pool = LaneWorkers(self.lanes, self.parts, self.workers)
                i, tokens = self._pool.read(lane)
            else:
                i, tokens = lane.read()
            window = torch.tensor(tokens, dtype=torch.long)
            self.parts[i].check_window(window)
            yield window

    def worker_pids(self) -> list[int]:
        return self._pool.pids() if self._pool is not None else []

    def _stop_workers(self):
        if self._pool is not None:
            self._pool.stop()
            self._pool = None

    def mixture_metrics(self, samples: int) -> dict[str, float]:
        """A mixture's share of each source over the first `samples` global samples (data_share/I) and the
        epoch this rank's lanes are in at least, per source (data_epoch/I); nothing for one source."""
        if self.weights is None:
            return {}
        assert self.pattern is not None  # a mixture's schedule
        counts = counts_at(self.weights, self.pattern, samples)
        metrics = {f"data_share/{i}": c / max(samples, 1) for i, c in enumerate(counts)}
        metrics.update(
            {f"data_epoch/{i}": min(lane.streams[i].epoch for lane in self.lanes) for i in range(len(self.parts))}
        )
        return metrics

    def state_dict(self) -> dict:
        local = {
            "lanes": {lane.index: lane.position() for lane in self.lanes},
            "layouts": [part.layout() for part in self.parts],
        }
        lanes, layouts = {}, [None] * len(self.parts)
        for share in self.gather(local) if self.gather is not None else [local]:
            lanes.update(share["lanes"])
            layouts = [_merge_layouts(a, b) for a, b in zip(layouts, share["layouts"])]
        state = {
            "version": STATE_VERSION,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "dp_degree": self.dp_degree,
            "next_sample": sum(stream["next_sample"] for position in lanes.values() for stream in position),
            "lanes": [[p, lanes[p]] for p in sorted(lanes)],
        }
        sources = [_part_state(part, layout) for part, layout in zip(self.parts, layouts)]
        if self.weights is None:
            return {**state, **sources[0]}
        assert self.specs is not None  # a mixture names its sources
        mixture = [{"source": spec, "weight": w, **src} for spec, w, src in zip(self.specs, self.weights, sources)]
        return {**state, "mixture": mixture}

    def load_state_dict(self, state: dict):
        version = state.get("version")
        if version in (1, 2, 3):
            raise UserError(
                f"the checkpoint's data loader state has version {version}, from before each rank read only its "
                f"share of the data (version {STATE_VERSION}): its positions are in another sample order; resume "
                "with the torchtitan that wrote it, or start the data from the beginning with "
                "checkpoint.exclude_from_loading = ['dataloader']"
            )
        if version == 4:
            changed = [
                part.name for part in self.parts if not part.units(self.global_batch_size, self.seq_len).same_as_v4
            ]
            if changed:
                raise UserError(
                    f"the checkpoint's data loader state has version 4, from before lanes that share a source's unit "
                    f"read different parts of it (version {STATE_VERSION}); {', '.join(changed)} has fewer units than "
                    "lanes, so its saved positions are in another sample order; resume with the torchtitan that wrote "
                    "it, or start the data from the beginning with checkpoint.exclude_from_loading = ['dataloader']"
                )
        elif version != STATE_VERSION:
            raise UserError(
                f"the checkpoint's data loader state has version {version}; this torchtitan reads version "
                f"{STATE_VERSION}: resume with the torchtitan that wrote it"
            )
        for key in ("seq_len", "global_batch_size"):
            # Explained to the user before launch (checkpoint.preflight_checkpoint).
            if state[key] != getattr(self, key):
                raise ValueError(f"data state saved with {key} = {state[key]}, loaded with {getattr(self, key)}")
        saved_mix, mix = state.get("mixture"), self._describe_mixture()
        saved = "one dataset" if saved_mix is None else _mixture_name([(m["weight"], m["source"]) for m in saved_mix])
        if saved != mix:
            raise UserError(
                f"the checkpoint's data state is for {saved}, but this job reads {mix}: positions in one mean nothing "
                "in the other; resume with the data it was saved with, or start the data from the beginning with "
                "checkpoint.exclude_from_loading = ['dataloader']"
            )
        lanes = {p: position for p, position in state["lanes"]}
        missing = [lane.index for lane in self.lanes if lane.index not in lanes]
        if missing:
            raise UserError(
                f"the data state holds the positions of lanes {_ranges(sorted(lanes))}, but this rank reads lanes "
                f"{_ranges([lane.index for lane in self.lanes])}: it was saved by one rank of another layout; "
                "resume from a checkpoint the trainer saved"
            )
        if len({sum(s["next_sample"] for s in position) for position in lanes.values()}) > 1 and (
            state["dp_degree"] != self.dp_degree
        ):
            raise UserError(
                f"the data state was saved in the middle of a step (its lanes are at different samples) under "
                f"data-parallel degree {state['dp_degree']}; only states saved at step boundaries load under a "
                "different layout"
            )
        for part, part_state in zip(self.parts, [state] if saved_mix is None else saved_mix):
            _check_part(part, part_state)
            part.load_layout(part_state.get("source_layout"))
        for lane in self.lanes:
            position = lanes[lane.index]
            if any(len(p["carry"]) > self.seq_len for p in position):
                raise ValueError("corrupt data state: more carried tokens than a window")
            lane.seek(position)
        self._stop_workers()

    def _describe_mixture(self) -> str:
        if self.weights is None:
            return "one dataset"
        assert self.specs is not None  # a mixture names its sources
        return _mixture_name(list(zip(self.weights, self.specs)))


def _ranges(indices: list[int]) -> str:
    return f"{indices[0]}-{indices[-1]}" if indices else "none"


def _merge_layouts(a: dict | None, b: dict | None) -> dict | None:
    """Two ranks' layouts of one source: each section's entries together."""
    if not a or not b:
        return a or b
    return {key: {**a.get(key, {}), **b.get(key, {})} for key in a.keys() | b.keys()}


def _mixture_name(entries: list[tuple[int, str]]) -> str:
    total = sum(w for w, _ in entries)
    return "the mixture " + ", ".join(f"{Fraction(w, total)}:{spec}" for w, spec in entries)


def _part_state(part: Part, layout: dict | None) -> dict:
    return {
        # Documents per unit learned by reading: a resume skips those units without reading them.
        "source_layout": layout,
        "dataset": part.name,
        "dataset_path": part.path,
        "shuffle_seed": part.shuffle_seed,
        "shuffle_block": part.shuffle_block,
    }


def _check_part(part: Part, state: dict):
    if state["dataset"] != part.name:
        raise UserError(
            f"the checkpoint's data state is for dataset {state['dataset']!r}, but training.dataset "
            f"is {part.name!r}; resume with the same dataset"
        )
    if state["dataset_path"] != part.path:
        logger.warning(
            "resuming data of %s from a state saved for %s: document positions are only "
            "meaningful if the data is the same",
            part.path,
            state["dataset_path"],
        )
    saved_seed = state["shuffle_seed"]
    if saved_seed != part.shuffle_seed:
        if saved_seed is None:
            fix = "resume with training.shuffle_documents = false"
        else:
            fix = f"resume with training.seed = {saved_seed}" + (
                " and training.shuffle_documents = true" if part.shuffle_seed is None else ""
            )
        raise UserError(
            f"the checkpoint's data state reads documents of {part.name} in {_order_name(saved_seed)}, but this job "
            f"would read them in {_order_name(part.shuffle_seed)}: its position means nothing in another order; {fix}"
        )
    if part.shuffle_seed is not None and state["shuffle_block"] != part.shuffle_block and not part.source.random_access:
        raise UserError(
            f"the checkpoint's data state reads the streamed files of {part.name} shuffled in blocks of "
            f"{state['shuffle_block']} documents, but this job would use {part.shuffle_block}: its position means "
            f"nothing in another order; resume with training.shuffle_buffer = {state['shuffle_block']}"
        )


def _collate(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.stack(windows)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def build_dataloader(
    cfg: Training,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_degree: int,
    global_batch_size: int,
    pin_memory: bool = False,
    gather: Callable[[object], list] | None = None,
) -> StatefulDataLoader:
    """Batches (inputs, labels), each int64 [local_batch_size, seq_len], of this rank's samples; in
    page-locked memory with `pin_memory` (for non-blocking copies to a CUDA device). `gather`: an
    all-gather of objects over the ranks, so that state_dict() holds every rank's lanes (None: this
    rank's, as for one process).

    `global_batch_size` is resolved: a positive multiple of local_batch_size x dp_degree.
    The loader never ends (the data loops). To resume, call loader.load_state_dict(state) and
    then iter(loader): the state is applied when the next iterator is created.
    """
    if global_batch_size % (cfg.local_batch_size * dp_degree):
        raise ValueError(
            f"global batch size {global_batch_size} is not a multiple of local_batch_size "
            f"{cfg.local_batch_size} x dp degree {dp_degree}"
        )
    if cfg.dataset_mix:
        fractions, specs = parse_mix(cfg.dataset_mix, "training.dataset_mix")
        parts = [_open_mix_part(cfg, tokenizer, spec, dp_rank == 0) for spec in specs]
        dataset = PackedDataset(
            parts,
            cfg.seq_len,
            dp_rank,
            dp_degree,
            global_batch_size,
            weights=integer_weights(fractions),
            specs=specs,
            workers=cfg.data_workers,
            gather=gather,
            document_end_id=tokenizer.eos_id,
        )
    else:
        source, text_tokenizer, shuffle = open_source(cfg, tokenizer, dp_rank == 0)
        part = open_part(
            source,
            text_tokenizer,
            cfg.dataset,
            cfg.dataset_path or "",
            cfg.seed if shuffle else None,
            cfg.shuffle_buffer,
        )
        dataset = PackedDataset(
            [part],
            cfg.seq_len,
            dp_rank,
            dp_degree,
            global_batch_size,
            workers=cfg.data_workers,
            gather=gather,
            document_end_id=tokenizer.eos_id,
        )
    with warnings.catch_warnings():
        # torchdata 0.11 calls a torch API that torch now deprecates; nothing for users to act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            # The dataset's own workers read the lanes (workers.py), and its state is the lanes' positions.
            dataset,
            batch_size=cfg.local_batch_size,
            num_workers=0,
            collate_fn=_collate,
            pin_memory=pin_memory,
        )


def open_source(cfg: Training, tokenizer: Tokenizer, check_all: bool = True):
    """(source, the tokenizer to encode it with or None for a token folder, whether to shuffle it) for
    training.dataset and dataset_path, checked now: every rank fails the same way at start (and
    run_train.sh's preflight before launch). `check_all`: every file of local data (data-parallel rank
    0 and the preflight), else the first and the others when read."""
    if cfg.dataset != "tokens":
        source, shuffle = build_source(cfg, check_all)
        return source, tokenizer, shuffle
    from torchtitan.components.data.token_folder import open_token_source

    source = open_token_source(cfg.dataset_path, tokenizer)
    return source, None, True if cfg.shuffle_documents is None else cfg.shuffle_documents


def _open_mix_part(cfg: Training, tokenizer: Tokenizer, spec: str, check_all: bool) -> Part:
    """One source of training.dataset_mix, opened as training.dataset would open it; its messages name
    the mixture's entry instead of the keys a mixture does not use."""
    try:
        source_spec, field = split_text_field(spec)  # SOURCE#FIELD: the source's own text field
        dataset, path = source_kind(source_spec)
        as_single = dataclasses.replace(
            cfg, dataset=dataset, dataset_path=path, dataset_mix=[], dataset_text_field=field or cfg.dataset_text_field
        )
        source, text_tokenizer, shuffle = open_source(as_single, tokenizer, check_all)
        return open_part(source, text_tokenizer, spec, path or "", cfg.seed if shuffle else None, cfg.shuffle_buffer)
    except UserError as e:
        message = (
            str(e).replace("set training.dataset_path to", "change it to").replace("training.dataset_path", "the path")
        )
        raise UserError(f"training.dataset_mix source {spec!r}: {message}") from None
