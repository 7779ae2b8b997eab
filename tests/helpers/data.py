"""The data pipeline tests' tools (tests/components/data/ and the data-parallel runs): a character-level
tokenizer, the expected order of documents and windows per lane, writers of corpora in each stored format, and
loaders built and read the way the trainer builds them.

Most tests use the character-level CharTokenizer (CHARS), so the expected token streams can be written down
independently of the code under test. With a global batch of one sequence there is one lane, and window k of a
run must equal stream[k*W:(k+1)*W] of the stored order; with more, `lane_windows` states the order of
torchtitan/components/data/lanes.py from the units' documents. Tests of stored-order behaviour turn shuffling
off; the shuffle tests state the order through `Permutation`, the one definition of a shuffled order. The
writers store `docs` (a list of texts) in one format each; each must read back as the jsonl of the same texts
does."""

import gzip
import json
import random
import sys
from pathlib import Path

import pytest

from helpers.paths import REPO


class CharTokenizer:
    """One token per character; BOS = 1, EOS = 2: token streams the tests can write down by hand."""

    bos_id, eos_id = 1, 2

    def __init__(self, vocab_size=1000):
        self.vocab_size = vocab_size

    def encode(self, text, bos, eos):
        return [1] * bos + [3 + ord(c) % 997 for c in text] + [2] * eos


CHARS = CharTokenizer()


def lane_streams(windows: list[list[int]], lanes: int) -> list[list[int]]:
    """Each lane's token stream from windows in global sample order: sample k is lane k % lanes's
    sample k // lanes (torchtitan/components/data/lanes.py)."""
    return [[t for w in windows[p::lanes] for t in w] for p in range(lanes)]


def framed_documents(tokens: list[int]) -> list[str]:
    """The complete documents ([BOS] text [EOS] of CharTokenizer, ASCII text) in a token stream, in
    order; a document cut by the start or the end of the stream is left out."""
    docs, current = [], None
    for t in tokens:
        if t == CharTokenizer.bos_id:
            current = []
        elif t == CharTokenizer.eos_id:
            if current is not None:
                docs.append("".join(chr(c - 3) for c in current))
            current = None
        elif current is not None:
            current.append(t)
    return docs


def mixture_corpus(folder: Path, docs: list[list[str]], tokenizer) -> list[Path]:
    """Three sources as pre-training corpora are published: a folder of two parquet shards (docs[0]), a
    folder of two jsonl.zst shards (docs[1]) and a token folder written by pretokenize (docs[2])."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from torchtitan.components.data.files import FilesSource
    from torchtitan.components.data.token_folder import pretokenize

    parquet, zst, text, tokens = (folder / name for name in ("parquet", "zst", "text", "tokens"))
    for path in (parquet, zst, text):
        path.mkdir(parents=True)
    for shard, part in enumerate((docs[0][::2], docs[0][1::2])):
        pq.write_table(pa.table({"text": part}), parquet / f"shard-{shard:05d}.parquet", row_group_size=8)
    for shard, part in enumerate((docs[1][::2], docs[1][1::2])):
        lines = "".join(json.dumps({"text": d}) + "\n" for d in part).encode()
        (zst / f"shard-{shard:05d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (text / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[2]))
    pretokenize(
        FilesSource(str(text)),
        tokenizer,
        tokens,
        source_description={"description": str(text)},
        workers=1,
        log=lambda *_: None,
    )
    return [parquet, zst, tokens]


def short_documents_corpus(path: Path, count: int = 3000) -> Path:
    """A jsonl corpus of short documents (1 or 2 lines of the standard library, about 20 tokens):
    several per 64-token window (scripts/short_documents.py)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from short_documents import short_documents_corpus as write

    return write(path, count, lines=1)


def expected_stream(docs, n_tokens, tok=CHARS):
    """One lane's token stream in stored order: framed non-empty documents, concatenated, looped."""
    out = []
    while len(out) < n_tokens:
        out += [t for doc in docs if doc for t in tok.encode(doc, bos=True, eos=True)]
    return out[:n_tokens]


def expected_windows(docs, seq_len, start, stop, tok=CHARS):
    """Windows start..stop-1 of one lane (a global batch of one sequence) in stored order."""
    w = seq_len + 1
    stream = expected_stream(docs, stop * w, tok)
    return [stream[k * w : (k + 1) * w] for k in range(start, stop)]


def document_units(docs, lanes):
    """A random-access source's units: its documents in min(n, 16 x lanes) consecutive ranges."""
    k = min(len(docs), 16 * lanes)
    return [docs[i * len(docs) // k : (i + 1) * len(docs) // k] for i in range(k)]


def lane_documents(units, lane, lanes, epoch, seed=None, random_access=False, block=10_000):
    """The documents lane `lane` of `lanes` reads in `epoch`, in order, as torchtitan/components/data/lanes.py
    states it: the units at positions q, q + lanes, ... (q = (lane + epoch) % lanes) of the unit order of
    the epoch's cycle of `lanes` epochs, or with fewer units than lanes every stride-th document of one
    unit; shuffled, in the order of a permutation (random access) or of permuted blocks (streams)."""
    from torchtitan.components.data.shuffle import Permutation, derived_seed

    n, q = len(units), (lane + epoch) % lanes
    order = [Permutation(n, seed, epoch // lanes)[j] for j in range(n)] if seed is not None else list(range(n))
    if n >= lanes:
        docs = [d for j in range(q, n, lanes) for d in units[order[j]]]
    else:
        docs = units[order[q % n]][q // n :: len(range(q % n, lanes, n))]
    if seed is None or not docs:
        return docs
    lane_seed = derived_seed(derived_seed(seed, epoch), lane)
    if random_access:
        perm = Permutation(len(docs), lane_seed, 0)
        return [docs[perm[j]] for j in range(len(docs))]
    out = []
    for b, first in enumerate(range(0, len(docs), block)):
        chunk = docs[first : first + block]
        perm = Permutation(len(chunk), lane_seed, b)
        out += [chunk[perm[j]] for j in range(len(chunk))]
    return out


def lane_windows(units, lanes, seq_len, stop, tok=CHARS, text=lambda d: d, **order):
    """Global samples 0..stop-1: sample k is window k // lanes of lane k % lanes's token stream (its
    documents of epoch 0, 1, ..., framed and concatenated). `text`: a unit entry's text."""
    w, per_lane = seq_len + 1, -(-stop // lanes)
    windows = []
    for lane in range(lanes):
        tokens, epoch = [], 0
        while len(tokens) < per_lane * w and epoch < 100:
            for d in lane_documents(units, lane, lanes, epoch, **order):
                if len(tokens) >= per_lane * w:
                    break
                if text(d):
                    tokens += tok.encode(text(d), bos=True, eos=True)
            epoch += 1
        windows.append([tokens[s * w : (s + 1) * w] for s in range(per_lane)])
    return [windows[k % lanes][k // lanes] for k in range(stop)]


def json_round_trip(state):
    return json.loads(json.dumps(state))  # fails on anything but plain ints, lists, strings, ...


def merged(states):
    """One state from single-process loaders of several ranks: each holds its own lanes."""
    out = json_round_trip(states[0])
    lanes = {p: pos for state in states for p, pos in state["dataset_state"]["lanes"]}
    out["dataset_state"]["lanes"] = [[p, lanes[p]] for p in sorted(lanes)]
    out["dataset_state"]["next_sample"] = sum(pos["next_sample"] for ps in lanes.values() for pos in ps)
    return out


def lane_position(state, lane=0, source=0):
    return dict(state["dataset_state"]["lanes"])[lane][source]


def random_docs(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij KLMNOP\n") for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def make_loader(
    path,
    seq_len,
    local_batch,
    dp_degree=1,
    dp_rank=0,
    global_batch=None,
    tok=CHARS,
    dataset="local",
    shuffle=False,
    **training,
):
    """A loader of `path`; shuffle=False unless asked (None: the default, shuffle where possible)."""
    from torchtitan.components.data import build_dataloader
    from torchtitan.config.training_sections import Training

    cfg = Training(
        dataset=dataset,
        dataset_path=None if path is None else str(path),
        seq_len=seq_len,
        local_batch_size=local_batch,
        shuffle_documents=shuffle,
        **training,
    )
    global_batch = global_batch or local_batch * dp_degree
    return build_dataloader(cfg, tok, dp_rank, dp_degree, global_batch)


def take(it, n_batches):
    """The windows (seq_len + 1 tokens each) of the next n_batches, checking the batch format."""
    import torch

    windows = []
    for _ in range(n_batches):
        inputs, labels = next(it)
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.shape == labels.shape
        assert torch.equal(inputs[:, 1:], labels[:, :-1]), "labels are inputs shifted by one"
        windows += [row + [last] for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]
    return windows


LAYOUTS = [  # (dp_degree, local_batch_size, global_batch_size)
    (1, 8, 8),
    (2, 4, 8),
    (4, 2, 8),
    (2, 2, 8),  # two accumulation micro-batches per step
]


def sharded_docs(folder: Path, shards: int, per_shard: int, seed: int, name: str):
    """`shards` JSON lines shards of `per_shard` random documents each (file names `name`.format(i=shard)) in
    a new `folder`: (the documents of each shard, `folder`)."""
    docs = random_docs(shards * per_shard, seed=seed)
    folder.mkdir()
    for i in range(shards):
        write_jsonl(folder / name.format(i=i), docs[per_shard * i : per_shard * i + per_shard])
    return [docs[per_shard * i : per_shard * i + per_shard] for i in range(shards)], folder


def run_steps(path, dp, lb, gb, steps, seq_len=16, shuffle=False):
    """Per step, the samples of every rank in rank order: list[step][rank] -> windows."""
    per_rank = []
    for rank in range(dp):
        it = iter(make_loader(path, seq_len, lb, dp, rank, gb, shuffle=shuffle))
        per_rank.append([take(it, gb // dp // lb) for _ in range(steps)])
    return [[per_rank[r][s] for r in range(dp)] for s in range(steps)]


def shuffled_steps_from(state, path, dp, lb, gb, steps, **training):
    """The windows of each of the next `steps` steps, over all ranks, when every rank of layout (dp, lb)
    loads `state` into a loader of shuffled `path` (seq_len 16)."""
    ranks = []
    for rank in range(dp):
        loader = make_loader(path, 16, lb, dp, rank, gb, shuffle=True, **training)
        loader.load_state_dict(state)
        it = iter(loader)
        ranks.append([take(it, gb // dp // lb) for _ in range(steps)])
    return [[w for r in range(dp) for w in ranks[r][s]] for s in range(steps)]


def steps_of(windows, gb, first, steps):
    return [windows[step * gb : (step + 1) * gb] for step in range(first, first + steps)]


def write_gz(path, docs):
    path.write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode()))
    return path


def write_zst(path, docs):
    zstandard = pytest.importorskip("zstandard")
    # Two frames, as pzstd or concatenated files make them.
    half = len(docs) // 2
    frames = [
        zstandard.ZstdCompressor().compress("".join(json.dumps({"text": d}) + "\n" for d in part).encode())
        for part in (docs[:half], docs[half:])
    ]
    path.write_bytes(b"".join(frames))
    return path


def arrow_table(docs, field="text"):
    pa = pytest.importorskip("pyarrow")
    return pa.table({"id": pa.array(range(len(docs)), pa.int64()), field: pa.array(docs, pa.string())})


def write_parquet(path, docs, field="text"):
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(arrow_table(docs, field), path, row_group_size=7)  # several row groups
    return path


def write_arrow(path, docs, field="text", file_format=False):
    pa = pytest.importorskip("pyarrow")
    table = arrow_table(docs, field)
    with (pa.ipc.new_file if file_format else pa.ipc.new_stream)(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=5):  # several record batches
            writer.write_batch(batch)
    return path


def write_save_to_disk(path, docs, shards=3):
    """The layout of datasets.Dataset.save_to_disk: Arrow IPC stream shards listed in state.json."""
    path.mkdir()
    size = -(-len(docs) // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        write_arrow(path / name, docs[i * size : (i + 1) * size])
    (path / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names], "_fingerprint": "x", "_split": None})
    )
    (path / "dataset_info.json").write_text("{}")
    return path


def jsonl_pieces(path, docs, pieces):
    """The units of an uncompressed JSON lines file cut into byte ranges: a line belongs to the range
    its first byte is in."""
    data, size = path.read_bytes(), path.stat().st_size
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n")][:-1]
    units = [[] for _ in range(pieces)]
    for start, doc in zip(starts, docs):
        units[next(j for j in range(pieces) if start < (j + 1) * size // pieces)].append(doc)
    return units
