"""Local data files: one reader per format, and a file or folder of them as a source of documents.

Formats, read by extension: .jsonl / .json (JSON lines, or a .json array, of records with a text
field), .txt (one document per file), each optionally compressed (.gz, .zst); .parquet and .arrow
(a text column); and `datasets.save_to_disk` folders (their .arrow shards, in state.json order). A
folder is read recursively in sorted relative path order.

A source is also read in units (components/data/lanes.py): its files, or when a folder has fewer files
than it is asked for, pieces of them: a parquet file's row groups, an uncompressed JSON lines file's
byte ranges (a line belongs to the piece its first byte is in), an Arrow file's ranges of rows. A
compressed file, a JSON array and a .txt file are one piece.
"""

import bisect
import logging
import itertools
import json
import os
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

from torchtitan.components.data.compression import INSTALL_DATA, byte_chunks, byte_lines, decode, open_raw, whole_text
from torchtitan.config.errors import UserError

logger = logging.getLogger(__name__)

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
TEXT_EXTENSIONS = (".jsonl", ".json", ".txt")  # each may also carry a compression suffix
TABLE_EXTENSIONS = (".parquet", ".arrow")
SUPPORTED = (
    ".jsonl / .json (JSON lines, or a .json array, of objects with the text field), .txt (one document per "
    "file), each also as .gz or .zst; .parquet and .arrow (a text column); a datasets save_to_disk folder"
)

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
# Each has `random_access`, `max_pieces(k)` (how many pieces of at most k it splits into), and for
# piece j of n: `known_count(j, n)` (its number of documents if known without reading the data, else
# None) and `texts(start, j, n)` (a generator of the texts of its documents start.. that returns the
# number of documents in the piece); with random access also `count()` and `text(i)`.


class _TxtFile:
    """A .txt file (optionally compressed): one document."""

    random_access = True

    def __init__(self, path: Path, compression: str | None):
        self.path, self.compression = path, compression
        if compression:  # check the header now: a corrupt file is reported before launch
            next(byte_chunks(path, compression, size=1), None)

    def max_pieces(self, k: int) -> int:
        return 1

    def known_count(self, piece: int = 0, pieces: int = 1) -> int:
        return 1

    def count(self) -> int:
        return 1

    def texts(self, start: int, piece: int = 0, pieces: int = 1):
        if start == 0:
            yield self.text(0)
        return 1

    def text(self, index: int) -> str:
        return whole_text(self.path, self.compression)


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


def _parse_json_line(line: bytes, field: str, where: str) -> str:
    try:
        record = json.loads(decode(line))
    except json.JSONDecodeError as e:
        raise UserError(
            f"{where}: invalid JSON ({e.msg}); each line must be a JSON object with a {field!r} string field"
        ) from None
    return _record_text(record, field, where)


class _JsonFile:
    """A .jsonl or .json file (optionally compressed): one JSON object per non-blank line, or (.json
    whose first character is '[') one JSON array of objects, loaded whole. JSON lines are read as a
    stream; uncompressed, the file splits into byte ranges."""

    random_access = False

    def __init__(self, path: Path, ext: str, compression: str | None, field: str):
        self.path, self.compression, self.field = path, compression, field
        first = b""
        for chunk in byte_chunks(path, compression, size=4096):  # also checks a compressed header now
            first = chunk.lstrip()
            if first:
                break
        self.array = ext == ".json" and first[:1] == b"["
        self.size = path.stat().st_size
        self._records: list[str] | None = None  # arrays: the texts

    def max_pieces(self, k: int) -> int:
        return max(1, min(k, self.size)) if not self.array and self.compression is None else 1

    def _array_texts(self) -> list[str]:
        if self._records is None:
            data = b"".join(byte_chunks(self.path, self.compression))
            try:
                records = json.loads(decode(data))
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{self.path}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg}); a .json file holds "
                    f"JSON lines or one JSON array of objects with a {self.field!r} field"
                ) from None
            self._records = [_record_text(r, self.field, f"{self.path} record {i}") for i, r in enumerate(records)]
        return self._records

    def _lines(self, piece: int, pieces: int) -> Iterator[tuple[str, bytes]]:
        """(where, line) of the piece's non-blank lines; where names the line or its byte offset."""
        if pieces == 1:
            for lineno, line in enumerate(byte_lines(self.path, self.compression), start=1):
                if line.strip():
                    yield f"{self.path} line {lineno}", line
            return
        lo, hi = piece * self.size // pieces, (piece + 1) * self.size // pieces
        with open_raw(self.path) as f:
            if lo:
                f.seek(lo - 1)
                if f.read(1) != b"\n":
                    f.readline()  # the line that started in the piece before
            position = f.tell()
            while position < hi:
                line = f.readline()
                if not line:
                    return
                if line.strip():
                    yield f"{self.path} line at byte {position}", line
                position += len(line)

    def known_count(self, piece: int = 0, pieces: int = 1) -> int | None:
        return len(self._records) if self.array and self._records is not None else None

    def texts(self, start: int, piece: int = 0, pieces: int = 1):
        if self.array:
            texts = self._array_texts()
            yield from texts[start:]
            return len(texts)
        n = 0
        for where, line in self._lines(piece, pieces):
            # Skipped lines are counted, not parsed: resuming deep into a file stays cheap.
            if n >= start:
                yield _parse_json_line(line, self.field, where)
            n += 1
        return n


def _one_line(error: BaseException) -> str:
    """An Arrow error's text on one line (parquet's thrift errors span several)."""
    return " ".join(str(error).split())


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
            with self.pa.parquet.ParquetFile(path) as f:  # its footer: read once, kept for every later open
                self.metadata, schema = f.metadata, f.schema_arrow
        except (OSError, self.pa.ArrowException) as e:
            raise UserError(f"{path} is not a readable parquet file ({e}); it is corrupt or truncated: download or "
                            "write it again, or remove it from the dataset") from None
        _check_column(self.pa, path, schema, field, "")
        self.row_groups = [self.metadata.row_group(i).num_rows for i in range(self.metadata.num_row_groups)]

    def max_pieces(self, k: int) -> int:
        return max(1, min(k, len(self.row_groups)))

    def _groups(self, piece: int, pieces: int) -> range:
        n = len(self.row_groups)
        return range(piece * n // pieces, (piece + 1) * n // pieces)

    def known_count(self, piece: int = 0, pieces: int = 1) -> int:
        return sum(self.row_groups[g] for g in self._groups(piece, pieces))

    def texts(self, start: int, piece: int = 0, pieces: int = 1):
        groups = self._groups(piece, pieces)
        if start >= self.known_count(piece, pieces):
            return self.known_count(piece, pieces)  # nothing to read: the file is not opened
        try:
            f = self.pa.parquet.ParquetFile(self.path, metadata=self.metadata)
        except (OSError, self.pa.ArrowException) as e:
            raise UserError(f"cannot read parquet file {self.path} ({e}); it is corrupt or truncated: download or "
                            "write it again, or remove it from the dataset") from None
        with f:
            first = sum(self.row_groups[: groups.start])  # the number in the file of the row group's first row
            for group in groups:
                rows = self.row_groups[group]
                if start < rows:
                    yield from self._group_texts(f, group, first, start)
                start, first = max(0, start - rows), first + rows
        return self.known_count(piece, pieces)

    def _group_texts(self, f, group: int, first: int, start: int):
        """The texts of row group `group` (whose first row is row `first` of the file) from its row
        `start` on; a failure to read it names the row group and its rows."""
        batches = f.iter_batches(batch_size=1024, row_groups=[group], columns=[self.field])
        row = first  # the row of the file the next batch starts at
        while True:
            # Only the reading is guarded: the yields below hand control to the caller.
            try:
                batch = next(batches, None)
                if batch is None:
                    return
                values = batch.column(0).to_pylist()
            except (OSError, self.pa.ArrowException) as e:
                # Numbered from 0, as pyarrow's ParquetFile.read_row_group and metadata.row_group number them.
                last = first + self.row_groups[group] - 1
                # Rows are read a batch at a time: those of the batch that failed were not delivered.
                at = f", of which {first}-{row - 1} were read" if row > first else ""
                raise UserError(
                    f"cannot read parquet file {self.path}: row group {group} of {len(self.row_groups)} (rows "
                    f"{first}-{last}{at}; counted from 0) fails ({_one_line(e)}); it is corrupt or truncated: "
                    "download or write it again, or remove it from the dataset"
                ) from None
            row += len(values)
            if start:
                values, start = values[start:], max(0, start - len(values))
            for text in values:
                yield text or ""


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

    def _batches(self) -> list:
        """The record batches, read one by one (zero-copy: their buffers stay in the memory map) so that
        a failure names the batch and the rows before it; each is checked to hold the buffers its
        metadata claims (cheap: the data is not scanned) so a corrupt one fails here, not on access."""
        reader, batches, rows = self._open(), [], 0
        # The file format knows its number of batches; the stream format is read to its end.
        total = reader.num_record_batches if isinstance(reader, self.pa.ipc.RecordBatchFileReader) else None
        while total is None or len(batches) < total:
            try:
                if total is None:
                    batch = reader.read_next_batch()
                else:
                    batch = reader.get_batch(len(batches))
                batch.validate()
            except StopIteration:
                break
            except (OSError, self.pa.ArrowException) as e:
                of = f" of {total}" if total is not None else ""
                raise UserError(
                    f"cannot read Arrow file {self.path}: record batch {len(batches)}{of} (counted from 0, after "
                    f"{rows} rows) fails ({_one_line(e)}); it is corrupt or truncated: write it again, or remove it "
                    "from the dataset"
                ) from None
            batches.append(batch)
            rows += batch.num_rows
        return batches

    def _chunks(self):
        if self._column is None:
            batches = self._batches()
            column = batches[0].schema.names.index(self.field) if batches else None
            chunks = [b.column(column) for b in batches]
            self._column = (chunks, list(itertools.accumulate(len(c) for c in chunks)))
        return self._column

    def count(self) -> int:
        ends = self._chunks()[1]  # cheap: the table is memory-mapped, not read
        return ends[-1] if ends else 0

    def max_pieces(self, k: int) -> int:
        return max(1, min(k, self.count()))

    def _rows(self, piece: int, pieces: int) -> range:
        n = self.count()
        return range(piece * n // pieces, (piece + 1) * n // pieces)

    def known_count(self, piece: int = 0, pieces: int = 1) -> int:
        return len(self._rows(piece, pieces))

    def texts(self, start: int, piece: int = 0, pieces: int = 1):
        rows = self._rows(piece, pieces)
        for i in rows[start:]:
            yield self.text(i)
        return len(rows)

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


class FilesSource:
    """Local data: a file, or a folder of files read recursively in sorted relative path order (hidden
    files and folders, *.md and LICENSE files are ignored; any other file must be data), or a
    `datasets` save_to_disk folder."""

    def __init__(self, path: str, text_field: str = "text", name: str = "local",
                 include: Callable[[str], bool] | None = None, skip_corrupt: bool = False, check_all: bool = True):
        self.name, self.text_field = name, text_field
        # training.skip_corrupt_files: a file that fails past its start is read no further (a document
        # read by index: taken as empty), with a warning and a running count, instead of stopping the run.
        self.skip_corrupt = skip_corrupt
        self.skipped: dict[Path, int] = {}  # file -> how many times it failed (its rest, or documents read by index)
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
        self._entries = entries
        self._readers: list = [None] * len(entries)
        # Random access by kind: .txt files and Arrow (JSON lines and parquet are read as streams).
        self.random_access = all(ext in (".txt", ".arrow") for _, ext, _ in entries)
        # Opening a file checks it (its header, footer or first record). `check_all`: every file now, so that
        # a bad one is refused before training (run_train.sh's preflight, and data-parallel rank 0); else only
        # the first, and each other file when a lane first reads it: a rank reads nothing of the files of
        # other ranks' lanes, not even their footers.
        for i in range(len(entries) if check_all else 1):
            self.file(i)
        self._ends: list[int] | None = None
        self._learned: dict[tuple[int, int, int], int] = {}  # documents per unit, counted by reading
        self._by_name: dict[str, int] | None = None  # a file's index by its layout name
        self._sizes: list[int | None] = [None] * len(self.paths)
        self._layout: tuple[int, dict | None] | None = None  # (counts it was built from, layout())

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

    def file(self, i: int):
        """The reader of file i, opened (and checked) on first use."""
        if self._readers[i] is None:
            self._readers[i] = self._reader(*self._entries[i])
        return self._readers[i]

    def _reader(self, path: Path, ext: str, compression: str | None):
        if ext == ".txt":
            return _TxtFile(path, compression)
        if ext in (".jsonl", ".json"):
            return _JsonFile(path, ext, compression, self.text_field)
        if ext == ".parquet":
            return _ParquetFile(path, self.text_field)
        return _ArrowFile(path, self.text_field)

    def units(self, target: int) -> list[tuple[int, int, int]]:
        """The source cut into units (file, piece, pieces) of which there are about `target`: one per
        file, or with fewer files than `target` each file in as many pieces as it splits into."""
        files = len(self.paths)
        if files >= target:
            return [(i, 0, 1) for i in range(files)]
        k = -(-target // files)
        return [(i, j, n) for i in range(files) for n in [self.file(i).max_pieces(k)] for j in range(n)]

    def unit_count(self, unit: tuple[int, int, int]) -> int | None:
        """The unit's number of documents: known without reading it (parquet, Arrow), or counted when it
        was read (or loaded with a saved layout); None if not known yet."""
        learned = self._learned.get(unit)
        return learned if learned is not None else self.file(unit[0]).known_count(unit[1], unit[2])

    def unit_texts(self, unit: tuple[int, int, int], start: int):
        """The texts of the unit from its document `start`; returns its number of documents, which is
        remembered (and saved with the position) when it was not known."""
        known = self.unit_count(unit)
        n = yield from self._texts(unit, start)
        if known is None:
            self._learned[unit] = n
        return n

    def documents(self, start: int) -> Iterator[str]:
        """The documents in stored order from position `start`, files before it skipped by their counts
        where known."""
        for i in range(len(self.paths)):
            known = self.unit_count((i, 0, 1))
            if known is not None and known <= start:
                start -= known  # a file before the position: skipped without reading it
                continue
            n = yield from self.unit_texts((i, 0, 1), start)
            start = max(0, start - n)

    def _texts(self, unit: tuple[int, int, int], start: int):
        """The texts of a unit from its document `start`; returns the unit's document count. With
        skip_corrupt, a unit that fails ends there: its count is the documents before the failure."""
        i = unit[0]
        texts = self.file(i).texts(start, unit[1], unit[2])
        if not self.skip_corrupt:
            return (yield from texts)
        read = 0
        while True:
            try:
                text = next(texts)
            except StopIteration as end:
                return end.value
            except UserError as e:
                self._skip(i, e, f"the rest of it, after document {start + read}")
                return start + read
            read += 1
            yield text

    def _skip(self, i: int, error: UserError, what: str):
        path = self.paths[i]
        self.skipped[path] = self.skipped.get(path, 0) + 1
        logger.warning("training.skip_corrupt_files: skipping %s of %s (%s); skipped so far: %d document(s) or "
                       "file rest(s) in %d file(s)", what, path, error, sum(self.skipped.values()), len(self.skipped))

    def layout(self) -> dict | None:
        """Documents per unit of the units counted so far by reading them, with the file's size: saved
        with the data position, so that a resume skips those units without reading them. Built again
        only when a count was added (a worker asks after every window)."""
        if self._layout is None or self._layout[0] != len(self._learned):
            learned = {self._unit_key(unit): [n, self._size(unit[0])] for unit, n in self._learned.items()}
            self._layout = (len(self._learned), {"unit_documents": learned} if learned else None)
        return self._layout[1]

    def _size(self, i: int) -> int:
        if self._sizes[i] is None:
            self._sizes[i] = self.paths[i].stat().st_size
        return self._sizes[i]

    def load_layout(self, layout: dict):
        """Take the counts of a saved layout for the units of files still there with the same size."""
        if self._by_name is None:
            self._by_name = {self._relative(i): i for i in range(len(self.paths))}
        for key, (n, size) in layout.get("unit_documents", {}).items():
            name, _, piece = key.rpartition("#")
            i = self._by_name.get(name)
            j, _, pieces = piece.partition("/")
            unit = (i, int(j), int(pieces)) if i is not None else None
            if unit is not None and unit not in self._learned and size == self._size(i):
                self._learned[unit] = n

    def _unit_key(self, unit: tuple[int, int, int]) -> str:
        return f"{self._relative(unit[0])}#{unit[1]}/{unit[2]}"

    def _relative(self, i: int) -> str:
        return self.paths[i].relative_to(self.root).as_posix() if self.root.is_dir() else self.paths[i].name

    def _file_ends(self) -> list[int]:
        if self._ends is None:
            self._ends = list(itertools.accumulate(self.file(i).count() for i in range(len(self.paths))))
        return self._ends

    def num_documents(self) -> int:
        return self._file_ends()[-1]

    def document(self, index: int) -> str:
        ends = self._file_ends()
        k = bisect.bisect_right(ends, index)
        try:
            return self.file(k).text(index - (ends[k - 1] if k else 0))
        except UserError as e:
            if not self.skip_corrupt:
                raise
            self._skip(k, e, f"document {index - (ends[k - 1] if k else 0)} (read as empty)")
            return ""
