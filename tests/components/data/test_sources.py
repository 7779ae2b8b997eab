"""Sources of documents by name (torchtitan/components/data/sources.py): the embedded python_stdlib
corpus, Hugging Face datasets streamed through `datasets` (faked, or real on local files), the
reference schema's c4 and c4_test, and empty sources."""

import json
import sys
import sysconfig
import types
from pathlib import Path

import pytest

from torchtitan.components.data import build_dataloader, sources as data_sources, stdlib_files
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError
from torchtitan.config.training_sections import Training

from helpers.data import (
    CHARS,
    document_units,
    expected_windows,
    json_round_trip,
    jsonl_pieces,
    lane_documents,
    lane_position,
    lane_windows,
    make_loader,
    random_docs,
    take,
    write_gz,
    write_jsonl,
    write_parquet,
)
from helpers.paths import MODEL


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
    assert (
        inputs[0].tolist() == tok.encode(first.read_text(encoding="utf-8", errors="replace"), bos=True, eos=False)[:16]
    )
    # shuffle_documents = false: stored (sorted path) order.
    inputs, _ = next(
        iter(build_dataloader(Training(seq_len=16, local_batch_size=2, shuffle_documents=False), tok, 0, 1, 2))
    )
    assert (
        inputs[0].tolist()
        == tok.encode(files[0].read_text(encoding="utf-8", errors="replace"), bos=True, eos=False)[:16]
    )


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


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.hf
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
        write_jsonl(folder / f"part-{k}.jsonl", docs[k * 30 : (k + 1) * 30])
    # Two lanes: a unit per shard of the stream, lane 0 reading shards 0, 2, 4, 6 in epoch 0.
    loader = make_loader(folder, 31, 2, dataset="huggingface", data_workers=data_workers)
    it = iter(loader)
    reference = take(it, 75)  # 150 windows of 32 tokens, 75 per lane: into each lane's fourth shard
    lanes = [[d for k in range(p, 8, 2) for d in docs[k * 30 : (k + 1) * 30]] for p in range(2)]
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
    with pytest.raises(
        UserError, match=r"huggingface dataset .*: reading up to document \d+ failed \(ArrowInvalid: JSON parse"
    ):
        take(iter(again), 3)


# --- empty sources -------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["", "\n\n", '{"text": ""}\n{"text": ""}\n'])
def test_empty_jsonl(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match="is empty"):
        make_loader(path, 8, 2)


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
    (folder / "data.json").write_text(
        "".join(
            json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.com/{i}"}) + "\n"
            for i, d in enumerate(docs)
        )
    )
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
    with pytest.raises(
        UserError, match="cannot be reached: HF_HUB_OFFLINE is set; offline alternatives: .*python_stdlib"
    ):
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
    with pytest.raises(
        UserError,
        match=r"reads the reference torchtitan's C4 sample from tests/assets/c4_test .*"
        r"copy tests/assets/c4_test from a checkout",
    ):
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
