"""Pre-tokenized corpora (scripts/pretokenize.py, training.dataset = "tokens"): the same samples as the
text pipeline, resumable state across layouts, bad-input messages, interrupted pretokenize.

A token folder has random access: its documents are cut into ranges, dealt to the lanes
(torchtitan/components/data/lanes.py) as those of a text source with random access (an Arrow file), so
the two give the same samples under every layout and order. A JSON lines or parquet source is a stream,
cut into files or pieces of them: it gives the same samples as its token folder in one lane (a global
batch of one sequence) in stored order, where each reads the whole source in order."""

import gzip
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torchtitan.components.data import build_dataloader
from torchtitan.components.data.shuffle import Permutation
from torchtitan.components.data.token_folder import pretokenize
from torchtitan.config.errors import UserError
from torchtitan.config.training_sections import Training

from helpers.data import CHARS, CharTokenizer, framed_documents, lane_streams, merged, random_docs
from helpers.paths import MODEL, REPO

SCRIPT = REPO / "scripts" / "pretokenize.py"
sys.path.insert(0, str(SCRIPT.parent))
import pretokenize as script  # noqa: E402 (scripts/pretokenize.py)


def write_jsonl(path, docs, compress=False):
    data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def tokenize(src, out, tok=CHARS, workers=2, **kwargs):
    from torchtitan.components.data.files import FilesSource as _FilesSource

    return pretokenize(
        _FilesSource(str(src)),
        tok,
        out,
        source_description={"description": str(src)},
        workers=workers,
        chunk_docs=kwargs.pop("chunk_docs", 7),
        batch_docs=3,
        log=lambda *_: None,
        **kwargs,
    )


def loader(dataset, path, seq_len, dp_degree=1, dp_rank=0, local_batch=2, tok=CHARS, shuffle=True, seed=0):
    cfg = Training(
        dataset=dataset,
        dataset_path=str(path),
        seq_len=seq_len,
        local_batch_size=local_batch,
        shuffle_documents=shuffle,
        seed=seed,
    )
    return build_dataloader(cfg, tok, dp_rank, dp_degree, local_batch * dp_degree)


def windows(batch):
    inputs, labels = batch
    return [row + [last] for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]


def write_arrow(path, docs):
    """An Arrow file of `docs`: a text source with random access, as a token folder has (its documents
    are cut into the same ranges, lanes.py), so the two give the same samples under every layout."""
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"text": docs})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 documents (some empty) and their token folder: ~1,200 tokens, so 40 steps of dp x 2 windows of
    17 tokens cover several epochs. Also the documents, and the same documents as an Arrow file."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = random_docs(60, seed=1, lo=0)
    src = write_jsonl(folder / "docs.jsonl", docs)
    meta = tokenize(src, folder / "tokens")
    assert meta["num_docs"] == 60 and meta["dtype"] == "uint16"
    return SimpleNamespace(src=src, tokens=folder / "tokens", docs=docs, arrow=write_arrow(folder / "docs.arrow", docs))


def lane_documents(docs, lanes, seed):
    """The documents each lane of a random-access source of `docs` reads in epoch 0 (lanes.py): the units
    (16 x lanes consecutive ranges of documents) at positions p, p + lanes, ... of the epoch's order."""
    k = min(len(docs), 16 * lanes)
    units = [docs[i * len(docs) // k : (i + 1) * len(docs) // k] for i in range(k)]
    order = Permutation(k, seed, 0) if seed is not None else range(k)
    return [[d for j in range(p, k, lanes) for d in units[order[j]]] for p in range(lanes)]


# --- the same samples as the text pipeline ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [True, None])
def test_same_samples_as_the_text_pipeline(corpus, dp, shuffle):
    """Against a text source with random access (an Arrow file): the same units, document order and
    packing, so the same samples on every rank, shuffled (asked for, or by default)."""
    steps = 40  # 40 * dp * 2 * 17 tokens: several passes over the ~1,200-token corpus
    for rank in range(dp):
        text = iter(loader("local", corpus.arrow, 16, dp, rank, shuffle=shuffle))
        tok = iter(loader("tokens", corpus.tokens, 16, dp, rank, shuffle=shuffle))
        for step in range(steps):
            a, b = next(text), next(tok)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (rank, step)


def test_same_samples_as_a_streamed_text_source_in_one_lane_in_stored_order(corpus):
    """A JSON lines file is a stream (its units are byte ranges), the token folder has random access
    (ranges of documents): with several lanes they deal documents differently. One lane (a global batch
    of one sequence) in stored order reads both whole, as one stream: the same samples, over epochs."""
    text = iter(loader("local", corpus.src, 16, local_batch=1, shuffle=False))
    tok = iter(loader("tokens", corpus.tokens, 16, local_batch=1, shuffle=False))
    stream = [t for d in corpus.docs if d for t in CHARS.encode(d, bos=True, eos=True)] * 2
    for step in range(len(stream) // 17):  # two epochs
        a, b = next(text), next(tok)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), step
        assert windows(b) == [stream[step * 17 : (step + 1) * 17]], step


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_token_folder_deals_each_document_to_one_lane_per_epoch_under_every_layout(corpus, shuffle):
    """Global batch 8 (8 lanes) under dp 1, 2 and 4: the same global samples; in the first epoch the
    lanes' documents are the corpus, each document once."""
    gb, steps = 8, 20  # 20 * 17 tokens a lane: well past its first epoch (~150 tokens)
    runs = []
    for dp in (1, 2, 4):
        iters = [
            iter(loader("tokens", corpus.tokens, 16, dp, r, local_batch=gb // dp, shuffle=shuffle)) for r in range(dp)
        ]
        runs.append([w for _ in range(steps) for it in iters for w in windows(next(it))])
    assert runs[1] == runs[0] and runs[2] == runs[0]
    streams = lane_streams(runs[0], gb)
    first_epoch = []
    for p, docs in enumerate(lane_documents(corpus.docs, gb, 0 if shuffle else None)):
        n = sum(1 for d in docs if d)  # an empty document is no tokens
        read = framed_documents(streams[p])
        assert len(read) > n, p  # the lane read past its first epoch
        first_epoch += read[:n]
        if not shuffle:
            assert read[:n] == [d for d in docs if d], p
    assert sorted(first_epoch) == sorted(d for d in corpus.docs if d)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_corpus_smaller_than_a_step_wraps_as_in_the_text_pipeline(tmp_path):
    """8 lanes (dp 4 x 2) on 4 documents, one unit each: the 2 lanes on a unit each read half of its
    tokens, so a lane's first window spans several epochs. The text pipeline on the same documents with
    random access gives the same samples on every rank."""
    docs = ["abcdefghij", "", "KLMNOP klm", "abc"]  # 31 tokens
    tokenize(write_jsonl(tmp_path / "d.jsonl", docs), tmp_path / "tok")
    arrow = write_arrow(tmp_path / "d.arrow", docs)
    for shuffle in (None, False):
        got = {}
        for rank in range(4):
            a = iter(loader("local", arrow, 8, 4, rank, shuffle=shuffle))
            b = iter(loader("tokens", tmp_path / "tok", 8, 4, rank, shuffle=shuffle))
            for step in range(6):
                x, y = next(a), next(b)
                assert all(torch.equal(u, v) for u, v in zip(x, y)), (shuffle, rank, step)
                got[rank, step] = windows(y)
        samples = [w for step in range(6) for rank in range(4) for w in got[rank, step]]
        streams = lane_streams(samples, 8)
        if shuffle is False:
            # Epoch e: lane p is at position q = (p + e) % 8 of the 4 units; the 2 lanes on unit q % 4 take
            # half q // 4 of its document's tokens each.
            for p, stream in enumerate(streams):
                expected = []
                for q in [(p + e) % 8 for e in range(24)]:
                    tokens = CHARS.encode(docs[q % 4], bos=True, eos=True) if docs[q % 4] else []
                    expected += tokens[q // 4 * len(tokens) // 2 : (q // 4 + 1) * len(tokens) // 2]
                assert stream == expected[: len(stream)], p
    src = write_jsonl(tmp_path / "small.jsonl", ["abc", "de"])  # 9 tokens: not one window of 17
    tokenize(src, tmp_path / "small")
    # In stored order a lane reads every unit once in 8 epochs: all of the corpus.
    with pytest.raises(
        UserError,
        match="too small: one lane's share of 8 epochs tokenizes to 9 tokens, fewer than "
        r"one sequence of seq_len \+ 1 = 17",
    ):
        next(iter(loader("tokens", tmp_path / "small", 16, 4, 3, shuffle=False)))
    with pytest.raises(UserError, match=r"too small: one lane's share of 8 epochs tokenizes to \d+ tokens"):
        next(iter(loader("tokens", tmp_path / "small", 16, 4, 3)))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_streamed_source_in_stored_order_gives_the_same_samples_and_both_shuffle_by_default(tmp_path):
    """A compressed JSON lines source is a stream; its token folder has random access. In stored order
    one lane reads both alike. By default both are shuffled (every local file is): the first epoch is
    every document once, in another order than stored."""
    docs = random_docs(30, seed=2, lo=0)
    src = write_jsonl(tmp_path / "d.jsonl.gz", docs, compress=True)
    meta = tokenize(src, tmp_path / "tok")
    assert meta["source_random_access"] is False
    a = iter(loader("local", src, 8, local_batch=1, shuffle=False))
    b = iter(loader("tokens", tmp_path / "tok", 8, local_batch=1, shuffle=False))
    for _ in range(100):  # 900 tokens: past the first epoch (~600)
        assert all(torch.equal(x, y) for x, y in zip(next(a), next(b)))
    framed = [d for d in docs if d]
    tokens = sum(len(d) + 2 for d in framed)  # one lane: the first epoch is the stream's first tokens
    for dataset, path in (("local", src), ("tokens", tmp_path / "tok")):
        it = iter(loader(dataset, path, 8, local_batch=1, shuffle=None))
        stream = [t for _ in range(-(-tokens // 9)) for w in windows(next(it)) for t in w]
        first = framed_documents(stream[:tokens])
        assert sorted(first) == sorted(framed) and first != framed, dataset


@pytest.mark.slow
@pytest.mark.multiprocess
def test_same_samples_with_the_real_tokenizer(tmp_path):
    from torchtitan.components.tokenizer import Tokenizer

    tok = Tokenizer(MODEL)
    docs = ["import os\n", "", "def f(x):\n    return x + 1\n"] * 20
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    tokenize(src, tmp_path / "tok", tok=tok, tokenizer_spec=str(MODEL))
    arrow = write_arrow(tmp_path / "d.arrow", docs)
    for rank in range(2):
        a = iter(loader("local", arrow, 32, 2, rank, tok=tok))
        b = iter(loader("tokens", tmp_path / "tok", 32, 2, rank, tok=tok))
        for _ in range(10):
            assert all(torch.equal(x, y) for x, y in zip(next(a), next(b)))
    a = iter(loader("local", src, 32, local_batch=1, tok=tok, shuffle=False))  # the stream, in one lane
    b = iter(loader("tokens", tmp_path / "tok", 32, local_batch=1, tok=tok, shuffle=False))
    for _ in range(20):
        assert all(torch.equal(x, y) for x, y in zip(next(a), next(b)))


# --- resumable state ---------------------------------------------------------------------------------


def test_resume_under_another_data_parallel_degree(corpus):
    """A state saved by dp 2 (its ranks' lanes gathered) continues under dp 4: every global sample once,
    equal to the text pipeline's; at a step boundary it is the state dp 1 saves."""
    reference = iter(loader("local", corpus.arrow, 16, 1, 0, local_batch=8))  # global batch 8, one rank
    expected = [w for _ in range(12) for w in windows(next(reference))]

    dp1 = loader("tokens", corpus.tokens, 16, 1, 0, local_batch=8)
    it = iter(dp1)
    for _ in range(5):
        next(it)
    dp2 = [loader("tokens", corpus.tokens, 16, 2, r, local_batch=4) for r in range(2)]
    iters = [iter(d) for d in dp2]
    got = []
    for _ in range(5):  # 5 steps of 8 global samples
        for it in iters:
            got += windows(next(it))
    states = [d.state_dict() for d in dp2]
    assert [[p for p, _ in s["dataset_state"]["lanes"]] for s in states] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    state = merged(states)
    same_step = lambda s: {k: v for k, v in json.loads(json.dumps(s)).items() if k != "dp_degree"}  # noqa: E731
    assert same_step(state["dataset_state"]) == same_step(dp1.state_dict()["dataset_state"])
    dp4 = [loader("tokens", corpus.tokens, 16, 4, r, local_batch=2) for r in range(4)]
    for d in dp4:
        d.load_state_dict(state)
    iters = [iter(d) for d in dp4]
    for _ in range(7):
        for it in iters:
            got += windows(next(it))
    assert got == expected


def test_state_matches_the_text_pipeline(corpus):
    """The same state as the text pipeline on the documents with random access (an Arrow file)."""
    a, b = loader("local", corpus.arrow, 16, 2, 1), loader("tokens", corpus.tokens, 16, 2, 1)
    ia, ib = iter(a), iter(b)
    for _ in range(9):
        next(ia), next(ib)
    sa, sb = a.state_dict()["dataset_state"], b.state_dict()["dataset_state"]
    assert [p for p, _ in sa["lanes"]] == [2, 3] and sa["next_sample"] == 18
    strip = lambda s: {k: v for k, v in s.items() if k not in ("dataset", "dataset_path")}  # noqa: E731
    assert strip(json.loads(json.dumps(sa))) == strip(json.loads(json.dumps(sb)))


# --- bad input ----------------------------------------------------------------------------------------


def _copy(tokens, dest):
    dest.mkdir()
    for name in ("tokens.bin", "docs.idx", "meta.json"):
        (dest / name).write_bytes((tokens / name).read_bytes())
    return dest


def test_missing_meta_is_incomplete(corpus, tmp_path):
    bad = _copy(corpus.tokens, tmp_path / "t")
    (bad / "meta.json").unlink()
    with pytest.raises(UserError, match=r"incomplete.*run pretokenize again"):
        loader("tokens", bad, 16)


def test_truncated_token_file(corpus, tmp_path):
    bad = _copy(corpus.tokens, tmp_path / "t")
    with open(bad / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError, match=r"tokens\.bin is 100 bytes.*truncated.*pretokenize"):
        loader("tokens", bad, 16)


def test_ids_beyond_the_vocabulary(corpus, tmp_path):
    # Recorded at write time: refused at open (before launch), naming the file.
    small = CharTokenizer(vocab_size=50)
    bad = _copy(corpus.tokens, tmp_path / "t")
    meta = json.loads((bad / "meta.json").read_text())
    meta["tokenizer"]["vocab_size"] = meta["vocab_size"] = 50
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"tokens\.bin holds token id \d+, not below the vocabulary size 50"):
        loader("tokens", bad, 16, tok=small)
    # Changed after it was written (max_id no longer true): caught in the window read.
    bad2 = _copy(corpus.tokens, tmp_path / "t2")
    ids = np.fromfile(bad2 / "tokens.bin", dtype="<u2")
    ids[5] = 1005
    ids.tofile(bad2 / "tokens.bin")
    meta = json.loads((bad2 / "meta.json").read_text())
    meta["max_id"] = 100
    (bad2 / "meta.json").write_text(json.dumps(meta))
    small = CharTokenizer(vocab_size=1000)
    it = iter(loader("tokens", bad2, 16, tok=small, shuffle=False))
    with pytest.raises(UserError, match=r"tokens\.bin holds token id 1005, not below the vocabulary size 1000"):
        for _ in range(5):
            next(it)


def test_uint16_file_with_a_large_vocabulary(corpus, tmp_path):
    bad = _copy(corpus.tokens, tmp_path / "t")
    with pytest.raises(UserError, match=r"tokens\.bin holds uint16 ids, but the job's tokenizer has 100000 tokens"):
        loader("tokens", bad, 16, tok=CharTokenizer(vocab_size=100_000))
    meta = json.loads((bad / "meta.json").read_text())
    meta["vocab_size"] = 70000
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"uint16 ids, but the vocabulary it was written with has 70000"):
        loader("tokens", bad, 16)


def test_another_tokenizer_is_refused(corpus):
    class Other(CharTokenizer):
        eos_id = 3

    with pytest.raises(UserError, match=r"was written with the CharTokenizer.*eos 2.*this job's .*eos 3"):
        loader("tokens", corpus.tokens, 16, tok=Other())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_large_vocabulary_is_written_as_uint32(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", random_docs(10, seed=3, lo=5))
    big = CharTokenizer(vocab_size=100_000)
    meta = tokenize(src, tmp_path / "tok", tok=big)
    assert meta["dtype"] == "uint32"
    # One lane in stored order: the JSON lines stream and the token folder read alike (past an epoch).
    a = iter(loader("local", src, 8, local_batch=1, tok=big, shuffle=False))
    b = iter(loader("tokens", tmp_path / "tok", 8, local_batch=1, tok=big, shuffle=False))
    for _ in range(40):
        assert all(torch.equal(x, y) for x, y in zip(next(a), next(b)))


# --- interrupted pretokenize --------------------------------------------------------------------------


def _files(folder):
    return {n: (folder / n).read_bytes() for n in ("tokens.bin", "docs.idx", "meta.json")}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_stopped_pretokenize_resumes_to_the_same_output(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", random_docs(50, seed=4, lo=0))
    assert tokenize(src, tmp_path / "part", max_chunks=3) is None
    assert not (tmp_path / "part" / "meta.json").exists()
    with pytest.raises(UserError, match="incomplete"):
        loader("tokens", tmp_path / "part", 8)
    # A killed run may have appended part of a chunk past progress.json: cut back on resume.
    with open(tmp_path / "part" / "tokens.bin", "ab") as f:
        f.write(b"\x07\x00" * 11)
    assert tokenize(src, tmp_path / "part") is not None
    tokenize(src, tmp_path / "whole", workers=1)
    assert _files(tmp_path / "part") == _files(tmp_path / "whole")
    # Resuming with another tokenizer is refused.
    tokenize(src, tmp_path / "other", max_chunks=1)
    with pytest.raises(UserError, match="interrupted pretokenize of another source or tokenizer"):
        tokenize(src, tmp_path / "other", tok=CharTokenizer(vocab_size=999))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_killed_pretokenize_script_resumes_to_the_same_output(tmp_path):
    """SIGKILL the real script mid-way: no meta.json; the same command finishes it, identical to a clean run."""
    src = write_jsonl(tmp_path / "d.jsonl", random_docs(6000, seed=5, lo=100, hi=400))
    out = tmp_path / "killed"
    cmd = [
        sys.executable,
        str(SCRIPT),
        str(src),
        str(out),
        "--tokenizer",
        str(MODEL),
        "--workers",
        "2",
        "--chunk-docs",
        "100",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (out / "progress.json").exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)  # the script and its worker processes
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stderr.close()
    assert not (out / "meta.json").exists(), "killed too late: raise the corpus size"
    done = json.loads((out / "progress.json").read_text())["docs_done"]
    assert 0 < done < 6000
    with pytest.raises(UserError, match="incomplete"):
        loader("tokens", out, 16)
    args = ["--tokenizer", str(MODEL), "--workers", "2", "--chunk-docs", "100"]
    assert script.main([str(src), str(out)] + args) == 0
    assert script.main([str(src), str(tmp_path / "clean")] + args) == 0
    assert _files(out) == _files(tmp_path / "clean")
    assert not (out / "progress.json").exists()


# --- the script: every source the trainer reads, OUTPUT checks --------------------------------------


def _run(capsys, *argv):
    """scripts/pretokenize.py in this process: (exit code, stderr)."""
    rc = script.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def _tokens(folder):
    return {n: (folder / n).read_bytes() for n in ("tokens.bin", "docs.idx")}


def test_source_names_the_trainers_datasets(tmp_path, monkeypatch):
    """SOURCE [--dataset NAME] is training.dataset_path [training.dataset]."""
    monkeypatch.chdir(tmp_path)
    cases = {
        ("data.jsonl", None): ("local", "data.jsonl"),
        ("python_stdlib", None): ("python_stdlib", None),
        ("c4_test", None): ("c4_test", None),
        ("c4", None): ("c4", None),
        ("org/name", "huggingface"): ("huggingface", "org/name"),
        ("c4", "c4"): ("c4", None),
        ("clone", "c4"): ("c4", "clone"),
        ("c4", "local"): ("local", "c4"),
        ("python_stdlib", "python_stdlib"): ("python_stdlib", None),
    }
    for (spec, dataset), expected in cases.items():
        cfg = script.source_config(spec, dataset, "content")
        assert (cfg.dataset, cfg.dataset_path) == expected, (spec, dataset)
        assert cfg.dataset_text_field == "content" and cfg.shuffle_documents is False
    (tmp_path / "c4").mkdir()  # a folder of that name is data
    assert script.source_config("c4").dataset == "local"
    with pytest.raises(UserError, match="python_stdlib is the embedded corpus and takes no path"):
        script.source_config("other", "python_stdlib")


def _write_docs(folder, docs, fmt):
    """docs in three files (one in a subfolder) of JSON lines or parquet."""
    parts = [docs[:10], docs[10:25], docs[25:]]
    names = ["a", "b", "sub/c"]
    for name, part in zip(names, parts):
        path = folder / f"{name}.{fmt}"
        path.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "jsonl":
            path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(part)))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": part, "id": list(range(len(part)))}), path)
    return folder


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.hf
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_datasets_stream_writes_the_tokens_of_the_same_files_read_locally(tmp_path, capsys, fmt):
    """--dataset huggingface on a local folder (datasets.load_dataset(folder, split="train", streaming=True),
    as training.dataset = "huggingface" reads it) writes the token folder of the same files read as local
    data; stopped after 2 chunks, the same command finishes it to the same bytes."""
    pytest.importorskip("datasets")
    docs = random_docs(40, seed=6, lo=0) + ["", None, "déjà vu ✓\n\ttabs", "x"]
    data = _write_docs(tmp_path / "data", docs, fmt)
    args = ["--tokenizer", MODEL, "--workers", "2", "--chunk-docs", "7"]
    assert _run(capsys, data, tmp_path / "local", *args) == (0, "")
    assert _run(capsys, "--dataset", "huggingface", data, tmp_path / "hf", *args) == (0, "")
    assert _tokens(tmp_path / "hf") == _tokens(tmp_path / "local")
    meta = json.loads((tmp_path / "hf" / "meta.json").read_text())
    assert meta["num_docs"] == len(docs) and meta["source_random_access"] is False
    assert meta["source"]["dataset"] == "huggingface" and meta["source"]["files"] == 3

    part = tmp_path / "part"
    assert _run(capsys, "--dataset", "huggingface", data, part, *args, "--max-chunks", "2") == (3, "")
    assert json.loads((part / "progress.json").read_text())["docs_done"] == 14
    # The same folder read as local data is another source: refused, the partial folder kept.
    rc, err = _run(capsys, data, part, *args)
    assert rc == 2 and "interrupted pretokenize of another source" in err
    assert f"it is of the source huggingface {data}" in err and f"not local {data}" in err
    assert _run(capsys, "--dataset", "huggingface", data, part, *args) == (0, "")
    assert _tokens(part) == _tokens(tmp_path / "local")
    assert (part / "meta.json").read_bytes() == (tmp_path / "hf" / "meta.json").read_bytes()


class _Stream:
    """A streamed source of documents (as datasets' are: no random access)."""

    random_access = False

    def __init__(self, docs):
        self.docs = docs

    def documents(self, start):
        yield from self.docs[start:]


def test_a_hub_dataset_is_recorded_by_name_config_and_data_files(tmp_path):
    """No local files: the description is the dataset's name, config and the hf:// URLs it streams (which
    name the revision); a rerun on another revision or dataset is refused."""

    def hub(name, commit, config="en"):
        url = f"hf://datasets/{name}@{commit}/{config}/part-0.json.gz"
        stream = SimpleNamespace(
            info=SimpleNamespace(config_name=config), _ex_iterable=SimpleNamespace(kwargs={"original_files": [url]})
        )
        return script.describe_source(
            script.source_config(name, "huggingface"), SimpleNamespace(path=name, dataset=stream)
        )

    first = hub("org/name", "a" * 40)
    assert first["path"] == "org/name" and first["stream"] == "org/name"  # not resolved as a local path
    assert first["config"] == "en" and first["files"] == 1 and first["description"] == "huggingface org/name"
    assert hub("org/name", "a" * 40) == first
    assert hub("org/name", "b" * 40)["files_sha256"] != first["files_sha256"]
    assert hub("org/name", "a" * 40, config="de") != first

    docs = _Stream(random_docs(30, seed=7, lo=1))
    out = tmp_path / "tok"
    run = lambda description, **kw: pretokenize(  # noqa: E731
        docs,
        CHARS,
        out,
        source_description=description,
        workers=1,
        chunk_docs=7,
        log=lambda *_: None,
        **kw,
    )
    assert run(first, max_chunks=1) is None
    with pytest.raises(UserError, match=r"huggingface org/name has changed since .*dataset's data files or revision"):
        run(hub("org/name", "b" * 40))
    with pytest.raises(UserError, match=r"it is of the source huggingface org/name .*, not huggingface org/other"):
        run(hub("org/other", "a" * 40))
    assert run(first)["num_docs"] == 30


def test_c4_reads_a_local_clones_training_shards(tmp_path, capsys, monkeypatch):
    """--dataset c4 CLONE reads en/c4-train.* only (as training.dataset = "c4" does); bare c4 streams the
    Hub, which offline is one line, and leaves no OUTPUT folder behind."""
    clone = tmp_path / "c4"
    (clone / "en").mkdir(parents=True)
    train = random_docs(12, seed=8, lo=1)
    write_jsonl(clone / "en" / "c4-train.00000-of-01024.json.gz", train, compress=True)
    write_jsonl(clone / "en" / "c4-validation.00000-of-00008.json.gz", random_docs(5, seed=9, lo=1), compress=True)
    write_jsonl(tmp_path / "train.jsonl.gz", train, compress=True)
    args = ["--tokenizer", MODEL, "--workers", "1"]
    assert _run(capsys, "--dataset", "c4", clone, tmp_path / "c4tok", *args) == (0, "")
    assert _run(capsys, tmp_path / "train.jsonl.gz", tmp_path / "ref", *args) == (0, "")
    assert _tokens(tmp_path / "c4tok") == _tokens(tmp_path / "ref")
    assert json.loads((tmp_path / "c4tok" / "meta.json").read_text())["source"]["files"] == 1

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, err = _run(capsys, "c4", tmp_path / "new" / "out", *args)
    assert rc == 2 and err.startswith("error: training.dataset = 'c4' streams allenai/c4 from the Hugging Face Hub")
    assert "HF_HUB_OFFLINE is set" in err and err.count("\n") == 1
    assert not (tmp_path / "new").exists()


def _unwritable_outputs(tmp):
    (tmp / "file").write_text("x")
    cases = [
        (tmp / "file" / "out", f"{tmp / 'file'} is a file, not a folder"),
        (tmp / "file", "it is a file, not a folder"),
    ]
    # Pseudo file systems refuse new folders even to root (the reason given varies by kernel).
    cases += [
        (Path(root) / sub, "")
        for root, sub in (("/proc", "pretokenize-test/out"), ("/sys", "pretokenize-test"))
        if Path(root).is_dir()
    ]
    return cases


def test_an_output_folder_that_cannot_be_created_is_refused_first(tmp_path, capsys):
    """One line naming the folder, the reason and the fix, before the source is opened (here it does not
    exist: its error would come first otherwise). Root writes anywhere permissions allow, so the cases are
    a path below a file, a file, and pseudo file systems."""
    for out, reason in _unwritable_outputs(tmp_path):
        rc, err = _run(capsys, tmp_path / "missing.jsonl", out, "--tokenizer", MODEL)
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: cannot create the output folder {out}: {reason}"), err
        assert "give OUTPUT as a new folder in a place you can write to" in err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_script_reports_a_bad_output_folder_without_a_traceback(tmp_path):
    (tmp_path / "file").write_text("x")
    src = write_jsonl(tmp_path / "d.jsonl", random_docs(5, seed=10, lo=1))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(src), str(tmp_path / "file" / "out"), "--tokenizer", str(MODEL)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        f"error: cannot create the output folder {tmp_path / 'file' / 'out'}: {tmp_path / 'file'} "
        "is a file, not a folder; give OUTPUT as a new folder in a place you can write to (or the "
        "folder of an interrupted run, to finish it)\n"
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_write_error_is_one_line_and_the_rerun_finishes(tmp_path, capsys):
    """A file size limit (EFBIG, as a full disk's ENOSPC) stops the run mid-way with one line; the same
    command then continues after the last complete chunk, to the bytes of a clean run."""
    src = write_jsonl(tmp_path / "d.jsonl", random_docs(300, seed=11, lo=50, hi=120))
    out = tmp_path / "tok"
    args = [src, out, "--tokenizer", MODEL, "--workers", "2", "--chunk-docs", "20"]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # tokens.bin grows past it mid-way
    try:
        rc = script.main([str(a) for a in args])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(
        f"error: could not write the token folder {out}: File too large; free space on it and "
        "run the same command again (it continues after the last complete chunk)"
    ), err
    assert 0 < json.loads((out / "progress.json").read_text())["docs_done"] < 300
    assert _run(capsys, *args) == (0, "")
    assert _run(capsys, src, tmp_path / "clean", *args[2:]) == (0, "")
    assert _files(out) == _files(tmp_path / "clean")
