"""The data pipeline: packing, sample ownership across layouts, resumable state, sources, file
formats, document shuffling, errors.

Most tests use a character-level fake tokenizer, so the expected token streams can be written
down independently of the code under test. With a global batch of one sequence there is one lane,
and window k of a run must equal stream[k*W:(k+1)*W] of the stored order; with more, `lane_windows`
states the order of torchtitan/components/data/lanes.py from the units' documents. Tests of
stored-order behaviour turn shuffling off; the shuffle tests state the order through `Permutation`,
the one definition of a shuffled order.
"""

import gzip
import json
import logging
import multiprocessing
import os
import random
import signal
import sys
import sysconfig
import types
from pathlib import Path

import pytest
import torch

from conftest import CharTokenizer
from torchtitan.components.data import sources as data_sources
from torchtitan.components.data import build_dataloader, stdlib_files
from torchtitan.components.data.shuffle import Permutation, derived_seed
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError
from torchtitan.config.job_config import Training

MODEL = Path(__file__).resolve().parents[2] / "assets" / "tokenizer" / "python_stdlib_4k.model"


CHARS = CharTokenizer()


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


def make_loader(path, seq_len, local_batch, dp_degree=1, dp_rank=0, global_batch=None, tok=CHARS, dataset="local",
                shuffle=False, **training):
    """A loader of `path`; shuffle=False unless asked (None: the default, shuffle where possible)."""
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
    windows = []
    for _ in range(n_batches):
        inputs, labels = next(it)
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.shape == labels.shape
        assert torch.equal(inputs[:, 1:], labels[:, :-1]), "labels are inputs shifted by one"
        windows += [row + [last] for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]
    return windows


# --- packing ---------------------------------------------------------------------------------


def test_packing_frames_documents_and_cuts_consecutive_windows(tmp_path):
    docs = ["hello world", "", "a", "x" * 50, "second to last", "end"]  # "" is skipped
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    it = iter(make_loader(path, seq_len=7, local_batch=1))  # one lane: the stored order
    inputs, labels = next(it)
    assert inputs.shape == labels.shape == (1, 7)
    assert inputs[0].tolist() == [1] + CHARS.encode("hello ", False, False)
    assert labels[0].tolist() == CHARS.encode("hello w", False, False)
    windows = [row + [last] for row, last in zip(inputs.tolist(), labels[:, -1].tolist())] + take(it, 10)
    got = [t for w in windows for t in w]
    assert got == expected_stream(docs, len(got))
    # Document boundaries: every BOS follows an EOS (or starts the stream).
    assert all(got[i - 1] == 2 for i, t in enumerate(got) if t == 1 and i > 0)


def test_packing_with_the_real_tokenizer(tmp_path):
    tok = Tokenizer(MODEL)
    docs = ["import os\n\n\ndef main():\n    print(os.getcwd())\n", "x = 1\n", "class A:\n    pass\n"]
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    windows = take(iter(make_loader(path, seq_len=16, local_batch=1, tok=tok)), 8)
    assert all(len(w) == 17 for w in windows)
    got = [t for w in windows for t in w]
    assert got == expected_stream(docs, len(got), tok)
    assert got[0] == tok.bos_id


def test_txt_file_is_one_document(tmp_path):
    text = "line one\nline two\n\nline four\n"
    path = tmp_path / "doc.txt"
    path.write_text(text)
    got = [t for w in take(iter(make_loader(path, seq_len=9, local_batch=1)), 6) for t in w]
    assert got == expected_stream([text], len(got))


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


def test_epoch_wrap_continues_the_stream_and_warns_once_per_epoch(tmp_path, caplog):
    docs = ["abc", "defgh"]  # 12 tokens per epoch
    path = write_jsonl(tmp_path / "tiny.jsonl", docs)
    loader = make_loader(path, seq_len=4, local_batch=1)
    with caplog.at_level(logging.WARNING, logger="torchtitan.components.data"):
        got = [t for w in take(iter(loader), 12) for t in w]  # 60 tokens: 5 epochs
    assert got == expected_stream(docs, 60)
    warnings = [r for r in caplog.records if "starts epoch" in r.getMessage()]
    assert [r.getMessage().split("starts epoch ")[1].split()[0] for r in warnings] == ["1", "2", "3", "4"]
    assert lane_position(loader.state_dict())["epoch"] == 4


# --- sample ownership --------------------------------------------------------------------------

LAYOUTS = [  # (dp_degree, local_batch_size, global_batch_size)
    (1, 8, 8),
    (2, 4, 8),
    (4, 2, 8),
    (2, 2, 8),  # two accumulation micro-batches per step
]


@pytest.fixture
def docs_path(tmp_path):
    """A folder of 10 JSON lines shards of 6 documents: 10 units, one per shard."""
    docs = random_docs(60)
    (tmp_path / "docs").mkdir()
    for i in range(10):
        write_jsonl(tmp_path / "docs" / f"shard-{i:02d}.jsonl", docs[6 * i : 6 * i + 6])
    return [docs[6 * i : 6 * i + 6] for i in range(10)], tmp_path / "docs"


def run_steps(path, dp, lb, gb, steps, seq_len=16, shuffle=False):
    """Per step, the samples of every rank in rank order: list[step][rank] -> windows."""
    per_rank = []
    for rank in range(dp):
        it = iter(make_loader(path, seq_len, lb, dp, rank, gb, shuffle=shuffle))
        per_rank.append([take(it, gb // dp // lb) for _ in range(steps)])
    return [[per_rank[r][s] for r in range(dp)] for s in range(steps)]


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


# --- resumable state ---------------------------------------------------------------------------


def json_round_trip(state):
    return json.loads(json.dumps(state))  # fails on anything but plain ints, lists, strings, ...


def test_state_is_plain_and_small(docs_path):
    _, path = docs_path
    loader = make_loader(path, 16, 2)
    it = iter(loader)
    take(it, 3)
    state = loader.state_dict()
    ds = state["dataset_state"]
    assert json_round_trip(state) == state
    assert ds["version"] == 5 and ds["next_sample"] == 6
    assert [p for p, _ in ds["lanes"]] == [0, 1]  # a lane per sample of the global batch of 2
    for _, (position,) in ds["lanes"]:  # one source
        assert set(position) == {"next_sample", "epoch", "doc_index", "token_offset", "carry"}
        assert position["next_sample"] == 3 and position["carry"] == []
    assert ds["shuffle_seed"] is None  # stored order
    assert len(json.dumps(state)) < 2000


@pytest.mark.parametrize("dp,lb,gb,rank,n", [(1, 2, 2, 0, 3), (2, 2, 8, 1, 3), (2, 2, 8, 0, 2)])
def test_resume_jsonl_continues_exactly(docs_path, dp, lb, gb, rank, n):
    units, path = docs_path
    first = make_loader(path, 16, lb, dp, rank, gb)
    it = iter(first)
    take(it, n)
    state = json_round_trip(first.state_dict())
    uninterrupted = take(it, 6)

    resumed = make_loader(path, 16, lb, dp, rank, gb)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 6) == uninterrupted
    # ... and both are the right samples (state_dict must not disturb the loader it reads).
    block = gb // dp
    owned = [k for k in range(200) if rank * block <= k % gb < (rank + 1) * block]
    windows = lane_windows(units, gb, 16, 200)
    assert uninterrupted == [windows[k] for k in owned[n * lb : n * lb + 6 * lb]]


def test_resume_deep_into_a_folder_and_after_a_wrap(tmp_path):
    (tmp_path / "d").mkdir()
    docs_a, docs_b = random_docs(5, seed=1), random_docs(5, seed=2)
    write_jsonl(tmp_path / "d" / "a.jsonl", docs_a)
    write_jsonl(tmp_path / "d" / "b.jsonl", docs_b)
    first = make_loader(tmp_path / "d", 8, 2)
    it = iter(first)
    take(it, 15)  # 270 tokens, more than one epoch (each lane reads one file per epoch)
    state = json_round_trip(first.state_dict())
    assert lane_position(state, 0)["epoch"] >= 1 and lane_position(state, 1)["epoch"] >= 1
    uninterrupted = take(it, 10)
    resumed = make_loader(tmp_path / "d", 8, 2)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 10) == uninterrupted == lane_windows([docs_a, docs_b], 2, 8, 50)[30:]


def test_resume_python_stdlib_mid_step():
    tok = Tokenizer(MODEL)
    # dp 2, two micro-batches per step: after 3 batches, rank 1 is in the middle of step 1.
    first = make_loader(None, 32, 2, 2, 1, 8, tok=tok, dataset="python_stdlib", shuffle=None)
    it = iter(first)
    take(it, 3)
    state = json_round_trip(first.state_dict())
    # Rank 1 holds lanes 4-7: the first micro-batch of step 1 took lanes 4 and 5.
    assert [[p, pos["next_sample"]] for p, (pos,) in state["dataset_state"]["lanes"]] == [[4, 2], [5, 2], [6, 1], [7, 1]]
    assert state["dataset_state"]["shuffle_seed"] == 0  # shuffled by default, with training.seed
    uninterrupted = take(it, 3)
    resumed = make_loader(None, 32, 2, 2, 1, 8, tok=tok, dataset="python_stdlib", shuffle=None)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 3) == uninterrupted
    windows = lane_windows(document_units(stdlib_files(), 8), 8, 32, 40, tok, seed=0, random_access=True,
                           text=lambda f: f.read_text(encoding="utf-8", errors="replace"))
    assert uninterrupted == windows[14:16] + windows[20:24]


def test_carried_tokens_come_before_the_source_position(docs_path):
    units, path = docs_path
    docs = [d for unit in units for d in unit]
    loader = make_loader(path, 16, 1)
    state = loader.state_dict()  # before any batch: the start of the stream
    position = lane_position(state)
    assert position["carry"] == [] and position["token_offset"] == 0
    # The same position, expressed as 3 tokens already read from document 0.
    position["carry"] = CHARS.encode(docs[0], bos=True, eos=True)[:3]
    position["token_offset"] = 3
    resumed = make_loader(path, 16, 1)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 6) == expected_windows(docs, 16, 0, 6)


def test_step_boundary_state_loads_under_other_dp_degrees(docs_path):
    units, path = docs_path
    gb, steps_before, steps_after = 8, 3, 3
    reference = lane_windows(units, gb, 16, (steps_before + steps_after) * gb)

    # Save under dp 2 with accumulation, at a step boundary: each rank's loader holds its lanes, which
    # the trainer gathers into one state (merged here).
    states = []
    for rank in range(2):
        loader = make_loader(path, 16, 2, 2, rank, gb)
        it = iter(loader)
        take(it, steps_before * 2)
        states.append(json_round_trip(loader.state_dict()))
    assert [[p for p, _ in state["dataset_state"]["lanes"]] for state in states] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    state = merged(states)
    assert state["dataset_state"]["next_sample"] == steps_before * gb
    with pytest.raises(UserError, match="holds the positions of lanes 0-3, but this rank reads lanes 4-7"):
        loader.load_state_dict(states[0])
        next(iter(loader))

    for dp, lb in [(4, 2), (1, 8), (1, 2), (2, 4)]:
        ranks = []
        for rank in range(dp):
            loader = make_loader(path, 16, lb, dp, rank, gb)
            loader.load_state_dict(state)
            it = iter(loader)
            ranks.append([take(it, gb // dp // lb) for _ in range(steps_after)])
        for s in range(steps_after):
            union = [w for r in range(dp) for w in ranks[r][s]]
            step = steps_before + s
            assert union == reference[step * gb : (step + 1) * gb], (dp, lb, s)


def test_mid_step_state_does_not_load_under_another_layout(docs_path):
    _, path = docs_path
    states = []
    for rank in range(2):
        loader = make_loader(path, 16, 2, 2, rank, 8)
        take(iter(loader), 1)  # each rank is half way through its block of step 0
        states.append(loader.state_dict())
    state = merged(states)
    same = make_loader(path, 16, 2, 2, 1, 8)
    same.load_state_dict(state)
    assert take(iter(same), 1) == take(iter(loader), 1)  # resumes exactly under its own layout
    other = make_loader(path, 16, 2, 4, 3, 8)
    other.load_state_dict(state)
    with pytest.raises(UserError, match="middle of a step"):
        next(iter(other))


def test_changed_seq_len_is_refused(docs_path):
    _, path = docs_path
    loader = make_loader(path, 16, 2)
    take(iter(loader), 1)
    state = loader.state_dict()
    other = make_loader(path, 32, 2)
    other.load_state_dict(state)
    # The trainer explains this before launch (checkpoint.preflight_checkpoint); the loader refuses it.
    with pytest.raises(ValueError, match="seq_len"):
        next(iter(other))


# --- sources -----------------------------------------------------------------------------------


def test_python_stdlib_files_are_sorted_and_exclude_tests():
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in files]
    assert len(files) > 100
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    assert "os.py" in rel and "json/__init__.py" in rel
    for r in rel:
        parts = r.split("/")[:-1]
        assert not {"test", "tests", "site-packages", "dist-packages"} & set(parts), r
        assert not r.startswith("idlelib/idle_test/"), r
    assert stdlib_files() == files  # same list every call


def test_python_stdlib_is_the_default_dataset_and_is_shuffled():
    tok = Tokenizer(MODEL)
    cfg = Training(seq_len=16, local_batch_size=2)
    assert cfg.dataset == "python_stdlib" and cfg.shuffle_documents is None and cfg.seed == 0
    inputs, labels = next(iter(build_dataloader(cfg, tok, 0, 1, 2)))
    files = stdlib_files()
    first = lane_documents(document_units(files, 2), 0, 2, 0, seed=0, random_access=True)[0]
    assert first != files[0]
    assert inputs[0].tolist() == tok.encode(first.read_text(encoding="utf-8", errors="replace"), bos=True, eos=False)[:16]
    # shuffle_documents = false: stored (sorted path) order.
    inputs, _ = next(iter(build_dataloader(Training(seq_len=16, local_batch_size=2, shuffle_documents=False), tok, 0, 1, 2)))
    assert inputs[0].tolist() == tok.encode(files[0].read_text(encoding="utf-8", errors="replace"), bos=True, eos=False)[:16]


def install_fake_datasets(monkeypatch, rows):
    calls = []

    def load_dataset(path, split=None, streaming=False, **kwargs):
        calls.append((path, split, streaming, *kwargs.items()))
        return list(rows)

    def split_dataset_by_node(dataset, rank, world_size):
        return dataset[rank::world_size]  # as datasets splits a stream of too few shards: every n-th row

    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    module.distributed = types.ModuleType("datasets.distributed")
    module.distributed.split_dataset_by_node = split_dataset_by_node
    monkeypatch.setitem(sys.modules, "datasets", module)
    monkeypatch.setitem(sys.modules, "datasets.distributed", module.distributed)
    return calls


def test_huggingface_source_reads_the_text_column_and_resumes(monkeypatch):
    docs = random_docs(20, seed=3)
    calls = install_fake_datasets(monkeypatch, [{"text": d, "meta": i} for i, d in enumerate(docs)])
    loader = make_loader("org/corpus", 8, 2, dataset="huggingface")
    assert calls == [("org/corpus", "train", True)]
    it = iter(loader)
    units = [docs[0::2], docs[1::2]]  # a lane per sample of the batch of 2, each on a split of the stream
    expected = lane_windows(units, 2, 8, 16)
    assert take(it, 4) == expected[:8]
    state = json_round_trip(loader.state_dict())
    assert lane_position(state, 0)["doc_index"] > 0 and lane_position(state, 1)["doc_index"] > 0
    resumed = make_loader("org/corpus", 8, 2, dataset="huggingface")
    resumed.load_state_dict(state)
    assert take(iter(resumed), 4) == take(it, 4) == expected[8:]


def test_huggingface_row_without_text_is_a_user_error(monkeypatch):
    install_fake_datasets(monkeypatch, [{"content": "x"}])
    with pytest.raises(UserError, match="no 'text' column"):
        make_loader("org/corpus", 8, 2, dataset="huggingface")


def test_huggingface_without_datasets_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(UserError, match="pip install datasets"):
        make_loader("org/corpus", 8, 2, dataset="huggingface")


# --- user errors -------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match="dataset_path .*nope.jsonl does not exist"):
        make_loader(tmp_path / "nope.jsonl", 8, 2)


@pytest.mark.parametrize("content", ["", "\n\n", '{"text": ""}\n{"text": ""}\n'])
def test_empty_jsonl(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match="is empty"):
        make_loader(path, 8, 2)


def test_folder_without_data_files(tmp_path):
    (tmp_path / "notes.md").write_text("not data")
    with pytest.raises(UserError, match="is empty: it holds no data files"):
        make_loader(tmp_path, 8, 2)


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


def test_unsupported_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("text\nhello\n")
    with pytest.raises(UserError, match=r"unsupported extension '.csv'.*\.jsonl.*\.txt"):
        make_loader(path, 8, 2)


def test_dataset_smaller_than_one_sequence(tmp_path):
    path = write_jsonl(tmp_path / "small.jsonl", ["abc", "de"])  # 9 tokens < 17
    with pytest.raises(UserError, match="too small.*9 tokens.*17"):
        next(iter(make_loader(path, 16, 1)))
    # Two lanes: each reads its byte range of the file in each of 2 epochs, the other's in the other.
    with pytest.raises(UserError, match="too small: one lane's share of 2 epochs tokenizes to 9 tokens.*17.*2 lanes"):
        next(iter(make_loader(path, 16, 2)))


# --- file formats ------------------------------------------------------------------------------
# Each writer stores `docs` (a list of texts) in one format; each must read back as the jsonl of the
# same texts does.


def write_gz(path, docs):
    path.write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode()))
    return path


def write_zst(path, docs):
    zstandard = pytest.importorskip("zstandard")
    # Two frames, as pzstd or concatenated files make them.
    half = len(docs) // 2
    frames = [zstandard.ZstdCompressor().compress("".join(json.dumps({"text": d}) + "\n" for d in part).encode())
              for part in (docs[:half], docs[half:])]
    path.write_bytes(b"".join(frames))
    return path


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
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                 "_fingerprint": "x", "_split": None}))
    (path / "dataset_info.json").write_text("{}")
    return path


def write_dataset_dict(path, docs):
    """datasets.DatasetDict.save_to_disk: one save_to_disk folder per split."""
    path.mkdir()
    write_save_to_disk(path / "train", docs)
    write_save_to_disk(path / "validation", ["held out"], shards=1)
    (path / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
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


# (writer, file name, its units for 2 lanes, random access)
FORMATS = {
    "jsonl.gz": (write_gz, "d.jsonl.gz", lambda docs: [docs], False),  # compressed: one unit
    "jsonl.zst": (write_zst, "d.jsonl.zst", lambda docs: [docs], False),
    "json array": (write_json_array, "d.json", lambda docs: [docs], False),
    "txt folder": (write_txt_folder, "docs", lambda docs: document_units(docs, 2), True),
    "parquet": (write_parquet, "d.parquet", lambda docs: [docs[:14], docs[14:]], False),  # 2 row groups each
    "arrow stream": (write_arrow, "d.arrow", lambda docs: document_units(docs, 2), True),
    "arrow file": (lambda p, d: write_arrow(p, d, file_format=True), "d.arrow", lambda docs: document_units(docs, 2),
                   True),
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


def test_real_datasets_save_to_disk_folder_if_datasets_is_installed(tmp_path):
    datasets = pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    docs = random_docs(12, seed=6)
    datasets.Dataset(pa.table({"text": docs}), fingerprint="f").save_to_disk(str(tmp_path / "ds"), num_shards=2)
    assert take(iter(make_loader(tmp_path / "ds", 8, 1)), 20) == expected_windows(docs, 8, 0, 20)


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


# --- shuffled documents --------------------------------------------------------------------------


def test_permutation_is_a_seeded_bijection_different_per_epoch_and_seed():
    for n in (1, 2, 3, 5, 16, 17, 100, 1000):
        for epoch in range(3):
            order = [Permutation(n, 0, epoch)[i] for i in range(n)]
            assert sorted(order) == list(range(n))
    orders = {(seed, epoch): tuple(Permutation(50, seed, epoch)[i] for i in range(50))
              for seed in (0, 1, -3, 2**40) for epoch in (0, 1, 2)}
    assert len(set(orders.values())) == len(orders)  # all different
    assert orders[(0, 0)] == tuple(Permutation(50, 0, 0)[i] for i in range(50))  # deterministic
    # Pinned: a change of the order would silently change resumed runs.
    assert [Permutation(10, 0, 0)[i] for i in range(10)] == [8, 7, 6, 1, 4, 9, 2, 0, 5, 3]


@pytest.fixture
def shuffled_docs(tmp_path):
    """A folder of 10 JSON lines shards of 4 documents: 10 units."""
    docs = random_docs(40, seed=9)
    (tmp_path / "docs").mkdir()
    for i in range(10):
        write_jsonl(tmp_path / "docs" / f"part-{i}.jsonl", docs[4 * i : 4 * i + 4])
    return [docs[4 * i : 4 * i + 4] for i in range(10)], tmp_path / "docs"


@pytest.mark.parametrize("dp,lb,gb", LAYOUTS)
def test_shuffled_samples_are_the_same_under_every_layout(shuffled_docs, dp, lb, gb):
    units, path = shuffled_docs
    steps = 12  # 96 windows of 17 tokens: more than two epochs
    reference = lane_windows(units, gb, 16, steps * gb, seed=0)
    for s, ranks in enumerate(run_steps(path, dp, lb, gb, steps, shuffle=True)):
        assert [w for samples in ranks for w in samples] == reference[s * gb : (s + 1) * gb], (s, dp)


def test_each_epoch_has_its_own_order_and_the_seed_sets_it(shuffled_docs, caplog):
    units, path = shuffled_docs
    assert lane_documents(units, 0, 2, 0, seed=0) != lane_documents(units, 0, 2, 2, seed=0)
    loader = make_loader(path, 16, 2, shuffle=True, seed=7)
    with caplog.at_level(logging.WARNING, logger="torchtitan.components.data"):
        got = take(iter(loader), 60)  # 120 windows of 17 tokens; an epoch is ~920 tokens, ~460 per lane
    assert got == lane_windows(units, 2, 16, 120, seed=7) != lane_windows(units, 2, 16, 120, seed=0)
    assert "starts epoch 1 (the data repeats, in a new order)" in caplog.text
    assert lane_position(loader.state_dict(), 0)["epoch"] >= 2


@pytest.mark.parametrize("n", [3, 17, 25])  # mid epoch 0, across the first wrap, in epoch 1
def test_shuffled_resume_is_exact_mid_epoch(shuffled_docs, n):
    units, path = shuffled_docs
    first = make_loader(path, 16, 2, shuffle=True)
    it = iter(first)
    take(it, n)
    state = json_round_trip(first.state_dict())
    assert state["dataset_state"]["shuffle_seed"] == 0
    uninterrupted = take(it, 8)
    resumed = make_loader(path, 16, 2, shuffle=True)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 8) == uninterrupted == lane_windows(units, 2, 16, 2 * n + 16, seed=0)[2 * n:]


def test_shuffled_step_boundary_state_loads_under_other_dp_degrees(shuffled_docs):
    units, path = shuffled_docs
    gb, before, after = 8, 5, 4  # 72 windows: crosses an epoch boundary after the resume
    reference = lane_windows(units, gb, 16, (before + after) * gb, seed=0)
    states = []
    for rank in range(2):
        loader = make_loader(path, 16, 2, 2, rank, gb, shuffle=True)
        it = iter(loader)
        take(it, before * 2)
        states.append(json_round_trip(loader.state_dict()))
    state = merged(states)
    for dp, lb in [(4, 2), (1, 8), (1, 2)]:
        assert shuffled_steps_from(state, path, dp, lb, gb, after) == steps_of(reference, gb, before, after), dp


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


def test_a_state_of_another_order_or_an_earlier_version_is_refused(shuffled_docs):
    _, path = shuffled_docs
    loader = make_loader(path, 16, 2, shuffle=True, seed=3)
    take(iter(loader), 2)
    state = json_round_trip(loader.state_dict())
    for kwargs, fix in [({"shuffle": True, "seed": 4}, "training.seed = 3"),
                        ({"shuffle": False}, "training.seed = 3 and training.shuffle_documents = true")]:
        other = make_loader(path, 16, 2, **kwargs)
        other.load_state_dict(state)
        with pytest.raises(UserError, match=f"shuffled with seed 3, but this job .*{fix}"):
            next(iter(other))
    plain = make_loader(path, 16, 2)
    take(iter(plain), 3)
    stored = json_round_trip(plain.state_dict())
    refused = make_loader(path, 16, 2, shuffle=None)
    refused.load_state_dict(stored)
    with pytest.raises(UserError, match="stored order, but .*shuffle_documents = false"):
        next(iter(refused))
    # A state of version 1-3 (one stream per source, before lanes) is a position in another sample order.
    old = {"version": 3, "seq_len": 16, "global_batch_size": 2, "next_sample": 6, "dataset": "local",
           "dataset_path": str(path), "shuffle_seed": None, "num_documents": None, "shuffle_block": None,
           "epoch": 0, "doc_index": 2, "token_offset": 5, "carry": []}
    resumed = make_loader(path, 16, 2)
    resumed.load_state_dict({**stored, "dataset_state": old})
    with pytest.raises(UserError, match="version 3, from before each rank read only its share.*exclude_from_loading"):
        next(iter(resumed))


# --- the reference schema's names: c4, c4_test ------------------------------------------------------

# The reference torchtitan's Llama 3 8B recipe (mid-2025 schema), unchanged.
REFERENCE_LLAMA3_8B = """
# torchtitan Config.toml
# NOTE: this toml config is a preset for 64 A100 GPUs.

[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
tokenizer_path = "./assets/hf/Llama-3.1-8B"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200  # lr scheduler warm up

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 1000
compile = false
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable_checkpoint = false
folder = "checkpoint"
interval = 500
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]
"""


def write_c4_test(root, docs):
    """The reference layout: tests/assets/c4_test/data.json, one C4 record per line."""
    folder = root / "tests" / "assets" / "c4_test"
    folder.mkdir(parents=True)
    (folder / "data.json").write_text("".join(
        json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.com/{i}"}) + "\n"
        for i, d in enumerate(docs)))
    return folder


def test_reference_llama3_8b_recipe_loads_and_names_the_offline_alternatives(tmp_path, monkeypatch):
    from torchtitan.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama3_8b.toml").write_text(REFERENCE_LLAMA3_8B)
    cfg = load_config(["--job.config_file", "llama3_8b.toml"])
    assert cfg.training.dataset == "c4" and cfg.training.dataset_path is None
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(UserError) as e:
        build_dataloader(cfg.training, CHARS, 0, 8, 8)
    message = str(e.value)
    assert "allenai/c4" in message and "pip install datasets" in message
    assert "'python_stdlib' (embedded)" in message and "'local'" in message and "c4_test" not in message
    write_c4_test(tmp_path, ["a"])
    with pytest.raises(UserError, match=r"training.dataset = 'c4_test' \(the sample at tests/assets/c4_test\)"):
        build_dataloader(cfg.training, CHARS, 0, 8, 8)


def test_c4_offline_is_refused_at_once_with_the_alternatives(monkeypatch):
    install_fake_datasets(monkeypatch, [{"text": "x"}])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="cannot be reached: HF_HUB_OFFLINE is set; offline alternatives: .*python_stdlib"):
        make_loader(None, 8, 2, dataset="c4", shuffle=None)
    # A network failure inside the library (found by reading the first document) says the same.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(data_sources, "_hub_unreachable", lambda: None)

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'allenai/c4' on the Hub (LocalEntryNotFoundError)")

    sys.modules["datasets"].load_dataset = unreachable
    with pytest.raises(UserError, match="ConnectionError: Couldn't reach .*offline alternatives: .*python_stdlib"):
        make_loader(None, 8, 2, dataset="c4", shuffle=None)


def test_c4_streams_allenai_c4_en_in_stored_order(monkeypatch):
    docs = random_docs(10, seed=10)
    calls = install_fake_datasets(monkeypatch, [{"text": d, "url": "u"} for d in docs])
    monkeypatch.setattr(data_sources, "_hub_unreachable", lambda: None)
    loader = make_loader(None, 8, 2, dataset="c4", shuffle=None)
    assert calls == [("allenai/c4", "train", True, ("name", "en"))]
    assert take(iter(loader), 4) == lane_windows([docs[0::2], docs[1::2]], 2, 8, 8)
    # Shuffled on request: its units (here the 2 splits of a stream that does not say its shards) are
    # dealt in a new order each epoch, and each lane shuffles its documents in blocks.
    loader = make_loader(None, 8, 2, dataset="c4", shuffle=True, shuffle_buffer=3)
    assert take(iter(loader), 4) == lane_windows([docs[0::2], docs[1::2]], 2, 8, 8, seed=0, block=3)


def test_c4_local_copy_reads_the_english_training_shards(tmp_path):
    docs = random_docs(8, seed=11)
    en = tmp_path / "c4" / "en"
    en.mkdir(parents=True)
    write_gz(en / "c4-train.00000-of-01024.json.gz", docs[:5])
    write_gz(en / "c4-train.00001-of-01024.json.gz", docs[5:])
    write_gz(en / "c4-validation.00000-of-00008.json.gz", ["held out"])
    (tmp_path / "c4" / "README.md").write_text("ignored")
    loader = make_loader(tmp_path / "c4", 8, 1, dataset="c4", shuffle=False)
    assert take(iter(loader), 8) == expected_windows(docs, 8, 0, 8)
    # Local shards shuffle by default: each of 2 lanes reads one shard per epoch, shuffled.
    loader = make_loader(tmp_path / "c4", 8, 2, dataset="c4", shuffle=None)
    assert take(iter(loader), 4) == lane_windows([docs[:5], docs[5:]], 2, 8, 8, seed=0)


def test_c4_test_reads_the_reference_sample_where_the_user_has_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"reads the reference torchtitan's C4 sample from tests/assets/c4_test .*"
                                        r"copy tests/assets/c4_test from a checkout"):
        make_loader(None, 8, 2, dataset="c4_test")
    docs = random_docs(15, seed=12)
    folder = write_c4_test(tmp_path, docs)
    pieces = jsonl_pieces(folder / "data.json", docs, 2)  # one file, two lanes: two byte ranges
    assert take(iter(make_loader(None, 8, 2, dataset="c4_test")), 5) == lane_windows(pieces, 2, 8, 10)
    # Shuffled by default.
    loader = make_loader(None, 8, 2, dataset="c4_test", shuffle=None, seed=1)
    assert take(iter(loader), 5) == lane_windows(pieces, 2, 8, 10, seed=1)
    assert loader.state_dict()["dataset_state"]["dataset"] == "c4_test"


def test_config_accepts_the_reference_dataset_names_without_a_path():
    from torchtitan.config import load_config

    assert load_config(["--training.dataset", "c4"]).training.dataset_path is None
    assert load_config(["--training.dataset", "c4_test"]).training.dataset == "c4_test"
    with pytest.raises(UserError, match="dataset_text_field is empty"):
        load_config(["--training.dataset_text_field", ""])


# --- bad input -----------------------------------------------------------------------------------


def test_parquet_without_the_text_column_names_its_columns(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ["a", "b"], field="content")
    with pytest.raises(UserError, match=r"d.parquet has no column 'text' \(its columns: id, content\); set "
                                        r"training.dataset_text_field"):
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


@pytest.mark.parametrize("kind", ["gz truncated", "gz not gzip", "zst truncated", "zst corrupt"])
def test_corrupt_or_truncated_compressed_file(tmp_path, kind):
    docs = random_docs(300, seed=14, lo=30, hi=60)  # ~14k tokens: the test reads them all
    ext = kind.split()[0]
    path = (write_gz if ext == "gz" else write_zst)(tmp_path / f"d.jsonl.{ext}", docs)
    data = path.read_bytes()
    if kind.endswith("truncated"):
        path.write_bytes(data[: len(data) * 3 // 4])
    elif kind == "gz not gzip":
        path.write_bytes(b"plain text, not gzip\n")
    else:
        path.write_bytes(data[:20] + bytes(b ^ 0x55 for b in data[20:200]) + data[200:])
    kind_name = "gzip" if ext == "gz" else "zstd"
    with pytest.raises(UserError, match=rf"d.jsonl.{ext} is not a readable {kind_name} file .*corrupt or truncated"):
        take(iter(make_loader(path, 16, 4)), 400)


def test_empty_corpora(tmp_path):
    write_parquet(tmp_path / "empty.parquet", [])
    with pytest.raises(UserError, match="is empty"):
        make_loader(tmp_path / "empty.parquet", 8, 2)
    write_parquet(tmp_path / "nulls.parquet", [None, ""])
    with pytest.raises(UserError, match="is empty"):
        make_loader(tmp_path / "nulls.parquet", 8, 2)
    (tmp_path / "e.json").write_text("[]")
    with pytest.raises(UserError, match="is empty"):
        make_loader(tmp_path / "e.json", 8, 2, shuffle=None)


def test_unknown_extension_in_a_folder(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x"])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.csv").write_text("text\nhello\n")
    (tmp_path / "c.jsonl.bz2").write_bytes(b"")
    with pytest.raises(UserError, match=r"holds files of unsupported types: c.jsonl.bz2, sub/b.csv; supported: "
                                        r".*Move the other files out"):
        make_loader(tmp_path, 8, 2)


def test_datasetdict_without_a_train_split(tmp_path):
    (tmp_path / "dd").mkdir()
    write_save_to_disk(tmp_path / "dd" / "test", ["a"], shards=1)
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
    with pytest.raises(UserError, match="without a train split \\(its splits: test\\)"):
        make_loader(tmp_path / "dd", 8, 2)


@pytest.mark.parametrize("module,name,writer", [("zstandard", "d.jsonl.zst", write_zst),
                                                ("pyarrow", "d.parquet", write_parquet)])
def test_missing_optional_package(tmp_path, monkeypatch, module, name, writer):
    path = writer(tmp_path / name, ["a", "b"])
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(UserError, match=rf"{name}.* needs the {module} package: pip install {module}"):
        make_loader(path, 8, 2)


# --- data workers: documents read and tokenized in other processes ---------------------------------


class PidRecordingTokenizer(CharTokenizer):
    """CharTokenizer that appends the id of the process encoding each document to a file."""

    def __init__(self, log):
        self.log = log

    def encode(self, text, bos, eos):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return super().encode(text, bos, eos)


@pytest.mark.parametrize("shuffle", [False, True])
def test_data_workers_tokenize_in_other_processes_and_give_the_same_samples(tmp_path, shuffle):
    # The empty document keeps its index. Four lanes (four byte ranges of the file), three workers.
    docs = random_docs(300, seed=4) + [""] + random_docs(80, seed=5)
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    log = tmp_path / "pids"
    tok = PidRecordingTokenizer(log)
    loader = make_loader(path, 31, 4, tok=tok, shuffle=shuffle, data_workers=3)
    log.unlink(missing_ok=True)
    it = iter(loader)
    got = take(it, 5)
    # A scheduler may signal every process of the job: the workers leave that to the trainer.
    workers = [p for p in multiprocessing.active_children() if p.pid != os.getpid()]
    assert len(workers) >= 3
    for worker in workers:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            os.kill(worker.pid, sig)
    state = json_round_trip(loader.state_dict())
    got += take(it, 155)  # 20,480 tokens in all: two epoch boundaries per lane (an epoch is ~8,900)
    expected = lane_windows(jsonl_pieces(path, docs, 4), 4, 31, 640, seed=0 if shuffle else None)
    assert got == expected
    # Resumed mid-epoch, the workers start from the saved document position.
    resumed = make_loader(path, 31, 4, shuffle=shuffle, data_workers=2)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 20) == expected[20:100]
    pids = set(log.read_text().split())
    assert str(os.getpid()) not in pids
    assert len(pids) >= 3  # three workers
    assert all(lane_position(loader.state_dict(), p)["epoch"] == 2 for p in range(4))


def test_with_data_workers_the_state_is_the_streams_and_loads_under_any_worker_count(shuffled_docs):
    units, path = shuffled_docs
    gb, before, after = 8, 5, 4  # 72 windows of 17 tokens: an epoch boundary after the resume
    reference = lane_windows(units, gb, 16, (before + after) * gb, seed=0)
    states = []
    for workers in (2, 0):
        for rank in range(2):
            loader = make_loader(path, 16, 2, 2, rank, gb, shuffle=True, data_workers=workers)
            it = iter(loader)
            take(it, before * 2)
            states.append(json_round_trip(loader.state_dict()))
    assert states[0] == states[2] and states[1] == states[3]  # the same with and without workers
    for dp, lb, workers in [(1, 8, 3), (2, 2, 1), (4, 2, 0)]:
        got = shuffled_steps_from(merged(states[:2]), path, dp, lb, gb, after, data_workers=workers)
        assert got == steps_of(reference, gb, before, after), (dp, workers)


def test_a_bad_document_read_by_a_worker_fails_with_the_same_message_as_in_the_trainer(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = "".join(json.dumps({"text": d}) + "\n" for d in random_docs(60, seed=2))
    path.write_text(good + '{"text": oops}\n')
    messages = []
    for workers in (0, 2):
        with pytest.raises(UserError) as caught:
            take(iter(make_loader(path, 8, 2, data_workers=workers)), 500)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    # The second lane's byte range holds the bad line.
    assert f"bad.jsonl line at byte {len(good)}: invalid JSON" in messages[1] and "Traceback" not in messages[1]


def test_data_workers_are_refused_for_a_token_folder(tmp_path):
    from torchtitan.config import load_config

    with pytest.raises(UserError, match="a token folder has nothing to tokenize"):
        load_config(["--training.dataset", "tokens", "--training.dataset_path", str(tmp_path),
                     "--training.data_workers", "1"])


# --- resume of streamed shards without reading them again ----------------------------------------


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
        write_zst(folder / f"shard-{k}.jsonl.zst", docs[k * 40:(k + 1) * 40])
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
        first = len(zstandard.ZstdCompressor().compress(
            "".join(json.dumps({"text": d}) + "\n" for d in docs[k * 40:k * 40 + 20]).encode()))
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


# --- shuffled streams ------------------------------------------------------------------------------


def test_shuffled_streams_permute_files_and_blocks_and_resume_exactly(tmp_path):
    files_docs = [random_docs(9 + k, seed=20 + k) for k in range(4)]
    folder = tmp_path / "gz"
    folder.mkdir()
    for k, docs in enumerate(files_docs):
        data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        (folder / f"part-{k}.jsonl.gz").write_bytes(gzip.compress(data))
    expected = lane_windows(files_docs, 2, 15, 60, seed=3, block=7)  # 60 windows of 16: over two epochs
    assert expected != lane_windows(files_docs, 2, 15, 60, seed=4, block=7)
    loader = make_loader(folder, 15, 2, shuffle=True, shuffle_buffer=7, seed=3)
    assert loader.state_dict()["dataset_state"]["shuffle_block"] == 7
    it = iter(loader)
    assert take(it, 30) == expected
    # The same global samples at dp 2 with 2 data workers; a state saved there mid-block continues at dp 1.
    ranks = [make_loader(folder, 15, 1, dp_degree=2, dp_rank=r, shuffle=True, shuffle_buffer=7, seed=3,
                         data_workers=2) for r in range(2)]
    its = [iter(r) for r in ranks]
    got = []
    for _ in range(11):
        for r_it in its:
            got += take(r_it, 1)
    assert got == expected[:22]
    state = merged([ranks[0].state_dict(), ranks[1].state_dict()])
    resumed = make_loader(folder, 15, 2, shuffle=True, shuffle_buffer=7, seed=3)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 19) == expected[22:60]
    other = make_loader(folder, 15, 2, shuffle=True, shuffle_buffer=8, seed=3)
    other.load_state_dict(state)
    with pytest.raises(UserError, match="shuffled in blocks of 7 documents, but this job would use 8"):
        iter(other)



@pytest.mark.parametrize("data_workers", [0, 2])
def test_a_resumed_datasets_stream_starts_at_its_saved_position_without_reading_before_it(tmp_path, data_workers):
    """datasets' own position (IterableDataset.state_dict) is saved with the data state: the resume starts
    at the saved shard. Proved by overwriting the shards passed before the save, except the first (every
    start reads the first document), with text that is not JSON: reading them would fail."""
    pytest.importorskip("datasets")
    docs = random_docs(240, seed=13)
    folder = tmp_path / "hub_like"
    folder.mkdir()
    for k in range(8):
        write_jsonl(folder / f"part-{k}.jsonl", docs[k * 30:(k + 1) * 30])
    # Two lanes: a unit per shard of the stream, lane 0 reading shards 0, 2, 4, 6 in epoch 0.
    loader = make_loader(folder, 31, 2, dataset="huggingface", data_workers=data_workers)
    it = iter(loader)
    reference = take(it, 75)  # 150 windows of 32 tokens, 75 per lane: into each lane's fourth shard
    lanes = [[d for k in range(p, 8, 2) for d in docs[k * 30:(k + 1) * 30]] for p in range(2)]
    assert reference == lane_windows(lanes, 2, 31, 150)
    later = take(it, 3)
    fresh = make_loader(folder, 31, 2, dataset="huggingface", data_workers=data_workers)
    assert take(iter(fresh), 75) == reference
    state = json_round_trip(fresh.state_dict())
    # A unit per shard (split_dataset_by_node(stream, k, 8)): the lanes are in shards 6 and 7, and know
    # how many documents the shards before them hold.
    layout = state["dataset_state"]["source_layout"]
    assert set(layout["hf_states"]) >= {"6/8", "7/8"}
    assert layout["unit_documents"] == {f"{k}/8": 30 for k in range(6)}
    for k in (2, 3):  # each lane's second shard: skipped by its count
        (folder / f"part-{k}.jsonl").write_text("not json\n" * 30)
    resumed = make_loader(folder, 31, 2, dataset="huggingface", data_workers=data_workers)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 3) == later
    del state["dataset_state"]["source_layout"]  # without it, the resume reads the documents before it
    again = make_loader(folder, 31, 2, dataset="huggingface", data_workers=data_workers)
    again.load_state_dict(state)
    with pytest.raises(UserError, match=r"huggingface dataset .*: reading up to document \d+ failed \(ArrowInvalid: JSON parse"):
        take(iter(again), 3)


def test_workers_do_not_collect_an_abandoned_loader_they_inherit(tmp_path):
    """A loader dropped without being closed is garbage that the workers of the next one inherit by fork;
    had they collected it, its reader would run its shutdown in their process ("can only test a child
    process", and a shutdown sent to workers that are not theirs). In a fresh interpreter, where the
    collector runs as it would in a script (it printed that error 4 times before the fix)."""
    import subprocess

    path = write_jsonl(tmp_path / "a.jsonl", random_docs(400, seed=1))
    script = f"""
import sys
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
from test_data import make_loader, take
for _ in range(3):
    loader = make_loader({str(path)!r}, 31, 2, data_workers=2)
    it = iter(loader)
    take(it, 5)
    del it, loader
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "can only test a child process" not in proc.stderr


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
