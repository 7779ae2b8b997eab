"""Checkpoints that never lose a run: exact resume, resharding to any layout, crash safety.

A checkpoint is a folder `{dump_folder}/{folder}/step-N` holding:
- torch.distributed.checkpoint (DCP) files for `{"model": ..., "optimizer": {"state": ...}}`, keyed
  by parameter names (FQNs), never by rank or shard: any layout can load what any layout saved;
- `train_state.json`: step, tokens, model name/flavor/args, LR-scheduler state, the optimizer's
  current learning rates, the data loader's position in the global sample stream, the world size;
- `rng/rank-R.safetensors`: each rank's RNG states (restored when the world size is unchanged).
- `checksums/rank-R.json`: size and CRC-32 of every file rank R wrote, checked before a load.
No Python object is pickled into a checkpoint (tensors go to DCP/safetensors, the rest to JSON), and
DCP's own `.metadata` is read with an unpickler that accepts exact (module, name) pairs only.

Resuming takes the newest checkpoint that verifies; a damaged newer one is renamed corrupt-step-N
(kept, out of the step-N namespace). `load_step` may choose an older one; newer ones are renamed
superseded-step-N. Purging never deletes the newest checkpoint training can resume from.

Crash safety: every save is written to `.step-N.partial` and renamed to `step-N` only after every
rank has finished writing (a rename within one folder is atomic). A folder named `step-N` is thus
always complete; a process killed at any moment leaves at most a `.partial` folder, which is never
loaded and is cleared by the next run. Old checkpoints are deleted only after a newer one is
published (keep_latest_k), by renaming them out of the `step-N` namespace first. A run never writes
over an existing checkpoint: it refuses to start if it would.

Async saves (async_mode = "async"): the state is copied to host memory before training continues and
the files are written by a background thread over a separate gloo group; every step the ranks agree
(a one-element all-reduce) whether all writes are done, and only then publish. A new save first
waits for the previous one, so saves never overlap.
"""

import json
import logging
import os
import pickle
import re
import shutil
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan.config import Checkpoint as CheckpointConfig
from torchtitan.config import UserError
from torchtitan.distributed.utils import DTYPES

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "train_state.json"
CHECKSUM_DIR = "checksums"
FORMAT_VERSION = 2  # 2: with checksums; 1 (read, not written): without


# ---------------------------------------------------------------------------------------------
# Reading checkpoint folders without trusting them


class _MetadataUnpickler(pickle.Unpickler):
    """DCP writes its .metadata with pickle; accept exactly the (module, name) pairs that file is made
    of. No module prefixes and no dotted names: pickle resolves "a.b" as an attribute path, which
    would reach any object importable from an allowed module. Every allowed callable only builds data."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"), ("torch", "float64"),
        ("torch", "int64"), ("torch", "int32"), ("torch", "int8"), ("torch", "uint8"), ("torch", "bool"),
        ("torch", "float8_e4m3fn"), ("torch", "float8_e5m2"),
        ("torch.serialization", "_get_layout"),  # looks a layout up by name in a fixed table
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # the checkpoint id DCP records
    }

    def find_class(self, module: str, name: str):
        if "." not in name and (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a checkpoint never holds")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any):
        path = os.path.join(self.path, ".metadata")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def complete_checkpoints(folder: str) -> list[int]:
    """Steps of the published (hence complete) checkpoints in `folder`, oldest first."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(folder, name, STATE_FILE)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def train_state_record(
    step: int,
    tokens: int,
    model_only: bool,
    world_size: int,
    model: dict,
    dtype: str,
    optimizer_lrs: list[float] | None = None,
    lr_scheduler: dict | None = None,
    dataloader: dict | None = None,
    counters: dict[str, int] | None = None,
) -> dict:
    """The train_state.json object (the one schema, for the trainer's saves and converted weights).
    `model` is {"name", "flavor", "args": dataclasses.asdict(args)}; the last three are absent from
    model-only checkpoints. `counters` are the run's running totals (e.g. skipped_steps)."""
    record = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "tokens": tokens,
        "model_only": model_only,
        "world_size": world_size,
        "model": model,
        "dtype": dtype,
    }
    if optimizer_lrs is not None:
        record.update(optimizer_lrs=optimizer_lrs, lr_scheduler=lr_scheduler, dataloader=dataloader)
    if counters:
        record["counters"] = counters
    return record


def read_train_state(path: str) -> dict:
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_path):
        raise UserError(f"{path} is not a complete checkpoint: {STATE_FILE} is missing")
    try:
        with open(state_path) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint {path} is corrupt: {STATE_FILE} cannot be read ({e})") from None
    if not isinstance(state, dict) or state.get("format_version") not in (1, FORMAT_VERSION):
        raise UserError(f"checkpoint {path} has an unknown format (format_version {state.get('format_version')!r})")
    return state


def read_metadata(path: str):
    """DCP metadata after checking that every data file it names exists and is long enough."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise UserError(f"{path} is not a complete checkpoint: its DCP .metadata file is missing")
    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    except Exception as e:  # truncated or foreign file
        raise UserError(f"checkpoint {path} is corrupt: its .metadata cannot be read ({e})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise UserError(f"checkpoint {path} is corrupt: data file {name} is missing")
        if os.path.getsize(file) < size:
            raise UserError(
                f"checkpoint {path} is corrupt: data file {name} has {os.path.getsize(file)} bytes, "
                f"{size} expected (truncated)"
            )
    return metadata


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_checksums(folder: str, rank: int):
    """Record the size and CRC-32 of every file this rank wrote into the checkpoint `folder` (its DCP
    data files `__{rank}_*.distcp` and RNG file; rank 0 also .metadata and train_state.json), so that
    flipped or lost bytes are found before a load instead of being trained on."""
    names = sorted(n for n in os.listdir(folder) if n.startswith(f"__{rank}_") and n.endswith(".distcp"))
    names += [n for n in (os.path.join("rng", f"rank-{rank}.safetensors"),) if os.path.isfile(os.path.join(folder, n))]
    if rank == 0:
        names += [".metadata", STATE_FILE]
    files = {n: [os.path.getsize(os.path.join(folder, n)), _crc32(os.path.join(folder, n))] for n in names}
    os.makedirs(os.path.join(folder, CHECKSUM_DIR), exist_ok=True)
    out = os.path.join(folder, CHECKSUM_DIR, f"rank-{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"algorithm": "crc32", "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(out + ".tmp", out)


def verify_checkpoint(path: str, rank: int = 0, world_size: int = 1) -> str | None:
    """What is wrong with the checkpoint at `path`, or None. Every rank reads the small files; rank r
    compares the bytes of every world_size-th file with its recorded checksum."""
    try:
        version = read_train_state(path)["format_version"]
        metadata = read_metadata(path)
    except UserError as e:
        return str(e)
    records = os.path.join(path, CHECKSUM_DIR)
    if version == 1 and not os.path.isdir(records):
        return None  # written before checksums existed: sizes were checked, bytes cannot be
    if not os.path.isdir(records):
        return f"checkpoint {path} is corrupt: its {CHECKSUM_DIR} folder is missing"
    files: dict[str, list] = {}
    for name in sorted(os.listdir(records)):
        try:
            with open(os.path.join(records, name)) as f:
                files.update(json.load(f)["files"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"checkpoint {path} is corrupt: {CHECKSUM_DIR}/{name} cannot be read ({e})"
    needed = {info.relative_path for info in (metadata.storage_data or {}).values()} | {".metadata", STATE_FILE}
    unrecorded = sorted(needed - set(files))
    if unrecorded:
        return f"checkpoint {path} is corrupt: no checksum recorded for {', '.join(unrecorded[:3])}"
    for i, (name, (size, crc)) in enumerate(sorted(files.items())):
        if i % world_size != rank:
            continue
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"checkpoint {path} is corrupt: {name} is missing"
        if os.path.getsize(file) != size:
            return f"checkpoint {path} is corrupt: {name} has {os.path.getsize(file)} bytes, {size} were written"
        if _crc32(file) != crc:
            return f"checkpoint {path} is corrupt: the bytes of {name} differ from those written (checksum mismatch)"
    return None


def storage_state(folder: str) -> str:
    """Free space where `folder` lives and any file-size limit: what a failed write most often hits
    (torch's writers may report it only as a short write)."""
    import resource

    parts = []
    try:
        st = os.statvfs(folder)
        parts.append(f"{st.f_bavail * st.f_frsize / 2**20:,.1f} MiB free on its filesystem")
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        parts.append(f"this process's file-size limit (ulimit -f) is {soft:,} bytes")
    return "; ".join(parts) or "free space unknown"


def describe_failure(e: BaseException) -> str:
    """The underlying errors of a DCP CheckpointException (one per failed rank), or the error itself."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}" if not isinstance(e, OSError) else str(e)


def check_model_matches(path: str, metadata, model_sd: dict, prefix: str = "model.", partial: bool = False):
    """Name the first keys and shapes in which the checkpoint and the model differ. A pipeline rank
    holds part of the model (`partial`): the checkpoint may then hold keys this rank does not."""
    stored = {k[len(prefix):]: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    wanted = {k: tuple(v.shape) for k, v in model_sd.items()}
    missing = [k for k in wanted if k not in stored]
    unexpected = [] if partial else [k for k in stored if k not in wanted]
    shapes = [f"{k}: checkpoint {stored[k]} vs model {wanted[k]}" for k in wanted if k in stored and stored[k] != wanted[k]]
    if missing or unexpected or shapes:
        lines = []
        if shapes:
            lines.append("shape mismatches: " + "; ".join(shapes[:3]))
        if missing:
            lines.append(f"{len(missing)} model keys not in the checkpoint, e.g. " + ", ".join(missing[:3]))
        if unexpected:
            lines.append(f"{len(unexpected)} checkpoint keys not in the model, e.g. " + ", ".join(unexpected[:3]))
        raise UserError(
            f"checkpoint {path} does not fit this model (was it saved from another model or flavor?): "
            + " | ".join(lines)
        )


def preflight_checkpoint(
    cfg: CheckpointConfig, dump_folder: str, world_size: int, device_type: str, seq_len: int, global_batch_size: int
):
    """File-level checks that need no process group, run before launch and on every rank."""
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
    if not cfg.enable_checkpoint:
        return
    folder = os.path.join(dump_folder, cfg.folder)
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
            f"{folder}/step-{steps[-1]} --checkpoint.no-initial_load_model_only (exclude_from_loading applies there too)"
        )
    resume_state = None
    if cfg.load_step != -1:
        resume_state = read_train_state(os.path.join(folder, f"step-{cfg.load_step}"))
    else:
        for step in reversed(steps):  # the trainer resumes from the newest that verifies
            try:
                resume_state = read_train_state(os.path.join(folder, f"step-{step}"))
                break
            except UserError:
                continue
    if resume_state is not None:
        resume_step = resume_state.get("step")
        saved = resume_state.get("dataloader", {}).get("dataset_state", {})
        for key, now in (("seq_len", seq_len), ("global_batch_size", global_batch_size)):
            if key in saved and saved[key] != now:
                raise UserError(
                    f"the run resumes from {folder}/step-{resume_step}, saved with training.{key} = {saved[key]}, "
                    f"but this job has {now}; global sample positions depend on it, so keep {key} = {saved[key]} "
                    f"(with a new data-parallel degree, adjust local_batch_size so the global batch stays the same)"
                )


def check_writable(folder: str, what: str):
    """The nearest existing ancestor of `folder` must be a folder this process can create entries in:
    tried for real (a permission check passes for root on read-only or virtual filesystems)."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    reason = None
    if not os.path.isdir(existing):
        reason = f"{existing} is not a folder"
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=existing))
        except OSError as e:
            reason = f"{existing} is not a writable folder ({e.strerror})"
    if reason:
        raise UserError(f"cannot write {what} to {folder}: {reason}; choose another job.dump_folder")


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


# ---------------------------------------------------------------------------------------------
# The manager


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
        self.folder = os.path.join(dump_folder, cfg.folder)
        # Several parts when a rank holds several pipeline stages; each keeps full-model parameter names.
        self.parts, self.optimizers, self.lr_schedulers = model_parts, optimizers, lr_schedulers
        self.dataloader = dataloader
        self.model_info = model_info
        self.device = device
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.pending = None  # an async save not yet published: (future, step)
        self.rng_source = None  # (path, train_state) of a loaded checkpoint whose RNG states are due
        self.counters: dict[str, int] = {}  # the run's running totals, saved and restored with it
        self.stager = None
        self.executor = None  # background checksums of async saves
        self.pg = None
        if cfg.enable_checkpoint:
            self._prepare_folder()
            if cfg.async_mode != "disabled" and self.distributed:
                # Background writes use their own gloo group, so they never interleave with training collectives.
                self.pg = dist.new_group(backend="gloo")
            if cfg.async_mode == "async_with_pinned_mem":
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                self.stager = DefaultStager(StagingOptions(True, False, False, False))

    # -- helpers --------------------------------------------------------------------------------

    def _model_sds(self) -> list[dict]:
        return [get_model_state_dict(part) for part in self.parts]

    def _optim_sds(self) -> list[dict]:
        return [get_optimizer_state_dict(part, opt) for part, opt in zip(self.parts, self.optimizers)]

    def _optim_state_to_store(self, optim_sds: list[dict]) -> dict:
        """The parts' optimizer states in one dict, each under its stored name: a copy of a weight
        shared across pipeline stages under the weight's canonical name (distributed.shared_weights),
        as an unsplit model stores it. Copies on one rank collapse into one entry (equal values)."""
        names = self.model_info.get("optimizer_names") or [{} for _ in optim_sds]
        return {renames.get(k, k): v for sd, renames in zip(optim_sds, names) for k, v in sd["state"].items()}

    def _share_loaded_optim_state(self, optim_sds: list[dict], loaded: dict):
        """After a load into `loaded` (from _optim_state_to_store): a copy whose entry collapsed into
        another's gets its own clone of the loaded values (optimizers must not share state tensors)."""
        names = self.model_info.get("optimizer_names") or [{} for _ in optim_sds]
        for sd, renames in zip(optim_sds, names):
            for k, v in list(sd["state"].items()):
                source = loaded[renames.get(k, k)]
                if source is not v:
                    sd["state"][k] = {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in source.items()}

    def _barrier(self):
        if self.distributed:
            dist.barrier()

    def _all_true(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _prepare_folder(self):
        """Check the folder is writable and clear what killed runs left half-written."""
        probe = os.path.join(self.folder, f".write-test-{self.rank}")
        try:
            os.makedirs(self.folder, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise UserError(
                f"cannot write checkpoints to {self.folder} ({e.strerror}); choose a writable job.dump_folder "
                f"or checkpoint.folder"
            ) from None
        self._barrier()
        if self.rank == 0:
            for name in os.listdir(self.folder):
                if name.endswith(".partial") or name.startswith(".deleting-"):
                    logger.warning(f"removing incomplete checkpoint {name} left by an interrupted run")
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        self._barrier()

    def _path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    # -- loading --------------------------------------------------------------------------------

    def load(self) -> tuple[int, int]:
        """Restore the run's state if there is one; returns (step, tokens) to continue from.

        Without checkpoint.load_step the run resumes from the newest checkpoint that verifies; newer
        ones that do not are renamed to corrupt-step-N (kept, out of the step-N namespace, so that
        neither loading nor purging sees them again). With load_step, newer checkpoints are renamed to
        superseded-step-N, since the run now continues from the older one."""
        if not self.cfg.enable_checkpoint:
            if self.cfg.initial_load_path:
                return self._load_initial()
            return 0, 0
        steps = complete_checkpoints(self.folder)
        if self.cfg.load_step != -1:
            # preflight_checkpoint explained a missing step before launch.
            if self.cfg.load_step not in steps:
                raise ValueError(f"checkpoint step-{self.cfg.load_step} vanished from {self.folder} after preflight")
            problem = self._verify(self._path(self.cfg.load_step))
            if problem is not None:
                raise UserError(f"{problem}; choose another checkpoint.load_step (complete: {', '.join(map(str, steps))})")
            newer = [s for s in steps if s > self.cfg.load_step]
            self._set_aside(newer, "superseded", f"checkpoint.load_step = {self.cfg.load_step} continues from an older checkpoint")
            return self._load_from(self._path(self.cfg.load_step), model_only=False, resuming=True)
        skipped: list[tuple[int, str]] = []
        for step in reversed(steps):
            problem = self._verify(self._path(step))
            if problem is None:
                for bad, why in skipped:
                    logger.warning(f"skipping checkpoint step-{bad}: {why}")
                self._set_aside([bad for bad, _ in skipped], "corrupt", f"resuming from the older step-{step}")
                return self._load_from(self._path(step), model_only=False, resuming=True)
            skipped.append((step, problem))
        if skipped:
            raise UserError(
                f"no checkpoint in {self.folder} can be loaded: " + "; ".join(why for _, why in skipped)
                + ". Nothing was moved or deleted; repair them, or move them away to start a new run"
            )
        if self.cfg.initial_load_path:
            return self._load_initial()
        return 0, 0

    def _verify(self, path: str) -> str | None:
        """verify_checkpoint with the files shared out over the ranks; every rank gets the same answer."""
        problem = verify_checkpoint(path, self.rank, self.world_size)
        if self.distributed:
            problems: list[str | None] = [None] * self.world_size
            dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p is not None), None)
        return problem

    def _set_aside(self, steps: list[int], prefix: str, why: str):
        """Rename step-N folders to {prefix}-step-N (never over an existing name): kept, but no longer loaded or purged."""
        if not steps:
            return
        if self.rank == 0:
            for step in steps:
                target = os.path.join(self.folder, f"{prefix}-step-{step}")
                n = 1
                while os.path.exists(target):
                    target = os.path.join(self.folder, f"{prefix}-step-{step}.{n}")
                    n += 1
                os.rename(self._path(step), target)
                logger.warning(f"{why}: moved checkpoint step-{step} to {target}")
        self._barrier()

    def _load_initial(self) -> tuple[int, int]:
        path = self.cfg.initial_load_path  # its existence was checked by preflight_checkpoint
        if self.cfg.initial_load_in_hf:
            from torchtitan.components.hf_sharded import load_hf_into

            start = time.perf_counter()
            figures = load_hf_into(self.parts, path, self.model_info["hf_adapter"], self.model_info["hf_args"],
                                   self.model_info["shapes"])
            growth = "" if figures["peak_growth"] is None else \
                f"; its resident memory peaked {figures['peak_growth'] / 2**20:,.1f} MiB above its size before"
            logger.info(
                f"loaded initial weights from the Hugging Face folder {path} in {time.perf_counter() - start:.1f}s "
                f"(this rank read {figures['bytes_read'] / 2**20:,.1f} MiB of its {figures['folder_bytes'] / 2**20:,.1f} "
                f"MiB{growth})"
            )
            self.hf_load_figures = figures
            return 0, 0
        problem = self._verify(path)
        if problem is not None:
            raise UserError(f"checkpoint.initial_load_path: {problem}")
        return self._load_from(path, model_only=self.cfg.initial_load_model_only, resuming=False)

    def _load_from(self, path: str, model_only: bool, resuming: bool) -> tuple[int, int]:
        start = time.perf_counter()
        state = read_train_state(path)
        metadata = read_metadata(path)
        saved_model = state.get("model", {})
        if saved_model.get("name") != self.model_info["name"]:
            raise UserError(
                f"checkpoint {path} holds model '{saved_model.get('name')}' ({saved_model.get('flavor')}), "
                f"this job trains '{self.model_info['name']}' ({self.model_info['flavor']})"
            )
        model_sds = self._model_sds()
        model_sd = {k: v for sd in model_sds for k, v in sd.items()}
        check_model_matches(path, metadata, model_sd, partial=len(self.parts) > 1 or self.model_info.get("pipelined", False))
        excluded = set(self.cfg.exclude_from_loading)
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
        if load_optimizer:
            optim_sds = self._optim_sds()
            to_load["optimizer"] = {"state": self._optim_state_to_store(optim_sds)}
        try:
            dcp.load(to_load, storage_reader=SafeFileSystemReader(path), no_dist=not self.distributed)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise UserError(f"checkpoint {path} could not be read: {describe_failure(e)}") from None
        if "model" in to_load:
            for part, sd in zip(self.parts, model_sds):
                set_model_state_dict(part, sd)
        # The lr multipliers of the saving run's first optimizer's groups (absent before multipliers: all 1).
        saved_mults = (state.get("lr_scheduler") or {}).get("lr_mults")
        if load_optimizer:
            self._share_loaded_optim_state(optim_sds, to_load["optimizer"]["state"])
            for part, opt, sd in zip(self.parts, self.optimizers, optim_sds):
                set_optimizer_state_dict(part, opt, sd)
                # Groups differ between layouts (one per semantic group and device mesh, a pipeline stage
                # holds some): each gets the saved unmultiplied learning rate times its own lr multiplier.
                for group in opt.param_groups:
                    group["lr"] = _scaled(_unscaled(state["optimizer_lrs"], saved_mults), group)
        if model_only:
            logger.info(f"loaded model weights from {path} in {time.perf_counter() - start:.1f}s")
            return 0, 0
        if "lr_scheduler" not in excluded:
            for sched, opt in zip(self.lr_schedulers, self.optimizers):
                # The saved per-group lists are the saving layout's groups; this layout's groups take the
                # saved unmultiplied peak times their own multiplier, and the schedule's value at the saved
                # step (bit for bit what the uninterrupted run has there).
                saved = dict(state["lr_scheduler"], lr_lambdas=[None])
                saved.pop("lr_mults", None)
                peak = _unscaled(saved["base_lrs"], saved_mults)
                saved["base_lrs"] = [_scaled(peak, group) for group in opt.param_groups]
                sched.load_state_dict(saved)
                for group, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
                    group["lr"] = base * fn(sched.last_epoch)
                sched._last_lr = [group["lr"] for group in opt.param_groups]
        if "dataloader" not in excluded:
            self.dataloader.load_state_dict(state["dataloader"])
        self.counters.update(state.get("counters", {}))
        self.rng_source = (path, state)  # restored by restore_rng, right before the next step
        step, tokens = (0, 0) if "train_state" in excluded else (state["step"], state["tokens"])
        logger.info(f"resumed from {path} (step {state['step']}) in {time.perf_counter() - start:.1f}s")
        return step, tokens

    def restore_rng(self):
        """Put back the loaded checkpoint's RNG states. Called by the trainer after its start-up, which
        draws random numbers too (a restore before it would put the run ahead of the saved one)."""
        if self.rng_source is None:
            return
        path, state = self.rng_source
        self.rng_source = None
        if state.get("world_size") != self.world_size:
            logger.info(
                f"checkpoint saved by {state.get('world_size')} ranks, loading on {self.world_size}: "
                f"random-number generators are not restored (the training step draws no random numbers)"
            )
            return
        rng = load_safetensors(os.path.join(path, "rng", f"rank-{self.rank}.safetensors"))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    # -- saving ---------------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        if not self.cfg.enable_checkpoint:
            return False
        return step % self.cfg.interval == 0 or step == last_step or (
            step == 1 and self.cfg.enable_first_step_checkpoint
        )

    def save(self, step: int, tokens: int, last: bool = False):
        self.wait()
        if os.path.exists(self._path(step)):
            raise UserError(f"checkpoint {self._path(step)} already exists; refusing to overwrite it")
        model_only = last and self.cfg.last_save_model_only
        start = time.perf_counter()
        partial = os.path.join(self.folder, f".step-{step}.partial")
        state = self._state_dict(model_only)
        train_state = self._train_state(step, tokens, model_only)
        error = None
        try:
            if self.rank == 0:
                os.makedirs(partial, exist_ok=True)
        except OSError as e:
            error = str(e)
        self._agree_or_abandon(error, step)
        if self.cfg.async_mode != "disabled" and not last:
            try:
                result = dcp.async_save(
                    state, checkpoint_id=partial, process_group=self.pg, async_stager=self.stager, no_dist=not self.distributed
                )
                upload = getattr(result, "upload_completion", result)
                self._write_side_files(partial, train_state, model_only)
            except (OSError, CheckpointException) as e:
                error = describe_failure(e)
            self._agree_or_abandon(error, step)
            # Checksums are computed in the background too, once this rank's files are written.
            self.executor = self.executor or ThreadPoolExecutor(1, thread_name_prefix="checkpoint-checksums")
            self.pending = (self.executor.submit(self._finish_writing, upload, partial), step)
            logger.info(f"checkpoint step-{step}: state staged in {time.perf_counter() - start:.2f}s, writing in the background")
            return
        try:
            dcp.save(state, checkpoint_id=partial, no_dist=not self.distributed)
            self._write_side_files(partial, train_state, model_only)
            write_checksums(partial, self.rank)
        except (OSError, CheckpointException) as e:  # CheckpointException (DCP's errors) is a BaseException
            error = describe_failure(e)
        self._agree_or_abandon(error, step)
        self._publish(step)
        logger.info(
            f"saved {'model-only ' if model_only else ''}checkpoint {self._path(step)} in {time.perf_counter() - start:.2f}s"
        )

    def _finish_writing(self, upload, partial: str):
        upload.result()
        write_checksums(partial, self.rank)

    def _agree_or_abandon(self, error: str | None, step: int):
        """Every rank learns whether all succeeded; on a failure anywhere all remove the partial folder
        and stop with the reason (a rank that failed gives its own; the others point to it)."""
        if self._all_true(error is None):
            return
        self._abandon(os.path.join(self.folder, f".step-{step}.partial"))
        raise UserError(
            f"saving checkpoint step-{step} to {self.folder} failed: {error or 'on another rank (see its error)'} "
            f"[{storage_state(self.folder)}]; earlier checkpoints are untouched"
        )

    def _state_dict(self, model_only: bool) -> dict:
        model_sd = {k: v for sd in self._model_sds() for k, v in sd.items()}
        if model_only:
            dtype = DTYPES[self.cfg.export_dtype]
            model_sd = {k: v.to(dtype) for k, v in model_sd.items()}
            return {"model": model_sd}
        optim_state = self._optim_state_to_store(self._optim_sds())
        return {"model": model_sd, "optimizer": {"state": optim_state}}

    def _train_state(self, step: int, tokens: int, model_only: bool) -> dict:
        sched = {k: v for k, v in self.lr_schedulers[0].state_dict().items() if k != "lr_lambdas"}
        # Each group's lr multiplier, so that a load can take the unmultiplied schedule from any group.
        sched["lr_mults"] = [g.get("lr_mult", 1.0) for g in self.optimizers[0].param_groups]
        return train_state_record(
            step=step,
            tokens=tokens,
            model_only=model_only,
            world_size=self.world_size,
            model={k: self.model_info[k] for k in ("name", "flavor", "args")},
            dtype=self.cfg.export_dtype if model_only else "float32",
            optimizer_lrs=[g["lr"] for g in self.optimizers[0].param_groups],
            lr_scheduler=sched,
            dataloader=self.dataloader.state_dict(),
            counters=dict(self.counters),
        )

    def _write_side_files(self, partial: str, train_state: dict, model_only: bool):
        if not model_only:
            os.makedirs(os.path.join(partial, "rng"), exist_ok=True)
            rng = {"cpu": torch.get_rng_state()}
            if self.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.device)
            save_safetensors(rng, os.path.join(partial, "rng", f"rank-{self.rank}.safetensors"))
        if self.rank == 0:
            tmp = os.path.join(partial, STATE_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(train_state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(partial, STATE_FILE))

    def _publish(self, step: int):
        """All ranks have written: make the checkpoint visible in one rename, then trim old ones."""
        self._barrier()
        if self.rank == 0:
            os.rename(os.path.join(self.folder, f".step-{step}.partial"), self._path(step))
            fd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._purge()
        self._barrier()

    def _purge(self):
        """Delete all but the newest keep_latest_k checkpoints, never the newest one a run can resume
        from (a weights-only final save does not replace it)."""
        if self.cfg.keep_latest_k == 0:
            return
        steps = complete_checkpoints(self.folder)
        resumable = next((s for s in reversed(steps) if self._resumable(s)), None)
        for old in steps[: -self.cfg.keep_latest_k]:
            if old == resumable:
                logger.info(f"keeping checkpoint step-{old} beyond keep_latest_k: the newest one training can resume from")
                continue
            # Leave the step-N namespace first, so a kill during rmtree never leaves a half-deleted "complete" one.
            doomed = os.path.join(self.folder, f".deleting-step-{old}")
            os.rename(self._path(old), doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            logger.info(f"deleted checkpoint step-{old} (keep_latest_k = {self.cfg.keep_latest_k})")

    def _resumable(self, step: int) -> bool:
        try:
            return not read_train_state(self._path(step)).get("model_only", False)
        except UserError:
            return False

    def _abandon(self, partial: str):
        self._barrier_quietly()
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)

    def _barrier_quietly(self):
        try:
            self._barrier()
        except Exception:  # a peer may already be gone; the partial folder is harmless anyway
            pass

    def maybe_publish(self):
        """Called every step: publish a finished async save once every rank's writes are done."""
        if self.pending is None:
            return
        future, _ = self.pending
        if self._all_true(future.done()):
            self._finish_pending()

    def wait(self):
        """Block until a pending async save is written and published."""
        if self.pending is not None:
            self._finish_pending()

    def _finish_pending(self):
        future, step = self.pending
        self.pending = None
        error = None
        try:
            future.result()
        except (OSError, CheckpointException) as e:
            error = describe_failure(e)
        self._agree_or_abandon(error, step)
        self._publish(step)
        logger.info(f"published checkpoint {self._path(step)}")

    def close(self):
        self.wait()
        if self.stager is not None:
            self.stager.close()
        if self.executor is not None:
            self.executor.shutdown()

    # -- exports --------------------------------------------------------------------------------

    def export_hf(self, step: int, bos_id: int | None, eos_id: int | None, mesh=None,
                  tokenizer_path: str | None = None):
        """Write the current weights as a Hugging Face folder {folder}/step-N-hf, every rank writing
        its share of the files (hf_sharded.save_hf_sharded); `mesh`: the job's DeviceMesh."""
        from torchtitan.components.hf_sharded import save_hf_sharded

        start = time.perf_counter()
        out = os.path.join(self.folder, f"step-{step}-hf")
        figures = save_hf_sharded(
            out, self.parts, self.model_info["hf_adapter"], self.model_info["hf_args"], self.model_info["shapes"],
            DTYPES[self.cfg.export_dtype], mesh, self.cfg.hf_max_shard_mb * 2**20, bos_id=bos_id, eos_id=eos_id,
            tokenizer_path=tokenizer_path,
        )
        logger.info(f"exported Hugging Face weights to {out} in {time.perf_counter() - start:.1f}s "
                    f"(this rank wrote {len(figures['files'])} file(s))")

    def save_seed(self):
        """Write the freshly initialized weights as the model-only step-0 checkpoint."""
        partial = os.path.join(self.folder, ".step-0.partial")
        if complete_checkpoints(self.folder):
            raise UserError(
                f"{self.folder} already holds checkpoints; a seed checkpoint goes into an empty checkpoint folder"
            )
        os.makedirs(partial, exist_ok=True)
        dcp.save({"model": get_model_state_dict(self.parts[0])}, checkpoint_id=partial, no_dist=not self.distributed)
        state = self._train_state(0, 0, model_only=True)
        state["dtype"] = "float32"
        self._write_side_files(partial, state, model_only=True)
        write_checksums(partial, self.rank)
        self._publish(0)
        logger.info(f"wrote seed checkpoint {self._path(0)}")
