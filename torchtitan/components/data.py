"""Pre-training data: documents -> one packed token stream -> each rank's share of every step.

What is unusual here:

- The default corpus, `python_stdlib`, is embedded: it is the `.py` files of the running
  interpreter's standard library (`sysconfig.get_paths()["stdlib"]`), minus `site-packages`,
  `dist-packages` and test folders (any path component named `test` or `tests`, and
  `idlelib/idle_test`), indexed in sorted relative POSIX path order, one file per document, read as
  UTF-8 with errors="replace". It is real text nobody here wrote, it exists offline on every
  machine, and it is deterministic for a given interpreter (~730 files, ~12 MB on CPython 3.11).

- Sources: a source is a list of documents with a stable index. Local corpora are files, read by
  extension: .jsonl / .json (JSON lines, or a .json array, of records with a text field), .txt (one
  document per file), each optionally compressed (.gz, .zst); .parquet and .arrow (a text column);
  and `datasets.save_to_disk` folders (their .arrow shards, in state.json order). A folder is read
  recursively in sorted relative path order. `c4` streams allenai/c4 through `datasets`; `c4_test`
  is the reference framework's local sample (tests/assets/c4_test/data.json, JSON lines).

- Shuffling: with training.shuffle_documents (default: wherever the source has random access),
  epoch e reads the documents in the order of a pseudo-random permutation of their indices seeded
  by (training.seed, e): a Feistel network over the index domain (`_Permutation`), computed per
  index in O(1) time and memory, the same on every rank and layout. Sources read as streams
  (compressed JSON lines, parquet, `huggingface`, `c4`) have no random access and keep their stored
  order.

- Packing: each document is tokenized as [BOS] + text + [EOS], the documents are concatenated
  into one global token stream, and the stream is cut into consecutive non-overlapping windows
  of seq_len + 1 tokens. Window k is global sample k (inputs = w[:-1], labels = w[1:]). At the
  end of the source the stream goes on with the next epoch's first document, without dropping the
  tokens carried over the boundary.

- Ownership: optimizer step s consumes global samples [s*G, (s+1)*G), G = global batch size.
  Data-parallel rank r of D owns the contiguous block [s*G + r*G/D, s*G + (r+1)*G/D), read in
  order and cut into micro-batches of local_batch_size. The samples of a step are thus the same
  for every D and every gradient-accumulation split, so runs of different layouts compare step
  by step. With a text source every rank tokenizes the whole stream and skips the windows it does
  not own: simple and deterministic, and cheap at this scale (sentencepiece encodes ~1.5M tokens/s
  per rank). At scale, pre-tokenize: `training.dataset = "tokens"` reads a token folder written by
  scripts/pretokenize.py (torchtitan/components/token_file.py), memory-mapped; a rank reads the
  tokens of its own windows only and skips the others by document lengths (docs.idx), without
  reading their tokens.

- Token folders: the same documents (each stored as encode_document frames it, empty ones as no
  tokens, so the indices are the text source's), the same permutation and the same packing code
  (`_TokenStream` consumes token lists from either source), hence the same samples, order and
  resumable state as the text pipeline on the corpus it was written from. By default its documents
  are shuffled where the text pipeline would shuffle that corpus (recorded in its meta.json).

- Resumable state, independent of the layout: the dataset's state names a position in the
  global stream (the next global sample, the epoch, the position of the document in the epoch's
  order, the token offset in that document and any carried tokens) and the order itself (the
  shuffle seed, or none, and the number of documents), not a rank's progress. At the end of its
  block in a step, a rank's state_dict() first reads ahead to the step boundary, so at step
  boundaries every rank holds the same state, and it can be loaded under another data-parallel
  degree: each rank then skips to its own block of the next step. A state saved mid-step resumes
  exactly, for the layout it was saved under. seq_len and the global batch size define what a
  global sample is, so a state only loads with the values it was saved with. States of version 1
  (before shuffling) load as states of the stored order.

- Worker processes (training.data_workers = W > 0, text sources): the documents of an epoch are
  read and tokenized in W forked processes, in chunks of 16 consecutive positions of the epoch's
  order dealt to the workers in turn, and come back in order. Cutting windows stays in the trainer
  process, so the samples, their order and the state are those of W = 0. Workers ignore the
  scheduler's signals (the trainer stops on them and shuts the workers down) and end with their
  trainer. Batches are pinned for CUDA (build_dataloader's pin_memory).

- Empty documents (and null texts) are skipped (no BOS/EOS pair for them), but they keep their
  document index.
"""

import bisect
import functools
import gzip
import io
import itertools
import json
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import socket
import sysconfig
import urllib.parse
import warnings
import zlib
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError
from torchtitan.config.job_config import Training

logger = logging.getLogger(__name__)

# Version 2 added the document order (shuffle_seed, num_documents); version 1 states are in stored order.
STATE_VERSION = 2

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
TEXT_EXTENSIONS = (".jsonl", ".json", ".txt")  # each may also carry a compression suffix
TABLE_EXTENSIONS = (".parquet", ".arrow")
SUPPORTED = (
    ".jsonl / .json (JSON lines, or a .json array, of objects with the text field), .txt (one document per "
    "file), each also as .gz or .zst; .parquet and .arrow (a text column); a datasets save_to_disk folder"
)
INSTALL_DATA = "pip install 'torchtitan[data]'"

C4_HUB = "allenai/c4"
C4_TEST_PATH = "tests/assets/c4_test"


# ---------------------------------------------------------------------------------------------
# The document order: a seeded permutation per epoch.

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijective, well-mixing map of 64-bit integers."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class _Permutation:
    """A pseudo-random permutation of range(n) seeded by (seed, epoch), evaluated per index in O(1)
    time and memory: a balanced 6-round Feistel network on the smallest even number of bits that
    covers n (a permutation of range(4**k)), restricted to range(n) by cycle walking (applying it
    again while the value is >= n; fewer than 4 applications on average). Plain integer arithmetic:
    the same on every machine, Python and torch version."""

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self.n, self.half, self.mask = n, bits // 2, (1 << (bits // 2)) - 1
        base = _mix64((_mix64((seed + _GOLDEN) & _M64) + epoch * _GOLDEN) & _M64)
        self.keys = [_mix64((base + (r + 1) * _GOLDEN) & _M64) for r in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << self.half) | right

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        x = self._encrypt(i)
        while x >= self.n:
            x = self._encrypt(x)
        return x


# ---------------------------------------------------------------------------------------------
# Sources: documents by index. `documents(start)` yields the texts of documents start, start+1,
# ... in stored order to the end of the source; resuming calls it with the saved index. A source
# with `random_access` also has `num_documents()` and `document(i)`, which shuffling needs.


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded_stdlib_dir(rel_dir: str) -> bool:
    parts = rel_dir.split("/")
    if parts[-1] in ("site-packages", "dist-packages", "test", "tests"):
        return True
    return rel_dir == "idlelib/idle_test"


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    root = _stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        # Prune in place so os.walk never descends into excluded folders.
        dirnames[:] = [
            d for d in dirnames
            if not _is_excluded_stdlib_dir(d if rel_dir == "." else f"{rel_dir}/{d}")
        ]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return tuple(sorted(found, key=lambda p: p.relative_to(root).as_posix()))


def stdlib_files() -> list[Path]:
    """The documents of the python_stdlib corpus, in stored (index) order (computed once)."""
    return list(_stdlib_files())


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


class _StdlibSource:
    name = "python_stdlib"
    random_access = True

    def __init__(self):
        self.files = _stdlib_files()
        if not self.files:
            raise UserError(
                f"dataset python_stdlib is empty: no .py files under {_stdlib_root()}; "
                "set training.dataset = 'local' and training.dataset_path to your own data"
            )

    def documents(self, start: int) -> Iterator[str]:
        for path in self.files[start:]:
            yield _read_text(path)

    def num_documents(self) -> int:
        return len(self.files)

    def document(self, index: int) -> str:
        return _read_text(self.files[index])


# --- optional packages ---------------------------------------------------------------------------


def _import_pyarrow(path: Path, what: str):
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise UserError(
            f"{path} is {what}: reading it needs the pyarrow package: pip install pyarrow (or {INSTALL_DATA})"
        ) from None
    return pyarrow


def _import_zstandard(path: Path):
    try:
        import zstandard
    except ImportError:
        raise UserError(
            f"{path} is zstd-compressed: reading it needs the zstandard package: pip install zstandard "
            f"(or {INSTALL_DATA}), or decompress it (zstd -d)"
        ) from None
    return zstandard


# --- reading bytes: plain, gzip, zstd --------------------------------------------------------------


def _corrupt(path: Path, compression: str, error: BaseException) -> UserError:
    tool = "gzip -t" if compression == "gzip" else "zstd -t"
    return UserError(
        f"{path} is not a readable {compression} file ({type(error).__name__}: {error}): it is corrupt or "
        f"truncated (check it with `{tool} {path}`); download or compress it again, or remove it from the dataset"
    )


def _open_raw(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def _zstd_chunks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of a .zst file (one or more frames), in chunks; a file that ends inside
    a frame is an error (zstandard's stream reader would end silently)."""
    zstandard = _import_zstandard(path)
    dctx = zstandard.ZstdDecompressor()
    with _open_raw(path) as f:
        try:
            d, in_frame = dctx.decompressobj(), False
            while data := f.read(1 << 20):
                while data:
                    out = d.decompress(data)
                    in_frame = True
                    if out:
                        yield out
                    if not d.eof:
                        break
                    data, d, in_frame = d.unused_data, dctx.decompressobj(), False
        except zstandard.ZstdError as e:
            raise _corrupt(path, "zstd", e) from None
        if in_frame:
            raise _corrupt(path, "zstd", EOFError("the file ends inside a frame"))


def _byte_chunks(path: Path, compression: str | None, size: int = 1 << 20) -> Iterator[bytes]:
    """The (decompressed) bytes of a file, in chunks; decompression errors are UserErrors naming it."""
    if compression == "zstd":
        yield from _zstd_chunks(path)
        return
    with _open_raw(path) as raw:
        if compression is None:
            while chunk := raw.read(size):
                yield chunk
            return
        try:
            with gzip.GzipFile(fileobj=raw) as f:
                while chunk := f.read(size):
                    yield chunk
        except (OSError, EOFError, zlib.error) as e:
            raise _corrupt(path, "gzip", e) from None


def _byte_lines(path: Path, compression: str | None) -> Iterator[bytes]:
    """The lines of a (decompressed) file, split on b"\\n", without it."""
    pending: list[bytes] = []  # the start of a line that spans chunks
    for chunk in _byte_chunks(path, compression):
        lines = chunk.split(b"\n")
        if len(lines) == 1:
            pending.append(chunk)
            continue
        if pending:
            lines[0] = b"".join(pending + [lines[0]])
        pending = [lines.pop()]
        yield from lines
    if pending and any(pending):
        yield b"".join(pending)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _whole_text(path: Path, compression: str | None) -> str:
    if compression is None:
        return _read_text(path)
    # Decoded as Path.read_text does: UTF-8 with replacement, universal newlines.
    data = b"".join(_byte_chunks(path, compression))
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace").read()


def _file_format(name: str) -> tuple[str, str | None] | None:
    """(extension, compression) of a data file name, None for an unsupported one."""
    lower = name.lower()
    compression = None
    for ext, kind in COMPRESSIONS.items():
        if lower.endswith(ext):
            lower, compression = lower[: -len(ext)], kind
            break
    for ext in TEXT_EXTENSIONS + (() if compression else TABLE_EXTENSIONS):
        if lower.endswith(ext):
            return ext, compression
    return None


# --- files: one reader per format --------------------------------------------------------------------
# Each has `random_access`, `known_count()` (the number of documents if known without reading the
# data), `count()`, `texts(start)` (a generator of the texts of documents start.. that returns the
# number of documents in the file) and, with random access, `text(i)`.


class _TxtFile:
    """A .txt file (optionally compressed): one document."""

    random_access = True

    def __init__(self, path: Path, compression: str | None):
        self.path, self.compression = path, compression
        if compression:  # check the header now: a corrupt file is reported before launch
            next(_byte_chunks(path, compression, size=1), None)

    def known_count(self) -> int:
        return 1

    def count(self) -> int:
        return 1

    def texts(self, start: int):
        if start == 0:
            yield self.text(0)
        return 1

    def text(self, index: int) -> str:
        return _whole_text(self.path, self.compression)


def _record_text(record, field: str, where: str) -> str:
    fix = f"each record must be a JSON object with a {field!r} string field (training.dataset_text_field)"
    if not isinstance(record, dict):
        raise UserError(f"{where}: a JSON {type(record).__name__}, not an object; {fix}")
    if field not in record:
        fields = ", ".join(repr(k) for k in list(record)[:10])
        raise UserError(f"{where}: no {field!r} field (it has {fields or 'none'}); {fix}")
    text = record[field]
    if text is None:
        return ""  # a null text is an empty document, as in parquet and Arrow
    if not isinstance(text, str):
        raise UserError(f"{where}: {field!r} is a {type(text).__name__}; {fix}")
    return text


def _parse_json_line(line: bytes, field: str, path: Path, lineno: int) -> str:
    where = f"{path} line {lineno}"
    try:
        record = json.loads(_decode(line))
    except json.JSONDecodeError as e:
        raise UserError(
            f"{where}: invalid JSON ({e.msg}); each line must be a JSON object with a {field!r} string field"
        ) from None
    return _record_text(record, field, where)


class _JsonFile:
    """A .jsonl or .json file (optionally compressed): one JSON object per non-blank line, or (.json
    whose first character is '[') one JSON array of objects, loaded whole. Uncompressed JSON lines
    are read by random access through an index of line offsets (built by one pass over the file)."""

    def __init__(self, path: Path, ext: str, compression: str | None, field: str):
        self.path, self.compression, self.field = path, compression, field
        first = b""
        for chunk in _byte_chunks(path, compression, size=4096):  # also checks a compressed header now
            first = chunk.lstrip()
            if first:
                break
        self.array = ext == ".json" and first[:1] == b"["
        self.random_access = self.array or compression is None
        self._offsets: array | None = None  # uncompressed JSON lines: byte offset of each document
        self._records: list[str] | None = None  # arrays: the texts

    # JSON arrays
    def _array_texts(self) -> list[str]:
        if self._records is None:
            data = b"".join(_byte_chunks(self.path, self.compression))
            try:
                records = json.loads(_decode(data))
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{self.path}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg}); a .json file holds "
                    f"JSON lines or one JSON array of objects with a {self.field!r} field"
                ) from None
            self._records = [_record_text(r, self.field, f"{self.path} record {i}") for i, r in enumerate(records)]
        return self._records

    # JSON lines
    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(line number, line) of the non-blank lines."""
        for lineno, line in enumerate(_byte_lines(self.path, self.compression), start=1):
            if line.strip():
                yield lineno, line

    def _index(self) -> array:
        if self._offsets is None:
            offsets, position = array("q"), 0
            with _open_raw(self.path) as f:
                for line in f:
                    if line.strip():
                        offsets.append(position)
                    position += len(line)
            self._offsets = offsets
        return self._offsets

    def known_count(self) -> int | None:
        if self.array:
            return len(self._records) if self._records is not None else None
        return len(self._offsets) if self._offsets is not None else None

    def count(self) -> int:
        if self.array:
            return len(self._array_texts())
        if self.compression is None:
            return len(self._index())
        return sum(1 for _ in self._lines())

    def texts(self, start: int):
        if self.array:
            texts = self._array_texts()
            yield from texts[start:]
            return len(texts)
        n = 0
        for lineno, line in self._lines():
            # Skipped lines are counted, not parsed: resuming deep into a file stays cheap.
            if n >= start:
                yield _parse_json_line(line, self.field, self.path, lineno)
            n += 1
        return n

    def text(self, index: int) -> str:
        if self.array:
            return self._array_texts()[index]
        offset = self._index()[index]
        with _open_raw(self.path) as f:
            f.seek(offset)
            line = f.readline()
            try:
                return _parse_json_line(line, self.field, self.path, 0)
            except UserError:
                f.seek(0)
                lineno = f.read(offset).count(b"\n") + 1  # only on the error path
                return _parse_json_line(line, self.field, self.path, lineno)


def _check_column(pa, path: Path, schema, field: str, fix: str):
    if field not in schema.names:
        raise UserError(
            f"{path} has no column {field!r} (its columns: {', '.join(schema.names) or 'none'}); set "
            f"training.dataset_text_field to the column holding the text{fix}"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
        raise UserError(f"{path}: column {field!r} is of type {kind}, not text; set training.dataset_text_field "
                        "to the column holding the text")


class _ParquetFile:
    """A .parquet file: the text column, read as a stream (row groups are decompressed whole, so it has
    no cheap random access). Its row count is in the footer: skipping whole row groups is free."""

    random_access = False

    def __init__(self, path: Path, field: str):
        self.pa = _import_pyarrow(path, "a parquet file")
        self.path, self.field = path, field
        try:
            metadata = self.pa.parquet.read_metadata(path)
            schema = self.pa.parquet.read_schema(path)
        except (OSError, self.pa.ArrowException) as e:
            raise UserError(f"{path} is not a readable parquet file ({e}); it is corrupt or truncated: download or "
                            "write it again, or remove it from the dataset") from None
        _check_column(self.pa, path, schema, field, "")
        self.row_groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]

    def known_count(self) -> int:
        return sum(self.row_groups)

    count = known_count

    def texts(self, start: int):
        try:
            with self.pa.parquet.ParquetFile(self.path) as f:
                for group, rows in enumerate(self.row_groups):
                    if start >= rows:
                        start -= rows
                        continue
                    for batch in f.iter_batches(batch_size=1024, row_groups=[group], columns=[self.field]):
                        values = batch.column(0).to_pylist()
                        if start:
                            values, start = values[start:], max(0, start - len(values))
                        for text in values:
                            yield text or ""
        except (OSError, self.pa.ArrowException) as e:
            raise UserError(f"cannot read parquet file {self.path} ({e}); it is corrupt or truncated: download or "
                            "write it again, or remove it from the dataset") from None
        return sum(self.row_groups)


class _ArrowFile:
    """A .arrow file (Arrow IPC stream or file format, as datasets.save_to_disk writes): memory-mapped,
    the text column read by random access."""

    random_access = True

    def __init__(self, path: Path, field: str):
        self.pa = _import_pyarrow(path, "an Arrow file")
        self.path, self.field = path, field
        self._column = None
        _check_column(self.pa, path, self._open().schema, field, "")

    def _open(self):
        try:
            source = self.pa.memory_map(str(self.path))
            if source.read(6) == b"ARROW1":
                return self.pa.ipc.open_file(source)
            source.seek(0)
            return self.pa.ipc.open_stream(source)
        except (OSError, self.pa.ArrowException) as e:
            raise UserError(f"{self.path} is not a readable Arrow IPC file ({e}); it is corrupt or truncated: write "
                            "it again, or remove it from the dataset") from None

    def _chunks(self):
        if self._column is None:
            reader = self._open()
            try:
                table = reader.read_all()  # zero-copy: the buffers stay in the memory map
            except (OSError, self.pa.ArrowException) as e:
                raise UserError(f"cannot read Arrow file {self.path} ({e}); it is corrupt or truncated: write it "
                                "again, or remove it from the dataset") from None
            chunks = table.column(self.field).chunks
            self._column = (chunks, list(itertools.accumulate(len(c) for c in chunks)))
        return self._column

    def count(self) -> int:
        ends = self._chunks()[1]  # cheap: the table is memory-mapped, not read
        return ends[-1] if ends else 0

    known_count = count

    def texts(self, start: int):
        n = self.count()
        for i in range(start, n):
            yield self.text(i)
        return n

    def text(self, index: int) -> str:
        chunks, ends = self._chunks()
        c = bisect.bisect_right(ends, index)
        return chunks[c][index - (ends[c - 1] if c else 0)].as_py() or ""


# --- a file, a folder, or a save_to_disk folder ------------------------------------------------------


def _save_to_disk_files(folder: Path) -> list[Path] | None:
    """The .arrow shards of a `datasets` save_to_disk folder, in its state.json order (a DatasetDict
    folder: those of its train split); None if `folder` is not such a folder."""
    splits_file = folder / "dataset_dict.json"
    if splits_file.is_file():
        try:
            splits = json.loads(splits_file.read_text())["splits"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"cannot read {splits_file} ({type(e).__name__}: {e}): not a datasets DatasetDict folder"
            ) from None
        if "train" not in splits:
            raise UserError(
                f"{folder} is a datasets DatasetDict folder without a train split (its splits: {', '.join(splits)}); "
                "set training.dataset_path to the folder of the split to train on"
            )
        files = _save_to_disk_files(folder / "train")
        if files is None:
            raise UserError(f"{folder / 'train'} is not a datasets save_to_disk folder (no state.json)")
        return files
    state_file = folder / "state.json"
    if not (state_file.is_file() and (folder / "dataset_info.json").is_file()):
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state_file.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"cannot read {state_file} ({type(e).__name__}: {e}): not a datasets save_to_disk folder"
        ) from None
    files = [folder / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"datasets folder {folder} lists data files that are missing: {', '.join(missing[:3])}")
    return files


def _is_ignored(name: str) -> bool:
    """Files a folder of data may hold besides data: hidden files, README.md and the like, licenses."""
    upper = name.upper()
    return name.startswith(".") or upper.endswith(".MD") or upper.startswith(("LICENSE", "COPYING", "NOTICE"))


class _FilesSource:
    """Local data: a file, or a folder of files read recursively in sorted relative path order (hidden
    files and folders, *.md and LICENSE files are ignored; any other file must be data), or a
    `datasets` save_to_disk folder."""

    def __init__(self, path: str, text_field: str = "text", name: str = "local",
                 include: Callable[[str], bool] | None = None):
        self.name, self.text_field = name, text_field
        root = Path(path)
        self.root = root
        if not root.exists():
            raise UserError(
                f"dataset_path {root} does not exist; set training.dataset_path to a data file ({SUPPORTED}) "
                "or a folder of them"
            )
        if root.is_dir():
            entries = self._walk(root, include)
            if not entries:
                raise UserError(f"dataset folder {root} is empty: it holds no data files (supported: {SUPPORTED})")
        else:
            fmt = _file_format(root.name)
            if fmt is None:
                raise UserError(
                    f"dataset_path {root} has unsupported extension {root.suffix!r}; supported: {SUPPORTED}, "
                    "or a folder of such files"
                )
            entries = [(root, *fmt)]
        self.paths = [p for p, _, _ in entries]
        self.files = [self._reader(p, ext, compression) for p, ext, compression in entries]
        self.random_access = all(f.random_access for f in self.files)
        self._ends: list[int] | None = None

    @staticmethod
    def _walk(root: Path, include) -> list[tuple[Path, str, str | None]]:
        found, unknown = [], []  # found: (sort key, entry)
        for dirpath, dirnames, filenames in os.walk(root):
            folder = Path(dirpath)
            rel = folder.relative_to(root).as_posix()
            arrow_files = _save_to_disk_files(folder)
            if arrow_files is not None:
                dirnames[:] = []
                found.extend(((f"{rel}/", i), (f, ".arrow", None)) for i, f in enumerate(arrow_files))
                continue
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if _is_ignored(name) or (include is not None and not include(name)):
                    continue
                fmt = _file_format(name)
                if fmt is None:
                    unknown.append(folder / name)
                else:
                    found.append((((folder / name).relative_to(root).as_posix(), 0), (folder / name, *fmt)))
        if unknown:
            unknown.sort()
            shown = ", ".join(str(p.relative_to(root)) for p in unknown[:3])
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            raise UserError(
                f"dataset folder {root} holds files of unsupported types: {shown}{more}; supported: {SUPPORTED} "
                "(hidden files, *.md and LICENSE files are ignored). Move the other files out, or set "
                "training.dataset_path to a file or a subfolder"
            )
        return [entry for _, entry in sorted(found, key=lambda item: item[0])]

    def _reader(self, path: Path, ext: str, compression: str | None):
        if ext == ".txt":
            return _TxtFile(path, compression)
        if ext in (".jsonl", ".json"):
            return _JsonFile(path, ext, compression, self.text_field)
        if ext == ".parquet":
            return _ParquetFile(path, self.text_field)
        return _ArrowFile(path, self.text_field)

    @property
    def streamed_files(self) -> list[Path]:
        return [p for p, f in zip(self.paths, self.files) if not f.random_access]

    def documents(self, start: int) -> Iterator[str]:
        for f in self.files:
            known = f.known_count()
            if known is not None and known <= start:
                start -= known
                continue
            n = yield from f.texts(start)
            start = max(0, start - n)

    def _file_ends(self) -> list[int]:
        if self._ends is None:
            self._ends = list(itertools.accumulate(f.count() for f in self.files))
        return self._ends

    def num_documents(self) -> int:
        return self._file_ends()[-1]

    def document(self, index: int) -> str:
        ends = self._file_ends()
        k = bisect.bisect_right(ends, index)
        return self.files[k].text(index - (ends[k - 1] if k else 0))


_LocalSource = _FilesSource  # the name torchtitan/components/validate.py uses


class _HuggingFaceSource:
    name = "huggingface"
    random_access = False

    def __init__(self, path: str, text_field: str = "text", config_name: str | None = None,
                 name: str = "huggingface", hint: str = ""):
        self.name, self.text_field = name, text_field
        try:
            import datasets
        except ImportError:
            raise UserError(
                f"training.dataset = '{name}' needs the datasets package: pip install datasets (or "
                f"{INSTALL_DATA}), or use dataset = 'local' with your own files{hint}"
            ) from None
        self.path = path
        kwargs = {"name": config_name} if config_name else {}
        what = f"{path!r}" + (f" (config {config_name!r})" if config_name else "")
        try:
            self.dataset = datasets.load_dataset(path, split="train", streaming=True, **kwargs)
        except Exception as e:  # the library raises many types for a bad name, path, split or network
            raise UserError(
                f"could not load huggingface dataset {what}, split 'train': {type(e).__name__}: {e}; "
                f"check training.dataset_path{hint}"
            ) from None

    def documents(self, start: int) -> Iterator[str]:
        # Streaming datasets cannot seek: resuming skips the documents before `start`.
        field = self.text_field
        for index, row in enumerate(itertools.islice(self.dataset, start, None), start=start):
            if field not in row:
                raise UserError(
                    f"huggingface dataset {self.path!r} row {index} has no {field!r} column "
                    f"(columns: {', '.join(sorted(row))}); set training.dataset_text_field to the text column"
                )
            text = row[field]
            if text is not None and not isinstance(text, str):
                raise UserError(
                    f"huggingface dataset {self.path!r} row {index}: {field!r} is a {type(text).__name__}, "
                    "not a string; set training.dataset_text_field to the text column"
                )
            yield text or ""


# --- the reference schema's names: c4, c4_test --------------------------------------------------


def _offline_alternatives() -> str:
    alternatives = [
        "training.dataset = 'python_stdlib' (embedded)",
        "training.dataset = 'local' with training.dataset_path = your files (.jsonl, .json, .txt, their .gz/.zst, "
        ".parquet, Arrow; C4's own en/c4-train.*.json.gz shards work too)",
    ]
    if Path(C4_TEST_PATH).is_dir():
        alternatives.append(f"training.dataset = 'c4_test' (the sample at {C4_TEST_PATH})")
    return "; offline alternatives: " + "; ".join(alternatives)


def _hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached from here, found in well under a second (the datasets
    library retries for about half a minute first); None if it may be reachable."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"{var} is set"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urllib.parse.urlparse(endpoint).hostname or endpoint
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"{host} cannot be resolved ({e.strerror or e}): no network here?"
    return None


def _c4_local_include(folder: Path) -> tuple[Path, Callable[[str], bool] | None]:
    """A local copy of allenai/c4: its English training shards (en/c4-train.*.json.gz) when the folder
    is a clone of the repository (or its en/ folder); otherwise the folder is read as local data."""
    en = folder / "en" if (folder / "en").is_dir() else folder
    if any(name.startswith("c4-train.") for name in os.listdir(en)):
        return en, lambda name: name.startswith("c4-train.")
    return folder, None


def _c4_source(cfg: Training):
    path = cfg.dataset_path or C4_HUB
    if os.path.exists(path):
        root, include = _c4_local_include(Path(path)) if os.path.isdir(path) else (Path(path), None)
        return _FilesSource(str(root), cfg.dataset_text_field, name="c4", include=include)
    hint = _offline_alternatives()
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise UserError(
            f"training.dataset = 'c4' streams {path} from the Hugging Face Hub through the datasets package, which "
            f"is not installed: pip install datasets (or {INSTALL_DATA}) on a machine with network access{hint}"
        ) from None
    reason = _hub_unreachable()
    if reason:
        raise UserError(
            f"training.dataset = 'c4' streams {path} from the Hugging Face Hub, which cannot be reached: {reason}{hint}"
        )
    return _HuggingFaceSource(path, cfg.dataset_text_field, config_name="en", name="c4", hint=hint)


def _c4_test_source(cfg: Training):
    path = cfg.dataset_path or C4_TEST_PATH
    if not os.path.exists(path):
        raise UserError(
            f"training.dataset = 'c4_test' reads the reference torchtitan's C4 sample from {path} (a folder holding "
            f"data.json, one {{\"text\": ...}} object per line), relative to the working directory {os.getcwd()}, "
            "and it is not there: copy tests/assets/c4_test from a checkout of https://github.com/pytorch/torchtitan "
            f"to {path}, or set training.dataset_path to where it is; or train on training.dataset = 'python_stdlib' "
            "(embedded) or 'local' files"
        )
    return _FilesSource(path, cfg.dataset_text_field, name="c4_test")


def _streamed_reason(source) -> str:
    if isinstance(source, _FilesSource):
        files = source.streamed_files
        more = f" and {len(files) - 1} more" if len(files) > 1 else ""
        return (
            f"{files[0]}{more} can only be read as a stream (compressed JSON lines, parquet); decompress them, "
            "or convert them to an Arrow folder (datasets' save_to_disk)"
        )
    return f"dataset {source.name} is streamed through the datasets package"


def _build_source(cfg: Training):
    """The source named by the config and whether to shuffle it, checked now: every rank fails the same
    way at start (and run_train.sh's preflight before launch). Which dataset names take a dataset_path
    is the config validator's rule (torchtitan/config/manager.py)."""
    if cfg.dataset == "python_stdlib":
        source = _StdlibSource()
    elif cfg.dataset == "local" and cfg.dataset_path:
        source = _FilesSource(cfg.dataset_path, cfg.dataset_text_field)
    elif cfg.dataset == "huggingface" and cfg.dataset_path:
        source = _HuggingFaceSource(cfg.dataset_path, cfg.dataset_text_field)
    elif cfg.dataset == "c4":
        source = _c4_source(cfg)
    elif cfg.dataset == "c4_test":
        source = _c4_test_source(cfg)
    else:
        raise ValueError(f"unvalidated data config: dataset {cfg.dataset!r}, dataset_path {cfg.dataset_path!r}")
    shuffle = source.random_access if cfg.shuffle_documents is None else cfg.shuffle_documents
    if shuffle and not source.random_access:
        raise UserError(
            "training.shuffle_documents = true needs random access to the documents, but "
            f"{_streamed_reason(source)}; or set training.shuffle_documents = false (read in stored order), or leave "
            "it unset (shuffle where the data allows it)"
        )
    # Finding one non-empty document is enough: a source too small for one sequence is caught
    # when its first epoch ends.
    where = f" at {cfg.dataset_path}" if cfg.dataset_path else ""
    try:
        found = any(text for text in source.documents(0))
    except UserError:
        raise
    except Exception as e:  # a streamed dataset: the network, the library
        if not isinstance(source, _HuggingFaceSource):
            raise
        hint = _offline_alternatives() if cfg.dataset == "c4" else ""
        raise UserError(f"could not read the first document of dataset {cfg.dataset}{where}: "
                        f"{type(e).__name__}: {e}{hint}") from None
    if not found:
        raise UserError(f"dataset {cfg.dataset}{where} is empty: it has no non-empty document")
    return source, shuffle


# ---------------------------------------------------------------------------------------------
# The packed token stream and each rank's view of it.


def encode_document(tokenizer, text: str | None) -> list[int]:
    """The tokens of one document in the packed stream: [BOS] + text + [EOS]; an empty document (or a
    null text) is no tokens at all. The one definition, shared by the text pipeline and pretokenize."""
    return tokenizer.encode(text, bos=True, eos=True) if text else []


class _TokenizedSource:
    """A text source seen as documents of tokens (encode_document of each text), with the source's
    random access and document count."""

    def __init__(self, source, tokenizer):
        self.source, self.tokenizer = source, tokenizer
        self.name = source.name
        self.random_access = source.random_access

    def documents(self, start: int, keep: Callable[[int], bool] | None = None) -> Iterator[list[int] | None]:
        """The documents from position `start` in stored order; with `keep`, the ones it refuses (by
        position) are read but not tokenized, and come as None."""
        for position, text in enumerate(self.source.documents(start), start):
            yield encode_document(self.tokenizer, text) if keep is None or keep(position) else None

    def num_documents(self) -> int:
        return self.source.num_documents()

    def document(self, index: int) -> list[int]:
        return encode_document(self.tokenizer, self.source.document(index))


# ---------------------------------------------------------------------------------------------
# Reading and tokenizing documents in worker processes (training.data_workers).

DOCUMENTS_PER_CHUNK = 16  # a worker's unit of work: few enough that the first chunk comes quickly
CHUNKS_AHEAD = 4  # per worker: how far the workers read ahead of the trainer


class _WorkerError:
    """A UserError raised in a worker, sent to the trainer as an item so that it is raised there with
    its own message (a DataLoader re-raises a worker's exception with the worker's traceback in it)."""

    def __init__(self, message: str):
        self.message = message


class _DocumentChunks(IterableDataset):
    """The tokenized documents at positions start, start + 1, ... of an epoch's order (`order`: the
    epoch's permutation of `count` documents; None: stored order, to the end of the source), in chunks
    of DOCUMENTS_PER_CHUNK positions, as arrays of token ids. Worker w of W makes chunks w, w + W,
    w + 2W, ... A DataLoader asks its workers for items in turn and yields them in that order, so the
    chunks come in position order. In stored order each worker reads every document but tokenizes only
    its own; shuffled, it reads only its own."""

    def __init__(self, docs: _TokenizedSource, start: int, order: "_Permutation | None", count: int | None):
        self.docs, self.start, self.order, self.count = docs, start, order, count

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = info.id, info.num_workers
        try:
            yield from self._chunks(worker, workers)
        except UserError as e:
            yield _WorkerError(str(e))

    def _chunks(self, worker: int, workers: int):
        def tokens(doc):
            return array("i", doc)  # compact to send, and sliced like a list

        if self.order is not None:
            for lo in range(self.start + worker * DOCUMENTS_PER_CHUNK, self.count, workers * DOCUMENTS_PER_CHUNK):
                positions = range(lo, min(lo + DOCUMENTS_PER_CHUNK, self.count))
                yield [tokens(self.docs.document(self.order[p])) for p in positions]
            return

        def own(position: int) -> bool:
            return (position - self.start) // DOCUMENTS_PER_CHUNK % workers == worker

        chunk = []
        for position, doc in enumerate(self.docs.documents(self.start, keep=own), self.start):
            if doc is not None:
                chunk.append(tokens(doc))
                if (position - self.start + 1) % DOCUMENTS_PER_CHUNK == 0:
                    yield chunk
                    chunk = []
        if chunk:
            yield chunk


def _as_is(item):
    return item


def _start_worker(worker_id: int):
    # A scheduler may signal every process of the job (SLURM does). The trainer stops on it after its
    # step (components/stop_signals.py), and may still read documents to save the data position; a
    # worker that died of it would fail that step. Workers end when the trainer is done with them.
    for sig in _WORKER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _WORKER_SIGNALS)  # blocked from the fork until now


_WORKER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)


def _worker_documents(docs: _TokenizedSource, start: int, order, count: int | None, workers: int) -> Iterator:
    """What `_TokenStream` reads from position `start` of an epoch, tokenized by `workers` processes."""
    with warnings.catch_warnings():
        # torch's advice on the worker count against the cores, repeated at every epoch; the user chose it.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        loader = DataLoader(
            _DocumentChunks(docs, start, order, count), batch_size=None, num_workers=workers,
            collate_fn=_as_is, prefetch_factor=CHUNKS_AHEAD, worker_init_fn=_start_worker,
            # Forked workers share the open source and tokenizer; nothing of torch runs in them.
            multiprocessing_context="fork" if "fork" in multiprocessing.get_all_start_methods() else None,
        )
        # Blocked while the workers fork, so that none dies of a signal before _start_worker.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _WORKER_SIGNALS)
        try:
            chunks = iter(loader)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    # The workers are stopped when the stream seeks or starts an epoch, when the stream is collected as
    # garbage, or when this process exits. The registered finalizer holds the iterator: one collected as
    # garbage along with its queues loses their feeder threads first, and its workers would never hear
    # the shutdown. At exit it runs before multiprocessing ends the process's children with SIGTERM,
    # which the workers ignore, and waits for them (also where this process is a multiprocessing child,
    # which runs no atexit handlers).
    stop = multiprocessing.util.Finalize(chunks, chunks._shutdown_workers, exitpriority=100)
    try:
        for chunk in chunks:
            if isinstance(chunk, _WorkerError):
                raise UserError(chunk.message)
            yield from chunk
    finally:
        stop()


class _TokenStream:
    """Windows of window_len tokens cut from the global token stream, one after another.

    `docs` is a source of documents of tokens: `documents(start)` yields token lists in stored order,
    and with random access `num_documents()` and `document(i)`; a source that also has
    `document_length(i)` (a token file) is skipped over by lengths alone, without reading tokens.

    The position is (epoch, doc_index, offset): the next token is `offset` into the token list of
    the document at position `doc_index` of the epoch's order (stored order, or with a shuffle
    seed the permutation of the document indices for the epoch). `carry` holds tokens read but not
    yet part of an emitted window; it is always empty between reads, as the position is exact, but
    a saved carry is honoured.
    """

    def __init__(self, docs, window_len: int, shuffle_seed: int | None = None,
                 num_documents: int | None = None, workers: int = 0):
        self.source = docs
        self.workers = workers  # > 0: documents are read and tokenized in that many processes
        self.window_len = window_len
        self.shuffle_seed = shuffle_seed  # None: stored order
        self.num_documents = num_documents  # with a shuffle seed: the permutation's size
        self.next_sample = 0  # global index of the window read next
        self.epoch = 0
        self.doc_index = 0
        self.offset = 0
        self.carry: list[int] = []
        self._docs: Iterator | None = None  # yields document doc_index next, when _tokens is None
        self._tokens = None  # token list of document doc_index
        self._order: tuple[int, _Permutation] | None = None  # (epoch, its permutation)

    def seek(self, next_sample: int, epoch: int, doc_index: int, offset: int, carry: list[int]):
        self._close_documents()
        self.next_sample, self.epoch, self.doc_index, self.offset = next_sample, epoch, doc_index, offset
        self.carry = list(carry)

    def _close_documents(self):
        if self._docs is not None and hasattr(self._docs, "close"):
            self._docs.close()  # releases an open file
        self._docs = None
        self._tokens = None

    def _permutation(self) -> _Permutation:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, _Permutation(self.num_documents, self.shuffle_seed, self.epoch))
        return self._order[1]

    def _epoch_documents(self, start: int) -> Iterator:
        """The token lists of the documents at positions start, start + 1, ... of this epoch's order."""
        if self.workers:
            order = None if self.shuffle_seed is None else self._permutation()
            yield from _worker_documents(self.source, start, order, self.num_documents, self.workers)
            return
        if self.shuffle_seed is None:
            yield from self.source.documents(start)
            return
        order = self._permutation()
        for position in range(start, self.num_documents):
            yield self.source.document(order[position])

    def _document_tokens(self):
        """The token list of document doc_index; None past the last document."""
        if self._tokens is None:
            if self._docs is None:
                self._docs = self._epoch_documents(self.doc_index)
            self._tokens = next(self._docs, None)
        return self._tokens

    def _start_epoch(self, tokens_read: int):
        if self.epoch == 0 and self.next_sample == 0:
            raise UserError(
                f"dataset {self.source.name} is too small: all of it tokenizes to {tokens_read} tokens, "
                f"fewer than one sequence of seq_len + 1 = {self.window_len}; add data or lower "
                "training.seq_len"
            )
        documents = self.doc_index
        if documents == 0:  # a whole pass without a document: wrapping again would spin forever
            raise UserError(f"dataset {self.source.name} is empty: it has no document")
        self._close_documents()
        self.epoch += 1
        self.doc_index = 0
        self.offset = 0
        logger.warning(
            "dataset %s exhausted after %d documents: starting epoch %d (the data repeats%s)",
            self.source.name, documents, self.epoch,
            ", in a new order" if self.shuffle_seed is not None else "",
        )

    def read(self) -> list[int]:
        window, self.carry = self.carry, []
        while len(window) < self.window_len:
            tokens = self._document_tokens()
            if tokens is None:
                self._start_epoch(len(window))
                continue
            taken = tokens[self.offset : self.offset + self.window_len - len(window)]
            window += taken if isinstance(taken, list) else taken.tolist()
            self.offset += len(taken)
            if self.offset >= len(tokens):
                self.doc_index += 1
                self.offset = 0
                self._tokens = None
        self.next_sample += 1
        return window

    def skip(self, windows: int):
        """Move past the next `windows` windows: as many read()s, leaving the same position, but with
        document lengths alone where the source has them (the tokens are not read)."""
        length_of = getattr(self.source, "document_length", None)
        if length_of is None:
            for _ in range(windows):
                self.read()
            return
        if windows <= 0:
            return
        total = self.num_documents if self.shuffle_seed is not None else self.source.num_documents()
        first, carried = self.next_sample, len(self.carry)
        need = windows * self.window_len - carried
        wanted, self.carry = need, []
        self._close_documents()
        while need > 0:
            if self.doc_index >= total:
                # The sample being passed at the epoch's end, for _start_epoch's "too small" rule.
                self.next_sample = first + (carried + wanted - need) // self.window_len
                self._start_epoch(carried + wanted - need)
                continue
            index = self.doc_index if self.shuffle_seed is None else self._permutation()[self.doc_index]
            left = length_of(index) - self.offset
            if left > need:
                self.offset += need
                need = 0
            else:
                need -= left
                self.doc_index += 1
                self.offset = 0
        self.next_sample = first + windows


def _order_name(seed: int | None) -> str:
    return "stored order" if seed is None else f"the order shuffled with seed {seed}"


class PackedDataset(IterableDataset):
    """This rank's samples of the packed stream, as tensors of seq_len + 1 token ids.

    `shuffle_seed`: read each epoch's documents in the order of a permutation seeded by
    (shuffle_seed, epoch) (the source needs random access); None: in stored order.
    """

    def __init__(self, source, tokenizer, seq_len: int, dp_rank: int, dp_degree: int, global_batch_size: int,
                 dataset_name: str = "", dataset_path: str = "", shuffle_seed: int | None = None,
                 workers: int = 0):
        # `source`: a text source, tokenized by `tokenizer`; with tokenizer None, a source of token lists
        # (a token file). A source of tokens with `check_window` checks each window this rank reads.
        # `workers`: processes that read and tokenize the text source's documents (0: this process).
        if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"bad data-parallel rank {dp_rank} of {dp_degree}")
        if workers < 0 or (workers and tokenizer is None):
            raise ValueError(f"{workers} data workers: only a text source (with a tokenizer) has workers")
        if global_batch_size < 1 or global_batch_size % dp_degree:
            raise ValueError(f"global batch size {global_batch_size} is not a positive multiple of {dp_degree}")
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        block = global_batch_size // dp_degree
        self._block_start = dp_rank * block  # this rank's block, as offsets inside a step
        self._block_end = (dp_rank + 1) * block
        self.dataset_name = dataset_name or source.name
        self.dataset_path = dataset_path
        docs = source if tokenizer is None else _TokenizedSource(source, tokenizer)
        self._check_window = getattr(docs, "check_window", None)
        num_documents = docs.num_documents() if shuffle_seed is not None else None
        self._stream = _TokenStream(docs, seq_len + 1, shuffle_seed, num_documents, workers)

    def owns(self, sample: int) -> bool:
        return self._block_start <= sample % self.global_batch_size < self._block_end

    def _next_owned(self, sample: int) -> int:
        """The first global sample >= `sample` that this rank owns."""
        step, pos = divmod(sample, self.global_batch_size)
        if pos < self._block_start:
            return step * self.global_batch_size + self._block_start
        if pos < self._block_end:
            return sample
        return (step + 1) * self.global_batch_size + self._block_start

    def _skip_to(self, sample: int):
        self._stream.skip(sample - self._stream.next_sample)

    def __iter__(self) -> Iterator[torch.Tensor]:
        # All progress lives in self._stream, so an abandoned iterator costs nothing and a state
        # loaded (or advanced by state_dict) between two samples is picked up here.
        while True:
            self._skip_to(self._next_owned(self._stream.next_sample))
            window = torch.tensor(self._stream.read(), dtype=torch.long)
            if self._check_window is not None:
                self._check_window(window)
            yield window

    def state_dict(self) -> dict:
        stream = self._stream
        # Past the end of this rank's block: read ahead to the step boundary, so that the state is
        # the same on every rank and loads under any data-parallel layout.
        if stream.next_sample % self.global_batch_size >= self._block_end:
            self._skip_to((stream.next_sample // self.global_batch_size + 1) * self.global_batch_size)
        return {
            "version": STATE_VERSION,
            "dataset": self.dataset_name,
            "dataset_path": self.dataset_path,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "shuffle_seed": stream.shuffle_seed,
            "num_documents": stream.num_documents,
            "next_sample": stream.next_sample,
            "epoch": stream.epoch,
            "doc_index": stream.doc_index,
            "token_offset": stream.offset,
            "carry": list(stream.carry),
        }

    def load_state_dict(self, state: dict):
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise UserError(
                f"the checkpoint's data loader state has version {version}; this torchtitan reads versions 1 and "
                f"{STATE_VERSION}: resume with the torchtitan that wrote it"
            )
        if state["dataset"] != self.dataset_name:
            raise UserError(
                f"the checkpoint's data state is for dataset {state['dataset']!r}, but training.dataset "
                f"is {self.dataset_name!r}; resume with the same dataset"
            )
        if state["dataset_path"] != self.dataset_path:
            logger.warning(
                "resuming data of %s from a state saved for %s: document positions are only "
                "meaningful if the data is the same", self.dataset_path, state["dataset_path"],
            )
        for key in ("seq_len", "global_batch_size"):
            # Explained to the user before launch (checkpoint.preflight_checkpoint).
            if state[key] != getattr(self, key):
                raise ValueError(f"data state saved with {key} = {state[key]}, loaded with {getattr(self, key)}")
        stream = self._stream
        saved_seed = state.get("shuffle_seed")  # version 1: stored order
        if saved_seed != stream.shuffle_seed:
            if saved_seed is None:
                fix = "resume with training.shuffle_documents = false"
            else:
                fix = f"resume with training.seed = {saved_seed}" + (
                    " and training.shuffle_documents = true" if stream.shuffle_seed is None else "")
            raise UserError(
                f"the checkpoint's data state reads documents in {_order_name(saved_seed)}, but this job would read "
                f"them in {_order_name(stream.shuffle_seed)}: its position means nothing in another order; {fix}"
            )
        saved_count = state.get("num_documents")
        if saved_count is not None and saved_count != stream.num_documents:
            logger.warning(
                "resuming shuffled data saved for %d documents with %d documents: the data changed, so the rest of "
                "epoch %d is in another order (documents may repeat or be left out)",
                saved_count, stream.num_documents, state["epoch"],
            )
        next_sample = state["next_sample"]
        if next_sample % self.global_batch_size and not self.owns(next_sample):
            raise UserError(
                f"the data state was saved in the middle of a step (at global sample {next_sample}) by "
                "another data-parallel rank or layout; only states saved at step boundaries load "
                "under a different layout"
            )
        if len(state["carry"]) > self.seq_len:
            raise ValueError(f"corrupt data state: {len(state['carry'])} carried tokens")
        stream.seek(next_sample, state["epoch"], state["doc_index"], state["token_offset"], state["carry"])


def _collate(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.stack(windows)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def build_dataloader(
    cfg: Training, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, global_batch_size: int,
    pin_memory: bool = False,
) -> StatefulDataLoader:
    """Batches (inputs, labels), each int64 [local_batch_size, seq_len], of this rank's samples; in
    page-locked memory with `pin_memory` (for non-blocking copies to a CUDA device).

    `global_batch_size` is resolved: a positive multiple of local_batch_size x dp_degree.
    The loader never ends (the data loops). To resume, call loader.load_state_dict(state) and
    then iter(loader): the state is applied when the next iterator is created.
    """
    if global_batch_size % (cfg.local_batch_size * dp_degree):
        raise ValueError(
            f"global batch size {global_batch_size} is not a multiple of local_batch_size "
            f"{cfg.local_batch_size} x dp degree {dp_degree}"
        )
    if cfg.dataset == "tokens":
        from torchtitan.components.token_file import open_token_source

        # Documents already tokenized: shuffled by default where the text pipeline would shuffle their source.
        source, default_shuffle = open_token_source(cfg.dataset_path, tokenizer)
        shuffle = default_shuffle if cfg.shuffle_documents is None else cfg.shuffle_documents
        tokenizer = None
    else:
        source, shuffle = _build_source(cfg)
    dataset = PackedDataset(
        source, tokenizer, cfg.seq_len, dp_rank, dp_degree, global_batch_size,
        dataset_name=cfg.dataset, dataset_path=cfg.dataset_path or "",
        shuffle_seed=cfg.seed if shuffle else None, workers=cfg.data_workers,
    )
    with warnings.catch_warnings():
        # torchdata 0.11 calls a torch API that torch now deprecates; nothing for users to act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            # Windows are cut in this process, so the state is the stream's position (workers only tokenize).
            dataset, batch_size=cfg.local_batch_size, num_workers=0, collate_fn=_collate, pin_memory=pin_memory,
        )
