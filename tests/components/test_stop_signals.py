"""The stop-signal handler on its own: it records the signal, and its grace timer ends a stop that
cannot finish (a real signal to a real process)."""

import signal
import subprocess
import sys
import time

import pytest

from torchtitan.components.stop_signals import GRACE_EXPIRED_EXIT, StopSignals

STUCK = """
import os, signal, time
from torchtitan.components.stop_signals import StopSignals
stop = StopSignals(["SIGUSR1"], 1)
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(60)  # a step or save that never finishes
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stop_that_cannot_finish_ends_at_the_grace_period():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == GRACE_EXPIRED_EXIT != 0
    assert "SIGUSR1 received 1s ago (job.stop_grace_seconds)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert took < 20  # 1 s of grace plus the interpreter's start-up, far from the 60 s sleep


def test_the_signal_is_recorded_and_the_handlers_put_back():
    before = signal.getsignal(signal.SIGUSR2)
    stop = StopSignals(["SIGUSR2"], 60)
    assert stop.received is None
    signal.raise_signal(signal.SIGUSR2)  # the process survives: the default action would end it
    signal.raise_signal(signal.SIGUSR2)
    assert stop.received == "SIGUSR2"
    stop.restore()
    assert signal.getsignal(signal.SIGUSR2) is before
    stop._timer.join(5)
    assert not stop._timer.is_alive()  # cancelled: the stop finished in time


CTRL_C_TWICE = """
import os, signal, sys, time
from torchtitan.components.stop_signals import StopSignals
stop = StopSignals(["SIGINT"], 60)
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGINT)  # the copy the launcher passes on: ignored
assert stop.received == "SIGINT"
print("stopping", flush=True)
time.sleep(1.5)
os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_ctrl_c_ends_the_stop_at_once():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CTRL_C_TWICE], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "stopping\n", proc.stderr
    assert proc.returncode == 128 + signal.SIGINT
    assert "a second SIGINT (Ctrl-C): exiting without finishing the step or saving" in proc.stderr
    assert time.monotonic() - start < 20
