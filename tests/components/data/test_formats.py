"""Local data files, one reader per format (torchtitan/components/data/formats.py): every format reads
as the JSON lines of the same texts (in one lane and in two, resumed, shuffled), training.dataset_text_field,
bad records named by their line or column, and files corrupt in the middle.

Data files corrupt in the middle: the loader delivers the documents before the damage, then stops
with one UserError (printed without a traceback, exit 2) naming the file and where: the compressed
bytes being decoded and the last complete line read (gzip, zstd), the row group and its rows
(parquet), the record batch (Arrow). The files are real bytes, damaged where a decoder must notice.

There the loader reads one lane (a global batch of one sequence, components/data/lanes.py) in stored order:
the lane reads the whole file as one token stream, so what it delivers before the failure is the start
of the file's stream."""

import gzip
import json
import random
import re
import string
import zlib

import pytest

from torchtitan.components.data import build_dataloader, compression
from torchtitan.config.errors import UserError
from torchtitan.config.training_sections import Training

from helpers.data import (
    CharTokenizer,
    document_units,
    expected_stream,
    expected_windows,
    json_round_trip,
    jsonl_pieces,
    lane_windows,
    make_loader,
    random_docs,
    take,
    write_arrow,
    write_gz,
    write_jsonl,
    write_parquet,
    write_save_to_disk,
    write_zst,
)

SEQ_LEN, BATCH = 255, 1  # one lane: the file's own token stream
WINDOW = SEQ_LEN + 1
TOK = CharTokenizer()


def documents(n, seed):
    # Random letters and digits compress little: a few hundred documents span several of the pieces
    # the readers decode at a time, so a failure has pieces (and documents) before it.
    rng = random.Random(seed)
    letters = string.ascii_letters + string.digits + " "
    return [f"doc {i} " + "".join(rng.choice(letters) for _ in range(rng.randint(80, 160))) for i in range(n)]


def jsonl(docs):
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def read_until_error(path):
    """The windows the loader delivers from `path` before it fails, and the failure's message."""
    cfg = Training(
        dataset="local", dataset_path=str(path), seq_len=SEQ_LEN, local_batch_size=BATCH, shuffle_documents=False
    )
    windows = []
    with pytest.raises(UserError) as failure:
        for inputs, labels in build_dataloader(cfg, TOK, 0, 1, BATCH):
            windows += [row + [last] for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]
    message = str(failure.value)
    assert "Traceback" not in message and "\n" not in message, message  # one line, as the user sees it
    assert str(path) in message
    return windows, message


def assert_delivered(windows, docs, n):
    """The windows are the start of the token stream of `docs` and hold docs[:n], all of it but the
    tail that does not fill a batch: the run got as far as the message says."""
    stream = [t for d in docs for t in TOK.encode(d, bos=True, eos=True)]
    assert windows == [stream[k * WINDOW : (k + 1) * WINDOW] for k in range(len(windows))]
    tokens = sum(len(d) + 2 for d in docs[:n])
    assert tokens - BATCH * WINDOW < len(windows) * WINDOW <= tokens


def stream_failure(message):
    """(first byte, last byte, file size, frame start, lines read) of a compressed file's message."""
    m = re.search(
        r" (?:in compressed bytes (\d+)-(\d+)|at byte (\d+)) of (\d+) \(in the (?:frame|member) that "
        r"starts at byte (\d+)\), (?:after line (\d+)|before the end of line 1): it is corrupt",
        message,
    )
    assert m, message
    first, last, at, size, start, lines = m.groups()
    first, last = (int(at), int(at)) if at else (int(first), int(last))
    return first, last, int(size), int(start), int(lines or 0)


# --- zstd ----------------------------------------------------------------------------------------


def zstd_frame(docs, lines_per_block):
    """One zstd frame of the JSON lines of `docs`, a block ended every `lines_per_block` lines (as a
    streaming compressor flushing makes them)."""
    zstandard = pytest.importorskip("zstandard")
    c = zstandard.ZstdCompressor().compressobj()
    parts = [
        c.compress(jsonl(docs[i : i + lines_per_block])) + c.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        for i in range(0, len(docs), lines_per_block)
    ]
    return b"".join(parts) + c.flush()


def zstd_blocks(frame):
    """The offsets of a zstd frame's block headers (RFC 8878 3.1.1)."""
    descriptor = frame[4]
    single_segment = descriptor >> 5 & 1
    position = 4 + 1 + (1 - single_segment) + (0, 1, 2, 4)[descriptor & 3] + (single_segment, 2, 4, 8)[descriptor >> 6]
    blocks = []
    while True:
        header = int.from_bytes(frame[position : position + 3], "little")
        blocks.append(position)
        kind, size = header >> 1 & 3, header >> 3
        position += 3 + (1 if kind == 1 else size)  # an RLE block holds its one byte
        if header & 1:  # the last block
            return blocks


@pytest.fixture
def zstd_file(tmp_path):
    """A .jsonl.zst of three frames of 300 lines, a block per 20 lines: (path, docs, frames)."""
    docs = documents(900, seed=1)
    frames = [zstd_frame(docs[i : i + 300], 20) for i in range(0, 900, 300)]
    path = tmp_path / "shard.jsonl.zst"
    path.write_bytes(b"".join(frames))
    return path, docs, frames


def test_zstd_block_corrupt_in_a_middle_frame_names_the_bytes_the_frame_and_the_line(zstd_file):
    path, docs, frames = zstd_file
    start = len(frames[0])  # of the middle frame
    blocks = zstd_blocks(frames[1])
    block = next(b for b in blocks if b >= compression._PIECE)  # a piece after the one the first frame ends in
    assert block < blocks[-2], "the frame is too small for a block in its middle"
    data = bytearray(path.read_bytes())
    data[start + block] |= 0b110  # block type 3: reserved, which a decoder must reject
    path.write_bytes(bytes(data))

    windows, message = read_until_error(path)
    assert re.search(r"shard.jsonl.zst is not a readable zstd file \(ZstdError: .*\) in compressed bytes", message)
    first, last, size, frame_start, lines = stream_failure(message)
    assert (size, frame_start) == (len(data), start)
    # The decoder checks a block header once it has its 3 bytes: the piece that holds the last one.
    assert first <= start + block + 2 <= last and last - first < compression._PIECE
    lines_before_block = 300 + blocks.index(block) * 20
    assert 300 <= lines <= lines_before_block  # the first frame and more were read
    assert_delivered(windows, docs, lines)


def test_zstd_file_cut_inside_a_frame_names_where_it_ends_and_the_line(zstd_file):
    path, docs, frames = zstd_file
    start = len(frames[0])
    blocks = zstd_blocks(frames[1])
    cut = start + blocks[len(blocks) // 2] + 7  # a few bytes into a block in the middle of the frame
    path.write_bytes(path.read_bytes()[:cut])

    windows, message = read_until_error(path)
    assert "shard.jsonl.zst is not a readable zstd file (EOFError: the file ends inside a frame) at byte" in message
    assert stream_failure(message) == (cut, cut, cut, start, 300 + len(blocks) // 2 * 20)  # the blocks before it
    assert_delivered(windows, docs, 300 + len(blocks) // 2 * 20)


# --- gzip ----------------------------------------------------------------------------------------


def gzip_member(docs, lines_per_flush):
    """A gzip member of the JSON lines of `docs`, flushed every `lines_per_flush` lines (as pigz does):
    each flush ends the deflate data so far with an empty stored block, 00 00 ff ff. Returns the
    member and the offsets of those markers in it."""
    c = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    member, markers = b"", []
    for i in range(0, len(docs), lines_per_flush):
        member += c.compress(jsonl(docs[i : i + lines_per_flush])) + c.flush(zlib.Z_FULL_FLUSH)
        assert member.endswith(b"\x00\x00\xff\xff")
        markers.append(len(member) - 4)
    return member + c.flush(), markers


@pytest.fixture
def gzip_file(tmp_path):
    """A .jsonl.gz of three members of 300 lines, flushed every 20 lines: (path, docs, members, markers)."""
    docs = documents(900, seed=2)
    members, markers = zip(*(gzip_member(docs[i : i + 300], 20) for i in range(0, 900, 300)))
    path = tmp_path / "shard.jsonl.gz"
    path.write_bytes(b"".join(members))
    return path, docs, members, markers


def test_gzip_data_corrupt_in_a_middle_member_names_the_bytes_the_member_and_the_line(gzip_file):
    path, docs, members, markers = gzip_file
    start = len(members[0])
    k = next(k for k, m in enumerate(markers[1]) if m >= compression._PIECE)  # a piece after the first member's end
    assert k < len(markers[1]) - 2, "the member is too small for a marker in its middle"
    at = start + markers[1][k] + 3  # the stored block's NLEN, no longer the complement of its LEN
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))

    windows, message = read_until_error(path)
    assert (
        "shard.jsonl.gz is not a readable gzip file (zlib: Error -3 while decompressing data: invalid stored "
        "block lengths) in compressed bytes" in message
    )
    first, last, size, member_start, lines = stream_failure(message)
    assert (size, member_start) == (len(data), start)
    assert first <= at <= last and last - first < compression._PIECE  # inflate checks NLEN once it has it all
    assert 300 <= lines <= 300 + (k + 1) * 20  # the first member and more were read, not past the damage
    assert_delivered(windows, docs, lines)


def test_gzip_member_header_corrupt_names_the_member_and_the_line(gzip_file):
    path, docs, members, _ = gzip_file
    start = len(members[0]) + len(members[1])  # the last member
    data = bytearray(path.read_bytes())
    data[start : start + 2] = b"PK"  # not the gzip magic
    path.write_bytes(bytes(data))

    windows, message = read_until_error(path)
    assert (
        "shard.jsonl.gz is not a readable gzip file (zlib: Error -3 while decompressing data: incorrect header "
        "check) in compressed bytes" in message
    )
    first, last, size, member_start, lines = stream_failure(message)
    assert (size, member_start, lines) == (len(data), start, 600)  # all of the first two members was read
    assert first <= start <= last
    assert_delivered(windows, docs, 600)


def test_gzip_file_cut_inside_a_member_names_where_it_ends_and_the_line(gzip_file):
    path, docs, members, markers = gzip_file
    start = len(members[0])
    cut = start + markers[1][len(markers[1]) // 2] + 4 + 100  # 100 bytes past the flush after line 300 + 20 k
    path.write_bytes(path.read_bytes()[:cut])

    windows, message = read_until_error(path)
    assert "shard.jsonl.gz is not a readable gzip file (EOFError: the file ends inside a member) at byte" in message
    first, last, size, member_start, lines = stream_failure(message)
    # All that was flushed before the cut was read (deflate yields what it can of the rest).
    flushed = 300 + (len(markers[1]) // 2 + 1) * 20
    assert (first, last, size, member_start) == (cut, cut, cut, start) and flushed <= lines < flushed + 20
    assert_delivered(windows, docs, lines)


def test_good_multi_member_gzip_with_zero_padding_reads_every_document(tmp_path):
    # gzip -c a b > ab and padded tape images: members one after another, zeros between them.
    docs = documents(200, seed=3)
    path = tmp_path / "shard.jsonl.gz"
    path.write_bytes(gzip_member(docs[:120], 7)[0] + bytes(16) + gzip_member(docs[120:], 9)[0] + bytes(5))
    cfg = Training(
        dataset="local", dataset_path=str(path), seq_len=SEQ_LEN, local_batch_size=BATCH, shuffle_documents=False
    )
    windows = []
    for inputs, labels in build_dataloader(cfg, TOK, 0, 1, BATCH):
        windows += [row + [last] for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]
        if len(windows) * WINDOW > sum(len(d) + 2 for d in docs):
            break  # into the second epoch: every document was read
    stream = [t for d in docs + docs for t in TOK.encode(d, bos=True, eos=True)]
    assert windows == [stream[k * WINDOW : (k + 1) * WINDOW] for k in range(len(windows))]


# --- parquet -------------------------------------------------------------------------------------


def test_parquet_row_group_corrupt_in_the_middle_names_the_group_and_its_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = documents(800, seed=4)
    path = tmp_path / "shard.parquet"
    pq.write_table(pa.table({"id": range(800), "text": docs}), path, row_group_size=100)
    text = pq.ParquetFile(path).metadata.row_group(3).column(1)
    data = bytearray(path.read_bytes())
    # The header of the group's first data page: its footer (and metadata) still read.
    data[text.data_page_offset : text.data_page_offset + 64] = bytes(64)
    path.write_bytes(bytes(data))

    windows, message = read_until_error(path)
    assert re.search(
        r"cannot read parquet file \S*shard.parquet: row group 3 of 8 \(rows 300-399; counted from 0\) "
        r"fails \(.+\); it is corrupt or truncated",
        message,
    ), message
    assert_delivered(windows, docs, 300)


def test_parquet_failure_deep_in_a_large_row_group_names_the_rows_read(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = [f"document {i:05d} " + "x" * (i % 7) for i in range(6000)]
    path = tmp_path / "shard.parquet"
    pq.write_table(pa.table({"text": docs}), path, row_group_size=3000, use_dictionary=False, compression="none")
    data = bytearray(path.read_bytes())
    at = data.index(docs[5500].encode())  # plain encoding: each value after its 4-byte length
    data[at - 4 : at] = (0x7FFFFFFF).to_bytes(4, "little")
    path.write_bytes(bytes(data))

    windows, message = read_until_error(path)
    # Rows are read 1024 at a time: those of the batch that failed were not delivered.
    assert re.search(
        r"shard.parquet: row group 1 of 2 \(rows 3000-5999, of which 3000-5047 were read; counted from "
        r"0\) fails \(.+\); it is corrupt",
        message,
    ), message
    assert_delivered(windows, docs, 5048)


# --- Arrow ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("file_format", [False, True], ids=["stream", "file"])
def test_arrow_record_batch_corrupt_names_the_batch(tmp_path, file_format):
    pa = pytest.importorskip("pyarrow")
    docs = documents(100, seed=5)
    table = pa.table({"id": range(100), "text": docs})
    path = tmp_path / "data" / "b.arrow"
    path.parent.mkdir()
    sink = pa.OSFile(str(path), "wb")
    starts = []
    with (pa.ipc.new_file if file_format else pa.ipc.new_stream)(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=10):
            starts.append(sink.tell())
            writer.write_batch(batch)
    sink.close()
    data = bytearray(path.read_bytes())
    data[starts[5] + 8 : starts[5] + 40] = b"\x7f" * 32  # batch 5's metadata (after its marker and length)
    path.write_bytes(bytes(data))
    (tmp_path / "data" / "a.jsonl").write_bytes(jsonl(docs[:40]))  # read first: a folder is read in path order

    windows, message = read_until_error(path.parent)
    of = " of 10" if file_format else ""  # a stream does not say how many batches it has
    assert re.search(
        rf"cannot read Arrow file \S*b.arrow: record batch 5{of} \(counted from 0, after 50 rows\) "
        r"fails \(.+\); it is corrupt or truncated",
        message,
    ), message
    assert_delivered(windows, docs[:40], 40)


# --- every format reads as the JSON lines of the same texts ----------------------------------------


def write_json_array(path, docs):
    path.write_text(json.dumps([{"text": d, "n": i} for i, d in enumerate(docs)], indent=1))
    return path


def write_txt_folder(path, docs):
    path.mkdir()
    for i, d in enumerate(docs):
        (path / f"{i:03d}.txt").write_text(d)
    (path / "007.txt").unlink()  # document 7 compressed instead
    (path / "007.txt.gz").write_bytes(gzip.compress(docs[7].encode()))
    return path


def write_dataset_dict(path, docs):
    """datasets.DatasetDict.save_to_disk: one save_to_disk folder per split."""
    path.mkdir()
    write_save_to_disk(path / "train", docs)
    write_save_to_disk(path / "validation", ["held out"], shards=1)
    (path / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    return path


# (writer, file name, its units for 2 lanes, random access)
FORMATS = {
    "jsonl.gz": (write_gz, "d.jsonl.gz", lambda docs: [docs], False),  # compressed: one unit
    "jsonl.zst": (write_zst, "d.jsonl.zst", lambda docs: [docs], False),
    "json array": (write_json_array, "d.json", lambda docs: [docs], False),
    "txt folder": (write_txt_folder, "docs", lambda docs: document_units(docs, 2), True),
    "parquet": (write_parquet, "d.parquet", lambda docs: [docs[:14], docs[14:]], False),  # 2 row groups each
    "arrow stream": (write_arrow, "d.arrow", lambda docs: document_units(docs, 2), True),
    "arrow file": (
        lambda p, d: write_arrow(p, d, file_format=True),
        "d.arrow",
        lambda docs: document_units(docs, 2),
        True,
    ),
    "save_to_disk": (write_save_to_disk, "ds", lambda docs: document_units(docs, 2), True),
    "DatasetDict": (write_dataset_dict, "dd", lambda docs: document_units(docs, 2), True),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_reads_as_the_jsonl_of_the_same_texts(tmp_path, fmt):
    writer, name, units_of, random_access = FORMATS[fmt]
    docs = random_docs(23, seed=5)
    docs[4] = ""  # an empty document keeps its index
    jsonl = write_jsonl(tmp_path / "ref.jsonl", docs)
    path = writer(tmp_path / name, docs)
    # One lane: stored order, as the JSON lines file of the same texts reads.
    reference = take(iter(make_loader(jsonl, 8, 1)), 60)  # 60 windows of 9 tokens: two epochs and more
    assert take(iter(make_loader(path, 8, 1)), 60) == reference == expected_windows(docs, 8, 0, 60)
    # Two lanes: each reads its units (the JSON lines file: two byte ranges).
    assert take(iter(make_loader(jsonl, 8, 2)), 30) == lane_windows(jsonl_pieces(jsonl, docs, 2), 2, 8, 60)
    units = units_of(docs)
    loader = make_loader(path, 8, 2)
    it = iter(loader)
    assert take(it, 30) == lane_windows(units, 2, 8, 60)
    # Resume deep into the data (parquet skips whole row groups, the others count documents).
    state = json_round_trip(loader.state_dict())
    resumed = make_loader(path, 8, 2)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 5) == take(it, 5)
    # The default: shuffled (streams in blocks of shuffle_buffer documents).
    got = take(iter(make_loader(path, 8, 2, shuffle=None)), 30)
    assert got == lane_windows(units, 2, 8, 60, seed=0, random_access=random_access) != reference[:60]
    if not random_access:  # a smaller shuffle block
        got = take(iter(make_loader(path, 8, 2, shuffle=True, shuffle_buffer=5)), 30)
        assert got == lane_windows(units, 2, 8, 60, seed=0, block=5)


def test_txt_file_is_one_document(tmp_path):
    text = "line one\nline two\n\nline four\n"
    path = tmp_path / "doc.txt"
    path.write_text(text)
    got = [t for w in take(iter(make_loader(path, seq_len=9, local_batch=1)), 6) for t in w]
    assert got == expected_stream([text], len(got))


@pytest.mark.parametrize("writer", [write_parquet, write_arrow, "jsonl"])
def test_text_field_option(tmp_path, writer):
    docs = random_docs(10, seed=8)
    if writer == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps({"content": d, "text": 0}) + "\n" for d in docs))
    else:
        path = writer(tmp_path / f"d.{'parquet' if writer is write_parquet else 'arrow'}", docs, field="content")
    loader = make_loader(path, 8, 1, dataset_text_field="content")
    assert take(iter(loader), 10) == expected_windows(docs, 8, 0, 10)


# --- bad records -----------------------------------------------------------------------------------


def test_bad_json_on_the_first_line_fails_when_the_loader_is_built(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"\n')
    with pytest.raises(UserError, match=r"bad.jsonl line 1: invalid JSON"):
        make_loader(path, 8, 2)


def test_bad_json_later_fails_naming_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    first = '{"text": "a fine first document"}\n'
    path.write_text(first + '\n{"text": oops}\n')
    with pytest.raises(UserError, match=r"bad.jsonl line 3: invalid JSON"):
        take(iter(make_loader(path, 8, 1)), 10)
    # Two lanes read the file in two byte ranges: the second names where its bad line starts.
    assert path.stat().st_size // 2 <= len(first) + 1
    with pytest.raises(UserError, match=rf"bad.jsonl line at byte {len(first) + 1}: invalid JSON"):
        take(iter(make_loader(path, 8, 2)), 5)


@pytest.mark.parametrize("line", ['{"content": "x"}', '["text"]', '{"text": 5}'])
def test_line_without_a_text_string(tmp_path, line):
    path = tmp_path / "d.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(UserError, match=r"d.jsonl line 1: .*'text'"):
        make_loader(path, 8, 2)


def test_parquet_without_the_text_column_names_its_columns(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ["a", "b"], field="content")
    with pytest.raises(
        UserError,
        match=r"d.parquet has no column 'text' \(its columns: id, content\); set "
        r"training.dataset_text_field",
    ):
        make_loader(path, 8, 2)


def test_arrow_column_that_is_not_text(tmp_path):
    path = write_arrow(tmp_path / "d.arrow", ["a"])
    with pytest.raises(UserError, match=r"d.arrow: column 'id' is of type int64, not text"):
        make_loader(path, 8, 2, dataset_text_field="id")


def test_bad_line_found_in_a_shuffled_file_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": d}) for d in random_docs(6, seed=13)]
    lines[4] = '{"text": oops}'
    path.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")  # a blank line 3
    it = iter(make_loader(path, 8, 1, shuffle=True))
    with pytest.raises(UserError, match=r"bad.jsonl line 6: invalid JSON"):
        take(it, 80)


def test_bad_line_in_a_compressed_file_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "a fine first document"}\n{"body": "x"}\n'))
    it = iter(make_loader(path, 8, 2))
    with pytest.raises(UserError, match=r"bad.jsonl.gz line 2: no 'text' field \(it has 'body'\)"):
        take(it, 5)
