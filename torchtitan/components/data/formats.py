"""Local data files: one reader per format, and a file or folder of them as a source of documents.

Formats, read by extension: .jsonl / .json (JSON lines, or a .json array, of records with a text
field), .txt (one document per file), each optionally compressed (.gz, .zst); .parquet and .arrow
(a text column); and `datasets.save_to_disk` folders (their .arrow shards, in state.json order). A
folder is read recursively in sorted relative path order.

Text is UTF-8: a .txt or JSON file whose bytes are not UTF-8, or hold a NUL byte, is a binary file or
text in another encoding, refused with its file and byte offset (compression.py); its first bytes when
it is opened (before launch), the rest when read. So is a parquet or Arrow text column holding bytes
that are not UTF-8, by row.

A file splits into pieces (for files.FilesSource's units, components/data/lanes.py): a parquet file
into its row groups, an uncompressed JSON lines file into byte ranges (a line belongs to the piece its
first byte is in), an Arrow file into ranges of rows. A compressed file, a JSON array and a .txt file
are one piece.
"""

import bisect
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from torchtitan.components.data.compression import (
    INSTALL_DATA,
    byte_chunks,
    byte_lines,
    check_text,
    decode,
    open_raw,
    read_head,
    whole_text,
)
from torchtitan.config.errors import UserError

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


def _check_text_start(path: Path, compression: str | None, chunks: list[bytes]):
    """Refuse a text file whose first bytes (`chunks`, read from its start) are not UTF-8 text: a binary file
    is refused when it is opened (before launch: the preflight opens every file), not when a lane reaches it."""
    check_text(b"".join(chunks), path, compression, final=False)  # a character may be cut by the end of them


def file_format(name: str) -> tuple[str, str | None] | None:
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
        # The first bytes now (and a compressed file's header): a corrupt or binary file is reported before launch.
        if compression:
            chunks = byte_chunks(path, compression)
            head = next(chunks, b"")
            chunks.close()
        else:
            head = read_head(path, 4096)
        _check_text_start(path, compression, [head])

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


def _parse_json_line(text: str, field: str, where: str) -> str:
    try:
        record = json.loads(text)
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
        first, head = b"", []
        for chunk in byte_chunks(path, compression, size=4096):  # also checks a compressed header now
            head.append(chunk)
            first = chunk.lstrip()
            if first:
                break
        _check_text_start(path, compression, head)
        self.array = ext == ".json" and first[:1] == b"["
        self.size = path.stat().st_size
        self._records: list[str] | None = None  # arrays: the texts

    def max_pieces(self, k: int) -> int:
        """Up to k byte ranges, each holding a line: a range with none would leave its lane nothing to read
        (a file of fewer, longer lines than k). Fewer ranges until each holds one."""
        if self.array or self.compression is not None:
            return 1
        n = max(1, min(k, self.size))
        with open_raw(self.path) as f:
            while n > 1:
                held = sum(_holds_a_line(f, j * self.size // n, (j + 1) * self.size // n) for j in range(n))
                if held == n:
                    break
                n = max(1, held)
        self.pieces_dropped = n < min(k, self.size)
        return n

    def _array_texts(self) -> list[str]:
        if self._records is None:
            data = b"".join(byte_chunks(self.path, self.compression))
            text = decode(data, self.path, self.compression)
            try:
                records = json.loads(text)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{self.path}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg}); a .json file holds "
                    f"JSON lines or one JSON array of objects with a {self.field!r} field"
                ) from None
            self._records = [_record_text(r, self.field, f"{self.path} record {i}") for i, r in enumerate(records)]
        return self._records

    def _lines(self, piece: int, pieces: int) -> Iterator[tuple[str, bytes, int, int | None]]:
        """(where, line, its byte offset, its number if known) of the piece's non-blank lines; where names
        the line or its byte offset. Offsets are in the decompressed data of a compressed file."""
        if pieces == 1:
            position = 0
            for lineno, line in enumerate(byte_lines(self.path, self.compression), start=1):
                if line.strip():
                    yield f"{self.path} line {lineno}", line, position, lineno
                position += len(line) + 1
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
                    yield f"{self.path} line at byte {position}", line, position, None
                position += len(line)

    def known_count(self, piece: int = 0, pieces: int = 1) -> int | None:
        return len(self._records) if self.array and self._records is not None else None

    def texts(self, start: int, piece: int = 0, pieces: int = 1):
        if self.array:
            texts = self._array_texts()
            yield from texts[start:]
            return len(texts)
        n = 0
        for where, line, position, lineno in self._lines(piece, pieces):
            # Skipped lines are counted, not parsed: resuming deep into a file stays cheap.
            if n >= start:
                yield _parse_json_line(decode(line, self.path, self.compression, position, lineno), self.field, where)
            n += 1
        return n


def _chunks(f, start: int, limit: int | None = None) -> Iterator[bytes]:
    """The bytes of open file f from `start` (up to `limit`), in chunks that grow from 4 KiB: a check that
    needs only the first few bytes of each of many places reads little."""
    f.seek(start)
    size = 4096
    while limit is None or start < limit:
        chunk = f.read(size if limit is None else min(size, limit - start))
        if not chunk:
            return
        yield chunk
        start += len(chunk)
        size = min(2 * size, 1 << 20)


def _holds_a_line(f, lo: int, hi: int) -> bool:
    """Whether bytes [lo, hi) of a JSON lines file hold the start of a non-blank line: what _JsonFile._lines
    reads of that piece."""
    start, pos = (None, lo - 1) if lo else (0, 0)
    if start is None:  # the first line start at or after lo
        for chunk in _chunks(f, lo - 1, hi):
            i = chunk.find(b"\n")
            if i >= 0:
                start = pos + i + 1
                break
            pos += len(chunk)
        if start is None or start >= hi:
            return False
    line_start, pos = start, start
    for chunk in _chunks(f, start):
        text = chunk.lstrip()
        skipped = chunk[: len(chunk) - len(text)]
        newline = skipped.rfind(b"\n")
        if newline >= 0:
            line_start = pos + newline + 1
        if text or line_start >= hi:  # the first non-blank byte, in a line starting at line_start
            return bool(text) and line_start < hi
        pos += len(chunk)
    return False


def _one_line(error: BaseException) -> str:
    """An Arrow error's text on one line (parquet's thrift errors span several)."""
    return " ".join(str(error).split())


def _not_utf8_value(path: Path, field: str, values, first_row: int) -> UserError:
    """The error of a string column that holds bytes that are not UTF-8 (Arrow does not check them when
    reading, and Python's str of them fails): names the first such row of `values`, whose first row is row
    `first_row` of the file."""
    # A NUL is left alone here: a string column declares text, so a NUL in one is its writer's text, not a
    # binary file or UTF-16 read as UTF-8 (compression.py).
    for k in range(len(values)):
        value = values[k]
        if not value.is_valid:
            continue
        data = value.as_buffer().to_pybytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            return UserError(
                f"{path}: column {field!r} of row {first_row + k} (counted from 0) is not UTF-8 text: at byte "
                f"{e.start} of the value, 0x{data[e.start]:02x} is not UTF-8 ({e.reason}); the file was written "
                "with bytes that are not text in a string column (binary data, or text in another encoding): write it "
                "again with the text as UTF-8, or remove it from the dataset"
            )
    raise ValueError(f"{path}: no value of rows {first_row}.. that fails to decode")  # the caller saw one fail


def _check_column(pa, path: Path, schema, field: str, fix: str):
    if field not in schema.names:
        raise UserError(
            f"{path} has no column {field!r} (its columns: {', '.join(schema.names) or 'none'}); set "
            f"training.dataset_text_field to the column holding the text{fix}"
        )
    kind = schema.field(field).type
    if not (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or getattr(pa.types, "is_string_view", lambda _: False)(kind)
    ):
        raise UserError(
            f"{path}: column {field!r} is of type {kind}, not text; set training.dataset_text_field "
            "to the column holding the text"
        )


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
            raise UserError(
                f"{path} is not a readable parquet file ({e}); it is corrupt or truncated: download or "
                "write it again, or remove it from the dataset"
            ) from None
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
            raise UserError(
                f"cannot read parquet file {self.path} ({e}); it is corrupt or truncated: download or "
                "write it again, or remove it from the dataset"
            ) from None
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
            batch = None
            try:
                batch = next(batches, None)
                if batch is None:
                    return
                values = batch.column(0).to_pylist()
            except UnicodeDecodeError:
                assert batch is not None  # only a batch's values fail to decode (to_pylist)
                raise _not_utf8_value(self.path, self.field, batch.column(0), row) from None
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
            raise UserError(
                f"{self.path} is not a readable Arrow IPC file ({e}); it is corrupt or truncated: write "
                "it again, or remove it from the dataset"
            ) from None

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
        value = chunks[c][index - (ends[c - 1] if c else 0)]
        try:
            return value.as_py() or ""
        except UnicodeDecodeError:
            raise _not_utf8_value(self.path, self.field, [value], index) from None


def open_file(path: Path, ext: str, compression: str | None, field: str):
    """The reader of a data file of extension `ext` (file_format), checked now (its header, footer or
    first record)."""
    if ext == ".txt":
        return _TxtFile(path, compression)
    if ext in (".jsonl", ".json"):
        return _JsonFile(path, ext, compression, field)
    if ext == ".parquet":
        return _ParquetFile(path, field)
    return _ArrowFile(path, field)
