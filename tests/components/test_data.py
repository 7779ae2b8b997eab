"""The data pipeline: packing, sample ownership across layouts, resumable state, sources, errors.

Most tests use a character-level fake tokenizer, so the expected token stream can be written
down independently of the code under test: window k of a run must equal stream[k*W:(k+1)*W].
"""

import json
import logging
import random
import sys
import sysconfig
import types
from pathlib import Path

import pytest
import torch

from torchtitan.components.data import build_dataloader, stdlib_files
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError
from torchtitan.config.job_config import Training

MODEL = Path(__file__).resolve().parents[2] / "assets" / "tokenizer" / "python_stdlib_4k.model"


class CharTokenizer:
    """One token per character; BOS = 1, EOS = 2."""

    bos_id, eos_id, vocab_size = 1, 2, 1000

    def encode(self, text, bos, eos):
        return [1] * bos + [3 + ord(c) % 997 for c in text] + [2] * eos


CHARS = CharTokenizer()


def expected_stream(docs, n_tokens, tok=CHARS):
    """The global token stream: framed non-empty documents, concatenated, looped."""
    out = []
    while len(out) < n_tokens:
        for doc in docs:
            if doc:
                out += tok.encode(doc, bos=True, eos=True)
    return out[:n_tokens]


def expected_windows(docs, seq_len, start, stop, tok=CHARS):
    w = seq_len + 1
    stream = expected_stream(docs, stop * w, tok)
    return [stream[k * w : (k + 1) * w] for k in range(start, stop)]


def random_docs(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij KLMNOP\n") for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def make_loader(path, seq_len, local_batch, dp_degree=1, dp_rank=0, global_batch=None, tok=CHARS, dataset="local"):
    cfg = Training(
        dataset=dataset,
        dataset_path=None if path is None else str(path),
        seq_len=seq_len,
        local_batch_size=local_batch,
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
    it = iter(make_loader(path, seq_len=7, local_batch=2))
    inputs, labels = next(it)
    assert inputs.shape == labels.shape == (2, 7)
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
    windows = take(iter(make_loader(path, seq_len=16, local_batch=2, tok=tok)), 4)
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
    (tmp_path / "c.csv").write_text("ignored,file\n")
    (tmp_path / "README.md").write_text("ignored")
    docs = ["top-a", "b-a-0", "b-a-1", "zzz"]
    got = [t for w in take(iter(make_loader(tmp_path, seq_len=5, local_batch=2)), 5) for t in w]
    assert got == expected_stream(docs, len(got))


def test_epoch_wrap_continues_the_stream_and_warns_once_per_epoch(tmp_path, caplog):
    docs = ["abc", "defgh"]  # 12 tokens per epoch
    path = write_jsonl(tmp_path / "tiny.jsonl", docs)
    loader = make_loader(path, seq_len=4, local_batch=2)
    with caplog.at_level(logging.WARNING, logger="torchtitan.components.data"):
        got = [t for w in take(iter(loader), 6) for t in w]  # 60 tokens: 5 epochs
    assert got == expected_stream(docs, 60)
    warnings = [r for r in caplog.records if "starting epoch" in r.getMessage()]
    assert [r.getMessage().split("starting epoch ")[1].split()[0] for r in warnings] == ["1", "2", "3", "4"]
    assert loader.state_dict()["dataset_state"]["epoch"] == 4


# --- sample ownership --------------------------------------------------------------------------

LAYOUTS = [  # (dp_degree, local_batch_size, global_batch_size)
    (1, 8, 8),
    (2, 4, 8),
    (4, 2, 8),
    (2, 2, 8),  # two accumulation micro-batches per step
]


@pytest.fixture
def docs_path(tmp_path):
    docs = random_docs(60)
    return docs, write_jsonl(tmp_path / "docs.jsonl", docs)


def run_steps(path, dp, lb, gb, steps, seq_len=16):
    """Per step, the samples of every rank in rank order: list[step][rank] -> windows."""
    per_rank = []
    for rank in range(dp):
        it = iter(make_loader(path, seq_len, lb, dp, rank, gb))
        per_rank.append([take(it, gb // dp // lb) for _ in range(steps)])
    return [[per_rank[r][s] for r in range(dp)] for s in range(steps)]


@pytest.mark.parametrize("dp,lb,gb", LAYOUTS)
def test_each_rank_reads_its_contiguous_block_of_each_step(docs_path, dp, lb, gb):
    docs, path = docs_path
    steps = 3
    reference = expected_windows(docs, 16, 0, steps * gb)
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
    assert {"next_sample", "epoch", "doc_index", "token_offset", "carry"} <= set(ds)
    assert ds["next_sample"] == 6
    assert all(isinstance(v, (int, str, list)) for v in ds.values())
    assert len(ds["carry"]) < 17


@pytest.mark.parametrize("dp,lb,gb,rank,n", [(1, 2, 2, 0, 3), (2, 2, 8, 1, 3), (2, 2, 8, 0, 2)])
def test_resume_jsonl_continues_exactly(docs_path, dp, lb, gb, rank, n):
    docs, path = docs_path
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
    windows = expected_windows(docs, 16, 0, 200)
    assert uninterrupted == [windows[k] for k in owned[n * lb : n * lb + 6 * lb]]


def test_resume_deep_into_a_folder_and_after_a_wrap(tmp_path):
    (tmp_path / "d").mkdir()
    docs_a, docs_b = random_docs(5, seed=1), random_docs(5, seed=2)
    write_jsonl(tmp_path / "d" / "a.jsonl", docs_a)
    write_jsonl(tmp_path / "d" / "b.jsonl", docs_b)
    first = make_loader(tmp_path / "d", 8, 2)
    it = iter(first)
    take(it, 15)  # 270 tokens, more than one epoch
    state = json_round_trip(first.state_dict())
    assert state["dataset_state"]["epoch"] >= 1
    uninterrupted = take(it, 10)
    resumed = make_loader(tmp_path / "d", 8, 2)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 10) == uninterrupted == expected_windows(docs_a + docs_b, 8, 30, 50)


def test_resume_python_stdlib_mid_step():
    tok = Tokenizer(MODEL)
    # dp 2, two micro-batches per step: after 3 batches, rank 1 is in the middle of step 1.
    first = make_loader(None, 32, 2, 2, 1, 8, tok=tok, dataset="python_stdlib")
    it = iter(first)
    take(it, 3)
    state = json_round_trip(first.state_dict())
    assert state["dataset_state"]["next_sample"] == 8 + 4 + 2
    uninterrupted = take(it, 3)
    resumed = make_loader(None, 32, 2, 2, 1, 8, tok=tok, dataset="python_stdlib")
    resumed.load_state_dict(state)
    assert take(iter(resumed), 3) == uninterrupted
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files()[:3]]
    windows = expected_windows(texts, 32, 0, 40, tok)  # the first files are enough for 40 windows
    assert uninterrupted == windows[14:16] + windows[20:24]


def test_carried_tokens_come_before_the_source_position(docs_path):
    docs, path = docs_path
    loader = make_loader(path, 16, 2)
    state = loader.state_dict()  # before any batch: the start of the stream
    assert state["dataset_state"]["carry"] == [] and state["dataset_state"]["token_offset"] == 0
    # The same position, expressed as 3 tokens already read from document 0.
    state["dataset_state"]["carry"] = CHARS.encode(docs[0], bos=True, eos=True)[:3]
    state["dataset_state"]["token_offset"] = 3
    resumed = make_loader(path, 16, 2)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 3) == expected_windows(docs, 16, 0, 6)


def test_step_boundary_state_loads_under_other_dp_degrees(docs_path):
    docs, path = docs_path
    gb, steps_before, steps_after = 8, 3, 3
    reference = expected_windows(docs, 16, 0, (steps_before + steps_after) * gb)

    # Save under dp 2 with accumulation, at a step boundary, on both ranks.
    states = []
    for rank in range(2):
        loader = make_loader(path, 16, 2, 2, rank, gb)
        it = iter(loader)
        take(it, steps_before * 2)
        states.append(json_round_trip(loader.state_dict()))
    # Every rank holds the same state at a step boundary: any rank's checkpoint will do.
    assert states[0] == states[1]
    assert states[0]["dataset_state"]["next_sample"] == steps_before * gb

    for dp, lb in [(4, 2), (1, 8), (1, 2), (2, 4)]:
        ranks = []
        for rank in range(dp):
            loader = make_loader(path, 16, lb, dp, rank, gb)
            loader.load_state_dict(states[rank % 2])
            it = iter(loader)
            ranks.append([take(it, gb // dp // lb) for _ in range(steps_after)])
        for s in range(steps_after):
            union = [w for r in range(dp) for w in ranks[r][s]]
            step = steps_before + s
            assert union == reference[step * gb : (step + 1) * gb], (dp, lb, s)


def test_mid_step_state_does_not_load_under_another_layout(docs_path):
    _, path = docs_path
    loader = make_loader(path, 16, 2, 2, 0, 8)
    it = iter(loader)
    take(it, 1)  # rank 0 is half way through its block of step 0
    state = loader.state_dict()
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


def test_python_stdlib_is_the_default_dataset():
    tok = Tokenizer(MODEL)
    cfg = Training(seq_len=16, local_batch_size=2)
    assert cfg.dataset == "python_stdlib"
    inputs, labels = next(iter(build_dataloader(cfg, tok, 0, 1, 2)))
    first = stdlib_files()[0].read_text(encoding="utf-8", errors="replace")
    assert inputs[0].tolist() == tok.encode(first, bos=True, eos=False)[:16]


def install_fake_datasets(monkeypatch, rows):
    calls = []

    def load_dataset(path, split=None, streaming=False):
        calls.append((path, split, streaming))
        return list(rows)

    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)
    return calls


def test_huggingface_source_reads_the_text_column_and_resumes(monkeypatch):
    docs = random_docs(20, seed=3)
    calls = install_fake_datasets(monkeypatch, [{"text": d, "meta": i} for i, d in enumerate(docs)])
    loader = make_loader("org/corpus", 8, 2, dataset="huggingface")
    assert calls == [("org/corpus", "train", True)]
    it = iter(loader)
    assert take(it, 4) == expected_windows(docs, 8, 0, 8)
    state = json_round_trip(loader.state_dict())
    assert state["dataset_state"]["doc_index"] > 0
    resumed = make_loader("org/corpus", 8, 2, dataset="huggingface")
    resumed.load_state_dict(state)
    assert take(iter(resumed), 4) == take(it, 4) == expected_windows(docs, 8, 8, 16)


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
    with pytest.raises(UserError, match="holds no .jsonl or .txt files"):
        make_loader(tmp_path, 8, 2)


def test_bad_json_on_the_first_line_fails_when_the_loader_is_built(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"\n')
    with pytest.raises(UserError, match=r"bad.jsonl line 1: invalid JSON"):
        make_loader(path, 8, 2)


def test_bad_json_later_fails_naming_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a fine first document"}\n\n{"text": oops}\n')
    it = iter(make_loader(path, 8, 2))
    with pytest.raises(UserError, match=r"bad.jsonl line 3: invalid JSON"):
        take(it, 5)


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
    it = iter(make_loader(path, 16, 2))
    with pytest.raises(UserError, match="too small.*9 tokens.*17"):
        next(it)
