"""Each rank's resumable loader (torchtitan/components/data/loader.py): its state is plain and small,
a resume continues exactly (deep into a folder, after a wrap, mid-step), a step-boundary state loads
under other data-parallel degrees, and states of another layout, seq_len, order or version are
refused."""

import json

import pytest

from torchtitan.components.data import stdlib_files
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError

from helpers.data import (
    document_units,
    json_round_trip,
    lane_position,
    lane_windows,
    make_loader,
    merged,
    random_docs,
    take,
    write_jsonl,
)
from helpers.paths import MODEL


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
    assert [[p, pos["next_sample"]] for p, (pos,) in state["dataset_state"]["lanes"]] == [
        [4, 2],
        [5, 2],
        [6, 1],
        [7, 1],
    ]
    assert state["dataset_state"]["shuffle_seed"] == 0  # shuffled by default, with training.seed
    uninterrupted = take(it, 3)
    resumed = make_loader(None, 32, 2, 2, 1, 8, tok=tok, dataset="python_stdlib", shuffle=None)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 3) == uninterrupted
    windows = lane_windows(
        document_units(stdlib_files(), 8),
        8,
        32,
        40,
        tok,
        seed=0,
        random_access=True,
        text=lambda f: f.read_text(encoding="utf-8", errors="replace"),
    )
    assert uninterrupted == windows[14:16] + windows[20:24]


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


def test_a_state_of_another_order_or_an_earlier_version_is_refused(shuffled_docs):
    _, path = shuffled_docs
    loader = make_loader(path, 16, 2, shuffle=True, seed=3)
    take(iter(loader), 2)
    state = json_round_trip(loader.state_dict())
    for kwargs, fix in [
        ({"shuffle": True, "seed": 4}, "training.seed = 3"),
        ({"shuffle": False}, "training.seed = 3 and training.shuffle_documents = true"),
    ]:
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
    old = {
        "version": 3,
        "seq_len": 16,
        "global_batch_size": 2,
        "next_sample": 6,
        "dataset": "local",
        "dataset_path": str(path),
        "shuffle_seed": None,
        "num_documents": None,
        "shuffle_block": None,
        "epoch": 0,
        "doc_index": 2,
        "token_offset": 5,
        "carry": [],
    }
    resumed = make_loader(path, 16, 2)
    resumed.load_state_dict({**stored, "dataset_state": old})
    with pytest.raises(UserError, match="version 3, from before each rank read only its share.*exclude_from_loading"):
        next(iter(resumed))
