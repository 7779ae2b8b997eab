"""Lanes read in worker processes (torchtitan/components/data/workers.py, training.data_workers):
the workers tokenize in other processes and give the same samples and state as the trainer alone,
ignore the scheduler's signals, report a bad document as the trainer does, are refused for a token
folder, and do not collect an abandoned loader they inherit."""

import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path

import pytest

from torchtitan.config.errors import UserError

from helpers.data import (
    CharTokenizer,
    json_round_trip,
    jsonl_pieces,
    lane_position,
    lane_windows,
    make_loader,
    merged,
    random_docs,
    shuffled_steps_from,
    steps_of,
    take,
    write_jsonl,
)


class PidRecordingTokenizer(CharTokenizer):
    """CharTokenizer that appends the id of the process encoding each document to a file."""

    def __init__(self, log):
        self.log = log

    def encode(self, text, bos, eos):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return super().encode(text, bos, eos)


@pytest.mark.slow
@pytest.mark.multiprocess
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


@pytest.mark.slow
@pytest.mark.multiprocess
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


@pytest.mark.slow
@pytest.mark.multiprocess
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
        load_config(
            ["--training.dataset", "tokens", "--training.dataset_path", str(tmp_path), "--training.data_workers", "1"]
        )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_workers_do_not_collect_an_abandoned_loader_they_inherit(tmp_path):
    """A loader dropped without being closed is garbage that the workers of the next one inherit by fork;
    had they collected it, its reader would run its shutdown in their process ("can only test a child
    process", and a shutdown sent to workers that are not theirs). In a fresh interpreter, where the
    collector runs as it would in a script (it printed that error 4 times before the fix)."""
    import subprocess

    path = write_jsonl(tmp_path / "a.jsonl", random_docs(400, seed=1))
    script = f"""
import sys
sys.path[:0] = [{str(Path(__file__).parents[2])!r}]
from helpers.data import make_loader, take
for _ in range(3):
    loader = make_loader({str(path)!r}, 31, 2, data_workers=2)
    it = iter(loader)
    take(it, 5)
    del it, loader
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "can only test a child process" not in proc.stderr
