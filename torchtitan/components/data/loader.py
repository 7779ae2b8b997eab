"""Each rank's share of every step, as a resumable loader of (inputs, labels) batches."""

import dataclasses
import logging
from fractions import Fraction
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.data.mixing import counts_after, integer_weights, next_source, source_kind
from torchtitan.components.data.packing import TokenizedSource, TokenStream
from torchtitan.components.data.sources import build_source
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError
from torchtitan.config.job_config import Training, parse_mix

logger = logging.getLogger(__name__)

# Version 2 added the document order (shuffle_seed, num_documents), version 3 mixtures (a state with a
# "mixture" list of the sources' states); version 1 states are in stored order.
STATE_VERSION = 3


def _order_name(seed: int | None) -> str:
    return "stored order" if seed is None else f"the order shuffled with seed {seed}"


@dataclass
class Part:
    """One source of the packed stream: its windows, and what names it in a saved state."""

    stream: TokenStream
    name: str  # training.dataset, or a mixture's SOURCE
    path: str
    check_window: Callable | None  # a token file's per-window id check


def open_part(source, tokenizer, seq_len: int, name: str, path: str = "", shuffle_seed: int | None = None,
              workers: int = 0, shuffle_block: int = 10_000) -> Part:
    """`source`: a text source, tokenized by `tokenizer`; with tokenizer None, a source of token lists (a
    token file). `shuffle_seed`: read each epoch's documents in the order of a permutation seeded by
    (shuffle_seed, epoch), or for local files read as streams their files permuted and their documents
    permuted in blocks of `shuffle_block` positions; None: in stored order. `workers`: processes
    that read and tokenize the text source's documents (0: this process)."""
    if workers < 0 or (workers and tokenizer is None):
        raise ValueError(f"{workers} data workers: only a text source (with a tokenizer) has workers")
    docs = source if tokenizer is None else TokenizedSource(source, tokenizer)
    streamed = shuffle_seed is not None and not docs.random_access
    num_documents = docs.num_documents() if shuffle_seed is not None and not streamed else None
    stream = TokenStream(docs, seq_len + 1, shuffle_seed, num_documents, workers,
                         shuffle_block if streamed else None)
    return Part(stream, name or source.name, path, getattr(docs, "check_window", None))


class PackedDataset(IterableDataset):
    """This rank's samples of the packed stream, as tensors of seq_len + 1 token ids.

    `parts`: one source, or with `weights` (integers, mixing.integer_weights) a mixture, whose sample k
    comes from the source mixing.next_source picks. Each part's stream counts the windows it has passed
    (read, or skipped as another rank's), so the global position is their sum.
    """

    def __init__(self, parts: list[Part], seq_len: int, dp_rank: int, dp_degree: int, global_batch_size: int,
                 weights: list[int] | None = None, specs: list[str] | None = None):
        if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"bad data-parallel rank {dp_rank} of {dp_degree}")
        if global_batch_size < 1 or global_batch_size % dp_degree:
            raise ValueError(f"global batch size {global_batch_size} is not a positive multiple of {dp_degree}")
        if (weights is None) != (len(parts) == 1 and specs is None):
            raise ValueError("one part without weights, or a mixture with weights and specs")
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        block = global_batch_size // dp_degree
        self._block_start = dp_rank * block  # this rank's block, as offsets inside a step
        self._block_end = (dp_rank + 1) * block
        self.parts, self.weights, self.specs = parts, weights, specs

    @property
    def next_sample(self) -> int:
        return sum(part.stream.next_sample for part in self.parts)

    def _counts(self) -> list[int]:
        return [part.stream.next_sample for part in self.parts]

    def owns(self, sample: int) -> bool:
        return self._block_start <= sample % self.global_batch_size < self._block_end

    def _next_owned(self, sample: int) -> int:
        """The first global sample >= `sample` that this rank owns."""
        step, pos = divmod(sample, self.global_batch_size)
        if pos < self._block_start:
            return step * self.global_batch_size + self._block_start
        if pos < self._block_end:
            return sample
        return (step + 1) * self.global_batch_size + self._block_start

    def _skip_to(self, sample: int):
        if self.weights is None:
            self.parts[0].stream.skip(sample - self.next_sample)
            return
        before = self._counts()
        after = counts_after(self.weights, before, sample - sum(before))
        for part, a, b in zip(self.parts, after, before):
            part.stream.skip(a - b)

    def __iter__(self) -> Iterator[torch.Tensor]:
        # All progress lives in the parts' streams, so an abandoned iterator costs nothing and a state
        # loaded (or advanced by state_dict) between two samples is picked up here.
        while True:
            self._skip_to(self._next_owned(self.next_sample))
            part = self.parts[0 if self.weights is None else next_source(self.weights, self._counts())]
            window = torch.tensor(part.stream.read(), dtype=torch.long)
            if part.check_window is not None:
                part.check_window(window)
            yield window

    def mixture_metrics(self, samples: int) -> dict[str, float]:
        """A mixture's share of each source over the first `samples` global samples (data_share/I) and the
        epoch each source is in (data_epoch/I); nothing for one source."""
        if self.weights is None:
            return {}
        counts = counts_after(self.weights, self._counts(), max(0, samples - self.next_sample))
        metrics = {f"data_share/{i}": c / max(samples, 1) for i, c in enumerate(counts)}
        metrics.update({f"data_epoch/{i}": part.stream.epoch for i, part in enumerate(self.parts)})
        return metrics

    def state_dict(self) -> dict:
        # Past the end of this rank's block: read ahead to the step boundary, so that the state is
        # the same on every rank and loads under any data-parallel layout.
        if self.next_sample % self.global_batch_size >= self._block_end:
            self._skip_to((self.next_sample // self.global_batch_size + 1) * self.global_batch_size)
        state = {"version": STATE_VERSION, "seq_len": self.seq_len, "global_batch_size": self.global_batch_size}
        if self.weights is None:
            return {**state, **_part_state(self.parts[0])}
        mixture = [{"source": spec, "weight": w, **_part_state(part)}
                   for spec, w, part in zip(self.specs, self.weights, self.parts)]
        return {**state, "next_sample": self.next_sample, "mixture": mixture}

    def load_state_dict(self, state: dict):
        version = state.get("version")
        if version not in (1, 2, STATE_VERSION):
            raise UserError(
                f"the checkpoint's data loader state has version {version}; this torchtitan reads versions 1 to "
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
        next_sample = state["next_sample"]
        if next_sample % self.global_batch_size and not self.owns(next_sample):
            raise UserError(
                f"the data state was saved in the middle of a step (at global sample {next_sample}) by "
                "another data-parallel rank or layout; only states saved at step boundaries load "
                "under a different layout"
            )
        for part, part_state in zip(self.parts, [state] if saved_mix is None else saved_mix):
            _load_part(part, part_state, self.seq_len)

    def _describe_mixture(self) -> str:
        return "one dataset" if self.weights is None else _mixture_name(list(zip(self.weights, self.specs)))


def _mixture_name(entries: list[tuple[int, str]]) -> str:
    total = sum(w for w, _ in entries)
    return "the mixture " + ", ".join(f"{Fraction(w, total)}:{spec}" for w, spec in entries)


def _part_state(part: Part) -> dict:
    stream = part.stream
    layout = getattr(stream.source, "layout", None)
    return {
        # Documents per file learned by reading: a resume skips those files without reading them.
        "source_layout": layout() if layout is not None else None,
        "dataset": part.name,
        "dataset_path": part.path,
        "shuffle_seed": stream.shuffle_seed,
        "num_documents": stream.num_documents,
        "shuffle_block": stream.shuffle_block,
        "next_sample": stream.next_sample,
        "epoch": stream.epoch,
        "doc_index": stream.doc_index,
        "token_offset": stream.offset,
        "carry": list(stream.carry),
    }


def _load_part(part: Part, state: dict, seq_len: int):
    if state["dataset"] != part.name:
        raise UserError(
            f"the checkpoint's data state is for dataset {state['dataset']!r}, but training.dataset "
            f"is {part.name!r}; resume with the same dataset"
        )
    if state["dataset_path"] != part.path:
        logger.warning(
            "resuming data of %s from a state saved for %s: document positions are only "
            "meaningful if the data is the same", part.path, state["dataset_path"],
        )
    stream = part.stream
    saved_seed = state.get("shuffle_seed")  # version 1: stored order
    if saved_seed != stream.shuffle_seed:
        if saved_seed is None:
            fix = "resume with training.shuffle_documents = false"
        else:
            fix = f"resume with training.seed = {saved_seed}" + (
                " and training.shuffle_documents = true" if stream.shuffle_seed is None else "")
        raise UserError(
            f"the checkpoint's data state reads documents of {part.name} in {_order_name(saved_seed)}, but this job "
            f"would read them in {_order_name(stream.shuffle_seed)}: its position means nothing in another order; {fix}"
        )
    saved_block = state.get("shuffle_block")
    if saved_block != stream.shuffle_block:
        raise UserError(
            f"the checkpoint's data state reads the streamed files of {part.name} shuffled in blocks of {saved_block} "
            f"documents, but this job would use {stream.shuffle_block}: its position means nothing in another order; "
            f"resume with training.shuffle_buffer = {saved_block}"
        )
    saved_count = state.get("num_documents")
    if saved_count is not None and saved_count != stream.num_documents:
        logger.warning(
            "resuming shuffled data saved for %d documents with %d documents: the data changed, so the rest of "
            "epoch %d is in another order (documents may repeat or be left out)",
            saved_count, stream.num_documents, state["epoch"],
        )
    if len(state["carry"]) > seq_len:
        raise ValueError(f"corrupt data state: {len(state['carry'])} carried tokens")
    load_layout = getattr(stream.source, "load_layout", None)
    if load_layout is not None:
        load_layout(state.get("source_layout"))
    stream.seek(state["next_sample"], state["epoch"], state["doc_index"], state["token_offset"], state["carry"])


def _collate(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.stack(windows)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def build_dataloader(
    cfg: Training, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, global_batch_size: int,
    pin_memory: bool = False,
) -> StatefulDataLoader:
    """Batches (inputs, labels), each int64 [local_batch_size, seq_len], of this rank's samples; in
    page-locked memory with `pin_memory` (for non-blocking copies to a CUDA device).

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
        parts = [_open_mix_part(cfg, tokenizer, spec) for spec in specs]
        dataset = PackedDataset(parts, cfg.seq_len, dp_rank, dp_degree, global_batch_size,
                                weights=integer_weights(fractions), specs=specs)
    else:
        source, text_tokenizer, shuffle = open_source(cfg, tokenizer)
        part = open_part(source, text_tokenizer, cfg.seq_len, cfg.dataset, cfg.dataset_path or "",
                         cfg.seed if shuffle else None, cfg.data_workers, cfg.shuffle_buffer)
        dataset = PackedDataset([part], cfg.seq_len, dp_rank, dp_degree, global_batch_size)
    with warnings.catch_warnings():
        # torchdata 0.11 calls a torch API that torch now deprecates; nothing for users to act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            # Windows are cut in this process, so the state is the stream's position (workers only tokenize).
            dataset, batch_size=cfg.local_batch_size, num_workers=0, collate_fn=_collate, pin_memory=pin_memory,
        )


def open_source(cfg: Training, tokenizer: Tokenizer):
    """(source, the tokenizer to encode it with or None for a token folder, whether to shuffle it) for
    training.dataset and dataset_path, checked now: every rank fails the same way at start (and
    run_train.sh's preflight before launch)."""
    if cfg.dataset != "tokens":
        source, shuffle = build_source(cfg)
        return source, tokenizer, shuffle
    from torchtitan.components.token_file import open_token_source

    # Documents already tokenized: shuffled by default where the text pipeline would shuffle their source.
    source, default_shuffle = open_token_source(cfg.dataset_path, tokenizer)
    return source, None, default_shuffle if cfg.shuffle_documents is None else cfg.shuffle_documents


def _open_mix_part(cfg: Training, tokenizer: Tokenizer, spec: str) -> Part:
    """One source of training.dataset_mix, opened as training.dataset would open it; its messages name
    the mixture's entry instead of the keys a mixture does not use."""
    try:
        dataset, path = source_kind(spec)
        as_single = dataclasses.replace(cfg, dataset=dataset, dataset_path=path, dataset_mix=[])
        source, text_tokenizer, shuffle = open_source(as_single, tokenizer)
        workers = cfg.data_workers if text_tokenizer is not None else 0  # a token folder has nothing to tokenize
        return open_part(source, text_tokenizer, cfg.seq_len, spec, path or "", cfg.seed if shuffle else None,
                         workers, cfg.shuffle_buffer)
    except UserError as e:
        message = str(e).replace("set training.dataset_path to", "change it to").replace(
            "training.dataset_path", "the path")
        raise UserError(f"training.dataset_mix source {spec!r}: {message}") from None

