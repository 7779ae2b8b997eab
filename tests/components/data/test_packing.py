"""Packing (torchtitan/components/data/packing.py): documents framed as [BOS] + text + [EOS],
concatenated into one token stream and cut into consecutive windows of seq_len + 1 tokens, with the
character-level and the real tokenizer; the stream going on across an epoch boundary; tokens carried
before a source position; a source too small for one sequence, refused as rank 0's loader is built (and so
by run_train.sh's preflight, tests/test_run_train.py), each source of a mixture and of a validation mixture
by its entry, reading only as much of a large source as one sequence."""

import logging

import pytest

from torchtitan.components.data import build_dataloader
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError
from torchtitan.config.training_sections import Training

from helpers.data import CHARS, expected_stream, expected_windows, lane_position, make_loader, take, write_jsonl
from helpers.paths import MODEL


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
    # Data-parallel rank 0 (and run_train.sh's preflight, which builds its loader) refuses it as the loader
    # is built, for any number of lanes: each lane would read all of it.
    for lanes in (1, 2):
        with pytest.raises(
            UserError,
            match=r"dataset local at \S*small.jsonl is too small: its documents "
            r"tokenize to 9 tokens in all, fewer than one sequence of "
            r"training.seq_len \+ 1 = 17",
        ):
            make_loader(path, 16, lanes)
    # Another rank does not read for it at start; its lane finds it once it has read its share of 2 epochs
    # (both byte ranges of the file): all of it.
    loader = make_loader(path, 16, 1, dp_degree=2, dp_rank=1)
    with pytest.raises(UserError, match="too small: one lane's share of 2 epochs tokenizes to 9 tokens.*17.*2 lanes"):
        next(iter(loader))


def test_each_source_of_a_mixture_must_fill_a_sequence_and_is_named(tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", [f"document {i} " + "abc" * 10 for i in range(200)])
    small = write_jsonl(tmp_path / "small.jsonl", ["abc", "de"])  # 9 tokens < 17
    # With weights 9:1 the first samples all come from big.jsonl: without the check rank 0 would read
    # several steps before a lane first reached small.jsonl and found it too small.
    cfg = Training(dataset_mix=[f"0.9:{big}", f"0.1:{small}"], seq_len=16, local_batch_size=4)
    with pytest.raises(
        UserError,
        match=rf"^training.dataset_mix source '{small}' is too small: its documents "
        r"tokenize to 9 tokens in all.*; add data to it, remove it from "
        r"training.dataset_mix, or lower training.seq_len$",
    ):
        build_dataloader(cfg, CHARS, 0, 1, 4)
    enough = write_jsonl(tmp_path / "enough.jsonl", ["abcdefgh", "ijklmn"])  # 18 tokens: one sequence
    cfg = Training(dataset_mix=[f"0.9:{big}", f"0.1:{enough}"], seq_len=16, local_batch_size=4)
    assert len(take(iter(build_dataloader(cfg, CHARS, 0, 1, 4)), 1)) == 4


def test_the_start_up_check_reads_one_sequence_of_a_large_source_and_counts_a_token_folder(tmp_path, monkeypatch):
    from torchtitan.components.data.files import FilesSource
    from torchtitan.components.data.token_folder import TokenFile, pretokenize

    # Stored order, a few documents: a line that is not JSON far into the file is not reached at start.
    path = write_jsonl(tmp_path / "large.jsonl", [f"document {i} " + "xyz" * 20 for i in range(3000)])
    with path.open("a") as f:
        f.write("not json\n")
    for rank in (0, 1):
        make_loader(path, 64, 2, dp_degree=2, dp_rank=rank, shuffle=None)
    # A token folder's count is in its meta.json: no document is read to refuse it.
    (tmp_path / "small").mkdir()
    src = write_jsonl(tmp_path / "small" / "small.jsonl", ["abc", "de"])
    pretokenize(
        FilesSource(str(src.parent)),
        CHARS,
        tmp_path / "tokens",
        source_description={"description": "small"},
        workers=1,
        log=lambda *_: None,
    )

    def unread(self, start):
        raise AssertionError("a document of the token folder was read")

    monkeypatch.setattr(TokenFile, "documents", unread)
    with pytest.raises(
        UserError,
        match=r"dataset tokens at \S*tokens is too small: its documents tokenize to 9 "
        r"tokens in all, fewer than one sequence of training.seq_len \+ 1 = 17",
    ):
        build_dataloader(
            Training(dataset="tokens", dataset_path=str(tmp_path / "tokens"), seq_len=16, local_batch_size=2),
            CHARS,
            0,
            1,
            2,
        )


def test_a_validation_mixture_source_without_one_sequence_is_refused_by_its_entry(tmp_path):
    from torchtitan.components import validation
    from torchtitan.config.training_sections import Validation

    big = write_jsonl(tmp_path / "big.jsonl", [f"document {i} " + "abc" * 10 for i in range(200)])
    small = write_jsonl(tmp_path / "small.jsonl", ["abc", "de"])
    # The set ends where the schedule first asks a source past its end: at small.jsonl's first turn, after
    # 9 windows of big.jsonl, enough for the batch of 2, so small.jsonl would never be measured.
    cfg = Validation(enabled=True, dataset_mix=[f"0.9:{big}", f"0.1:{small}"], local_batch_size=2, seq_len=16)
    with pytest.raises(
        UserError,
        match=rf"^validation.dataset_mix source '{small}' is too small: its documents "
        r"tokenize to fewer than one sequence of validation.seq_len \+ 1 = 17 tokens",
    ):
        validation.preflight_validation(cfg, Training(), CHARS, 1)
    enough = write_jsonl(tmp_path / "enough.jsonl", ["abcdefgh", "ijklmn"])  # 18 tokens: one sequence
    cfg = Validation(enabled=True, dataset_mix=[f"0.9:{big}", f"0.1:{enough}"], local_batch_size=2, seq_len=16)
    validation.preflight_validation(cfg, Training(), CHARS, 1)
