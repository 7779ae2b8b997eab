"""Replica groups on torchft ([fault_tolerance]; docs/launching.md).

Each replica group is an ordinary run (its own launch, process group and dump folder). Rank r of every group
holds the same part of the model, so across groups each rank averages its own gradients (its local shards,
after the group's backward) with rank r of the other groups alive at that step, through torchft's Manager (one
per rank; replica id = the group id) over a reconfigurable gloo process group; the quorum of live groups is
formed by the torchft lighthouse. A step is taken only where the Manager's should_commit() agrees: when a group
dies inside a step, the survivors drop that step (its gradients, not its batches) and go on without it from the
next quorum.

Data: group g is data-parallel replica g of a data-parallel degree group_count x dp, so each group reads its own
lanes and the groups together read what one run of that degree would. The lanes of a dead group are skipped while
it is away (no survivor reads them, so no sample is trained twice).

torchft is optional: it is imported only when fault_tolerance.enabled.
"""

import importlib.util
import logging
import os
import time
import urllib.request
from datetime import timedelta

import torch
from torch.distributed.tensor import DTensor

from torchtitan.config import UserError
from torchtitan.config.parallelism_sections import FaultTolerance
from torchtitan.models.common.moe import moe_layers

logger = logging.getLogger("torchtitan")

INSTALL = "pip install torchft==0.2.0"


def check(cfg: FaultTolerance) -> None:
    """Before launch: the torchft package is installed and the lighthouse answers within the timeout."""
    if not cfg.enabled:
        return
    if importlib.util.find_spec("torchft") is None:
        raise UserError(f"fault_tolerance.enabled needs the torchft package: {INSTALL} (or turn it off)")
    url = cfg.lighthouse.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=cfg.timeout_seconds) as answer:
            answer.read(1)
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise UserError(
            f"fault_tolerance.lighthouse = {cfg.lighthouse} does not answer within "
            f"fault_tolerance.timeout_seconds = {cfg.timeout_seconds} ({reason}); start one (torchft_lighthouse "
            f"--min_replicas 1 --bind HOST:PORT, or run_train.sh with LIGHTHOUSE_PORT) or fix the address"
        ) from None


def data_lanes(cfg: FaultTolerance, dp_rank: int, dp_degree: int, global_batch: int) -> tuple[int, int, int]:
    """(dp rank, dp degree, global batch) of the data loader: group g's ranks read the lanes of data-parallel
    replica g of group_count x dp_degree; the batch of all groups together is group_count x the group's."""
    if not cfg.enabled:
        return dp_rank, dp_degree, global_batch
    return cfg.group_id * dp_degree + dp_rank, cfg.group_count * dp_degree, cfg.group_count * global_batch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tree_local(value):
    """`value` (nested dicts and lists) with each DTensor replaced by its local shard."""
    if isinstance(value, dict):
        return {k: _tree_local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tree_local(v) for v in value)
    return _local(value) if isinstance(value, torch.Tensor) else value


class ReplicaGroups:
    """This rank's side of the replica groups; every method does nothing when fault tolerance is off, so the
    trainer calls them unconditionally: start_step before the forward, average after the backward,
    should_commit before the optimizer step, fields in each metrics record, close at the end."""

    def __init__(self, cfg: FaultTolerance, start_step: int, trainer):
        self.cfg, self.manager, self.store, self.trainer = cfg, None, None, trainer
        self.participants, self.waiting = 1, start_step == 0
        self.last_step, self.healed_step, self.joined = start_step, None, False
        if not cfg.enabled:
            return
        # torchft's own logs are off (a line per quorum and commit from its Rust server; a traceback for a peer's
        # expected death): should_commit names the error of a step that is not committed.
        os.environ.setdefault("RUST_LOG", "error")
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        from torchft import Manager, ProcessGroupGloo

        timeout = timedelta(seconds=cfg.timeout_seconds)
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if port is None:
            # One process started without a launcher: the Manager needs its group's store (torchrun's otherwise;
            # without one it waits forever, silently).
            self.store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            addr, port = "127.0.0.1", self.store.port
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
            min_replica_size=cfg.min_groups, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds), connect_timeout=timeout,
            rank=trainer.rank, world_size=trainer.dims.world_size, store_addr=addr, store_port=int(port),
            lighthouse_addr=cfg.lighthouse, replica_id=f"group{cfg.group_id}",
            # Every group initializes the same weights from training.seed (and loads the same checkpoint).
            init_sync=False,
        )
        self.manager.load_state_dict({"step": start_step, "batches_committed": start_step * cfg.group_count})
        # What a group that restarts behind the others heals from (state_dict, heal).
        self.manager.register_state_dict_fn("trainer", self.heal, self.state_dict)
        logger.info(f"fault tolerance: replica group {cfg.group_id} of {cfg.group_count} (at least {cfg.min_groups} "
                    f"to commit a step), lighthouse {cfg.lighthouse}")

    def join(self, start_step: int) -> int:
        """The first quorum, before the loop: a fresh run waits for all groups; a group behind the live ones (one
        restarted after it was lost) heals from one of them. Returns the step this run continues after."""
        if self.manager is None:
            return start_step
        self.start_step(start_step + 1)
        self.joined = True  # that quorum is the first step's: every group in it goes on to the same step
        if self.healed_step is None:
            return start_step
        # The data position: this group's own lanes, advanced past the batches of the steps the others took.
        t = self.trainer
        batches = iter(t.dataloader)
        for _ in range((self.healed_step - start_step) * t.plan.grad_accum_steps):
            next(batches)
        t.dataloader.load_state_dict(t.dataloader.state_dict())
        logger.info(f"fault tolerance: healed from a live replica group at step {self.healed_step} (weights, "
                    f"optimizer state, learning-rate schedule; data lanes advanced)")
        return self.healed_step

    def state_dict(self) -> dict:
        """What a live group sends to one that heals (torchft's checkpoint transport, rank r to rank r): this rank's
        local shards of the weights and optimizer state, the schedules and the last step done."""
        t = self.trainer
        return {"step": self.last_step, "steps_taken": t.optim.steps_taken,
                "model": [_tree_local(part.state_dict()) for part in t.parts],
                "optimizers": [_tree_local(opt.state_dict()) for opt in t.optim.optimizers],
                "schedulers": [sched.state_dict() for sched in t.optim.schedulers],
                "counters": dict(t.checkpointer.counters)}

    def heal(self, state: dict):
        """Load a live group's state_dict (in start_quorum, before the step's forward)."""
        t = self.trainer
        with torch.no_grad():
            for part, received in zip(t.parts, state["model"]):
                for name, value in part.state_dict().items():
                    _local(value).copy_(received[name])
        for opt, received in zip(t.optim.optimizers, state["optimizers"]):
            params = [p for group in opt.param_groups for p in group["params"]]
            for index, values in received["state"].items():
                p = params[index]
                for key, v in values.items():
                    if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0:
                        values[key] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                                         stride=p.stride())
            opt.load_state_dict(received)
        for sched, received in zip(t.optim.schedulers, state["schedulers"]):
            sched.load_state_dict(received)
        t.optim.steps_taken = state["steps_taken"]
        t.checkpointer.counters.update(state["counters"])
        self.healed_step = self.last_step = state["step"]

    def start_step(self, step: int):
        """Under every_step: the quorum of the groups alive now (the process group across them is rebuilt when it
        changed). A fresh run's first step waits (up to fault_tolerance.quorum_timeout_seconds) for all group_count
        groups, so that they start together instead of the first one training alone; any step waits as long for
        min_groups, and the run stops when they do not come. Under diloco the quorum is the sync's (end_step)."""
        if self.manager is not None and self.diloco is None:
            if self.joined:
                self.joined = False
                return
            self._quorum(step - 1)

    def _quorum(self, done: int):
        """A quorum of the live groups, taken after step `done` (a group behind the others heals in it)."""
        self.last_step = done
        self.manager.start_quorum()
        deadline = time.monotonic() + self.cfg.quorum_timeout_seconds
        need = self.cfg.group_count if self.waiting and self.healed_step is None else self.cfg.min_groups
        while self.manager.num_participants() < need and time.monotonic() < deadline:
            time.sleep(0.2)
            self.manager.start_quorum()
        self.waiting = False
        if self.manager.num_participants() < self.cfg.min_groups:
            raise UserError(
                f"step {done + 1}: only {self.manager.num_participants()} replica group(s) alive for "
                f"fault_tolerance.quorum_timeout_seconds = {self.cfg.quorum_timeout_seconds}, fewer than "
                f"fault_tolerance.min_groups = {self.cfg.min_groups}; restart the lost groups (they heal from a "
                f"live one) or lower min_groups"
            )
        if self.manager.num_participants() != self.participants:
            logger.info(f"fault tolerance: {self.manager.num_participants()} replica group(s) in this step's "
                        f"quorum (was {self.participants})")
        self.participants = self.manager.num_participants()

    def average(self, params: list[torch.Tensor], loss_sum: torch.Tensor):
        """Average this rank's gradients (local shards) and its summed loss over the live groups, in place: one
        flat all-reduce per dtype. A group lost during it leaves the step uncommitted (should_commit)."""
        if self.manager is None:
            return
        from torch.distributed import ReduceOp

        tensors = [_local(p.grad) for p in params if p.grad is not None] + [loss_sum]
        # An MoE model's expert loads of the step are summed over the groups, as over the ranks of one run, so that
        # every group moves its expert bias alike (moe.update_expert_bias) and keeps the same routing.
        counts = [m.tokens_per_expert for part in self.trainer.parts for _, m in moe_layers(part)]
        # One flat all-reduce per dtype, in the same order on every rank of every group.
        dtypes = sorted({t.dtype for t in tensors}, key=str)
        batches = [([t for t in tensors if t.dtype == dtype], ReduceOp.AVG) for dtype in dtypes]
        for same, op in batches + ([(counts, ReduceOp.SUM)] if counts else []):
            flat = torch.cat([t.reshape(-1) for t in same])
            self.manager.allreduce(flat, reduce_op=op).wait()
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def should_commit(self, step: int) -> bool:
        """Whether every rank of every live group got through the step: then its optimizer step is taken."""
        if self.manager is None:
            return True
        if self.manager.should_commit():
            return True
        for part in self.trainer.parts:  # the dropped step's expert loads move no expert bias
            for _, m in moe_layers(part):
                m.tokens_per_expert.zero_()
        error = self.manager.errored()
        reason = error and (str(error.original_exception) or type(error.original_exception).__name__)
        why = (f"a replica group failed during it: {reason.splitlines()[0][:300]}" if error
               else f"fewer than fault_tolerance.min_groups = {self.cfg.min_groups} groups took part")
        logger.warning(f"step {step}: not committed ({why}); its update is dropped")
        return False

    def fields(self) -> dict:
        """What a metrics record says of the groups: how many took part in the last step."""
        return {} if self.manager is None else {"replica_groups": self.participants}

    def close(self):
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
