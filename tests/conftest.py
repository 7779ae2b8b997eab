"""The tests' pytest fixtures, each a thin function over the shared helpers of tests/helpers/ (paths, launches,
tiny models, checkpoint runs, data, Hugging Face folders, tokenizer files), which the tests import directly:
`from helpers.launch import launch, losses`."""

from pathlib import Path

import pytest

from helpers.checkpoints import checkpoint_run
from helpers.data import sharded_docs
from helpers.launch import drop_closed_log_handlers
from helpers.tokenizer_files import write_hf_folder, write_tiktoken_file


@pytest.fixture(autouse=True)
def _no_log_handler_on_a_closed_stream():
    """An in-process run's setup_logging binds the root logger to the sys.stderr of its test, which pytest
    closes after that test; a later in-process run would log into it ("I/O operation on closed file")."""
    drop_closed_log_handlers()
    yield


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """A 6-step run that saved step-3 and step-6 (tests/helpers/checkpoints.py); run once per session: the
    checkpoint tests resume from, or damage, copies of its checkpoints."""
    folder = tmp_path_factory.mktemp("straight")
    return folder, checkpoint_run(folder)


@pytest.fixture
def docs_path(tmp_path):
    """A folder of 10 JSON lines shards of 6 documents: 10 units, one per shard."""
    return sharded_docs(tmp_path / "docs", 10, 6, seed=0, name="shard-{i:02d}.jsonl")


@pytest.fixture
def shuffled_docs(tmp_path):
    """A folder of 10 JSON lines shards of 4 documents: 10 units."""
    return sharded_docs(tmp_path / "docs", 10, 4, seed=9, name="part-{i}.jsonl")


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory) -> Path:
    """A Llama-3-like Hugging Face tokenizer folder (tests/helpers/tokenizer_files.py)."""
    return write_hf_folder(tmp_path_factory.mktemp("llama3_like"))


@pytest.fixture(scope="session")
def tiktoken_file(hf_folder, tmp_path_factory) -> Path:
    """A tiktoken ranks file of the same BPE as `hf_folder`."""
    return write_tiktoken_file(hf_folder, tmp_path_factory.mktemp("tiktoken") / "tokenizer.model")
