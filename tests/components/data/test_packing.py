"""Packing (torchtitan/components/data/packing.py): documents framed as [BOS] + text + [EOS],
concatenated into one token stream and cut into consecutive windows of seq_len + 1 tokens, with the
character-level and the real tokenizer; the stream going on across an epoch boundary; tokens carried
before a source position; a source too small for one sequence."""

import logging

import pytest

from conftest import CHARS, MODEL, expected_stream, expected_windows, lane_position, make_loader, take, write_jsonl
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError


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


def test_dataset_smaller_than_one_sequence(tmp_path):
    path = write_jsonl(tmp_path / "small.jsonl", ["abc", "de"])  # 9 tokens < 17
    with pytest.raises(UserError, match="too small.*9 tokens.*17"):
        next(iter(make_loader(path, 16, 1)))
    # Two lanes: each reads its byte range of the file in each of 2 epochs, the other's in the other.
    with pytest.raises(UserError, match="too small: one lane's share of 2 epochs tokenizes to 9 tokens.*17.*2 lanes"):
        next(iter(make_loader(path, 16, 2)))
