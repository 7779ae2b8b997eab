"""Each rank's share of every step, as a resumable loader of (inputs, labels) batches."""

import logging
import warnings
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.data.packing import TokenizedSource, TokenStream
from torchtitan.components.data.sources import build_source
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError
from torchtitan.config.job_config import Training

logger = logging.getLogger(__name__)

# Version 2 added the document order (shuffle_seed, num_documents); version 1 states are in stored order.
STATE_VERSION = 2


def _order_name(seed: int | None) -> str:
    return "stored order" if seed is None else f"the order shuffled with seed {seed}"


class PackedDataset(IterableDataset):
    """This rank's samples of the packed stream, as tensors of seq_len + 1 token ids.

    `shuffle_seed`: read each epoch's documents in the order of a permutation seeded by
    (shuffle_seed, epoch) (the source needs random access); None: in stored order.
    """

    def __init__(self, source, tokenizer, seq_len: int, dp_rank: int, dp_degree: int, global_batch_size: int,
                 dataset_name: str = "", dataset_path: str = "", shuffle_seed: int | None = None,
                 workers: int = 0):
        # `source`: a text source, tokenized by `tokenizer`; with tokenizer None, a source of token lists
        # (a token file). A source of tokens with `check_window` checks each window this rank reads.
        # `workers`: processes that read and tokenize the text source's documents (0: this process).
        if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"bad data-parallel rank {dp_rank} of {dp_degree}")
        if workers < 0 or (workers and tokenizer is None):
            raise ValueError(f"{workers} data workers: only a text source (with a tokenizer) has workers")
        if global_batch_size < 1 or global_batch_size % dp_degree:
            raise ValueError(f"global batch size {global_batch_size} is not a positive multiple of {dp_degree}")
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        block = global_batch_size // dp_degree
        self._block_start = dp_rank * block  # this rank's block, as offsets inside a step
        self._block_end = (dp_rank + 1) * block
        self.dataset_name = dataset_name or source.name
        self.dataset_path = dataset_path
        docs = source if tokenizer is None else TokenizedSource(source, tokenizer)
        self._check_window = getattr(docs, "check_window", None)
        num_documents = docs.num_documents() if shuffle_seed is not None else None
        self._stream = TokenStream(docs, seq_len + 1, shuffle_seed, num_documents, workers)

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
        self._stream.skip(sample - self._stream.next_sample)

    def __iter__(self) -> Iterator[torch.Tensor]:
        # All progress lives in self._stream, so an abandoned iterator costs nothing and a state
        # loaded (or advanced by state_dict) between two samples is picked up here.
        while True:
            self._skip_to(self._next_owned(self._stream.next_sample))
            window = torch.tensor(self._stream.read(), dtype=torch.long)
            if self._check_window is not None:
                self._check_window(window)
            yield window

    def state_dict(self) -> dict:
        stream = self._stream
        # Past the end of this rank's block: read ahead to the step boundary, so that the state is
        # the same on every rank and loads under any data-parallel layout.
        if stream.next_sample % self.global_batch_size >= self._block_end:
            self._skip_to((stream.next_sample // self.global_batch_size + 1) * self.global_batch_size)
        return {
            "version": STATE_VERSION,
            "dataset": self.dataset_name,
            "dataset_path": self.dataset_path,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "shuffle_seed": stream.shuffle_seed,
            "num_documents": stream.num_documents,
            "next_sample": stream.next_sample,
            "epoch": stream.epoch,
            "doc_index": stream.doc_index,
            "token_offset": stream.offset,
            "carry": list(stream.carry),
        }

    def load_state_dict(self, state: dict):
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise UserError(
                f"the checkpoint's data loader state has version {version}; this torchtitan reads versions 1 and "
                f"{STATE_VERSION}: resume with the torchtitan that wrote it"
            )
        if state["dataset"] != self.dataset_name:
            raise UserError(
                f"the checkpoint's data state is for dataset {state['dataset']!r}, but training.dataset "
                f"is {self.dataset_name!r}; resume with the same dataset"
            )
        if state["dataset_path"] != self.dataset_path:
            logger.warning(
                "resuming data of %s from a state saved for %s: document positions are only "
                "meaningful if the data is the same", self.dataset_path, state["dataset_path"],
            )
        for key in ("seq_len", "global_batch_size"):
            # Explained to the user before launch (checkpoint.preflight_checkpoint).
            if state[key] != getattr(self, key):
                raise ValueError(f"data state saved with {key} = {state[key]}, loaded with {getattr(self, key)}")
        stream = self._stream
        saved_seed = state.get("shuffle_seed")  # version 1: stored order
        if saved_seed != stream.shuffle_seed:
            if saved_seed is None:
                fix = "resume with training.shuffle_documents = false"
            else:
                fix = f"resume with training.seed = {saved_seed}" + (
                    " and training.shuffle_documents = true" if stream.shuffle_seed is None else "")
            raise UserError(
                f"the checkpoint's data state reads documents in {_order_name(saved_seed)}, but this job would read "
                f"them in {_order_name(stream.shuffle_seed)}: its position means nothing in another order; {fix}"
            )
        saved_count = state.get("num_documents")
        if saved_count is not None and saved_count != stream.num_documents:
            logger.warning(
                "resuming shuffled data saved for %d documents with %d documents: the data changed, so the rest of "
                "epoch %d is in another order (documents may repeat or be left out)",
                saved_count, stream.num_documents, state["epoch"],
            )
        next_sample = state["next_sample"]
        if next_sample % self.global_batch_size and not self.owns(next_sample):
            raise UserError(
                f"the data state was saved in the middle of a step (at global sample {next_sample}) by "
                "another data-parallel rank or layout; only states saved at step boundaries load "
                "under a different layout"
            )
        if len(state["carry"]) > self.seq_len:
            raise ValueError(f"corrupt data state: {len(state['carry'])} carried tokens")
        stream.seek(next_sample, state["epoch"], state["doc_index"], state["token_offset"], state["carry"])


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
    if cfg.dataset == "tokens":
        from torchtitan.components.token_file import open_token_source

        # Documents already tokenized: shuffled by default where the text pipeline would shuffle their source.
        source, default_shuffle = open_token_source(cfg.dataset_path, tokenizer)
        shuffle = default_shuffle if cfg.shuffle_documents is None else cfg.shuffle_documents
        tokenizer = None
    else:
        source, shuffle = build_source(cfg)
    dataset = PackedDataset(
        source, tokenizer, cfg.seq_len, dp_rank, dp_degree, global_batch_size,
        dataset_name=cfg.dataset, dataset_path=cfg.dataset_path or "",
        shuffle_seed=cfg.seed if shuffle else None, workers=cfg.data_workers,
    )
    with warnings.catch_warnings():
        # torchdata 0.11 calls a torch API that torch now deprecates; nothing for users to act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            # Windows are cut in this process, so the state is the stream's position (workers only tokenize).
            dataset, batch_size=cfg.local_batch_size, num_workers=0, collate_fn=_collate, pin_memory=pin_memory,
        )
