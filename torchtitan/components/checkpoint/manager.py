"""The trainer's checkpoints: resume at start-up, save at intervals, export Hugging Face weights, write
the seed checkpoint. Checkpoints never lose a run: exact resume, resharding to any layout, crash safety.

A run never writes over an existing checkpoint: it refuses to start if it would.
"""

import logging
import os
import time

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from torchtitan.components import watchdog
from torchtitan.components.checkpoint.async_save import AsyncSaves
from torchtitan.components.checkpoint.folders import CheckpointFolder, Peers
from torchtitan.components.checkpoint.hf_sharded import save_hf_sharded
from torchtitan.components.checkpoint.load import load_checkpoint, load_hf_weights, restore_rng
from torchtitan.components.checkpoint.resume import choose_checkpoint
from torchtitan.components.checkpoint.state import RunState
from torchtitan.components.checkpoint.storage import complete_checkpoints, describe_failure
from torchtitan.config import Checkpoint as CheckpointConfig, UserError
from torchtitan.distributed.dtypes import DTYPES

logger = logging.getLogger(__name__)


class CheckpointManager:
    def __init__(
        self,
        cfg: CheckpointConfig,
        dump_folder: str,
        model_parts: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        lr_schedulers: list,
        dataloader,
        model_info: dict,
        device: torch.device,
    ):
        self.cfg = cfg
        peers = Peers.of_this_process(device)
        self.folder = CheckpointFolder(os.path.join(dump_folder, cfg.folder), peers)
        self.run = RunState(model_parts, optimizers, lr_schedulers, dataloader, model_info, peers)
        self.async_saves = None
        if cfg.enable_checkpoint:
            self.folder.prepare()
            if cfg.async_mode != "disabled":
                self.async_saves = AsyncSaves(cfg.async_mode, self.folder, cfg.keep_latest_k)

    @property
    def counters(self) -> dict[str, int]:
        """The run's running totals (e.g. skipped_steps), saved and restored with it."""
        return self.run.counters

    # -- loading --------------------------------------------------------------------------------

    def load(self) -> tuple[int, int]:
        """Restore the run's state if there is one (resume.choose_checkpoint), else the initial
        weights if any; returns (step, tokens) to continue from."""
        if self.cfg.enable_checkpoint:
            path = choose_checkpoint(self.folder, self.cfg.load_step)
            if path is not None:
                return self._load(path, model_only=False, resuming=True)
        if self.cfg.initial_load_path:
            return self._load_initial(self.cfg.initial_load_path)
        return 0, 0

    def _load_initial(self, path: str) -> tuple[int, int]:
        # The path's existence was checked by preflight_checkpoint.
        if self.cfg.initial_load_in_hf:
            self.hf_load_figures = load_hf_weights(self.run, path)
            return 0, 0
        problem = self.folder.verify(path)
        if problem is not None:
            raise UserError(f"checkpoint.initial_load_path: {problem}")
        return self._load(path, model_only=self.cfg.initial_load_model_only, resuming=False)

    def _load(self, path: str, model_only: bool, resuming: bool) -> tuple[int, int]:
        return load_checkpoint(self.run, path, model_only, resuming, set(self.cfg.exclude_from_loading))

    def restore_rng(self):
        """Put back the loaded checkpoint's RNG states. Called by the trainer after its start-up, which
        draws random numbers too (a restore before it would put the run ahead of the saved one)."""
        restore_rng(self.run)

    # -- saving ---------------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        if not self.cfg.enable_checkpoint:
            return False
        return (
            step % self.cfg.interval == 0 or step == last_step or (step == 1 and self.cfg.enable_first_step_checkpoint)
        )

    def save(self, step: int, tokens: int, last: bool = False):
        # Bounded by comm.checkpoint_timeout_seconds: storage that stops answering ends the run (watchdog.py).
        with watchdog.phase("checkpoint", f"writing checkpoint step-{step}"):
            self._save(step, tokens, last)

    def _save(self, step: int, tokens: int, last: bool):
        self.wait()
        if os.path.exists(self.folder.step(step)):
            raise UserError(f"checkpoint {self.folder.step(step)} already exists; refusing to overwrite it")
        model_only = last and self.cfg.last_save_model_only
        start = time.perf_counter()
        partial = self.folder.partial(step)
        state = self.run.state_dict(model_only, self.cfg.export_dtype)
        train_state = self.run.train_state(step, tokens, model_only, self.cfg.export_dtype)
        error = None
        try:
            if self.folder.peers.rank == 0:
                os.makedirs(partial, exist_ok=True)
        except OSError as e:
            error = str(e)
        self.folder.agree_or_abandon(error, step)
        if self.async_saves is not None and not last:
            self.async_saves.start(state, step, lambda: self.run.write_side_files(partial, train_state, model_only))
            logger.info(
                f"checkpoint step-{step}: state staged in {time.perf_counter() - start:.2f}s, writing in the background"
            )
            return
        try:
            self.run.write(partial, state, train_state, model_only)
        except (OSError, CheckpointException) as e:  # CheckpointException (DCP's errors) is a BaseException
            error = describe_failure(e)
        self.folder.agree_or_abandon(error, step)
        self.folder.publish(step, self.cfg.keep_latest_k)
        logger.info(
            f"saved {'model-only ' if model_only else ''}checkpoint {self.folder.step(step)} in "
            f"{time.perf_counter() - start:.2f}s"
        )

    def maybe_publish(self):
        """Called every step: publish a finished async save once every rank's writes are done."""
        if self.async_saves is not None:
            self.async_saves.maybe_publish()

    def wait(self):
        """Block until a pending async save is written and published."""
        if self.async_saves is not None:
            self.async_saves.wait()

    def close(self):
        if self.async_saves is not None:
            self.async_saves.close()

    # -- exports --------------------------------------------------------------------------------

    def export_hf(
        self, step: int, bos_id: int | None, eos_id: int | None, mesh=None, tokenizer_path: str | None = None
    ):
        """Write the current weights as a Hugging Face folder {folder}/step-N-hf, every rank writing
        its share of the files (hf_sharded.save_hf_sharded); `mesh`: the job's DeviceMesh."""
        start = time.perf_counter()
        out = os.path.join(self.folder.path, f"step-{step}-hf")
        info = self.run.model_info
        figures = save_hf_sharded(
            out,
            self.run.parts,
            info["hf_adapter"],
            info["hf_args"],
            info["shapes"],
            DTYPES[self.cfg.export_dtype],
            mesh,
            self.cfg.hf_max_shard_mb * 2**20,
            bos_id=bos_id,
            eos_id=eos_id,
            tokenizer_path=tokenizer_path,
        )
        logger.info(
            f"exported Hugging Face weights to {out} in {time.perf_counter() - start:.1f}s "
            f"(this rank wrote {len(figures['files'])} file(s))"
        )

    def save_seed(self):
        """Write the freshly initialized weights as the model-only step-0 checkpoint."""
        partial = self.folder.partial(0)
        if complete_checkpoints(self.folder.path):
            raise UserError(
                f"{self.folder.path} already holds checkpoints; a seed checkpoint goes into an empty checkpoint folder"
            )
        os.makedirs(partial, exist_ok=True)
        state = self.run.train_state(0, 0, model_only=True, export_dtype=self.cfg.export_dtype)
        state["dtype"] = "float32"
        self.run.write(partial, {"model": get_model_state_dict(self.run.parts[0])}, state, model_only=True)
        self.folder.publish(0, self.cfg.keep_latest_k)
        logger.info(f"wrote seed checkpoint {self.folder.step(0)}")
