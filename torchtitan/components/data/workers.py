"""Lanes read in worker processes (training.data_workers).

Worker w of W reads lanes w, w + W, ... of this rank's lanes (components/data/lanes.py): it reads and
tokenizes their documents and cuts their windows, in the order the trainer takes them (the lane with
the fewest samples first, ties to the lower lane), and sends each window with its lane's position
after it and what its sources learned of their layout, so that the trainer's state is that of W = 0
and the samples are the same for every W. Its queue holds WINDOWS_AHEAD windows per lane. Workers
ignore the scheduler's signals (the trainer stops on them and shuts the workers down) and end with
their trainer.
"""

import gc
import logging
import multiprocessing
import multiprocessing.util
import os
import queue
import signal
import traceback
from array import array

from torchtitan.config.errors import UserError

logger = logging.getLogger(__name__)

WINDOWS_AHEAD = 4  # per lane: how far a worker reads ahead of the trainer
_POLL_S = 1.0  # how often a waiting trainer checks its worker, and a blocked worker its trainer

_WORKER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)


class _WorkerError:
    """An error in a worker, sent to the trainer as an item: a UserError is raised there with its own
    message, anything else with the worker's traceback."""

    def __init__(self, message: str, user: bool):
        self.message, self.user = message, user


def next_lane(lanes: list):
    """The lane the trainer takes a sample of next: the one with the fewest samples, then the lowest."""
    return min(lanes, key=lambda lane: (lane.next_sample, lane.index))


def _put(q, item, parent: int):
    while True:
        try:
            q.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            if os.getppid() != parent:  # the trainer is gone: nobody will read this
                os._exit(0)


def _work(lanes: list, sources: list, q, parent: int):
    # A scheduler may signal every process of the job (SLURM does). The trainer stops on it after its
    # step (components/stop_signals.py) and may still need windows; a worker that died of it would fail
    # that step. Workers end when the trainer stops them.
    for sig in _WORKER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _WORKER_SIGNALS)  # blocked from the fork until now
    sent = [source.layout() for source in sources]
    try:
        while True:
            lane = next_lane(lanes)
            index, window = lane.read()
            layouts = [source.layout() for source in sources]
            changed = [new if new != old else None for new, old in zip(layouts, sent)]
            sent = layouts
            _put(q, (lane.index, index, array("q", window), lane.position(), changed), parent)
    except UserError as e:
        _put(q, _WorkerError(str(e), user=True), parent)
    except Exception:
        _put(q, _WorkerError(traceback.format_exc(), user=False), parent)


class LaneWorkers:
    """`workers` forked processes reading `lanes` (this rank's, in lane order; at most one process per
    lane), whose sources are `sources` (shared by the lanes). The lanes' positions are the trainer's:
    each window taken moves its lane there."""

    def __init__(self, lanes: list, sources: list, workers: int):
        self.lanes, self.sources = lanes, sources
        n = min(workers, len(lanes))
        if n < workers:
            logger.warning(
                "training.data_workers = %d, but this rank reads %d lane(s) (a worker reads whole lanes): "
                "starting %d worker(s)",
                workers,
                len(lanes),
                n,
            )
        self.owner = {lane.index: w % n for w, lane in enumerate(lanes)}
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        self.queues = [context.Queue(WINDOWS_AHEAD * len(lanes[w::n])) for w in range(n)]
        self.processes = [
            context.Process(
                target=_work,
                args=(lanes[w::n], sources, self.queues[w], os.getpid()),
                daemon=True,
                name=f"data-worker-{w}",
            )
            for w in range(n)
        ]
        # Blocked while the workers fork, so that none dies of a signal before it ignores them. GC
        # frozen, so that a worker never collects what it inherits: its copy of another stream's
        # abandoned reader would run that reader's shutdown from the wrong process.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _WORKER_SIGNALS)
        gc.freeze()
        try:
            for process in self.processes:
                process.start()
        finally:
            gc.unfreeze()
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        # Stopped when the loader seeks or is collected, or when this process exits: multiprocessing
        # ends a process's children at exit with SIGTERM, which workers ignore, so this runs first.
        self._stop = multiprocessing.util.Finalize(self, _kill, args=(self.processes,), exitpriority=100)

    def read(self, lane) -> tuple[int, list[int]]:
        """(source index, window) of the lane's next sample, read by its worker; the lane moves past it."""
        w = self.owner[lane.index]
        while True:
            try:
                item = self.queues[w].get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self.processes[w].is_alive():
                    raise RuntimeError(
                        f"data worker {w} exited (exit code {self.processes[w].exitcode}) without an error message: "
                        "killed by the system (out of memory?); see the system log, or lower training.data_workers"
                    ) from None
        if isinstance(item, _WorkerError):
            if item.user:
                raise UserError(item.message)
            raise RuntimeError(f"data worker {w} failed:\n{item.message}")
        index, source, window, position, layouts = item
        assert index == lane.index, f"data worker {w} sent lane {index} for lane {lane.index}"
        lane.seek(position)
        for src, layout in zip(self.sources, layouts):
            if layout is not None:
                src.load_layout(layout)
        return source, window.tolist()

    def stop(self):
        self._stop()

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]  # all started in __init__: none is None


def _kill(processes):
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()
