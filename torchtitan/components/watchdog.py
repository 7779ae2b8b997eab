"""Hangs outside collectives, and ranks persistently slower than the others.

Stalls. Collectives time out on their own (comm.init_timeout_seconds, comm.train_timeout_seconds), but a
read of the data that blocks (a network file system that stopped answering, a data worker that stopped)
or a checkpoint write that never returns waits on no collective: the job would hang until a peer's next
collective timed out, naming the wrong rank and the wrong cause. The trainer marks these phases (the
step's data read: comm.data_timeout_seconds; a checkpoint save, its foreground writes and, with
checkpoint.async_mode, its background ones: comm.checkpoint_timeout_seconds); a daemon thread ends the
process once a phase runs past its timeout, with one line naming the phase, the step and the key
(exit STALL_EXIT; the launcher then stops the other ranks). Published checkpoints stay complete.

Stragglers. In synchronous training every rank's wall time per step is the same: a slow rank makes the
others wait inside the next collective. What differs is each rank's own time: the time its training
thread ran (or was ready to run but had no CPU, or was stopped), read its data or waited for its disk,
rather than slept waiting for its peers. The same daemon thread samples the thread's state in
/proc (Linux; elsewhere every rank's own time is its wall time, so no rank is ever named); at each
log step the ranks exchange their own seconds per step in one all-gather of a small tensor, and a
rank slower than metrics.straggler_factor times the median of the other ranks in
metrics.straggler_windows log windows in a row is named in the log and in metrics.jsonl
(straggler_rank). On a GPU the host thread mostly waits for kernels: the measure is the host's, and a
slow GPU is not seen.
"""

import collections
import contextlib
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan.config import Comm, Metrics

logger = logging.getLogger(__name__)

STALL_EXIT = 1  # the exit status of a rank whose phase ran past its timeout

# kind -> (config key of its timeout, what may be the cause)
PHASE_KINDS = {
    "data": (
        "comm.data_timeout_seconds",
        "a read that blocks: a network file system that stopped answering, a named pipe with no writer, a data "
        "worker that stopped (training.data_workers)",
    ),
    "checkpoint": (
        "comm.checkpoint_timeout_seconds",
        "storage that stopped answering (the checkpoints already published are complete)",
    ),
}

# Thread states of /proc/.../stat that count as the rank's own time: running or ready to run, and waiting
# for its disk; "S" (sleeping: in a collective, waiting for its peers) does not, except in a data read.
OWN_STATES = ("R", "D")


@dataclass
class Phase:
    kind: str  # a key of PHASE_KINDS
    what: str  # said in the stall line: "reading the data for step 7"
    timeout: float  # seconds; 0: not watched
    start: float  # time.monotonic()
    done: Callable[[], bool] | None = None  # a background phase: over once this says so
    seconds: float = 0.0  # how long it took, once over


# --- stragglers: the decision (pure) and the exchange ----------------------------------------------------


def median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def ratios(seconds: list[float]) -> list[float]:
    """Each rank's seconds per step over the median of the other ranks' (inf over a median of 0)."""
    out = []
    for rank, own in enumerate(seconds):
        others = median(seconds[:rank] + seconds[rank + 1 :])
        out.append(own / others if others > 0 else (float("inf") if own > 0 else 1.0))
    return out


def persistent_straggler(windows: list[list[float]], factor: float) -> int | None:
    """The rank slower than `factor` times the median of the other ranks in every one of `windows` (each
    rank's own seconds per step in consecutive log windows); the slowest in the latest window if several
    are; None if none is, or with fewer than 2 ranks."""
    if not windows or len(windows[-1]) < 2:
        return None
    slow = set.intersection(*({r for r, x in enumerate(ratios(w)) if x > factor} for w in windows))
    if not slow:
        return None
    latest = ratios(windows[-1])
    return max(slow, key=lambda r: latest[r])


def gather_step_seconds(seconds: float, device: torch.device) -> list[float]:
    """Every rank's `seconds`, in rank order: one all-gather of a one-element tensor."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [seconds]
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.item() for t in out]


def _thread_state(tid: int) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


# --- the watchdog -------------------------------------------------------------------------------------


class Watchdog:
    """Active inside its `with` block (one at a time per process): the phases of the thread that entered it
    are watched, and that thread's own time is measured for the straggler comparison."""

    def __init__(
        self,
        data_timeout: float,
        checkpoint_timeout: float,
        straggler_factor: float,
        straggler_windows: int,
        device: torch.device,
        rank: int = 0,
    ):
        self.timeouts = {"data": data_timeout, "checkpoint": checkpoint_timeout}
        self.factor, self.device, self.rank = straggler_factor, device, rank
        self.windows: collections.deque = collections.deque(maxlen=max(straggler_windows, 1))
        self.phases: dict[int, Phase] = {}
        self.lock = threading.Lock()
        self.own_seconds = 0.0  # the training thread's own time since the last log step
        self.last_log_step: int | None = None  # None until a launch's first log step
        self.tid = threading.get_native_id()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_id = 0

    def __enter__(self):
        global _active
        _active = self
        watched = [t for t in self.timeouts.values() if t > 0]
        if watched or self.factor > 0:
            # Sampling the thread's state every 20 ms costs about 0.1% of a core; a timeout needs no finer check.
            poll = 0.02 if self.factor > 0 else min(1.0, min(watched) / 10)
            self._thread = threading.Thread(target=self._watch, args=(poll,), name="watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        global _active
        _active = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    # phases

    def begin(self, kind: str, what: str, done: Callable[[], bool] | None = None) -> int:
        with self.lock:
            self._next_id += 1
            self.phases[self._next_id] = Phase(kind, what, self.timeouts[kind], time.monotonic(), done)
            return self._next_id

    def end(self, token: int) -> Phase:
        with self.lock:
            phase = self.phases.pop(token)
        phase.seconds = time.monotonic() - phase.start
        return phase

    def _watch(self, poll: float):
        sample = self.factor > 0
        last, state = time.monotonic(), _thread_state(self.tid) if sample else None
        while not self._stop.wait(poll):
            now = time.monotonic()
            with self.lock:
                phases = list(self.phases.items())
            if sample:
                # The interval since the last sample counts as the state seen then. Asleep (waiting for its
                # peers), only what this thread woke up late counts: the process did not run (it was stopped,
                # or had no CPU), which is its own delay whatever its training thread was doing.
                reading = any(p.kind == "data" and p.done is None for _, p in phases)
                own = state is None or state in OWN_STATES or reading
                with self.lock:
                    self.own_seconds += now - last if own else max(0.0, now - last - 2 * poll)
                last, state = now, _thread_state(self.tid)
            for token, phase in phases:
                if phase.done is not None and phase.done():
                    with self.lock:
                        self.phases.pop(token, None)
                elif phase.timeout > 0 and now - phase.start > phase.timeout:
                    stall(phase)

    # stragglers

    def straggler_fields(self, step: int) -> dict:
        """At a log step, on every rank: this window's comparison of the ranks (the first log step of a
        launch, which carries the start-up, only starts the first window). Rank 0 logs a persistent straggler."""
        with self.lock:
            own, self.own_seconds = self.own_seconds, 0.0
        last, self.last_log_step = self.last_log_step, step
        if self.factor <= 0 or last is None or step <= last:
            return {}
        seconds = gather_step_seconds(own / (step - last), self.device)
        if len(seconds) < 2:
            return {}
        self.windows.append(seconds)
        latest = ratios(seconds)
        fields = {"step_time_max_over_median": max(latest)}
        slow = (
            persistent_straggler(list(self.windows), self.factor) if len(self.windows) == self.windows.maxlen else None
        )
        if slow is not None:
            fields["straggler_rank"] = slow
            if self.rank == 0:
                others = median(seconds[:slow] + seconds[slow + 1 :])
                logger.warning(
                    f"straggler: rank {slow} spent {seconds[slow]:.3f}s per step of its own work (computing or reading "
                    f"data, not waiting for its peers) by step {step}, {latest[slow]:.2f}x the median of the other "
                    f"ranks ({others:.3f}s), slower than metrics.straggler_factor = {self.factor:g} in each of the "
                    f"last {len(self.windows)} log windows (metrics.straggler_windows)"
                )
        return fields


def from_config(comm: Comm, metrics: Metrics, device: torch.device, rank: int) -> Watchdog:
    """The watchdog of [comm]'s phase timeouts and [metrics]' straggler comparison."""
    return Watchdog(
        comm.data_timeout_seconds,
        comm.checkpoint_timeout_seconds,
        metrics.straggler_factor,
        metrics.straggler_windows,
        device,
        rank,
    )


def stall(phase: Phase):
    """End this process: `phase` ran past its timeout."""
    key, cause = PHASE_KINDS[phase.kind]
    logger.error(
        f"stalled: {phase.what} took more than {phase.timeout:g} s ({key}); likely {cause}. Ending this rank "
        f"(exit {STALL_EXIT}); the launcher stops the others"
    )
    for child in multiprocessing.active_children():  # data workers: a stopped one would outlive the run
        child.kill()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STALL_EXIT)


# --- what the trainer and the checkpointer call: no-ops without an active watchdog ------------------------

_active: Watchdog | None = None


@contextlib.contextmanager
def phase(kind: str, what: str) -> Generator[Phase, None, None]:
    """A phase of the calling thread, bounded by its kind's timeout; the yielded Phase gets its seconds."""
    watchdog = _active
    if watchdog is None:
        timed = Phase(kind, what, 0.0, time.monotonic())
        yield timed
        timed.seconds = time.monotonic() - timed.start
        return
    token = watchdog.begin(kind, what)
    try:
        yield watchdog.phases[token]
    finally:
        watchdog.end(token)


def in_background(kind: str, what: str, done: Callable[[], bool]):
    """A phase that runs on another thread (an async checkpoint's writes): over once `done()` is true."""
    if _active is not None:
        _active.begin(kind, what, done)


def read_batches(data_iter, count: int, step: int) -> tuple[list, float]:
    """The step's `count` micro-batches, read under comm.data_timeout_seconds, and the seconds it took."""
    with phase("data", f"reading the data for step {step}") as read:
        batches = [next(data_iter) for _ in range(count)]
    return batches, read.seconds


def straggler_fields(step: int) -> dict:
    """The metrics record's fields of the straggler comparison (every rank calls it at the same log steps)."""
    return {} if _active is None else _active.straggler_fields(step)
