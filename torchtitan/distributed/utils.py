"""Process-group set-up and reductions that work for plain tensors and DTensors alike."""

import ctypes
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Dtype names as the config spells them.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layers_of(model: nn.Module) -> nn.ModuleDict:
    """`model.layers`: the blocks of a model or pipeline stage, an nn.ModuleDict keyed by layer id
    (torchtitan.models.common.spec), which nn.Module's attribute lookup types as Tensor | Module."""
    return cast(nn.ModuleDict, model.layers)


def device_type() -> str:
    """Chosen once per process: CUDA with NCCL when a GPU is visible, otherwise CPU with gloo."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def tune_host_allocator():
    """On CPU, keep freed activation memory in the process instead of returning it to the OS.

    glibc serves allocations of 128 KiB and more with mmap and unmaps them on free, so every step pays
    page faults for every large activation again. Disabling mmap alone makes it trim the heap top just
    as often (1.7x slower, measured); together with a high trim threshold the memory is reused. Values
    set through MALLOC_MMAP_MAX_ / MALLOC_TRIM_THRESHOLD_ in the environment win. No-op off glibc."""
    if "MALLOC_MMAP_MAX_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    mallopt(m_trim_threshold, 2**31 - 1)
    mallopt(m_mmap_max, 0)


def release_host_memory():
    """Return the freed parts of the heap to the OS (glibc's malloc_trim), after start-up's large
    transients (the full tensors of the per-parameter init, the weights read for a load), which the
    allocator tuned above would otherwise keep for the whole run. No-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None, not_counted=()) -> torch.Tensor:
    """Clip gradients by their global 2-norm over all ranks; returns the norm before clipping.

    Sharded (DTensor) gradients give a DTensor norm whose full value is the norm over every FSDP/TP
    shard. With pipeline stages, each rank holds other parameters: the squares of the stage norms
    are summed over `pp_group`. `not_counted`: parameters clipped but left out of the norm (the
    copies of a weight shared across stages, which another copy counts). max_norm = 0 only
    measures the norm.
    """
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in not_counted}
    # Gradients on different meshes (expert-parallel experts beside the dense weights) cannot meet in
    # one norm kernel: take each mesh's norm, then combine them.
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        # Every p has a gradient (params); the test narrows the type.
        counted = [p.grad for p in group if id(p) not in skip and p.grad is not None]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        total = norms[0]
    elif norms:
        total = torch.stack([n.float() for n in norms]).square().sum().sqrt()
    else:  # nothing counted here (a stage holding only copies counted elsewhere, or no gradients)
        total = torch.zeros((), dtype=torch.float32, device=params[0].grad.device if params else None)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        squares = total.float() ** 2
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=pp_group)
        total = squares.sqrt()
    if max_norm > 0 and params:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def max_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """In place: the elementwise maximum of `x` over every rank of the job."""
    if dist.is_initialized():
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank; [obj] without a process group."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def set_determinism(seed: int, deterministic: bool):
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
