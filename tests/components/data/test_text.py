"""A user's data is UTF-8 text (torchtitan/components/data/compression.py, formats.py): a binary file, or
text in another encoding, given as .txt or JSON is refused with one UserError naming the file, the byte
(and line) where it stops being text, and the fix, instead of being decoded with replacement characters
and trained on. Its first bytes are checked when the file is opened, so the loader of data-parallel rank 0
(which run_train.sh's preflight builds before launch) refuses it; bytes further on when they are read.
A NUL byte is refused too (UTF-16 text of ASCII is valid UTF-8 byte by byte). Compressed files get the
same checks on their decompressed bytes; parquet and Arrow text columns are checked by row. The embedded
python_stdlib corpora keep their documented errors="replace".

The bad bytes are real: the shipped tokenizer's model file, this interpreter's executable, a gzip file
without its extension, standard-library test modules written in ISO-8859-1 and KOI8-R, and text encoded
by Python's own codecs."""

import gzip
import json
import random
import re
import string
import sys
from pathlib import Path

import pytest

from torchtitan.components import validation
from torchtitan.components.data import build_dataloader, compression, sources as data_sources
from torchtitan.config.errors import UserError
from torchtitan.config.training_sections import Training, Validation

from helpers.data import CharTokenizer, make_loader, take, write_jsonl
from helpers.paths import MODEL

FIX = r"is it a binary file, or text in another encoding \(UTF-16, Latin-1\)\? convert it to UTF-8"


def first_non_text(data: bytes) -> int:
    """The offset of the first byte that is not UTF-8 text or is NUL, by Python's own decoder."""
    nul = data.find(b"\0")
    try:
        data.decode("utf-8")
        return nul
    except UnicodeDecodeError as e:
        return e.start if nul < 0 else min(nul, e.start)


def zst(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def encoded_stdlib_modules() -> list[Path]:
    """Standard-library test modules that are not UTF-8 (written in ISO-8859-1 and KOI8-R)."""
    return [p for p in validation._stdlib_test_files() if first_non_text(p.read_bytes()) >= 0]


def binary(kind: str) -> bytes:
    if kind == "tokenizer model":
        return MODEL.read_bytes()  # a sentencepiece protobuf
    if kind == "executable":
        return Path(sys.executable).resolve().read_bytes()[: 1 << 16]
    if kind == "gzip without its extension":
        return gzip.compress(b'{"text": "a document"}\n' * 50)
    modules = encoded_stdlib_modules()
    if not modules:
        pytest.skip("this interpreter ships no standard-library modules in another encoding")
    return modules[0].read_bytes()


# --- refused before launch: the first bytes ------------------------------------------------------------


@pytest.mark.parametrize("compress", [None, "gz", "zst"])
@pytest.mark.parametrize("kind", ["tokenizer model", "executable", "gzip without its extension", "Latin-1 module"])
def test_a_binary_file_named_txt_is_refused_when_rank_0_builds_the_loader(tmp_path, kind, compress):
    data = binary(kind)
    (tmp_path / "a.txt").write_text("a good document\n")
    name = "b.txt" + (f".{compress}" if compress else "")
    (tmp_path / name).write_bytes({None: lambda d: d, "gz": gzip.compress, "zst": zst}[compress](data))
    offset = first_non_text(data)
    assert 0 <= offset < 4096  # in the first bytes: refused as the file is opened
    of = "of its decompressed data" if compress else "of the file"
    line = data.count(b"\n", 0, offset) + 1
    cfg = Training(dataset="local", dataset_path=str(tmp_path), seq_len=8, local_batch_size=1)
    with pytest.raises(UserError) as failure:
        build_dataloader(cfg, CharTokenizer(), 0, 1, 1)
    message = str(failure.value)
    assert re.match(
        rf"{re.escape(str(tmp_path / name))} is not UTF-8 text: at byte {offset} {of} "
        rf"\(line {line}\), .*; {FIX}",
        message,
    ), message
    assert "\n" not in message


def test_utf16_text_is_refused_by_its_nul_bytes_and_a_json_escape_of_nul_is_kept(tmp_path):
    # UTF-16 of ASCII text is valid UTF-8 byte by byte: only its NUL bytes tell it from text.
    path = tmp_path / "u16.txt"
    path.write_bytes("plain words, as an editor on Windows saves them\n".encode("utf-16-le"))
    with pytest.raises(UserError, match=r"u16.txt is not UTF-8 text: at byte 1 of the file \(line 1\), a NUL byte"):
        make_loader(path, 8, 1)
    # JSON writes a NUL character as an escape: it is the record's text, read as such.
    path = write_jsonl(tmp_path / "nul.jsonl", ["a\0b" + "c" * 20])
    assert b"\\u0000" in path.read_bytes() and b"\0" not in path.read_bytes()
    window = take(iter(make_loader(path, 8, 1)), 1)[0]
    assert window[:4] == CharTokenizer().encode("a\0b", bos=True, eos=False)


# --- refused where it is, further on ---------------------------------------------------------------------


def latin1_jsonl(bad_line: int, lines: int) -> tuple[bytes, list[str]]:
    """JSON lines with line `bad_line` (from 1) written in Latin-1, as a second tool appended it; the texts
    of the good lines before it. Random letters compress little: a line past the first 128 KiB lies past
    what opening a compressed file decodes (and checks): a zstd block, or a piece of gzip data."""
    rng = random.Random(bad_line)
    texts = [f"document {i} " + "".join(rng.choice(string.ascii_letters) for _ in range(100)) for i in range(lines)]
    data = b"".join(
        json.dumps({"text": "café crème" if i == bad_line - 1 else t}, ensure_ascii=False).encode(
            "latin-1" if i == bad_line - 1 else "utf-8"
        )
        + b"\n"
        for i, t in enumerate(texts)
    )
    return data, texts[: bad_line - 1]


@pytest.mark.parametrize("compress", [None, "gz", "zst"])
def test_a_latin1_line_deep_in_a_json_lines_file_stops_the_run_there_naming_its_line_and_byte(tmp_path, compress):
    data, before = latin1_jsonl(2001, 2200)
    offset = data.index(b"\xe9")  # the Latin-1 é of "café"
    assert offset > 128 << 10
    path = tmp_path / ("d.jsonl" + (f".{compress}" if compress else ""))
    path.write_bytes({None: lambda d: d, "gz": gzip.compress, "zst": zst}[compress](data))
    tokens = [t for text in before for t in CharTokenizer().encode(text, bos=True, eos=True)]
    windows = []
    with pytest.raises(UserError) as failure:
        loader = iter(make_loader(path, 255, 1))  # one lane: the file in stored order
        for _ in range(2 * len(tokens) // 256):  # the loader loops: bounded at twice the file
            inputs, labels = next(loader)
            windows += [row + [last] for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]
    of = "of its decompressed data" if compress else "of the file"
    assert str(failure.value).startswith(
        f"{path} is not UTF-8 text: at byte {offset} {of} (line 2001), 0xe9 is not UTF-8 (invalid continuation byte); "
    )
    # Everything before the line was delivered; nothing of it or after it.
    assert [t for w in windows for t in w] == tokens[: len(windows) * 256]
    assert len(tokens) - 256 < len(windows) * 256 <= len(tokens)


def test_a_lane_reading_a_byte_range_names_the_byte(tmp_path):
    data, _ = latin1_jsonl(380, 400)
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    offset = data.index(b"\xe9")
    loader = make_loader(path, 255, 2)  # two lanes: each reads a byte range of the file
    with pytest.raises(UserError, match=rf"d.jsonl is not UTF-8 text: at byte {offset} of the file, 0xe9"):
        take(iter(loader), 400)


def test_a_json_array_and_a_long_txt_file_name_the_line(tmp_path):
    records = [{"text": f"record {i}"} for i in range(5)] + [{"text": "naïve"}]
    data = ("[" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "]").encode("latin-1")
    (tmp_path / "a.json").write_bytes(data)
    offset = data.index(b"\xef")
    with pytest.raises(
        UserError,
        match=rf"a.json is not UTF-8 text: at byte {offset} of the file "
        r"\(line 6\), 0xef is not UTF-8",
    ):
        make_loader(tmp_path / "a.json", 8, 1)
    text = ("x" * 99 + "\n") * 100 + "Größe\n"  # the ö past the first bytes: found when the file is read
    (tmp_path / "long.txt").write_bytes(text.encode("latin-1"))
    with pytest.raises(UserError, match=r"long.txt is not UTF-8 text: at byte 10002 of the file \(line 101\), 0xf6"):
        make_loader(tmp_path / "long.txt", 8, 1)


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_text_column_holding_bytes_that_are_not_utf8_names_the_row(tmp_path, fmt):
    import pyarrow as pa
    import pyarrow.ipc  # noqa: F401 (pa.ipc)
    import pyarrow.parquet as pq

    # pyarrow writes a string column without checking its bytes; reading it into Python fails.
    values = [f"row {i}".encode() for i in range(6)] + ["Ärger".encode("latin-1")]
    table = pa.table({"text": pa.array(values, type=pa.binary()).view(pa.string())})
    path = tmp_path / f"d.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=4)
    else:
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table)
    with pytest.raises(
        UserError,
        match=rf"d.{fmt}: column 'text' of row 6 \(counted from 0\) is not UTF-8 text: at "
        r"byte 0 of the value, 0xc4 is not UTF-8",
    ):
        take(iter(make_loader(path, 8, 1)), 10)


def test_validation_and_mixture_sources_are_checked_too(tmp_path):
    (tmp_path / "model.txt").write_bytes(MODEL.read_bytes())
    good = write_jsonl(tmp_path / "good.jsonl", ["some text " * 20])
    offset = first_non_text(MODEL.read_bytes())
    held_out = Validation(enabled=True, dataset="local", dataset_path=str(tmp_path / "model.txt"))
    with pytest.raises(UserError, match=rf"^validation: \S*model.txt is not UTF-8 text: at byte {offset} of the file"):
        validation.preflight_validation(held_out, Training(), CharTokenizer(), 1)
    cfg = Training(dataset_mix=[f"0.5:{good}", f"0.5:{tmp_path / 'model.txt'}"], seq_len=8, local_batch_size=1)
    with pytest.raises(UserError, match=r"^training.dataset_mix source '\S*model.txt': \S*model.txt is not UTF-8"):
        build_dataloader(cfg, CharTokenizer(), 0, 1, 1)


# --- text as before ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [None, "gz", "zst"])
def test_utf8_text_reads_as_path_read_text_reads_it(tmp_path, compress):
    # A BOM, multi-byte characters, Windows and old Mac line ends; a 3-byte character cut by the end of the
    # first 4096 bytes the opening check reads is not taken for an error.
    head = "\ufeffprint('€')\r\nnaïve — 日本語\rend\n"
    text = head + "x" * (4095 - len(head.encode())) + "€ tail\r\n"
    data = text.encode("utf-8")
    assert data[4095:4098] == "€".encode()  # straddles byte 4096
    plain = tmp_path / "plain.txt"
    plain.write_bytes(data)
    path = tmp_path / ("t.txt" + (f".{compress}" if compress else ""))
    path.write_bytes({None: lambda d: d, "gz": gzip.compress, "zst": zst}[compress](data))
    expected = plain.read_text(encoding="utf-8")
    assert compression.whole_text(path, {None: None, "gz": "gzip", "zst": "zstd"}[compress]) == expected
    window = take(iter(make_loader(path, 30, 1)), 1)[0]
    assert window == CharTokenizer().encode(expected, bos=True, eos=False)[:31]


def test_the_python_stdlib_corpora_keep_replacement_characters(monkeypatch):
    # The embedded corpora are documented as read with errors="replace": their tokens (the default run's
    # losses) do not change. The held-out tests hold real modules in other encodings.
    modules = encoded_stdlib_modules()
    if not modules:
        pytest.skip("this interpreter ships no standard-library modules in another encoding")
    test_docs = dict(zip(validation._stdlib_test_files(), validation._StdlibTestSource().documents(0)))
    for path in modules:
        assert test_docs[path] == path.read_text(encoding="utf-8", errors="replace")
        assert "\ufffd" in test_docs[path]
    monkeypatch.setattr(data_sources, "_stdlib_files", lambda: tuple(modules))
    source = data_sources.StdlibSource()
    assert [source.document(i) for i in range(len(modules))] == [test_docs[p] for p in modules]
