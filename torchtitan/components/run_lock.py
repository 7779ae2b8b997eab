"""One live run per dump folder.

Two runs writing into one dump folder destroy each other's checkpoints (each clears the other's
half-written saves, purges its checkpoints, appends to its metrics). The run's rank 0 therefore holds
`{dump_folder}/.run.lock` for the whole run: a JSON record of host, pid, the process's start time and
a heartbeat (the file's modification time, refreshed by a background thread). A second run is
refused while the holder is alive. A lock whose holder is gone (killed, so it never removed the file)
is taken over with a warning: on the same host when its pid no longer runs the same process; from
another host when its heartbeat is older than STALE_AFTER_S.
"""

import json
import logging
import os
import socket
import threading
import time

from torchtitan.config import UserError

logger = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0


def _process_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (tells a reused pid from the original process), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "unknown"  # no /proc (not Linux): the pid runs, assume it is the same process


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            record = json.load(f)
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def holder_if_alive(folder: str) -> dict | None:
    """The record of the live run holding `folder`'s lock, or None when there is none or it is stale."""
    path = os.path.join(folder, LOCK_FILE)
    record = _read(path)
    if record is None:
        return None
    if record.get("host") == socket.gethostname():
        started = _process_start_time(int(record.get("pid", -1)))
        alive = started is not None and started in (record.get("start_time"), "unknown")
        return record if alive else None
    try:
        age = time.time() - os.path.getmtime(path)
    except OSError:
        return None
    return record if age < STALE_AFTER_S else None


def describe(record: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return f"host {record.get('host')}, pid {record.get('pid')}, since {since}"


def refuse_if_locked(folder: str):
    holder = holder_if_alive(folder)
    if holder is not None:
        raise UserError(
            f"job.dump_folder {folder} is in use by a running job ({describe(holder)}); two runs in one folder "
            f"would delete each other's checkpoints. Wait for it or stop it, or choose another job.dump_folder"
        )


class RunLock:
    """Held by rank 0 from start to end of a run (`release` on the way out, also after an error)."""

    def __init__(self, folder: str):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, LOCK_FILE)
        self.record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start_time": _process_start_time(os.getpid()),
            "started": time.time(),
        }
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                refuse_if_locked(folder)
                stale = _read(self.path)
                logger.warning(
                    f"taking over the lock of {folder} left by a run that is gone "
                    f"({describe(stale) if stale else 'unreadable lock file'})"
                )
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.record, f)
                f.flush()
                os.fsync(f.fileno())
            break
        else:
            raise UserError(
                f"could not take the lock {self.path}: another run keeps taking it; choose another job.dump_folder"
            )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _heartbeat(self):
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self):
        self._stop.set()
        if _read(self.path) == self.record:  # never remove a lock another run took over
            os.remove(self.path)


def take_run_lock(dump_folder: str, rank: int) -> RunLock | None:
    """Rank 0 locks the dump folder for the run; every rank stops with the reason if it cannot."""
    import torch.distributed as dist

    lock, error = None, None
    if rank == 0:
        try:
            lock = RunLock(dump_folder)
        except UserError as e:
            error = str(e)
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise UserError(error)
    return lock
