"""A data file's bytes: plain, gzip or zstd (files of several members or frames), in chunks or lines,
and its text. A file corrupt in the middle is a UserError naming the file and where it failed; so is
text that is not UTF-8 (a binary file, or text in another encoding), where it starts."""

import codecs
import os
import zlib
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

from torchtitan.config.errors import UserError

INSTALL_DATA = "pip install 'torchtitan[data]'"


def read_text(path: Path) -> str:
    """A file of the embedded python_stdlib corpus (sources.StdlibSource, and validation's stdlib tests),
    decoded with errors="replace" as that corpus is documented to be: a user's data goes through
    `decode` / `whole_text`, which refuse bytes that are not UTF-8 text."""
    return path.read_text(encoding="utf-8", errors="replace")


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


# Compressed bytes are given to the decoder in pieces of this size: neither library says how far into
# its input it got when it fails, so the piece it failed on is where the file is reported corrupt.
# Smaller pieces cost nothing measurable (one call per piece) and pin the failure closer.
_PIECE = 1 << 14
_UNIT = {"gzip": "member", "zstd": "frame"}  # what a compressed file is a sequence of


def _corrupt(path: Path, compression: str, error: BaseException, where: str = "") -> UserError:
    tool = "gzip -t" if compression == "gzip" else "zstd -t"
    kind = "zlib" if isinstance(error, zlib.error) else type(error).__name__  # zlib's is just "error"
    return UserError(
        f"{path} is not a readable {compression} file ({kind}: {error}){where}: it is corrupt or "
        f"truncated (check it with `{tool} {path}`); download or compress it again, or remove it from the dataset"
    )


def _stream_where(
    compression: str, start: int, end: int, size: int, unit_start: int, lines: Callable[[], int] | None
) -> str:
    """Where a compressed stream failed: the compressed bytes the decoder was given when it failed
    (start..end, end excluded), the frame or member they are in and, for a file read as lines, the
    last complete line read (the documents before it were delivered)."""
    span = f"at byte {start}" if end <= start else f"in compressed bytes {start}-{end - 1}"
    where = f" {span} of {size} (in the {_UNIT[compression]} that starts at byte {unit_start})"
    if lines is not None:
        n = lines()
        where += f", after line {n}" if n else ", before the end of line 1"
    return where


def open_raw(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def read_head(path: Path, size: int) -> bytes:
    """Up to the first `size` bytes of an uncompressed file. os.read costs half of open() and a buffered read:
    the first bytes of every file of a folder are read at start (formats.py checks that they are text)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.read(fd, size)
        finally:
            os.close(fd)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def _gzip_decoder(path: Path):
    return zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # one gzip member: header, deflate data, CRC check


def _zstd_decoder(path: Path):
    return _import_zstandard(path).ZstdDecompressor().decompressobj()


def _decoded_chunks(path: Path, compression: str, lines: Callable[[], int] | None = None) -> Iterator[bytes]:
    """The decompressed bytes of a .gz or .zst file (one or more members or frames, as concatenated
    files and pigz/pzstd make them), in chunks. Decoding is done here rather than by gzip.GzipFile or
    zstandard's stream reader to know where a failure is: the offset of the piece being decoded and of
    its frame. A file that ends inside a frame is an error (zstandard's stream reader ends silently).
    `lines()` is the number of complete lines the caller has read, for the message."""
    if compression == "zstd":
        new_decoder, errors = _zstd_decoder, _import_zstandard(path).ZstdError
    else:
        new_decoder, errors = _gzip_decoder, zlib.error
    with open_raw(path) as f:
        size = os.fstat(f.fileno()).st_size
        offset = 0  # compressed bytes the decoder has taken so far
        decoder, unit_start = None, 0  # the decoder of the frame being read (None between frames), its start
        while True:
            try:
                data = f.read(_PIECE)
            except OSError as e:
                raise UserError(f"cannot read {path} at byte {offset}: {e.strerror or e}") from None
            if not data:
                break
            while data:
                if decoder is None:
                    if compression == "gzip" and offset:  # zeros may pad a gzip member (GzipFile skips them)
                        rest = data.lstrip(b"\0")
                        offset, data = offset + len(data) - len(rest), rest
                        if not data:
                            break
                    decoder, unit_start = new_decoder(path), offset
                try:
                    out = decoder.decompress(data)
                except errors as e:
                    where = _stream_where(compression, offset, offset + len(data), size, unit_start, lines)
                    raise _corrupt(path, compression, e, where) from None
                if out:
                    yield out
                if not decoder.eof:
                    offset += len(data)
                    break
                # The frame ended inside this piece: the rest of it starts the next one.
                rest = decoder.unused_data
                offset, data, decoder = offset + len(data) - len(rest), rest, None
        if decoder is not None:
            where = _stream_where(compression, size, size, size, unit_start, lines)
            raise _corrupt(path, compression, EOFError(f"the file ends inside a {_UNIT[compression]}"), where)


def byte_chunks(
    path: Path, compression: str | None, size: int = 1 << 20, lines: Callable[[], int] | None = None
) -> Generator[bytes, None, None]:
    """The (decompressed) bytes of a file, in chunks (of `size` bytes for an uncompressed file);
    decompression errors are UserErrors naming it and where it failed."""
    if compression is not None:
        yield from _decoded_chunks(path, compression, lines)
        return
    with open_raw(path) as raw:
        while chunk := raw.read(size):
            yield chunk


def byte_lines(path: Path, compression: str | None) -> Iterator[bytes]:
    """The lines of a (decompressed) file, split on b"\\n", without it."""
    pending: list[bytes] = []  # the start of a line that spans chunks
    complete = 0  # lines yielded: a corrupt stream is reported after the last of them
    # 64 KiB at a time: reading a document or a line costs little more than it.
    # The lambda reads `complete` when a corrupt stream is reported: the count so far, not the one at the start.
    for chunk in byte_chunks(path, compression, size=1 << 16, lines=lambda: complete):  # noqa: B023
        lines = chunk.split(b"\n")
        if len(lines) == 1:
            pending.append(chunk)
            continue
        if pending:
            lines[0] = b"".join(pending + [lines[0]])
        pending = [lines.pop()]
        yield from lines
        complete += len(lines)
    if pending and any(pending):
        yield b"".join(pending)


# --- text: UTF-8, refused where it is not -----------------------------------------------------------
# A user's data is decoded strictly: bytes that are not UTF-8 are a binary file or text in another
# encoding, and decoding them with replacement characters would train on garbage without a word. A NUL
# byte is refused too, though it is valid UTF-8: text never holds one (grep, git and diff take a file
# with one for binary), while a binary file of mostly zeros, or UTF-16/UTF-32 text of ASCII characters
# (every other byte NUL, and valid UTF-8 byte by byte without a BOM), would otherwise be read as text.
# A NUL that JSON writes as the escape \u0000 is a character of the record's text, not a NUL byte: kept.


def text_problem(data: bytes, final: bool = True) -> tuple[int, str] | None:
    """(byte offset, what) of the first bytes of `data` that text cannot hold (bytes that are not UTF-8,
    or a NUL byte); None if there are none. `final`: `data` is complete (else the start of a file, where
    a character cut by its end is not an error)."""
    nul = data.find(b"\0")
    try:
        codecs.utf_8_decode(data, "strict", final)
    except UnicodeDecodeError as e:
        if nul < 0 or e.start < nul:
            return e.start, f"0x{data[e.start]:02x} is not UTF-8 ({e.reason})"
    return (nul, "a NUL byte (text holds none; UTF-16 and UTF-32 text does)") if nul >= 0 else None


def not_text(path: Path, compression: str | None, offset: int, what: str, line: int | None = None) -> UserError:
    """The error of a data file whose text is not UTF-8 at byte `offset` (of its decompressed data, for a
    compressed file), in line `line` if known."""
    of = "of its decompressed data" if compression else "of the file"
    at = f" (line {line})" if line is not None else ""
    return UserError(
        f"{path} is not UTF-8 text: at byte {offset} {of}{at}, {what}; is it a binary file, or text in another "
        "encoding (UTF-16, Latin-1)? convert it to UTF-8 (e.g. iconv -f ENCODING -t UTF-8) or remove it from "
        "the dataset"
    )


def check_text(
    data: bytes, path: Path, compression: str | None, start: int = 0, line: int | None = None, final: bool = True
):
    """Refuse `data`, bytes `start`.. of the file, where it is not text (text_problem). The error names the
    line: `line` where the data is one line of the file, else counted in `data` (from `start` = 0)."""
    problem = text_problem(data, final)
    if problem is not None:
        offset, what = problem
        if line is None and start == 0:
            line = data.count(b"\n", 0, offset) + 1
        raise not_text(path, compression, start + offset, what, line)


def decode(data: bytes, path: Path, compression: str | None, start: int = 0, line: int | None = None) -> str:
    """`data` (bytes `start`.. of the file, line `line` if it is one line) as text; a UserError naming the
    file and where if it is not UTF-8 or holds a NUL byte (check_text)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\0" in text:
        check_text(data, path, compression, start, line)
    assert text is not None  # check_text refused the bytes that are not UTF-8
    return text


def whole_text(path: Path, compression: str | None) -> str:
    """A file's text, as Path.read_text reads it (universal newlines: \\r\\n and \\r become \\n), where it is
    UTF-8 text; else a UserError naming where it is not."""
    data = b"".join(byte_chunks(path, compression))
    text = decode(data, path, compression)
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text
