"""A file or folder of local data files as a source of documents (torchtitan/components/data/files.py):
folders read recursively in path order and mixing formats, save_to_disk and DatasetDict folders,
missing paths and unsupported files, a resume that skips the streamed shards it has counted, and
training.skip_corrupt_files."""

import gzip
import json
import logging

import pytest

from torchtitan.config.errors import UserError

from helpers.data import (
    document_units,
    expected_stream,
    expected_windows,
    json_round_trip,
    jsonl_pieces,
    lane_windows,
    make_loader,
    random_docs,
    take,
    write_gz,
    write_jsonl,
    write_parquet,
    write_save_to_disk,
    write_zst,
)


def test_folder_reads_jsonl_and_txt_recursively_in_path_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zzz")
    write_jsonl(tmp_path / "b" / "a.jsonl", ["b-a-0", "b-a-1"])
    (tmp_path / "a.txt").write_text("top-a")
    (tmp_path / "README.md").write_text("ignored")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.csv").write_text("ignored")
    (tmp_path / ".gitattributes").write_text("ignored")
    (tmp_path / "LICENSE").write_text("ignored")
    docs = ["top-a", "b-a-0", "b-a-1", "zzz"]
    got = [t for w in take(iter(make_loader(tmp_path, seq_len=5, local_batch=1)), 10) for t in w]
    assert got == expected_stream(docs, len(got))


def test_a_folder_mixes_formats_in_path_order(tmp_path):
    docs = random_docs(12, seed=7)
    (tmp_path / "d").mkdir()
    write_parquet(tmp_path / "d" / "a.parquet", docs[:4])
    write_gz(tmp_path / "d" / "b.jsonl.gz", docs[4:8])
    write_save_to_disk(tmp_path / "d" / "c", docs[8:10], shards=2)
    (tmp_path / "d" / "d.txt").write_text(docs[10])
    write_jsonl(tmp_path / "d" / "e.jsonl", docs[11:])
    assert take(iter(make_loader(tmp_path / "d", 8, 1)), 20) == expected_windows(docs, 8, 0, 20)
    # Files read as streams and files with random access together: units are files (6 for 2 lanes).
    units = [docs[:4], docs[4:8], docs[8:9], docs[9:10], docs[10:11], docs[11:]]
    assert take(iter(make_loader(tmp_path / "d", 8, 2)), 10) == lane_windows(units, 2, 8, 20)


def test_real_datasets_save_to_disk_folder_if_datasets_is_installed(tmp_path):
    datasets = pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    docs = random_docs(12, seed=6)
    datasets.Dataset(pa.table({"text": docs}), fingerprint="f").save_to_disk(str(tmp_path / "ds"), num_shards=2)
    assert take(iter(make_loader(tmp_path / "ds", 8, 1)), 20) == expected_windows(docs, 8, 0, 20)


# --- user errors ---------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match="dataset_path .*nope.jsonl does not exist"):
        make_loader(tmp_path / "nope.jsonl", 8, 2)


def test_folder_without_data_files(tmp_path):
    (tmp_path / "notes.md").write_text("not data")
    with pytest.raises(UserError, match="is empty: it holds no data files"):
        make_loader(tmp_path, 8, 2)


def test_unsupported_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("text\nhello\n")
    with pytest.raises(UserError, match=r"unsupported extension '.csv'.*\.jsonl.*\.txt"):
        make_loader(path, 8, 2)


def test_unknown_extension_in_a_folder(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x"])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.csv").write_text("text\nhello\n")
    (tmp_path / "c.jsonl.bz2").write_bytes(b"")
    with pytest.raises(
        UserError,
        match=r"holds files of unsupported types: c.jsonl.bz2, sub/b.csv; supported: "
        r".*Move the other files out",
    ):
        make_loader(tmp_path, 8, 2)


def test_datasetdict_without_a_train_split(tmp_path):
    (tmp_path / "dd").mkdir()
    write_save_to_disk(tmp_path / "dd" / "test", ["a"], shards=1)
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
    with pytest.raises(UserError, match="without a train split \\(its splits: test\\)"):
        make_loader(tmp_path / "dd", 8, 2)


# --- resume of streamed shards without reading them again ----------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("data_workers", [0, 2])
def test_a_resume_skips_the_shards_it_has_read_without_reading_them(tmp_path, data_workers):
    """Compressed JSON lines have no document count until read. The state saves the counts learned by
    reading (with each file's size), so a resume skips those shards: proved by overwriting them with
    garbage of the same size after the save, which a resume that read them would stop on."""
    zstandard = pytest.importorskip("zstandard")
    docs = random_docs(240, seed=9)
    folder = tmp_path / "shards"
    folder.mkdir()
    for k in range(6):
        write_zst(folder / f"shard-{k}.jsonl.zst", docs[k * 40 : (k + 1) * 40])
    # ~21 tokens per document, 40 per shard, 32-token windows: 150 windows end in the last shard.
    loader = make_loader(folder, 31, 2, data_workers=data_workers)
    it = iter(loader)
    reference = take(it, 75)
    later = take(it, 3)
    fresh = make_loader(folder, 31, 2, data_workers=data_workers)
    head = take(iter(fresh), 75)
    state = json_round_trip(fresh.state_dict())
    assert head == reference
    # Two lanes: lane 0 reads shards 0, 2, 4 in epoch 0, lane 1 shards 1, 3, 5; each is in its third.
    layout = state["dataset_state"]["source_layout"]["unit_documents"]
    assert {name: count for name, (count, _) in layout.items()} == {f"shard-{k}.jsonl.zst#0/1": 40 for k in range(4)}
    for k in range(4):  # the shards before the position: same size, the second of their two frames garbage
        shard = folder / f"shard-{k}.jsonl.zst"  # (the first frame stays: the start-up checks read it)
        data = shard.read_bytes()
        first = len(
            zstandard.ZstdCompressor().compress(
                "".join(json.dumps({"text": d}) + "\n" for d in docs[k * 40 : k * 40 + 20]).encode()
            )
        )
        shard.write_bytes(data[:first] + b"\0" * (len(data) - first))
    resumed = make_loader(folder, 31, 2, data_workers=data_workers)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 3) == later
    # A shard whose size changed since the save is counted again by reading: here, it stops on the garbage.
    shard = folder / "shard-0.jsonl.zst"
    shard.write_bytes(shard.read_bytes() + b"\0")
    again = make_loader(folder, 31, 2, data_workers=data_workers)
    again.load_state_dict(state)
    with pytest.raises(UserError, match="shard-0.jsonl.zst is not a readable zstd file"):
        take(iter(again), 3)


# --- training.skip_corrupt_files ------------------------------------------------------------------


def test_skip_corrupt_files_reads_past_a_bad_shard_and_logs_the_count(tmp_path, caplog):
    shards = [random_docs(12, seed=30 + k) for k in range(3)]
    folder = tmp_path / "shards"
    folder.mkdir()
    for k, docs in enumerate(shards):
        lines = [json.dumps({"text": d}) for d in docs]
        if k == 1:
            lines[5] = "{not json"  # documents 0-4 of this shard are good, the rest are not read
        (folder / f"part-{k}.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    with pytest.raises(UserError, match="part-1.jsonl.gz line 6: invalid JSON"):
        take(iter(make_loader(folder, 15, 2)), 40)
    kept = [shards[0], shards[1][:5], shards[2]]
    with caplog.at_level(logging.WARNING, logger="torchtitan.components.data"):
        got = take(iter(make_loader(folder, 15, 2, skip_corrupt_files=True)), 40)  # over two epochs
    assert got == lane_windows(kept, 2, 15, 80)
    skips = [r.getMessage() for r in caplog.records if "skip_corrupt_files" in r.getMessage()]
    assert len(skips) >= 2 and "part-1.jsonl.gz" in skips[0] and "after document 5" in skips[0]
    assert "in 1 file(s)" in skips[0] and "skipped so far: 2" in skips[1]


def test_skip_corrupt_files_in_a_byte_range_skips_the_rest_of_that_range(tmp_path):
    docs = random_docs(30, seed=40)
    lines = [json.dumps({"text": d}) for d in docs]
    lines[7] = "{not json"
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    first, second = jsonl_pieces(path, docs, 2)  # two lanes: two byte ranges; the bad line is in the first
    assert len(first) > 8
    got = take(iter(make_loader(path, 15, 2, shuffle=True, skip_corrupt_files=True)), 30)
    assert got == lane_windows([first[:7], second], 2, 15, 60, seed=0)


def test_skip_corrupt_files_reads_a_document_read_by_index_as_empty(tmp_path):
    docs = random_docs(12, seed=41, lo=200, hi=400)
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i:02d}.txt").write_text(d)
    data = gzip.compress(docs[5].encode())
    (folder / "05.txt").unlink()
    (folder / "05.txt.gz").write_bytes(data[: len(data) // 2])  # its header is fine, its data ends early
    with pytest.raises(UserError, match="05.txt.gz is not a readable gzip file"):
        take(iter(make_loader(folder, 15, 2, shuffle=True)), 200)
    got = take(iter(make_loader(folder, 15, 2, shuffle=True, skip_corrupt_files=True)), 200)
    kept = docs[:5] + [""] + docs[6:]
    assert got == lane_windows(document_units(kept, 2), 2, 15, 400, seed=0, random_access=True)
