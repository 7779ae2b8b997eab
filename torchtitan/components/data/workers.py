"""Reading and tokenizing documents in worker processes (training.data_workers).

The documents of an epoch are read and tokenized in W forked processes, in chunks of 16
consecutive positions of the epoch's order dealt to the workers in turn, and come back in order.
Cutting windows stays in the trainer process, so the samples, their order and the state are those
of W = 0. Workers ignore the scheduler's signals (the trainer stops on them and shuts the workers
down) and end with their trainer.
"""

import gc
import multiprocessing
import multiprocessing.util
import signal
import warnings
from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, IterableDataset

from torchtitan.config.errors import UserError

if TYPE_CHECKING:
    from torchtitan.components.data.packing import TokenizedSource
    from torchtitan.components.data.shuffle import Permutation

DOCUMENTS_PER_CHUNK = 16  # a worker's unit of work: few enough that the first chunk comes quickly
CHUNKS_AHEAD = 4  # per worker: how far the workers read ahead of the trainer


class _WorkerError:
    """A UserError raised in a worker, sent to the trainer as an item so that it is raised there with
    its own message (a DataLoader re-raises a worker's exception with the worker's traceback in it)."""

    def __init__(self, message: str):
        self.message = message


class _DocumentChunks(IterableDataset):
    """The tokenized documents at positions start, start + 1, ... of an epoch's order (`order`: the
    epoch's permutation of `count` documents; None: stored order, to the end of the source), in chunks
    of DOCUMENTS_PER_CHUNK positions, as arrays of token ids. Worker w of W makes chunks w, w + W,
    w + 2W, ... A DataLoader asks its workers for items in turn and yields them in that order, so the
    chunks come in position order. In stored order each worker reads every document but tokenizes only
    its own; shuffled, it reads only its own."""

    def __init__(self, docs: "TokenizedSource", start: int, order: "Permutation | None", count: int | None):
        self.docs, self.start, self.order, self.count = docs, start, order, count

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = info.id, info.num_workers
        try:
            yield from self._chunks(worker, workers)
        except UserError as e:
            yield _WorkerError(str(e))

    def _chunks(self, worker: int, workers: int):
        def tokens(doc):
            return array("i", doc)  # compact to send, and sliced like a list

        # Each item is (layout, chunk): what the worker's copy of the source learned of its layout by
        # reading (documents per file), when it changed, rides with the chunk back to the trainer, whose
        # state saves it. A separate item would break the turn-by-turn order of the workers' items.
        if self.order is not None:
            for lo in range(self.start + worker * DOCUMENTS_PER_CHUNK, self.count, workers * DOCUMENTS_PER_CHUNK):
                positions = range(lo, min(lo + DOCUMENTS_PER_CHUNK, self.count))
                yield None, [tokens(self.docs.document(self.order[p])) for p in positions]
            return

        def own(position: int) -> bool:
            return (position - self.start) // DOCUMENTS_PER_CHUNK % workers == worker

        sent = self.docs.layout()

        def learned():
            nonlocal sent
            layout = self.docs.layout()
            if layout == sent:
                return None
            sent = layout
            return layout

        chunk = []
        for position, doc in enumerate(self.docs.documents(self.start, keep=own), self.start):
            if doc is not None:
                chunk.append(tokens(doc))
                if (position - self.start + 1) % DOCUMENTS_PER_CHUNK == 0:
                    yield learned(), chunk
                    chunk = []
        if chunk:
            yield learned(), chunk


def _as_is(item):
    return item


def _start_worker(worker_id: int):
    # A scheduler may signal every process of the job (SLURM does). The trainer stops on it after its
    # step (components/stop_signals.py), and may still read documents to save the data position; a
    # worker that died of it would fail that step. Workers end when the trainer is done with them.
    for sig in _WORKER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _WORKER_SIGNALS)  # blocked from the fork until now


_WORKER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)


def worker_documents(docs: "TokenizedSource", start: int, order, count: int | None, workers: int) -> Iterator:
    """What `TokenStream` reads from position `start` of an epoch, tokenized by `workers` processes."""
    with warnings.catch_warnings():
        # torch's advice on the worker count against the cores, repeated at every epoch; the user chose it.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        loader = DataLoader(
            _DocumentChunks(docs, start, order, count), batch_size=None, num_workers=workers,
            collate_fn=_as_is, prefetch_factor=CHUNKS_AHEAD, worker_init_fn=_start_worker,
            # Forked workers share the open source and tokenizer; nothing of torch runs in them.
            multiprocessing_context="fork" if "fork" in multiprocessing.get_all_start_methods() else None,
        )
        # Blocked while the workers fork, so that none dies of a signal before _start_worker.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _WORKER_SIGNALS)
        # Frozen while they fork, so that a worker never garbage-collects what it inherits: its copy of
        # another stream's abandoned reader would run that reader's shutdown from the wrong process.
        gc.freeze()
        try:
            chunks = iter(loader)
        finally:
            gc.unfreeze()
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    # The workers are stopped when the stream seeks or starts an epoch, when the stream is collected as
    # garbage, or when this process exits. The registered finalizer holds the iterator: one collected as
    # garbage along with its queues loses their feeder threads first, and its workers would never hear
    # the shutdown. At exit it runs before multiprocessing ends the process's children with SIGTERM,
    # which the workers ignore, and waits for them (also where this process is a multiprocessing child,
    # which runs no atexit handlers).
    stop = multiprocessing.util.Finalize(chunks, chunks._shutdown_workers, exitpriority=100)
    try:
        for item in chunks:
            if isinstance(item, _WorkerError):
                raise UserError(item.message)
            layout, chunk = item
            docs.load_layout(layout)
            yield from chunk
    finally:
        stop()
