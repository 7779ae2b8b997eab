"""Loading a checkpoint into a live run: a full resume, a model-only start, or Hugging Face weights.

A checkpoint loads into any layout: DCP reshards by parameter name, and every optimizer group (one
per semantic group and device mesh; a pipeline stage holds some) takes the saved learning rate
scaled by its own lr multiplier.
"""

import logging
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from torchtitan.components.checkpoint.hf_sharded import load_hf_into
from torchtitan.components.checkpoint.state import RunState
from torchtitan.components.checkpoint.storage import (
    SafeFileSystemReader,
    check_model_matches,
    describe_failure,
    read_metadata,
    read_rng,
    read_train_state,
)
from torchtitan.config import UserError

logger = logging.getLogger(__name__)


def load_checkpoint(run: RunState, path: str, model_only: bool, resuming: bool, excluded: set[str]) -> tuple[int, int]:
    """Load the checkpoint at `path` (verified) into `run`, but for the parts named in `excluded`
    (checkpoint.exclude_from_loading); returns (step, tokens) to continue from. The RNG states are
    restored later, by restore_rng."""
    start = time.perf_counter()
    state = read_train_state(path)
    metadata = read_metadata(path)
    saved_model = state.get("model", {})
    if saved_model.get("name") != run.model_info["name"]:
        raise UserError(
            f"checkpoint {path} holds model '{saved_model.get('name')}' ({saved_model.get('flavor')}), "
            f"this job trains '{run.model_info['name']}' ({run.model_info['flavor']})"
        )
    model_sds = run.model_sds()
    model_sd = {k: v for sd in model_sds for k, v in sd.items()}
    check_model_matches(path, metadata, model_sd, partial=len(run.parts) > 1 or run.model_info.get("pipelined", False))
    model_only = model_only or state.get("model_only", False)
    if model_only and resuming and state["step"] > 0:
        raise UserError(
            f"the newest checkpoint {path} holds model weights only (checkpoint.last_save_model_only), so "
            f"training cannot resume from it; pick a full checkpoint with --checkpoint.load_step, or start a "
            f"new run from these weights with --checkpoint.initial_load_path {path} in another dump_folder"
        )
    to_load: dict[str, Any] = {}
    if "model" not in excluded:
        to_load["model"] = model_sd
    load_optimizer = not model_only and "optimizer" not in excluded
    optim_sds: list[dict] = []
    if load_optimizer:
        optim_sds = run.optim_sds()
        to_load["optimizer"] = {"state": run.optim_state_to_store(optim_sds)}
    try:
        dcp.load(to_load, storage_reader=SafeFileSystemReader(path), no_dist=not run.peers.distributed)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise UserError(f"checkpoint {path} could not be read: {describe_failure(e)}") from None
    if "model" in to_load:
        for part, sd in zip(run.parts, model_sds):
            set_model_state_dict(part, sd)
    # The lr multipliers of the saving run's first optimizer's groups (absent before multipliers: all 1).
    saved_mults = (state.get("lr_scheduler") or {}).get("lr_mults")
    if load_optimizer:
        run.share_loaded_optim_state(optim_sds, to_load["optimizer"]["state"])
        for part, opt, sd in zip(run.parts, run.optimizers, optim_sds):
            set_optimizer_state_dict(part, opt, sd)
            # Groups differ between layouts (one per semantic group and device mesh, a pipeline stage
            # holds some): each gets the saved unmultiplied learning rate times its own lr multiplier.
            for group in opt.param_groups:
                group["lr"] = _scaled(_unscaled(state["optimizer_lrs"], saved_mults), group)
    if model_only:
        logger.info(f"loaded model weights from {path} in {time.perf_counter() - start:.1f}s")
        return 0, 0
    if "lr_scheduler" not in excluded:
        _restore_schedules(run, state["lr_scheduler"], saved_mults)
    if "dataloader" not in excluded:
        run.dataloader.load_state_dict(state["dataloader"])
    run.counters.update(state.get("counters", {}))
    run.rng_source = (path, state)  # restored by restore_rng, right before the next step
    step, tokens = (0, 0) if "train_state" in excluded else (state["step"], state["tokens"])
    logger.info(f"resumed from {path} (step {state['step']}) in {time.perf_counter() - start:.1f}s")
    return step, tokens


def _restore_schedules(run: RunState, saved_scheduler: dict, saved_mults: list[float] | None):
    for sched, opt in zip(run.lr_schedulers, run.optimizers):
        # The saved per-group lists are the saving layout's groups; this layout's groups take the
        # saved unmultiplied peak times their own multiplier, and the schedule's value at the saved
        # step (bit for bit what the uninterrupted run has there).
        saved = dict(saved_scheduler, lr_lambdas=[None])
        saved.pop("lr_mults", None)
        peak = _unscaled(saved["base_lrs"], saved_mults)
        saved["base_lrs"] = [_scaled(peak, group) for group in opt.param_groups]
        sched.load_state_dict(saved)
        for group, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(sched.last_epoch)
        sched._last_lr = [group["lr"] for group in opt.param_groups]


def _unscaled(values: list[float], mults: list[float] | None) -> float:
    """The unmultiplied learning rate from a saved per-group list: a group without a multiplier's value
    (exact), else the first group's divided by its multiplier."""
    mults = mults or [1.0] * len(values)
    for value, mult in zip(values, mults):
        if mult == 1.0:
            return value
    return values[0] / mults[0]


def _scaled(lr: float, group: dict) -> float:
    """A group's learning rate from the unmultiplied one, as the optimizer built it (peak x multiplier)."""
    mult = group.get("lr_mult", 1.0)
    return lr if mult == 1.0 else lr * mult


def restore_rng(run: RunState):
    """Put back the loaded checkpoint's RNG states. Called by the trainer after its start-up, which
    draws random numbers too (a restore before it would put the run ahead of the saved one)."""
    if run.rng_source is None:
        return
    path, state = run.rng_source
    run.rng_source = None
    if state.get("world_size") != run.peers.world_size:
        logger.info(
            f"checkpoint saved by {state.get('world_size')} ranks, loading on {run.peers.world_size}: "
            f"random-number generators are not restored (the training step draws no random numbers)"
        )
        return
    rng = read_rng(path, run.peers.rank)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and run.peers.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], run.peers.device)


def load_hf_weights(run: RunState, path: str) -> dict:
    """Fill the model parts from the Hugging Face folder at `path`, each rank reading only its shards;
    returns load_hf_into's figures."""
    start = time.perf_counter()
    info = run.model_info
    figures = load_hf_into(run.parts, path, info["hf_adapter"], info["hf_args"], info["shapes"])
    growth = (
        ""
        if figures["peak_growth"] is None
        else f"; its resident memory peaked {figures['peak_growth'] / 2**20:,.1f} MiB above its size before"
    )
    logger.info(
        f"loaded initial weights from the Hugging Face folder {path} in {time.perf_counter() - start:.1f}s "
        f"(this rank read {figures['bytes_read'] / 2**20:,.1f} MiB of its {figures['folder_bytes'] / 2**20:,.1f} "
        f"MiB{growth})"
    )
    return figures
