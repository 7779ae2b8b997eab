"""A worker's process group and process: the device and backend, the group's set-up and teardown, the
collectives' timeout, and the worker's end (with its launcher, and without interpreter finalization)."""

import logging
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan.distributed.host_memory import tune_host_allocator


def device_type() -> str:
    """Chosen once per process: CUDA with NCCL when a GPU is visible, otherwise CPU with gloo."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_seconds: int, trace_buf_size: int = 0) -> tuple[torch.device, int, int]:
    """Returns (device, rank, world_size); a process group exists whenever launched by torchrun.
    `trace_buf_size` sizes the collectives' flight recorder unless the environment already does (torch
    2.13 reads TORCH_FR_BUFFER_SIZE and warns that the older TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated:
    only a user's own setting of that one is left in place)."""
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(trace_buf_size))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dev_type = device_type()
    if dev_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        tune_host_allocator()
    if "RANK" in os.environ and not dist.is_initialized():
        backend = "nccl" if dev_type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_seconds)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one store across restarts (--max-restarts), so a restarted worker
            # would read the dead attempt's process-group addresses and wait for them: keep each
            # attempt's keys apart.
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
            )
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"torchtitan/attempt-{attempt}", store)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    return device, rank, world_size


def destroy_distributed(wait_for_peers: bool = True):
    """Tear down every process group. After a successful job, first wait for all ranks, so that no rank
    closes its connections while a peer still talks to it; after an error, do not wait (the peers may be
    stuck in a collective that will never complete, and torchrun stops them)."""
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()


def set_collective_timeout(seconds: int):
    """Bound every collective of every process group this rank belongs to by `seconds` from now on."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def stop_with_launcher(poll_s: float = 1.0):
    """End this worker within `poll_s` once the process that launched it is gone.

    torchrun starts its workers in sessions of their own, so killing the launcher (or the process group
    of the script that ran it) does not reach them: they would go on training and writing checkpoints
    into a folder the next run uses. A daemon thread watches the parent pid instead (a parent-death
    signal would follow the launcher's thread, not its process). Published checkpoints are safe at any
    moment: a save becomes visible in one rename."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                print(
                    f"[rank{os.environ.get('RANK', '0')}] the launcher (pid {parent}) is gone; stopping",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


def exit_process(code: int):
    """End the process with `code` without interpreter finalization. Call after destroy_distributed.

    With gloo, finalization sometimes aborts a process whose work is done ("terminate called without an
    active exception", SIGABRT: C++ threads and tensors of the communication library destroyed in the
    wrong order), which turns a finished run into a failed one. Everything the job writes is closed
    before this point, so only the output streams need flushing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
