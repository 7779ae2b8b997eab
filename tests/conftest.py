"""The tests' pytest fixtures, each a thin function over the shared helpers of tests/helpers/ (paths, launches,
tiny models, checkpoint runs, data, Hugging Face folders, tokenizer files), which the tests import directly:
`from helpers.launch import launch, losses`. The markers, and the check that each test carries the markers
of what it does, are in tests/helpers/markers.py."""

from pathlib import Path

import pytest

from helpers.checkpoints import checkpoint_run
from helpers.data import sharded_docs
from helpers.launch import drop_closed_log_handlers
from helpers.markers import MARKERS, checked, fixture_watched
from helpers.tokenizer_files import write_hf_folder, write_tiktoken_file


def pytest_addoption(parser):
    parser.addoption(
        "--network", action="store_true", help="also run the tests marked network (they reach the internet)"
    )


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--network"):
        return
    skip = pytest.mark.skip(reason="reaches the internet: run with --network")
    for item in items:
        if "network" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    with fixture_watched(fixturedef):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with checked(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with checked(item):
        return (yield)


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
