"""Profiler traces and memory records at a fixed cadence: one step out of every profile_freq.

Files land under {dump_folder}/{folder}/iteration_{step}/rank{R}_*, one per rank. With
enable_memory_snapshot, CUDA records the allocator's history and dumps a snapshot at the profiled
steps and when an out-of-memory error ends the run (open it at pytorch.org/memory_viz); on CPU,
where the allocator keeps no history, the profiler's memory timeline (bytes per category over time)
is written instead.
"""

import logging
import os
import warnings
from contextlib import contextmanager

import torch

from torchtitan.components.metrics import keep_earlier
from torchtitan.config import Profiling

logger = logging.getLogger(__name__)


def keep_earlier_steps(root: str, start_step: int):
    """Before a run writes into `root`: an earlier run's records are kept, not overwritten, as metrics.jsonl's are
    (metrics.keep_earlier): a fresh start keeps the whole folder as {root}.N; a resume from step S keeps the
    iteration_K folders of steps after S (a restart redoes those steps) as iteration_K.N."""
    if not os.path.isdir(root) or not os.listdir(root):
        return
    if start_step == 0:
        keep_earlier(root, "profiler records")
        return
    for name in sorted(os.listdir(root)):
        step = name.removeprefix("iteration_")
        if step.isdigit() and int(step) > start_step:
            keep_earlier(os.path.join(root, name), "profiler records")


class StepProfiler:
    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device, start_step: int):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.traces = os.path.join(dump_folder, cfg.save_traces_folder)
        self.memory = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
        self.step = start_step
        self.cuda_history = cfg.enable_memory_snapshot and device.type == "cuda"
        cpu_memory = cfg.enable_memory_snapshot and device.type != "cuda"
        if rank == 0:
            for root, on in ((self.traces, cfg.enable_profiling), (self.memory, cfg.enable_memory_snapshot)):
                if on:
                    keep_earlier_steps(root, start_step)
        self.prof = None
        self.stopping = False
        if cfg.enable_profiling or cpu_memory:
            warmup = min(1, cfg.profile_freq - 1)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=cfg.profile_freq - warmup - 1, warmup=warmup, active=1),
                acc_events=False,
                on_trace_ready=self._trace_ready,
                record_shapes=cpu_memory,
                profile_memory=cpu_memory,
                with_stack=cpu_memory,  # the memory timeline needs all three
            )
        if self.cuda_history:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _folder(self, root: str, name: str) -> str:
        folder = os.path.join(root, name)
        os.makedirs(folder, exist_ok=True)
        return folder

    def _trace_ready(self, prof):
        if self.stopping:  # stop() flushes a step that was only being warmed up for: not a profiled step
            return
        name = f"iteration_{self.step}"
        if self.cfg.enable_profiling:
            path = os.path.join(self._folder(self.traces, name), f"rank{self.rank}_trace.json")
            prof.export_chrome_trace(path)
            logger.info(f"profiler trace of step {self.step}: {path}")
        if self.cfg.enable_memory_snapshot and self.device.type != "cuda":
            path = os.path.join(self._folder(self.memory, name), f"rank{self.rank}_memory_timeline.json")
            with warnings.catch_warnings():  # deprecated in favour of CUDA snapshots, which CPU lacks
                warnings.simplefilter("ignore", FutureWarning)
                prof.export_memory_timeline(path, device="cpu")
            logger.info(f"memory timeline of step {self.step}: {path}")

    def step_done(self):
        """Call at the end of every training step."""
        self.step += 1
        if self.prof is not None:
            self.prof.step()
        if self.cuda_history and self.step % self.cfg.profile_freq == 0:
            self._dump_cuda_snapshot(f"iteration_{self.step}")

    def _dump_cuda_snapshot(self, name: str):
        path = os.path.join(self._folder(self.memory, name), f"rank{self.rank}_memory_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        logger.info(f"CUDA memory snapshot: {path}")

    def out_of_memory(self):
        if self.cuda_history:
            self._dump_cuda_snapshot("oom")


@contextmanager
def maybe_profile(cfg: Profiling, dump_folder: str, rank: int, device: torch.device, start_step: int):
    """Yields a StepProfiler (a no-op unless profiling or memory recording is on)."""
    profiler = StepProfiler(cfg, dump_folder, rank, device, start_step)
    if profiler.prof is not None:
        profiler.prof.start()
    try:
        yield profiler
    except torch.OutOfMemoryError:
        profiler.out_of_memory()
        raise
    finally:
        if profiler.prof is not None:
            profiler.stopping = True
            profiler.prof.stop()
        if profiler.cuda_history:
            torch.cuda.memory._record_memory_history(enabled=None)
