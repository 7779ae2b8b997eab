"""The checkpoint folder all ranks share, and how its step-N namespace changes.

Crash safety: every save is written to `.step-N.partial` and renamed to `step-N` only after every
rank has finished writing (a rename within one folder is atomic). A folder named `step-N` is thus
always complete; a process killed at any moment leaves at most a `.partial` folder, which is never
loaded and is cleared by the next run. Old checkpoints are deleted only after a newer one is
published (keep_latest_k), by renaming them out of the `step-N` namespace first. Purging never
deletes the newest checkpoint training can resume from. Every change to the namespace is made by
rank 0 between barriers, so all ranks see the same checkpoints.
"""

import logging
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan.components.checkpoint.storage import (
    complete_checkpoints,
    partial_path,
    read_train_state,
    step_path,
    storage_state,
    verify_checkpoint,
)
from torchtitan.config import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peers:
    """This process among the ranks that save and load checkpoints together (without a process
    group: rank 0 of one)."""

    device: torch.device
    distributed: bool
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of_this_process(cls, device: torch.device) -> "Peers":
        if not dist.is_initialized():
            return cls(device, False)
        return cls(device, True, dist.get_rank(), dist.get_world_size())

    def barrier(self):
        if self.distributed:
            dist.barrier()

    def barrier_quietly(self):
        try:
            self.barrier()
        except Exception:  # a peer may already be gone; what the barrier guards is harmless anyway
            pass

    def all_true(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def first_problem(self, problem: str | None) -> str | None:
        """The first rank's problem among every rank's (None where all have none)."""
        if not self.distributed:
            return problem
        problems: list[str | None] = [None] * self.world_size
        dist.all_gather_object(problems, problem)
        return next((p for p in problems if p is not None), None)


@dataclass(frozen=True)
class CheckpointFolder:
    path: str
    peers: Peers

    def step(self, step: int) -> str:
        return step_path(self.path, step)

    def partial(self, step: int) -> str:
        return partial_path(self.path, step)

    def prepare(self):
        """Check the folder is writable and clear what killed runs left half-written."""
        probe = os.path.join(self.path, f".write-test-{self.peers.rank}")
        try:
            os.makedirs(self.path, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise UserError(
                f"cannot write checkpoints to {self.path} ({e.strerror}); choose a writable job.dump_folder "
                f"or checkpoint.folder"
            ) from None
        self.peers.barrier()
        if self.peers.rank == 0:
            for name in os.listdir(self.path):
                if name.endswith(".partial") or name.startswith(".deleting-"):
                    logger.warning(f"removing incomplete checkpoint {name} left by an interrupted run")
                    shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
        self.peers.barrier()

    def verify(self, path: str) -> str | None:
        """verify_checkpoint with the files shared out over the ranks; every rank gets the same answer."""
        return self.peers.first_problem(verify_checkpoint(path, self.peers.rank, self.peers.world_size))

    def set_aside(self, steps: list[int], prefix: str, why: str):
        """Rename step-N folders to {prefix}-step-N (never over an existing name): kept, but no longer
        loaded or purged."""
        if not steps:
            return
        if self.peers.rank == 0:
            for step in steps:
                target = os.path.join(self.path, f"{prefix}-step-{step}")
                n = 1
                while os.path.exists(target):
                    target = os.path.join(self.path, f"{prefix}-step-{step}.{n}")
                    n += 1
                os.rename(self.step(step), target)
                logger.warning(f"{why}: moved checkpoint step-{step} to {target}")
        self.peers.barrier()

    def agree_or_abandon(self, error: str | None, step: int):
        """Every rank learns whether all succeeded in writing `step`; on a failure anywhere all remove
        the partial folder and stop with the reason (a rank that failed gives its own; the others
        point to it)."""
        if self.peers.all_true(error is None):
            return
        self.peers.barrier_quietly()
        if self.peers.rank == 0:
            shutil.rmtree(self.partial(step), ignore_errors=True)
        raise UserError(
            f"saving checkpoint step-{step} to {self.path} failed: {error or 'on another rank (see its error)'} "
            f"[{storage_state(self.path)}]; earlier checkpoints are untouched"
        )

    def publish(self, step: int, keep_latest_k: int):
        """All ranks have written: make the checkpoint visible in one rename, then trim old ones."""
        self.peers.barrier()
        if self.peers.rank == 0:
            os.rename(self.partial(step), self.step(step))
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            purge(self.path, keep_latest_k)
        self.peers.barrier()


def purge(folder: str, keep_latest_k: int):
    """Delete all but the newest keep_latest_k checkpoints, never the newest one a run can resume
    from (a weights-only final save does not replace it)."""
    if keep_latest_k == 0:
        return
    steps = complete_checkpoints(folder)
    resumable = next((s for s in reversed(steps) if _resumable(step_path(folder, s))), None)
    for old in steps[:-keep_latest_k]:
        if old == resumable:
            logger.info(f"keeping checkpoint step-{old} beyond keep_latest_k: the newest one training can resume from")
            continue
        # Leave the step-N namespace first, so a kill during rmtree never leaves a half-deleted "complete" one.
        doomed = os.path.join(folder, f".deleting-step-{old}")
        os.rename(step_path(folder, old), doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        logger.info(f"deleted checkpoint step-{old} (keep_latest_k = {keep_latest_k})")


def _resumable(path: str) -> bool:
    try:
        return not read_train_state(path).get("model_only", False)
    except UserError:
        return False
