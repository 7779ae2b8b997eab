"""Pre-tokenized corpora (scripts/pretokenize.py, training.dataset = "tokens"): the same samples as the
text pipeline, resumable state across layouts, bad-input messages, interrupted pretokenize."""

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from torchtitan.components.data import build_dataloader
from torchtitan.components.token_file import pretokenize
from torchtitan.config.errors import UserError
from torchtitan.config.job_config import Training

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "assets" / "tokenizer" / "python_stdlib_4k.model"
SCRIPT = ROOT / "scripts" / "pretokenize.py"


class CharTokenizer:
    """One token per character; BOS = 1, EOS = 2 (picklable: module level)."""

    bos_id, eos_id = 1, 2

    def __init__(self, vocab_size=1000):
        self.vocab_size = vocab_size

    def encode(self, text, bos, eos):
        return [1] * bos + [3 + ord(c) % 997 for c in text] + [2] * eos


CHARS = CharTokenizer()


def random_docs(n, seed=0, lo=0, hi=40):
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij KLMNOP\n") for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def write_jsonl(path, docs, compress=False):
    data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def tokenize(src, out, tok=CHARS, workers=2, **kwargs):
    from torchtitan.components.data.formats import FilesSource as _FilesSource

    return pretokenize(_FilesSource(str(src)), tok, out, source_description={"description": str(src)},
                       workers=workers, chunk_docs=kwargs.pop("chunk_docs", 7), batch_docs=3, log=lambda *_: None,
                       **kwargs)


def loader(dataset, path, seq_len, dp_degree=1, dp_rank=0, local_batch=2, tok=CHARS, shuffle=True, seed=0):
    cfg = Training(dataset=dataset, dataset_path=str(path), seq_len=seq_len, local_batch_size=local_batch,
                   shuffle_documents=shuffle, seed=seed)
    return build_dataloader(cfg, tok, dp_rank, dp_degree, local_batch * dp_degree)


def windows(batch):
    inputs, labels = batch
    return [row + [last] for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 documents (some empty) and their token folder: ~1,200 tokens, so 40 steps of dp x 2 windows of
    17 tokens cover several epochs."""
    folder = tmp_path_factory.mktemp("corpus")
    src = write_jsonl(folder / "docs.jsonl", random_docs(60, seed=1))
    meta = tokenize(src, folder / "tokens")
    assert meta["num_docs"] == 60 and meta["dtype"] == "uint16"
    return src, folder / "tokens"


# --- the same samples as the text pipeline ---------------------------------------------------------


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [True, None])
def test_same_samples_as_the_text_pipeline(corpus, dp, shuffle):
    src, tokens = corpus
    steps = 40  # 40 * dp * 2 * 17 tokens: several passes over the ~1,200-token corpus
    for rank in range(dp):
        text = iter(loader("local", src, 16, dp, rank, shuffle=shuffle))
        tok = iter(loader("tokens", tokens, 16, dp, rank, shuffle=shuffle))
        for step in range(steps):
            a, b = next(text), next(tok)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (rank, step)


def test_a_corpus_smaller_than_a_step_wraps_as_in_the_text_pipeline(tmp_path):
    """Rank 3 of 4 skips past the end of the first epoch (by document lengths) before its first window."""
    src = write_jsonl(tmp_path / "d.jsonl", ["abcdefghij", "", "KLMNOP klm", "abc"])  # 31 tokens
    tokenize(src, tmp_path / "tok")
    for rank in range(4):
        a = iter(loader("local", src, 8, 4, rank))
        b = iter(loader("tokens", tmp_path / "tok", 8, 4, rank))
        for _ in range(6):
            assert all(torch.equal(x, y) for x, y in zip(next(a), next(b)))
    src = write_jsonl(tmp_path / "small.jsonl", ["abc", "de"])  # 9 tokens: not one window of 17
    tokenize(src, tmp_path / "small")
    with pytest.raises(UserError, match="too small: all of it tokenizes to 9 tokens"):
        next(iter(loader("tokens", tmp_path / "small", 16, 4, 3)))


def test_stored_order_by_default_for_a_streamed_source(tmp_path):
    """A compressed JSON lines source is read in stored order by the text pipeline: its token folder too."""
    docs = random_docs(30, seed=2)
    src = write_jsonl(tmp_path / "d.jsonl.gz", docs, compress=True)
    meta = tokenize(src, tmp_path / "tok")
    assert meta["source_random_access"] is False
    a = iter(loader("local", src, 8, shuffle=None))
    b = iter(loader("tokens", tmp_path / "tok", 8, shuffle=None))
    for _ in range(30):
        assert all(torch.equal(x, y) for x, y in zip(next(a), next(b)))


def test_same_samples_with_the_real_tokenizer(tmp_path):
    from torchtitan.components.tokenizer import Tokenizer

    tok = Tokenizer(MODEL)
    src = write_jsonl(tmp_path / "d.jsonl", ["import os\n", "", "def f(x):\n    return x + 1\n"] * 20)
    tokenize(src, tmp_path / "tok", tok=tok, tokenizer_spec=str(MODEL))
    for rank in range(2):
        a = iter(loader("local", src, 32, 2, rank, tok=tok))
        b = iter(loader("tokens", tmp_path / "tok", 32, 2, rank, tok=tok))
        for _ in range(10):
            assert all(torch.equal(x, y) for x, y in zip(next(a), next(b)))


# --- resumable state ---------------------------------------------------------------------------------


def test_resume_under_another_data_parallel_degree(corpus):
    """A state saved by dp 2 continues under dp 4: every global sample once, equal to the text pipeline's."""
    src, tokens = corpus
    reference = iter(loader("local", src, 16, 1, 0, local_batch=8))  # global batch 8, one rank
    expected = [w for _ in range(12) for w in windows(next(reference))]

    dp2 = [loader("tokens", tokens, 16, 2, r, local_batch=4) for r in range(2)]
    iters = [iter(d) for d in dp2]
    got = []
    for _ in range(5):  # 5 steps of 8 global samples
        for it in iters:
            got += windows(next(it))
    states = [d.state_dict() for d in dp2]
    assert states[0] == states[1]  # layout-independent at step boundaries
    dp4 = [loader("tokens", tokens, 16, 4, r, local_batch=2) for r in range(4)]
    for d in dp4:
        d.load_state_dict(states[0])
    iters = [iter(d) for d in dp4]
    for _ in range(7):
        for it in iters:
            got += windows(next(it))
    assert got == expected


def test_state_matches_the_text_pipeline(corpus):
    src, tokens = corpus
    a, b = loader("local", src, 16, 2, 1), loader("tokens", tokens, 16, 2, 1)
    ia, ib = iter(a), iter(b)
    for _ in range(9):
        next(ia), next(ib)
    sa, sb = a.state_dict()["dataset_state"], b.state_dict()["dataset_state"]
    strip = lambda s: {k: v for k, v in s.items() if k not in ("dataset", "dataset_path")}  # noqa: E731
    assert strip(json.loads(json.dumps(sa))) == strip(json.loads(json.dumps(sb)))


# --- bad input ----------------------------------------------------------------------------------------


def _copy(tokens, dest):
    dest.mkdir()
    for name in ("tokens.bin", "docs.idx", "meta.json"):
        (dest / name).write_bytes((tokens / name).read_bytes())
    return dest


def test_missing_meta_is_incomplete(corpus, tmp_path):
    bad = _copy(corpus[1], tmp_path / "t")
    (bad / "meta.json").unlink()
    with pytest.raises(UserError, match=r"incomplete.*run pretokenize again"):
        loader("tokens", bad, 16)


def test_truncated_token_file(corpus, tmp_path):
    bad = _copy(corpus[1], tmp_path / "t")
    with open(bad / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(UserError, match=r"tokens\.bin is 100 bytes.*truncated.*pretokenize"):
        loader("tokens", bad, 16)


def test_ids_beyond_the_vocabulary(corpus, tmp_path):
    # Recorded at write time: refused at open (before launch), naming the file.
    small = CharTokenizer(vocab_size=50)
    bad = _copy(corpus[1], tmp_path / "t")
    meta = json.loads((bad / "meta.json").read_text())
    meta["tokenizer"]["vocab_size"] = meta["vocab_size"] = 50
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"tokens\.bin holds token id \d+, not below the vocabulary size 50"):
        loader("tokens", bad, 16, tok=small)
    # Changed after it was written (max_id no longer true): caught in the window read.
    bad2 = _copy(corpus[1], tmp_path / "t2")
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
    bad = _copy(corpus[1], tmp_path / "t")
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
        loader("tokens", corpus[1], 16, tok=Other())


def test_large_vocabulary_is_written_as_uint32(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", random_docs(10, seed=3, lo=5))
    big = CharTokenizer(vocab_size=100_000)
    meta = tokenize(src, tmp_path / "tok", tok=big)
    assert meta["dtype"] == "uint32"
    a = iter(loader("local", src, 8, tok=big))
    b = iter(loader("tokens", tmp_path / "tok", 8, tok=big))
    for _ in range(10):
        assert all(torch.equal(x, y) for x, y in zip(next(a), next(b)))


# --- interrupted pretokenize --------------------------------------------------------------------------


def _files(folder):
    return {n: (folder / n).read_bytes() for n in ("tokens.bin", "docs.idx", "meta.json")}


def test_stopped_pretokenize_resumes_to_the_same_output(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", random_docs(50, seed=4))
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


def test_killed_pretokenize_script_resumes_to_the_same_output(tmp_path):
    """SIGKILL the real script mid-way: no meta.json; the same command finishes it, identical to a clean run."""
    sys.path.insert(0, str(SCRIPT.parent))
    import pretokenize as script

    src = write_jsonl(tmp_path / "d.jsonl", random_docs(6000, seed=5, lo=100, hi=400))
    out = tmp_path / "killed"
    cmd = [sys.executable, str(SCRIPT), str(src), str(out), "--tokenizer", str(MODEL), "--workers", "2",
           "--chunk-docs", "100"]
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
