"""A checkpoint on disk: its files, their names, and reading them without trusting them.

A checkpoint is a folder `{dump_folder}/{folder}/step-N` holding:
- torch.distributed.checkpoint (DCP) files for `{"model": ..., "optimizer": {"state": ...}}`, keyed
  by parameter names (FQNs), never by rank or shard: any layout can load what any layout saved;
- `train_state.json`: step, tokens, model name/flavor/args, LR-scheduler state, the optimizer's
  current learning rates, the data loader's position in the global sample stream, the world size;
- `rng/rank-R.safetensors`: each rank's RNG states (restored when the world size is unchanged).
- `checksums/rank-R.json`: size and CRC-32 of every file rank R wrote, checked before a load.
No Python object is pickled into a checkpoint (tensors go to DCP/safetensors, the rest to JSON), and
DCP's own `.metadata` is read with an unpickler that accepts exact (module, name) pairs only.

Everything here works on files alone: no process group, no model, no optimizer.
"""

import json
import os
import pickle
import re
import shutil
import tempfile
import zlib
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors, save_file as save_safetensors
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.config import UserError

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "train_state.json"
CHECKSUM_DIR = "checksums"
FORMAT_VERSION = 2  # 2: with checksums; 1 (read, not written): without


def step_path(folder: str, step: int) -> str:
    """The published checkpoint of `step` in the checkpoint folder `folder`."""
    return os.path.join(folder, f"step-{step}")


def partial_path(folder: str, step: int) -> str:
    """Where the checkpoint of `step` is written until it is published: hidden, outside step-N."""
    return os.path.join(folder, f".step-{step}.partial")


def rng_file(rank: int) -> str:
    """Rank `rank`'s RNG states, relative to its checkpoint."""
    return os.path.join("rng", f"rank-{rank}.safetensors")


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
        ("torch", "float32"),
        ("torch", "bfloat16"),
        ("torch", "float16"),
        ("torch", "float64"),
        ("torch", "int64"),
        ("torch", "int32"),
        ("torch", "int8"),
        ("torch", "uint8"),
        ("torch", "bool"),
        ("torch", "float8_e4m3fn"),
        ("torch", "float8_e5m2"),
        ("torch.serialization", "_get_layout"),  # looks a layout up by name in a fixed table
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),  # the checkpoint id DCP records
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
    record: dict[str, Any] = {
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


def write_train_state(folder: str, record: dict):
    """The trainer's train_state.json, on disk before the checkpoint can be published."""
    tmp = os.path.join(folder, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, STATE_FILE))


def write_rng(folder: str, rank: int, states: dict[str, torch.Tensor]):
    os.makedirs(os.path.join(folder, "rng"), exist_ok=True)
    save_safetensors(states, os.path.join(folder, rng_file(rank)))


def read_rng(folder: str, rank: int) -> dict[str, torch.Tensor]:
    return load_safetensors(os.path.join(folder, rng_file(rank)))


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
    names += [n for n in (rng_file(rank),) if os.path.isfile(os.path.join(folder, n))]
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


def check_model_matches(path: str, metadata, model_sd: dict, prefix: str = "model.", partial: bool = False):
    """Name the first keys and shapes in which the checkpoint and the model differ. A pipeline rank
    holds part of the model (`partial`): the checkpoint may then hold keys this rank does not."""
    stored = {k[len(prefix) :]: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    wanted = {k: tuple(v.shape) for k, v in model_sd.items()}
    missing = [k for k in wanted if k not in stored]
    unexpected = [] if partial else [k for k in stored if k not in wanted]
    shapes = [
        f"{k}: checkpoint {stored[k]} vs model {wanted[k]}" for k in wanted if k in stored and stored[k] != wanted[k]
    ]
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


# ---------------------------------------------------------------------------------------------
# Failed writes, and the folders writes go to


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


def existing_folder(folder: str | os.PathLike, what: str) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{what} {folder} does not exist or is not a folder")
    return folder


def check_output_folder(folder: Path):
    """An export goes into a new or empty folder: it never mixes with or replaces earlier files."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UserError(f"{folder} already exists and is not empty; choose a new output folder or delete it")


def open_to_readers(folder: Path) -> None:
    """Give `folder` and its files the modes the umask allows (as a plain write would): safetensors and
    staging folders create them for their owner only (0600, 0700), and an exported folder is read by
    others (a shared model store, a published repository)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def staging(folder: str | os.PathLike) -> Generator[Path, None, None]:
    """A fresh hidden sibling of `folder`, renamed to `folder` when the block succeeds, deleted if not:
    a crash never leaves a half-written folder under the final name."""
    folder = Path(folder).resolve()
    check_output_folder(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left behind by a killed run that had the same pid
    tmp.mkdir()
    try:
        yield tmp
        open_to_readers(tmp)
        os.replace(tmp, folder)  # also replaces an existing empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
