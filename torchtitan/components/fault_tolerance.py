"""Replica groups on torchft ([fault_tolerance]; docs/launching.md).

Each replica group is an ordinary run (its own launch, process group and dump folder). Rank r of every group
holds the same part of the model, so across groups each rank averages its own gradients (its local shards,
after the group's backward) with rank r of the other groups alive at that step, through torchft's Manager (one
per rank; replica id = the group id) over a reconfigurable gloo process group; the quorum of live groups is
formed by the torchft lighthouse. A step is taken only where the Manager's should_commit() agrees: when a group
dies inside a step, the survivors drop that step (its gradients, not its batches; its learning rate is spent, so
that step N trains at step N's rate) and go on without it from the next quorum. Under sync = "diloco" (class
DiLoCo) the groups train alone and meet every sync_every steps to average their weight deltas instead.

Data: group g is data-parallel replica g of a data-parallel degree group_count x dp, so each group reads its own
lanes and the groups together read what one run of that degree would. The lanes of a dead group are skipped while
it is away (no survivor reads them, so no sample is trained twice); a group that heals advances its lanes to the
live groups' step. A checkpoint crosses between layouts (a normal run, another group_count) by the step
(ReplicaGroups.continue_data).

torchft is optional: it is imported only when fault_tolerance.enabled.
"""

import importlib.util
import logging
import os
import re
import time
import urllib.request
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from torchtitan.config import UserError
from torchtitan.config.parallelism_sections import FaultTolerance
from torchtitan.models.common.moe import moe_layers

if TYPE_CHECKING:
    import torchft

logger = logging.getLogger("torchtitan")

INSTALL = "pip install torchft==0.2.0"


def check(cfg: FaultTolerance, probe: bool = True) -> None:
    """Before launch: the torchft package is installed and (`probe`) the lighthouse answers within the timeout."""
    if not cfg.enabled:
        return
    if importlib.util.find_spec("torchft") is None:
        raise UserError(f"fault_tolerance.enabled needs the torchft package: {INSTALL} (or turn it off)")
    if not probe:
        return
    reason = lighthouse_silence(cfg.lighthouse, cfg.timeout_seconds)
    if reason is not None:
        raise UserError(
            f"fault_tolerance.lighthouse = {cfg.lighthouse} does not answer within "
            f"fault_tolerance.timeout_seconds = {cfg.timeout_seconds} ({reason}); start one (torchft_lighthouse "
            f"--min_replicas 1 --bind HOST:PORT, or run_train.sh with LIGHTHOUSE_PORT) or fix the address"
        )


def lighthouse_silence(address: str, timeout: float) -> str | None:
    """Why the lighthouse at `address` gave no answer within `timeout` seconds, or None when it answered."""
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=timeout) as answer:
            answer.read(1)
    except (OSError, ValueError) as e:
        return str(getattr(e, "reason", None) or e)
    return None


def start_local_lighthouse(port: int) -> str | None:
    """A torchft lighthouse answering at 127.0.0.1:`port` (run_train.sh's LIGHTHOUSE_PORT, for replica groups on one
    machine): started unless one answers there already. It keeps running after this process, for the other groups
    and for restarts. Launchers started together (one per group) take turns through a lock file, so that one starts
    it and the others find it. Returns what to print when this call started it."""
    import fcntl
    import subprocess
    import sys
    import tempfile

    address = f"http://127.0.0.1:{port}"
    binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    base = os.path.join(tempfile.gettempdir(), f"torchft_lighthouse_{port}")
    with open(base + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if lighthouse_silence(address, 2) is None:
            return None
        if not os.access(binary, os.X_OK):
            raise UserError(f"LIGHTHOUSE_PORT needs torchft's torchft_lighthouse next to {sys.executable}: {INSTALL}")
        with open(base + ".log", "w") as log:
            proc = subprocess.Popen(
                [binary, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while lighthouse_silence(address, 1) is not None:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                with open(base + ".log", errors="replace") as log:
                    last = (log.read().strip().splitlines() or ["(no output)"])[-1][:300]
                raise UserError(
                    f"LIGHTHOUSE_PORT={port}: the torchft lighthouse did not start on 127.0.0.1:{port} "
                    f"({last}); is the port taken by another program? Choose another LIGHTHOUSE_PORT"
                )
            time.sleep(0.2)
    return f"started a torchft lighthouse at {address} (pid {proc.pid}; log {base}.log; stop it with kill {proc.pid})"


def data_lanes(cfg: FaultTolerance, dp_rank: int, dp_degree: int, global_batch: int) -> tuple[int, int, int]:
    """(dp rank, dp degree, global batch) of the data loader: group g's ranks read the lanes of data-parallel
    replica g of group_count x dp_degree; the batch of all groups together is group_count x the group's."""
    if not cfg.enabled:
        return dp_rank, dp_degree, global_batch
    return cfg.group_id * dp_degree + dp_rank, cfg.group_count * dp_degree, cfg.group_count * global_batch


def weights_only_transport(timeout: timedelta):
    """torchft's HTTP checkpoint transport (what a healing group receives from a live one), reading with torch's
    weights-only unpickler: torchft's own unpickles whatever a peer sends with weights_only=False, so anything that
    reaches its port could run code in a healing process. What is sent (ReplicaGroups.state_dict: tensors, numbers,
    strings, lists and dicts, torchft's counters) needs nothing more."""
    import warnings

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f, warnings.catch_warnings():
                # The stream's bytes become tensors through torch.frombuffer, which warns that the buffer is
                # read-only: they are copied into this rank's own tensors (heal) and never written.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                return _streaming_load(f, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tree_local(value):
    """`value` (nested dicts and lists) with each DTensor replaced by its local shard."""
    if isinstance(value, dict):
        return {k: _tree_local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tree_local(v) for v in value)
    return _local(value) if isinstance(value, torch.Tensor) else value


def collective_error(e: BaseException) -> str:
    """A failed cross-group collective's error in a line: gloo's text without the source position it starts with
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:43213: Connection reset by peer"
    reads "read error from 127.0.0.1:43213: connection reset by peer"), or the error's type."""
    text = (str(e) or type(e).__name__).strip().splitlines()[0]
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)  # gloo's [file:line]
    text = re.sub(
        r"^(Read|Write) error \[([^\]]+)\]:(\d+):\s*", lambda m: f"{m[1].lower()} error from {m[2]}:{m[3]}: ", text
    )
    return text[:300]


class DiLoCo:
    """This rank's side of DiLoCo (fault_tolerance.sync = "diloco"): the algorithm of torchft.local_sgd.DiLoCo with
    one fragment, on this rank's local shards. The reference ("global") weights are those of the last sync; at a
    sync the groups average their weight deltas (reference - local) through the Manager, and the outer SGD steps the
    reference weights with the average as their gradient. Built on the Manager's own calls rather than on the
    class, so that the syncs follow the trainer's step numbers (a group whose update was skipped still takes part
    in the sync at the same step), and so that checkpoints and healing carry the reference weights and the outer
    state. Checkpoints: diloco/step-N-rank-R.pt next to the trainer's step-N, read back on resume."""

    def __init__(self, cfg: FaultTolerance, trainer, start_step: int):
        self.trainer = trainer
        self.params = [p for part in trainer.ctx.parts for p in part.parameters()]
        with torch.no_grad():
            self.reference = [_local(p.detach()).clone() for p in self.params]
        self.outer = torch.optim.SGD(
            self.reference, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_nesterov
        )
        ckpt = trainer.cfg.checkpoint
        self.folder: str | None = (
            os.path.join(trainer.ctx.checkpointer.folder.path, "diloco") if ckpt.enable_checkpoint else None
        )
        if start_step > 0 and self.folder is not None:
            path = self._path(start_step)
            if os.path.isfile(path):
                self.load_state_dict(torch.load(path, map_location=self.reference[0].device, weights_only=True))
                logger.info(f"DiLoCo: reference weights and outer optimizer state of step {start_step} from {path}")
            else:
                # A checkpoint of a run without DiLoCo (or of another layout): said, not silent.
                logger.warning(
                    f"DiLoCo: no {path} (the checkpoint was not written by a DiLoCo run of this layout): "
                    f"the loaded weights are the reference weights and the outer momentum starts at zero"
                )

    def _path(self, step: int) -> str:
        assert self.folder is not None  # files are written and read only with the trainer's checkpoints
        return os.path.join(self.folder, f"step-{step}-rank-{self.trainer.rank}.pt")

    def deltas(self) -> list[torch.Tensor]:
        """This group's weight deltas since the last sync (its outer gradient), one per local shard."""
        with torch.no_grad():
            return [r - _local(p.detach()) for r, p in zip(self.reference, self.params)]

    def outer_step(self, averaged: list[torch.Tensor] | None):
        """The outer SGD step on the averaged deltas (None: a sync not committed, no step); the weights then
        become the reference weights."""
        if averaged is not None:
            for r, d in zip(self.reference, averaged):
                r.grad = d
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for r, p in zip(self.reference, self.params):
                _local(p.detach()).copy_(r)
        if getattr(self.trainer.ctx, "precompute_float8", False):  # the scales of the weights just written
            from torchtitan.components.float8 import precompute_float8_scales

            for part in self.trainer.ctx.parts:
                precompute_float8_scales(part)

    def state_dict(self) -> dict:
        return {"reference": [r.clone() for r in self.reference], "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict):
        with torch.no_grad():
            for r, received in zip(self.reference, state["reference"]):
                r.copy_(received)
        self.outer.load_state_dict(state["outer"])

    def save(self, step: int):
        """With the trainer's checkpoint of this step (checkpoint.interval, the last step): this rank's reference
        weights and outer state; the files of checkpoints no longer kept are removed."""
        t = self.trainer
        if self.folder is None or not t.ctx.checkpointer.should_save(step, t.cfg.training.steps):
            return
        os.makedirs(self.folder, exist_ok=True)
        torch.save(self.state_dict(), self._path(step) + ".partial")
        os.replace(self._path(step) + ".partial", self._path(step))
        self.prune(step)

    def prune(self, newest: int):
        assert self.folder is not None  # files are written only with the trainer's checkpoints
        suffix = f"-rank-{self.trainer.rank}.pt"
        for name in os.listdir(self.folder):
            if name.startswith("step-") and name.endswith(suffix):
                step = int(name[5 : -len(suffix)])
                if step < newest and not os.path.isdir(self.trainer.ctx.checkpointer.folder.step(step)):
                    os.remove(os.path.join(self.folder, name))


class ReplicaGroups:
    """This rank's side of the replica groups; every method does nothing when fault tolerance is off, so the
    trainer calls them unconditionally: join before the loop, start_step before the forward, average after the
    backward, should_commit before the optimizer step, end_step after it, fields in each metrics record, close at
    the end."""

    def __init__(self, cfg: FaultTolerance, start_step: int, trainer):
        self.cfg, self.store, self.trainer = cfg, None, trainer
        self.manager: torchft.Manager | None = None
        self.participants, self.waiting = 1, start_step == 0
        self.last_step, self.healed_step, self.joined = start_step, None, False
        self.diloco: DiLoCo | None = None
        # The last quorum whose group ids were checked, and whether this group's were once (_check_group_ids).
        self.checked_quorum: int | None = None
        self.ids_checked = False
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
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=cfg.min_groups,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
            connect_timeout=timeout,
            rank=trainer.rank,
            world_size=trainer.dims.world_size,
            store_addr=addr,
            store_port=int(port),
            lighthouse_addr=cfg.lighthouse,
            replica_id=f"group{cfg.group_id}",
            checkpoint_transport=weights_only_transport(timeout),
            # Every group initializes the same weights from training.seed (and loads the same checkpoint).
            init_sync=False,
        )
        self.manager.load_state_dict({"step": start_step, "batches_committed": start_step * cfg.group_count})
        # What a group that restarts behind the others heals from (state_dict, heal).
        self.manager.register_state_dict_fn("trainer", self.heal, self.state_dict)
        if cfg.sync == "diloco":
            self.diloco = DiLoCo(cfg, trainer, start_step)
        logger.info(
            f"fault tolerance: replica group {cfg.group_id} of {cfg.group_count} (at least {cfg.min_groups} "
            f"to commit a step), lighthouse {cfg.lighthouse}"
            + (
                f"; DiLoCo: the weight deltas averaged every {cfg.sync_every} step(s), outer SGD lr "
                f"{cfg.outer_lr}, momentum {cfg.outer_momentum}{', Nesterov' if cfg.outer_nesterov else ''}"
                if self.diloco
                else "; gradients averaged at every step"
            )
        )

    def join(self, start_step: int) -> int:
        """The first quorum, before the loop: a fresh run waits for all groups; a group behind the live ones (one
        restarted after it was lost) heals from one of them. Returns the step this run continues after. Called
        in every run: one resumed across data layouts (continue_data) starts its lanes at the checkpoint's step."""
        self.continue_data(start_step)
        if self.manager is None:
            return start_step
        if self.diloco is not None:
            # A quorum at this group's step: groups starting (or resuming) together only wait for each other here;
            # a group behind the live ones heals in their sync's quorum and takes part in the rest of that sync.
            self.manager.load_state_dict({"step": start_step, "batches_committed": start_step * self.cfg.group_count})
            self._quorum(start_step)
            if self.healed_step is not None:
                self.sync(self.healed_step, quorum=False)
        else:
            self.start_step(start_step + 1)
            self.joined = True  # that quorum is the first step's: every group in it goes on to the same step
        if self.healed_step is None:
            return start_step
        # The data position: this group's own lanes, advanced past the batches of the steps the others took.
        self._advance_lanes(self.healed_step - start_step)
        logger.info(
            f"fault tolerance: healed from a live replica group at step {self.healed_step} (weights, "
            f"optimizer state, learning-rate schedule; data lanes advanced)"
        )
        return self.healed_step

    def _advance_lanes(self, steps: int):
        """Read (and drop) this rank's batches of `steps` steps: its lanes then stand where a run of this layout
        stands after them."""
        t = self.trainer
        batches = iter(t.ctx.dataloader)
        for _ in range(steps * t.preflight_result.grad_accum_steps):
            next(batches)
        t.ctx.dataloader.load_state_dict(t.ctx.dataloader.state_dict())

    def continue_data(self, start_step: int):
        """The data position across layouts. A checkpoint's counters say how many replica groups wrote it
        (replica_groups; none: a normal run). Resumed by a run of another data layout (a normal run from a
        fault-tolerant one, a group from a normal run's checkpoint, or another group_count), its data state does
        not apply (checkpoint.exclude_from_loading = ['dataloader'], asked for before launch): each lane of this
        run is advanced past the checkpoint's steps, so the run reads from the next step on what its layout reads
        there, and no sample of its lanes twice. Within one layout, exclude_from_loading keeps its meaning (the
        data from the beginning)."""
        t, cfg = self.trainer, self.cfg
        counters = t.ctx.checkpointer.counters
        wrote = counters.pop("replica_groups", 0)
        reads = cfg.group_count if cfg.enabled else 0
        if cfg.enabled:
            counters["replica_groups"] = reads
        excluded = t.cfg.checkpoint.exclude_from_loading
        if start_step > 0 and wrote != reads and "dataloader" in excluded and "train_state" not in excluded:
            self._advance_lanes(start_step)
            logger.info(
                f"the checkpoint of step {start_step} was written by "
                f"{f'{wrote} replica group(s)' if wrote else 'a run without replica groups'}, another data "
                f"layout: this run's lanes start at its step (advanced past {start_step} steps)"
            )

    def state_dict(self) -> dict:
        """What a live group sends to one that heals (torchft's checkpoint transport, rank r to rank r): this rank's
        local shards of the weights and optimizer state, the schedules and the last step done."""
        t = self.trainer
        return {
            "step": self.last_step,
            "steps_taken": t.ctx.optim.steps_taken,
            "model": [_tree_local(part.state_dict()) for part in t.ctx.parts],
            "optimizers": [_tree_local(opt.state_dict()) for opt in t.ctx.optim.optimizers],
            "schedulers": [sched.state_dict() for sched in t.ctx.optim.schedulers],
            "counters": dict(t.ctx.checkpointer.counters),
            **({"diloco": self.diloco.state_dict()} if self.diloco is not None else {}),
        }

    def heal(self, state: dict):
        """Load a live group's state_dict (in start_quorum, before the step's forward)."""
        t = self.trainer
        with torch.no_grad():
            for part, received in zip(t.ctx.parts, state["model"]):
                for name, value in part.state_dict().items():
                    _local(value).copy_(received[name])
        for opt, received in zip(t.ctx.optim.optimizers, state["optimizers"]):
            params = [p for group in opt.param_groups for p in group["params"]]
            for index, values in received["state"].items():
                p = params[index]
                for key, v in values.items():
                    if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0:
                        values[key] = DTensor.from_local(
                            v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                        )
            opt.load_state_dict(received)
        for sched, received in zip(t.ctx.optim.schedulers, state["schedulers"]):
            sched.load_state_dict(received)
        t.ctx.optim.steps_taken = state["steps_taken"]
        t.ctx.checkpointer.counters.update(state["counters"])
        if self.diloco is not None:
            self.diloco.load_state_dict(state["diloco"])
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

    def _live_manager(self) -> "torchft.Manager":
        """The Manager, for the steps that only run with fault tolerance on (their callers checked it)."""
        assert self.manager is not None
        return self.manager

    def _quorum(self, done: int):
        """A quorum of the live groups, taken after step `done` (a group behind the others heals in it)."""
        manager = self._live_manager()
        self.last_step = done
        manager.start_quorum()
        deadline = time.monotonic() + self.cfg.quorum_timeout_seconds
        need = self.cfg.group_count if self.waiting and self.healed_step is None else self.cfg.min_groups
        while manager.num_participants() < need and time.monotonic() < deadline:
            time.sleep(0.2)
            manager.start_quorum()
        self.waiting = False
        if manager.num_participants() < self.cfg.min_groups:
            raise UserError(
                f"step {done + 1}: only {manager.num_participants()} replica group(s) alive for "
                f"fault_tolerance.quorum_timeout_seconds = {self.cfg.quorum_timeout_seconds}, fewer than "
                f"fault_tolerance.min_groups = {self.cfg.min_groups}; restart the lost groups (they heal from a "
                f"live one) or lower min_groups"
            )
        if manager.num_participants() != self.participants:
            logger.info(
                f"fault tolerance: {manager.num_participants()} replica group(s) in this step's "
                f"quorum (was {self.participants})"
            )
        self.participants = manager.num_participants()
        self._check_group_ids(done)

    def _check_group_ids(self, done: int):
        """Every group of a new quorum has a group_id of its own. Two groups started with one id would each read
        that id's data lanes: the job would train those batches twice per step and another group's never, and
        exit 0. torchft tells such groups apart (their replica ids carry a random suffix), so they meet in one
        quorum; there each group adds its id, and whether it is new to the quorums, to one small sum. A group
        that joins with an id a live group already has stops (exit 2), and the live group trains on (the step
        in flight is not committed, as when a group dies); two that start together with one id both stop.
        Every member of a quorum sees the same quorum id, so all of them (and only they) take part in the sum."""
        manager = self._live_manager()
        quorum_id = manager._quorum_id  # torchft 0.2.0 has no public accessor for it
        if quorum_id == self.checked_quorum:
            return
        self.checked_quorum = quorum_id
        joining = not self.ids_checked
        g = self.cfg.group_count
        ids = torch.zeros(2 * g, dtype=torch.float32)
        ids[self.cfg.group_id] = 1
        ids[g + self.cfg.group_id] = 1 if joining else 0
        from torch.distributed import ReduceOp

        manager.allreduce(ids, reduce_op=ReduceOp.SUM).wait()
        if manager.errored() is not None:  # a group lost during the sum: the next quorum (a new one) checks
            return
        self.ids_checked = True
        holders, newcomers = int(ids[self.cfg.group_id]), int(ids[g + self.cfg.group_id])
        if holders > 1 and (joining or holders - newcomers > 1):
            live = holders - newcomers
            raise UserError(
                f"step {done + 1}: fault_tolerance.group_id = {self.cfg.group_id} is the id of {holders} replica "
                f"groups in this quorum"
                + (f" ({live} of them already training)" if live and joining else "")
                + f"; each group reads the data lanes of its id, so they would train the same batches; start each "
                f"group with its own fault_tolerance.group_id, 0..{g - 1}"
            )

    def average(self, params: Sequence[torch.Tensor], loss_sum: torch.Tensor):
        """Average this rank's gradients (local shards) and its summed loss over the live groups, in place: one
        flat all-reduce per dtype. A group lost during it leaves the step uncommitted (should_commit)."""
        if self.manager is None or self.diloco is not None:  # diloco: each group's own gradients
            return
        from torch.distributed import ReduceOp

        tensors = [_local(p.grad) for p in params if p.grad is not None] + [loss_sum]
        # An MoE model's expert loads of the step are summed over the groups, as over the ranks of one run, so that
        # every group moves its expert bias alike (moe.update_expert_bias) and keeps the same routing.
        counts = [m.tokens_per_expert for part in self.trainer.ctx.parts for _, m in moe_layers(part)]
        # One flat all-reduce per dtype, in the same order on every rank of every group.
        dtypes = sorted({t.dtype for t in tensors}, key=str)
        batches = [([t for t in tensors if t.dtype == dtype], ReduceOp.AVG) for dtype in dtypes]
        for same, op in batches + ([(counts, ReduceOp.SUM)] if counts else []):
            flat = torch.cat([t.reshape(-1) for t in same])
            self.manager.allreduce(flat, reduce_op=op).wait()
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def should_commit(self, step: int) -> bool:
        """Whether every rank of every live group got through the step: then its optimizer step is taken. A step
        not committed is dropped like a skipped step: its batches are not trained and its learning rate is spent
        (the schedules advance, so that step N always trains at step N's rate); uncommitted_steps counts them. Under
        diloco every step is the group's own (the groups vote on each sync instead, end_step)."""
        if self.manager is None or self.diloco is not None:
            return True
        if self.manager.should_commit():
            return True
        t = self.trainer
        t.ctx.optim.zero_grad()
        t.ctx.optim.step_schedulers()
        t.ctx.checkpointer.counters["uncommitted_steps"] = t.ctx.checkpointer.counters.get("uncommitted_steps", 0) + 1
        for part in self.trainer.ctx.parts:  # the dropped step's expert loads move no expert bias
            for _, m in moe_layers(part):
                m.tokens_per_expert.zero_()
        logger.warning(f"step {step}: not committed ({self._why()}); its update is dropped")
        return False

    def end_step(self, step: int):
        """After the step's update. Under diloco, every sync_every steps and at the last step: the sync."""
        if self.diloco is None:
            return
        if step % self.cfg.sync_every == 0 or step == self.trainer.cfg.training.steps:
            self.sync(step)
        self.diloco.save(step)  # with the trainer's checkpoint of this step, if one is due

    def sync(self, step: int, quorum: bool = True):
        """DiLoCo's outer step after step `step`, through the Manager as a step is under every_step: a quorum of the
        live groups (a group behind heals in it, outer state included), the average of the weight deltas since the
        last sync, a commit vote; committed, the outer optimizer applies the average to the reference weights,
        otherwise the local steps since the last sync are dropped. The weights are then the reference weights.
        A group that heals in the quorum takes part with the state it received, so that the sender's delta counts
        twice in that sync (as in torchft's DiLoCo, whose healed replicas take part too)."""
        manager = self._live_manager()
        diloco = self.diloco
        assert diloco is not None  # a sync is DiLoCo's
        if quorum:
            # The Manager's step is the trainer's: a group that restarted behind the others (a lower step) heals.
            manager.load_state_dict({"step": step, "batches_committed": step * self.cfg.group_count})
            self._quorum(step)
        deltas = diloco.deltas()
        # An MoE model's expert biases (its balancing state, a buffer each group moves by its own loads between
        # syncs) become their mean, so that after a sync every group routes alike.
        biases = [m.expert_bias for part in self.trainer.ctx.parts for _, m in moe_layers(part)]
        mean_biases = [b.clone() for b in biases]
        self._allreduce(deltas + mean_biases)
        committed = manager.should_commit()
        diloco.outer_step(deltas if committed else None)
        if committed:
            for b, mean in zip(biases, mean_biases):
                b.copy_(mean)
        else:
            counters = self.trainer.ctx.checkpointer.counters
            counters["uncommitted_syncs"] = counters.get("uncommitted_syncs", 0) + 1
            logger.warning(
                f"step {step}: the DiLoCo sync is not committed ({self._why()}); the weights go back to "
                f"those of the last sync"
            )

    def _allreduce(self, tensors: list[torch.Tensor]):
        """Average `tensors` in place over the live groups: one flat all-reduce per dtype."""
        manager = self._live_manager()
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in same])
            manager.allreduce(flat).wait()
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _why(self) -> str:
        """Why the step (or sync) is not committed, in a line."""
        manager = self._live_manager()
        error = manager.errored()
        if error is None:
            return f"fewer than fault_tolerance.min_groups = {self.cfg.min_groups} groups took part"
        return f"a replica group failed during it: {collective_error(error.original_exception)}"

    def fields(self) -> dict:
        """What a metrics record says of the groups: how many took part in the last step (the last sync under
        diloco), and how many steps (syncs) were not committed so far."""
        if self.manager is None:
            return {}
        counters = self.trainer.ctx.checkpointer.counters
        key = "uncommitted_syncs" if self.diloco is not None else "uncommitted_steps"
        return {"replica_groups": self.participants, key: counters.get(key, 0)}

    def close(self):
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
