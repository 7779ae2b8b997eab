"""Lanes: each data-parallel rank reads only its share of every source (torchtitan/components/data/lanes.py).

The bytes a rank reads are counted by the kernel (/proc/self/io rchar: every byte passed through
read(), cached or not) in a process of its own that builds the rank's loader and trains through most
of an epoch of a mixture of a parquet folder, a jsonl.zst folder and one plain JSON lines file.
"""

import base64
import json
import random
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan.components.data import build_dataloader
from torchtitan.components.data.files import FilesSource
from torchtitan.components.data.lanes import document_ranges, lane_share
from torchtitan.config import UserError
from torchtitan.config.training_sections import Training

from helpers.data import LAYOUTS, CharTokenizer, lane_streams, lane_windows, run_steps

TESTS = Path(__file__).resolve().parents[2]


def random_text(rng, lo, hi):
    letters = string.ascii_letters + string.digits + " "  # compresses little: compressed bytes ~ text bytes
    return "".join(rng.choice(letters) for _ in range(rng.randint(lo, hi)))


@pytest.mark.parametrize("units,lanes", [(20, 8), (8, 8), (3, 8), (1, 4), (5, 1)])
@pytest.mark.parametrize("seed", [None, 7])
def test_every_document_is_dealt_to_one_lane_per_epoch(units, lanes, seed):
    sizes = [3 + (u * 5) % 7 for u in range(units)]  # documents per unit
    for epoch in range(2 * lanes):
        dealt = []
        for lane in range(lanes):
            share = lane_share(lane, lanes, epoch, units, seed)
            dealt += [(u, d) for u in share.units for d in range(share.part, sizes[u], share.sharers)]
        assert sorted(dealt) == [(u, d) for u in range(units) for d in range(sizes[u])], epoch
    # In each cycle of `lanes` epochs a lane reads every document once (shuffled or not).
    for cycle in range(2):
        for lane in range(lanes):
            seen = []
            for e in range(cycle * lanes, (cycle + 1) * lanes):
                share = lane_share(lane, lanes, e, units, seed)
                seen += [(u, d) for u in share.units for d in range(share.part, sizes[u], share.sharers)]
            assert sorted(seen) == [(u, d) for u in range(units) for d in range(sizes[u])], (cycle, lane)


def test_document_ranges_cover_the_documents_in_order():
    for n, target in [(1, 16), (10, 3), (730, 128), (5, 5)]:
        ranges = document_ranges(n, target)
        assert len(ranges) == min(n, target)
        assert [i for r in ranges for i in r] == list(range(n))


def test_fewer_files_than_lanes_split_parquet_by_row_group_and_json_lines_by_byte_range(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    zstandard = pytest.importorskip("zstandard")
    rng = random.Random(0)
    docs = [random_text(rng, 20, 60) for _ in range(40)]
    (tmp_path / "pq").mkdir()
    for k in range(2):
        pq.write_table(
            pa.table({"text": docs[20 * k : 20 * k + 20]}), tmp_path / "pq" / f"{k}.parquet", row_group_size=5
        )  # 4 row groups each
    source = FilesSource(str(tmp_path / "pq"))
    assert source.units(8) == [(f, j, 4) for f in range(2) for j in range(4)]  # a row group each
    assert source.units(16) == source.units(8)  # no finer than row groups
    assert source.units(2) == [(0, 0, 1), (1, 0, 1)]  # enough files: one unit each
    assert [list(source.unit_texts(u, 0)) for u in source.units(8)] == [docs[5 * i : 5 * i + 5] for i in range(8)]

    (tmp_path / "jl").mkdir()
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (tmp_path / "jl" / "a.jsonl").write_text(lines)
    (tmp_path / "jl" / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    source = FilesSource(str(tmp_path / "jl"))
    units = source.units(8)
    assert units == [(0, j, 4) for j in range(4)] + [(1, 0, 1)]  # byte ranges; a compressed file is whole
    pieces = [list(source.unit_texts(u, 0)) for u in units[:4]]
    assert [d for piece in pieces for d in piece] == docs and all(pieces)
    assert list(source.unit_texts(units[4], 0)) == docs


RANK_SCRIPT = """
import hashlib, json, sys
sys.path[:0] = {paths!r}
from helpers.data import CharTokenizer
from torchtitan.components.data import build_dataloader
from torchtitan.config.training_sections import Training
import pyarrow.parquet, zstandard  # imported before counting: their modules are read from disk too

def rchar():
    return int(next(l for l in open("/proc/self/io") if l.startswith("rchar")).split()[1])

cfg = Training(dataset_mix={mix!r}, seq_len={seq_len}, local_batch_size={local_batch})
before = rchar()
it = iter(build_dataloader(cfg, CharTokenizer(), {rank}, {dp}, {global_batch}))
windows = []
for _ in range({steps}):
    inputs, labels = next(it)
    windows += [hashlib.sha1(str(row + [last]).encode()).hexdigest()
                for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]
print(json.dumps({{"bytes": rchar() - before, "windows": windows}}))
"""


def read_as_rank(mix, rank, dp, global_batch, steps, seq_len):
    """What rank `rank` of `dp` reads, in a process of its own: the bytes, and a digest of each window."""
    script = RANK_SCRIPT.format(
        paths=[str(TESTS), str(TESTS.parent)],
        mix=mix,
        seq_len=seq_len,
        local_batch=global_batch // dp,
        rank=rank,
        dp=dp,
        global_batch=global_batch,
        steps=steps,
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_at_dp_4_each_rank_reads_at_most_30_percent_of_the_corpus(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    zstandard = pytest.importorskip("zstandard")
    rng = random.Random(1)

    def docs(n):  # random base64 text: compresses little, so a file's bytes are about its text's
        return [base64.b64encode(rng.randbytes(rng.randint(1000, 3000))).decode() for _ in range(n)]

    # A rank also reads a little of every file it does not train on: a parquet footer (64 KiB), a zstd
    # file's first block (up to 128 KiB), checked before training. Shards of a few MB keep that small
    # (real shards are hundreds of MB).
    web, code, books = docs(4 * 1600), docs(4 * 1600), docs(4 * 1600)  # equal sizes for equal weights
    (tmp_path / "web").mkdir()  # 4 parquet shards of ~4.5 MB, 8 row groups each
    for k in range(4):
        pq.write_table(
            pa.table({"text": web[1600 * k : 1600 * k + 1600]}), tmp_path / "web" / f"{k}.parquet", row_group_size=200
        )
    (tmp_path / "code").mkdir()  # 4 jsonl.zst shards of ~3 MB
    for k in range(4):
        data = "".join(json.dumps({"text": d}) + "\n" for d in code[1600 * k : 1600 * k + 1600]).encode()
        (tmp_path / "code" / f"{k}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    # One plain JSON lines file of ~17 MB: fewer files than the 4 lanes, read in byte ranges.
    (tmp_path / "books.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in books))
    files = [*(tmp_path / "web").iterdir(), *(tmp_path / "code").iterdir(), tmp_path / "books.jsonl"]
    corpus = sum(f.stat().st_size for f in files)
    mix = [f"1:{tmp_path / 'web'}", f"1:{tmp_path / 'code'}", f"1:{tmp_path / 'books.jsonl'}"]
    tokens = sum(len(d) + 2 for d in web + code + books)
    seq_len, gb = 4095, 4  # a lane per rank at dp 4
    steps = int(0.7 * tokens / (gb * (seq_len + 1)))  # 70% of an epoch of every source
    whole = read_as_rank(mix, 0, 1, gb, steps, seq_len)
    ranks = [read_as_rank(mix, r, 4, gb, steps, seq_len) for r in range(4)]
    shares = [r["bytes"] / corpus for r in ranks]
    assert whole["bytes"] / corpus >= 0.7, (whole["bytes"] / corpus, shares)  # one rank reads nearly everything
    assert all(share <= 0.30 for share in shares), shares
    assert sum(r["bytes"] for r in ranks) >= 0.7 * corpus  # and together they read what one rank did
    # The same samples: rank r's windows are position r of each step of the single rank.
    for r, rank in enumerate(ranks):
        assert rank["windows"] == whole["windows"][r::gb]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_token_folder_ranks_read_disjoint_document_ranges(tmp_path, monkeypatch):
    from torchtitan.components.data import token_folder
    from torchtitan.components.data.files import FilesSource as Files
    from torchtitan.components.data.token_folder import pretokenize

    rng = random.Random(2)
    docs = [random_text(rng, 20, 80) for _ in range(640)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = CharTokenizer()
    pretokenize(Files(str(tmp_path / "d.jsonl")), tok, tmp_path / "tok", source_description={"path": "d.jsonl"})
    read: dict[int, set] = {}
    original = token_folder.TokenFile.document

    def recording(self, index):
        read.setdefault(self.rank, set()).add(index)
        return original(self, index)

    monkeypatch.setattr(token_folder.TokenFile, "document", recording)
    cfg = Training(dataset="tokens", dataset_path=str(tmp_path / "tok"), seq_len=63, local_batch_size=2)
    tokens = sum(len(d) + 2 for d in docs)
    steps = int(0.8 * tokens / (8 * 64))
    for rank in range(4):
        monkeypatch.setattr(token_folder.TokenFile, "rank", rank, raising=False)
        it = iter(build_dataloader(cfg, tok, rank, 4, 8))
        for _ in range(steps):
            next(it)
    assert all(len(read[r]) <= 0.3 * len(docs) for r in range(4)), [len(read[r]) for r in range(4)]
    assert all(read[a].isdisjoint(read[b]) for a in range(4) for b in range(a + 1, 4))
    # Each rank's documents lie in few ranges of the file (its units), not all over it.
    for r in range(4):
        indices = sorted(read[r])
        runs = 1 + sum(1 for a, b in zip(indices, indices[1:]) if b != a + 1)
        assert runs <= 2 * 16 * 2  # 16 units per lane, 2 lanes per rank (adjacent units may join)


def test_a_small_shuffled_source_is_not_taken_for_too_small(tmp_path):
    """31 tokens in 3 documents, 8 lanes of 9-token windows: each lane needs documents from several
    epochs. In a cycle of 8 epochs every lane reads the whole source once, shuffled or not, so none
    is refused as empty or too small (with a new unit order every epoch, 16 of 40 seeds were)."""
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"text": x}) + "\n" for x in ["abcdefghij", "", "KLMNOP klm", "abc"])
    )
    for seed in range(40):
        cfg = Training(
            dataset="local",
            dataset_path=str(tmp_path / "d.jsonl"),
            seq_len=8,
            local_batch_size=8,
            shuffle_documents=True,
            seed=seed,
        )
        inputs, _ = next(iter(build_dataloader(cfg, CharTokenizer(), 0, 1, 8)))
        assert inputs.shape == (8, 8)


def test_rank_0_checks_every_file_and_other_ranks_open_only_the_files_of_their_lanes(tmp_path):
    import gzip

    from torchtitan.config.errors import UserError

    rng = random.Random(3)
    for k in range(8):
        lines = "".join(json.dumps({"text": random_text(rng, 50, 100)}) + "\n" for _ in range(20))
        (tmp_path / f"{k}.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "5.jsonl.gz").write_bytes(b"not gzip at all\n")
    cfg = Training(dataset="local", dataset_path=str(tmp_path), seq_len=31, local_batch_size=2, shuffle_documents=False)
    with pytest.raises(UserError, match=r"5.jsonl.gz is not a readable gzip file"):
        build_dataloader(cfg, CharTokenizer(), 0, 4, 8)  # rank 0 (and the preflight) check every file
    loader = build_dataloader(cfg, CharTokenizer(), 1, 4, 8)  # lanes 2 and 3: files 2 and 3 in epoch 0
    it = iter(loader)
    for _ in range(3):
        next(it)
    opened = [k for k, reader in enumerate(loader.dataset.parts[0].source._readers) if reader is not None]
    assert opened == [0, 2, 3]  # the first file is checked by every rank


@pytest.mark.slow
@pytest.mark.multiprocess
def test_more_data_workers_than_lanes_start_one_per_lane_and_say_so(tmp_path, caplog):
    import logging

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    cfg = Training(
        dataset="local", dataset_path=str(tmp_path / "d.jsonl"), seq_len=15, local_batch_size=2, data_workers=3
    )
    loader = build_dataloader(cfg, CharTokenizer(), 0, 1, 2)
    with caplog.at_level(logging.WARNING, logger="torchtitan.components.data"):
        next(iter(loader))
    assert len(loader.dataset.worker_pids()) == 2
    assert "training.data_workers = 3, but this rank reads 2 lane(s)" in caplog.text


# --- lanes that share a unit read different parts of it --------------------------------------------


def one_document(kind: str, folder: Path, text: str) -> dict:
    """Training keys of a source holding the single document `text`: one .txt file, a one-line JSON
    lines file, a one-row parquet file, or a mixture of such a file and a source of many documents."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "txt":
        (folder / "book.txt").write_text(text)
        return {"dataset": "local", "dataset_path": str(folder / "book.txt")}
    if kind == "jsonl":
        (folder / "one.jsonl").write_text(json.dumps({"text": text}) + "\n")
        return {"dataset": "local", "dataset_path": str(folder / "one.jsonl")}
    if kind == "parquet":
        pq = pytest.importorskip("pyarrow.parquet")
        pa = pytest.importorskip("pyarrow")
        pq.write_table(pa.table({"text": [text]}), folder / "one.parquet")
        return {"dataset": "local", "dataset_path": str(folder / "one.parquet")}
    if kind == "arrow":
        pa = pytest.importorskip("pyarrow")
        table = pa.table({"text": [text]})
        with pa.ipc.new_file(str(folder / "one.arrow"), table.schema) as writer:
            writer.write_table(table)
        return {"dataset": "local", "dataset_path": str(folder / "one.arrow")}
    if kind == "tokens":
        from torchtitan.components.data.files import FilesSource as Files
        from torchtitan.components.data.token_folder import pretokenize

        source = one_document("jsonl", folder / "text", text)["dataset_path"]
        pretokenize(
            Files(source),
            CharTokenizer(),
            folder / "tokens",
            source_description={"description": source},
            workers=1,
            log=lambda *_: None,
        )
        return {"dataset": "tokens", "dataset_path": str(folder / "tokens")}
    if kind == "datasets":  # a datasets stream of one shard (a local folder: no network)
        pytest.importorskip("datasets")
        one_document("jsonl", folder / "hf", text)
        return {"dataset": "huggingface", "dataset_path": str(folder / "hf")}
    assert kind == "mixture"
    book = one_document("txt", folder / "book", text)["dataset_path"]
    rng = random.Random(1)
    (folder / "many.jsonl").write_text(
        "".join(json.dumps({"text": random_text(rng, 20, 200)}) + "\n" for _ in range(300))
    )
    return {"dataset_mix": [f"0.5:{book}", f"0.5:{folder / 'many.jsonl'}"]}


def global_batches(keys: dict, seq_len: int, global_batch: int, dp: int, steps: int, shuffle: bool) -> list:
    """The rows of each global batch (rank 0's rows first), each row a window of seq_len + 1 tokens."""
    iters = [
        iter(
            build_dataloader(
                Training(seq_len=seq_len, local_batch_size=global_batch // dp, shuffle_documents=shuffle, **keys),
                CharTokenizer(),
                r,
                dp,
                global_batch,
            )
        )
        for r in range(dp)
    ]
    batches = []
    for _ in range(steps):
        rows = []
        for it in iters:
            inputs, labels = next(it)
            rows += [tuple(row + [last]) for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]
        batches.append(rows)
    return batches


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("global_batch, dp", [(1, 1), (8, 1), (64, 1), (8, 2), (64, 2)])
@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "mixture"])
def test_no_two_rows_of_a_batch_are_equal_on_a_single_document(tmp_path, kind, global_batch, dp, shuffle):
    rng = random.Random(0)
    keys = one_document(kind, tmp_path, random_text(rng, 3000, 3000))
    batches = global_batches(keys, 32, global_batch, dp, 3, shuffle)
    for step, rows in enumerate(batches):
        assert len(rows) == global_batch
        assert len(set(rows)) == len(rows), f"step {step + 1}: a batch of {global_batch} holds a row twice"
    assert len({row for rows in batches for row in rows}) == 3 * global_batch  # and no row is read again


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_an_epoch_covers_a_single_document_once(tmp_path, kind, shuffle):
    _covers_once(tmp_path, kind, shuffle)


@pytest.mark.hf
@pytest.mark.parametrize("kind", ["arrow", "tokens", "datasets"])
def test_other_readers_give_distinct_rows_and_cover_a_single_document_once(tmp_path, kind):
    for global_batch, dp in [(8, 2), (64, 1)]:
        keys = one_document(kind, tmp_path / f"{global_batch}", random_text(random.Random(0), 3000, 3000))
        rows = [row for rows in global_batches(keys, 32, global_batch, dp, 2, True) for row in rows]
        assert len(set(rows)) == len(rows) == 2 * global_batch, (kind, global_batch, dp)
    _covers_once(tmp_path / "cover", kind, False)


def _covers_once(tmp_path, kind, shuffle):
    """8 lanes on one document of T tokens: in epoch 0 lane p reads part p, tokens [p T/8, (p+1) T/8) of
    the document's stream (shuffled: of the stream rotated by the epoch's offset), so that together the
    lanes read each token once."""
    rng = random.Random(0)
    text = random_text(rng, 2000, 2000)
    tokens = CharTokenizer().encode(text, bos=True, eos=True)
    lanes, seq_len = 8, 16
    n = len(tokens)
    steps = n // lanes // (seq_len + 1) + 2  # enough windows for every lane to finish its part
    batches = global_batches(one_document(kind, tmp_path, text), seq_len, lanes, 1, steps, shuffle)
    streams = lane_streams([list(row) for rows in batches for row in rows], lanes)
    parts = [streams[p][: (p + 1) * n // lanes - p * n // lanes] for p in range(lanes)]
    covered = [t for part in parts for t in part]
    assert len(covered) == n
    if shuffle:
        offset = next(i for i in range(n) if tokens[i:] + tokens[:i] == covered)
        assert offset > 0  # the cut points moved (a seeded offset in [0, n): 0 has odds 1 / n)
    else:
        assert covered == tokens


def test_a_version_4_state_loads_only_where_no_unit_is_shared(tmp_path):
    """Version 4 dealt a shared unit's documents round robin: its positions mean the same only for a
    source with at least as many units as lanes."""
    rng = random.Random(0)
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"text": random_text(rng, 50, 100)}) + "\n" for _ in range(40)))
    single = one_document("txt", tmp_path / "one", random_text(rng, 3000, 3000))
    for keys, loads in [({"dataset": "local", "dataset_path": str(many)}, True), (single, False)]:
        loader = build_dataloader(Training(seq_len=16, local_batch_size=4, **keys), CharTokenizer(), 0, 1, 4)
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        state["dataset_state"]["version"] = 4
        fresh = build_dataloader(Training(seq_len=16, local_batch_size=4, **keys), CharTokenizer(), 0, 1, 4)
        if loads:
            fresh.load_state_dict(state)
            assert torch.equal(next(iter(fresh))[0], next(it)[0])
        else:
            with pytest.raises(
                UserError,
                match="version 4, from before lanes that share a source's unit read "
                "different parts of it .* local has fewer units than lanes",
            ):
                fresh.load_state_dict(state)
                next(iter(fresh))


def test_a_json_lines_file_is_never_cut_into_an_empty_piece(tmp_path):
    path = tmp_path / "few.jsonl"
    path.write_text("\n".join(json.dumps({"text": "x" * size}) for size in [5000, 10, 3000]) + "\n\n\n")
    source = FilesSource(str(path))
    units = source.units(8)
    counts = [len(list(source.unit_texts(u, 0))) for u in units]
    assert all(counts) and sum(counts) == 3 and len(units) > 1, counts
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "y" * 10_000}) + "\n")
    assert FilesSource(str(tmp_path / "one.jsonl")).units(64) == [(0, 0, 1)]


def test_the_first_log_lines_say_how_the_data_was_cut(tmp_path, caplog):
    keys = one_document("txt", tmp_path, "a short book of thirty-one char")  # 33 tokens: 4 per lane
    with caplog.at_level("INFO"):
        global_batches(keys, 16, 8, 1, 1, False)
    assert (
        "data: local: 1 document, 1 unit for 8 lanes: up to 8 lanes share a unit (each lane reads a 1/8 "
        "part of a document's tokens)" in caplog.text
    )
    assert (
        "dataset local is small for its lanes: a unit of 33 tokens is shared by 8 lanes, 4 tokens each per "
        "epoch, less than one sequence of seq_len + 1 = 17" in caplog.text
    )
    assert "repeats the unit's tokens about 4.1 times" in caplog.text


# --- sample ownership: each rank reads its contiguous block of each step ----------------------------


@pytest.mark.parametrize("dp,lb,gb", LAYOUTS)
def test_each_rank_reads_its_contiguous_block_of_each_step(docs_path, dp, lb, gb):
    units, path = docs_path
    steps = 3
    reference = lane_windows(units, gb, 16, steps * gb)
    block = gb // dp
    for s, ranks in enumerate(run_steps(path, dp, lb, gb, steps)):
        for r, samples in enumerate(ranks):
            assert samples == reference[s * gb + r * block : s * gb + (r + 1) * block], (s, r)
        # The step's union is the same for every layout: the layouts compare step by step.
        assert [w for samples in ranks for w in samples] == reference[s * gb : (s + 1) * gb]
