"""Which checkpoint a run continues from: checked from the files alone before launch
(preflight_checkpoint), then chosen by all ranks together at start-up (choose_checkpoint).

Resuming takes the newest checkpoint that verifies; a damaged newer one is renamed corrupt-step-N
(kept, out of the step-N namespace, so that neither loading nor purging sees it again).
`load_step` may choose an older one; newer ones are renamed superseded-step-N, since the run now
continues from the older one.
"""

import logging
import os

from torchtitan.components.checkpoint.folders import CheckpointFolder
from torchtitan.components.checkpoint.storage import check_writable, complete_checkpoints, read_train_state, step_path
from torchtitan.config import Checkpoint as CheckpointConfig, UserError

logger = logging.getLogger(__name__)


def preflight_checkpoint(
    cfg: CheckpointConfig,
    dump_folder: str,
    world_size: int,
    device_type: str,
    seq_len: int,
    global_batch_size: int,
    last_step: int,
):
    """File-level checks that need no process group, run before launch and on every rank: whatever the run will
    write to (its checkpoints, its seed checkpoint, its Hugging Face export after `last_step`) can take it without
    replacing anything, and what it resumes from fits the job."""
    if cfg.create_seed_checkpoint and world_size != 1:
        raise UserError(
            f"checkpoint.create_seed_checkpoint runs on one process (the job has {world_size}); launch it with NGPU=1"
        )
    if cfg.async_mode == "async_with_pinned_mem" and device_type != "cuda":
        raise UserError(
            'checkpoint.async_mode = "async_with_pinned_mem" stages through pinned memory, which needs CUDA; '
            'on CPU use async_mode = "async"'
        )
    if cfg.initial_load_path and not os.path.isdir(cfg.initial_load_path):
        raise UserError(f"checkpoint.initial_load_path {cfg.initial_load_path} does not exist or is not a folder")
    folder = os.path.join(dump_folder, cfg.folder)
    if cfg.create_seed_checkpoint and complete_checkpoints(folder):
        raise UserError(
            f"checkpoint.create_seed_checkpoint writes step-0 into an empty checkpoint folder, and {folder} already "
            f"holds checkpoints (step-{complete_checkpoints(folder)[-1]}); choose another job.dump_folder"
        )
    if not cfg.enable_checkpoint:
        _check_hf_export_folder(cfg, folder, last_step, resumes_at=0)
        return
    if cfg.load_step != -1 and cfg.load_step not in complete_checkpoints(folder):
        steps = complete_checkpoints(folder)
        raise UserError(
            f"checkpoint.load_step = {cfg.load_step}: no complete checkpoint step-{cfg.load_step} in {folder}; "
            f"available steps: {', '.join(map(str, steps)) or 'none'}"
        )
    check_writable(folder, "checkpoints")
    steps = complete_checkpoints(folder)
    if "train_state" in cfg.exclude_from_loading and steps:
        raise UserError(
            f"checkpoint.exclude_from_loading names train_state, so step numbers restart at 0, but {folder} already "
            f"holds step-{steps[-1]}: the new run's checkpoints would sort before the one it started from (and be "
            f"purged first). Start the new run in another job.dump_folder with --checkpoint.initial_load_path "
            f"{folder}/step-{steps[-1]} --checkpoint.no-initial_load_model_only "
            "(exclude_from_loading applies there too)"
        )
    resume_state = _resume_state(folder, cfg.load_step, steps)
    _check_hf_export_folder(cfg, folder, last_step, resumes_at=(resume_state or {}).get("step", 0))
    # Global sample positions depend on these; a data state that is not loaded holds none.
    if resume_state is not None and "dataloader" not in cfg.exclude_from_loading:
        resume_step = resume_state.get("step")
        saved = resume_state.get("dataloader", {}).get("dataset_state", {})
        for key, now in (("seq_len", seq_len), ("global_batch_size", global_batch_size)):
            if key in saved and saved[key] != now:
                raise UserError(
                    f"the run resumes from {folder}/step-{resume_step}, saved with training.{key} = {saved[key]}, "
                    f"but this job has {now}; global sample positions depend on it, so keep {key} = {saved[key]} "
                    f"(with a new data-parallel degree, adjust local_batch_size so the global batch stays the same)"
                    + (
                        ""
                        if key == "seq_len"
                        else ". Replica groups (fault_tolerance) read group_count x the group's global batch: "
                        "between a fault-tolerant run and a normal one, or another group_count, resume with "
                        "--checkpoint.exclude_from_loading dataloader (the lanes then start at the checkpoint's step; "
                        "docs/launching.md)"
                    )
                )


def _check_hf_export_folder(cfg: CheckpointConfig, folder: str, last_step: int, resumes_at: int):
    """checkpoint.last_save_in_hf writes {folder}/step-{last_step}-hf after the last step, into a new folder: an
    existing one is refused now rather than after the run (a run that resumes at its last step trains and exports
    nothing)."""
    if not cfg.last_save_in_hf or resumes_at >= last_step:
        return
    export = os.path.join(folder, f"step-{last_step}-hf")
    if os.path.exists(export) and (not os.path.isdir(export) or os.listdir(export)):
        raise UserError(
            f"checkpoint.last_save_in_hf would export the model to {export} after step {last_step}, and it already "
            f"exists (an earlier run's export?); move it away, choose another job.dump_folder, or turn "
            f"checkpoint.last_save_in_hf off"
        )
    check_writable(folder, "the Hugging Face export")


def _resume_state(folder: str, load_step: int, steps: list[int]) -> dict | None:
    """The train_state.json a run would resume from, as far as files tell before launch: load_step's,
    else the newest that reads (the trainer resumes from the newest that verifies)."""
    if load_step != -1:
        return read_train_state(step_path(folder, load_step))
    for step in reversed(steps):
        try:
            return read_train_state(step_path(folder, step))
        except UserError:
            continue
    return None


def choose_checkpoint(folder: CheckpointFolder, load_step: int) -> str | None:
    """The checkpoint all ranks resume from (None: the folder holds none), after setting aside the
    newer ones it passes over."""
    steps = complete_checkpoints(folder.path)
    if load_step != -1:
        # preflight_checkpoint explained a missing step before launch.
        if load_step not in steps:
            raise ValueError(f"checkpoint step-{load_step} vanished from {folder.path} after preflight")
        problem = folder.verify(folder.step(load_step))
        if problem is not None:
            raise UserError(f"{problem}; choose another checkpoint.load_step (complete: {', '.join(map(str, steps))})")
        newer = [s for s in steps if s > load_step]
        folder.set_aside(newer, "superseded", f"checkpoint.load_step = {load_step} continues from an older checkpoint")
        return folder.step(load_step)
    skipped: list[tuple[int, str]] = []
    for step in reversed(steps):
        problem = folder.verify(folder.step(step))
        if problem is None:
            for bad, why in skipped:
                logger.warning(f"skipping checkpoint step-{bad}: {why}")
            folder.set_aside([bad for bad, _ in skipped], "corrupt", f"resuming from the older step-{step}")
            return folder.step(step)
        skipped.append((step, problem))
    if skipped:
        raise UserError(
            f"no checkpoint in {folder.path} can be loaded: "
            + "; ".join(why for _, why in skipped)
            + ". Nothing was moved or deleted; repair them, or move them away to start a new run"
        )
    return None
