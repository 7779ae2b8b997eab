"""The document order (torchtitan/components/data/shuffle.py): `Permutation` is a seeded bijection
per epoch, and shuffled samples are the same under every layout, change with each epoch and seed,
resume exactly mid-epoch and across data-parallel degrees, and streams shuffle in blocks."""

import gzip
import json
import logging

import pytest

from torchtitan.components.data.shuffle import Permutation
from torchtitan.config.errors import UserError

from helpers.data import (
    LAYOUTS,
    json_round_trip,
    lane_documents,
    lane_position,
    lane_windows,
    make_loader,
    merged,
    random_docs,
    run_steps,
    shuffled_steps_from,
    steps_of,
    take,
)


def test_permutation_is_a_seeded_bijection_different_per_epoch_and_seed():
    for n in (1, 2, 3, 5, 16, 17, 100, 1000):
        for epoch in range(3):
            order = [Permutation(n, 0, epoch)[i] for i in range(n)]
            assert sorted(order) == list(range(n))
    orders = {
        (seed, epoch): tuple(Permutation(50, seed, epoch)[i] for i in range(50))
        for seed in (0, 1, -3, 2**40)
        for epoch in (0, 1, 2)
    }
    assert len(set(orders.values())) == len(orders)  # all different
    assert orders[(0, 0)] == tuple(Permutation(50, 0, 0)[i] for i in range(50))  # deterministic
    # Pinned: a change of the order would silently change resumed runs.
    assert [Permutation(10, 0, 0)[i] for i in range(10)] == [8, 7, 6, 1, 4, 9, 2, 0, 5, 3]


@pytest.mark.parametrize("dp,lb,gb", LAYOUTS)
def test_shuffled_samples_are_the_same_under_every_layout(shuffled_docs, dp, lb, gb):
    units, path = shuffled_docs
    steps = 12  # 96 windows of 17 tokens: more than two epochs
    reference = lane_windows(units, gb, 16, steps * gb, seed=0)
    for s, ranks in enumerate(run_steps(path, dp, lb, gb, steps, shuffle=True)):
        assert [w for samples in ranks for w in samples] == reference[s * gb : (s + 1) * gb], (s, dp)


def test_each_epoch_has_its_own_order_and_the_seed_sets_it(shuffled_docs, caplog):
    units, path = shuffled_docs
    assert lane_documents(units, 0, 2, 0, seed=0) != lane_documents(units, 0, 2, 2, seed=0)
    loader = make_loader(path, 16, 2, shuffle=True, seed=7)
    with caplog.at_level(logging.WARNING, logger="torchtitan.components.data"):
        got = take(iter(loader), 60)  # 120 windows of 17 tokens; an epoch is ~920 tokens, ~460 per lane
    assert got == lane_windows(units, 2, 16, 120, seed=7) != lane_windows(units, 2, 16, 120, seed=0)
    assert "starts epoch 1 (the data repeats, in a new order)" in caplog.text
    assert lane_position(loader.state_dict(), 0)["epoch"] >= 2


@pytest.mark.parametrize("n", [3, 17, 25])  # mid epoch 0, across the first wrap, in epoch 1
def test_shuffled_resume_is_exact_mid_epoch(shuffled_docs, n):
    units, path = shuffled_docs
    first = make_loader(path, 16, 2, shuffle=True)
    it = iter(first)
    take(it, n)
    state = json_round_trip(first.state_dict())
    assert state["dataset_state"]["shuffle_seed"] == 0
    uninterrupted = take(it, 8)
    resumed = make_loader(path, 16, 2, shuffle=True)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 8) == uninterrupted == lane_windows(units, 2, 16, 2 * n + 16, seed=0)[2 * n :]


def test_shuffled_step_boundary_state_loads_under_other_dp_degrees(shuffled_docs):
    units, path = shuffled_docs
    gb, before, after = 8, 5, 4  # 72 windows: crosses an epoch boundary after the resume
    reference = lane_windows(units, gb, 16, (before + after) * gb, seed=0)
    states = []
    for rank in range(2):
        loader = make_loader(path, 16, 2, 2, rank, gb, shuffle=True)
        it = iter(loader)
        take(it, before * 2)
        states.append(json_round_trip(loader.state_dict()))
    state = merged(states)
    for dp, lb in [(4, 2), (1, 8), (1, 2)]:
        assert shuffled_steps_from(state, path, dp, lb, gb, after) == steps_of(reference, gb, before, after), dp


@pytest.mark.slow
@pytest.mark.multiprocess
def test_shuffled_streams_permute_files_and_blocks_and_resume_exactly(tmp_path):
    files_docs = [random_docs(9 + k, seed=20 + k) for k in range(4)]
    folder = tmp_path / "gz"
    folder.mkdir()
    for k, docs in enumerate(files_docs):
        data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        (folder / f"part-{k}.jsonl.gz").write_bytes(gzip.compress(data))
    expected = lane_windows(files_docs, 2, 15, 60, seed=3, block=7)  # 60 windows of 16: over two epochs
    assert expected != lane_windows(files_docs, 2, 15, 60, seed=4, block=7)
    loader = make_loader(folder, 15, 2, shuffle=True, shuffle_buffer=7, seed=3)
    assert loader.state_dict()["dataset_state"]["shuffle_block"] == 7
    it = iter(loader)
    assert take(it, 30) == expected
    # The same global samples at dp 2 with 2 data workers; a state saved there mid-block continues at dp 1.
    ranks = [
        make_loader(folder, 15, 1, dp_degree=2, dp_rank=r, shuffle=True, shuffle_buffer=7, seed=3, data_workers=2)
        for r in range(2)
    ]
    its = [iter(r) for r in ranks]
    got = []
    for _ in range(11):
        for r_it in its:
            got += take(r_it, 1)
    assert got == expected[:22]
    state = merged([ranks[0].state_dict(), ranks[1].state_dict()])
    resumed = make_loader(folder, 15, 2, shuffle=True, shuffle_buffer=7, seed=3)
    resumed.load_state_dict(state)
    assert take(iter(resumed), 19) == expected[22:60]
    other = make_loader(folder, 15, 2, shuffle=True, shuffle_buffer=8, seed=3)
    other.load_state_dict(state)
    with pytest.raises(UserError, match="shuffled in blocks of 7 documents, but this job would use 8"):
        iter(other)
