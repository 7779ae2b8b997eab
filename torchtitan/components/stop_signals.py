"""Stopping on a scheduler's signal. SLURM (`sbatch --signal`, scancel, preemption) and Kubernetes
send SIGTERM or SIGUSR1 some time before they kill a job. The handler only records the signal; the
trainer reads it once per step in the same all-reduce that checks the step's loss, so every rank
stops after the same step, saves, and exits 0 (SIGINT, Ctrl-C, stops the same way; a second Ctrl-C
ends the process at once). A grace timer bounds the whole stop: if the step and
the save are not done in time (a peer that died mid-step, storage that hangs), the process exits 1
before the scheduler's kill, and only the checkpoints already published remain.
"""

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

# What signal.signal returns and takes back: a Python handler, SIG_DFL or SIG_IGN, or None (a handler
# not installed from Python).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

# The exit status of a stop that ran past its grace period.
GRACE_EXPIRED_EXIT = 1


class StopSignals:
    def __init__(self, names: list[str], grace_seconds: float):
        self.received: str | None = None
        self.grace_seconds = grace_seconds
        self._previous: dict[int, Handler] = {}
        self._timer: threading.Timer | None = None
        if threading.current_thread() is not threading.main_thread():
            if names:
                logger.warning("not on the main thread: job.stop_signals keep their default action")
            return
        for name in names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.received is not None:
            # The launcher passes on the signal that a scheduler or the terminal also sent here: a repeat
            # within a second is that copy. A later second Ctrl-C ends the process without saving.
            if signum == signal.SIGINT == getattr(signal, self.received) and time.monotonic() - self._at > 1.0:
                logger.error(
                    "a second SIGINT (Ctrl-C): exiting without finishing the step or saving (the "
                    "checkpoints already published are complete)"
                )
                logging.shutdown()
                os._exit(128 + signal.SIGINT)
            return
        self.received = signal.Signals(signum).name
        self._at = time.monotonic()
        self._timer = threading.Timer(self.grace_seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self):
        logger.error(
            f"{self.received} received {self.grace_seconds}s ago (job.stop_grace_seconds) and the step and its "
            f"checkpoint are not done; exiting without them (the checkpoints already published are complete)"
        )
        logging.shutdown()
        os._exit(GRACE_EXPIRED_EXIT)

    def restore(self):
        """Put back the previous handlers and cancel the grace timer (the stop is done)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()
