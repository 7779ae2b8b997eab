"""Mixtures (training.dataset_mix): which source each global sample comes from, the measured shares,
the same samples under every layout and worker count, exact resume under another data-parallel
degree, each source's own epochs, and refusals of bad mixtures.

The corpus is three sources as corpora are published (a parquet folder, a jsonl.zst folder, a token
folder), each written in its own alphabet, so a window's tokens tell which source it came from."""

import json
import random
from fractions import Fraction

import pytest

from torchtitan.components.data import build_dataloader
from torchtitan.components.data.mixing import counts_after, integer_weights, next_source, schedule
from torchtitan.components.data.shuffle import derived_seed
from torchtitan.config import load_config
from torchtitan.config.entries import parse_mix
from torchtitan.config.errors import UserError
from torchtitan.config.training_sections import Training

from helpers.data import CHARS, framed_documents, lane_streams, mixture_corpus

ALPHABETS = ("abcdefgh ", "KLMNOPQR ", "0123456789 ")


def docs_in(alphabet: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(5, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mix")
    return mixture_corpus(folder, [docs_in(a, 40, seed=i) for i, a in enumerate(ALPHABETS)], CHARS)


def source_of(window: list[int]) -> int:
    """The source whose alphabet the window's characters are in."""
    chars = {t for t in window if t > 2}
    found = [i for i, a in enumerate(ALPHABETS) if chars <= {CHARS.encode(c, False, False)[0] for c in a}]
    assert len(found) == 1, f"a window of mixed alphabets: {window}"
    return found[0]


def mix_cfg(corpus, weights=("0.5", "0.3", "0.2"), seq_len=16, local_batch=4, **training) -> Training:
    mix = [f"{w}:{path}" for w, path in zip(weights, corpus)]
    return Training(dataset_mix=mix, seq_len=seq_len, local_batch_size=local_batch, **training)


def windows(loader_or_iter, batches: int) -> list[list[int]]:
    it = iter(loader_or_iter) if hasattr(loader_or_iter, "dataset") else loader_or_iter
    out = []
    for _ in range(batches):
        inputs, labels = next(it)
        out += [row + [last] for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]
    return out


def global_samples(cfg: Training, dp: int, steps: int, global_batch: int) -> list[list[int]]:
    """The samples of `steps` steps in global order, read by dp ranks (each its block of every step)."""
    accum = global_batch // (cfg.local_batch_size * dp)
    its = [iter(build_dataloader(cfg, CHARS, r, dp, global_batch)) for r in range(dp)]
    out = []
    for _ in range(steps):
        for it in its:
            out += windows(it, accum)
    return out


# --- the schedule ----------------------------------------------------------------------------------


def test_schedule_keeps_every_count_within_one_sample_of_its_weight():
    rng = random.Random(0)
    for _ in range(20):
        fractions = [Fraction(rng.randint(0, 9), rng.randint(1, 9)) for _ in range(rng.randint(1, 5))]
        if not sum(fractions):
            continue
        total = sum(fractions)
        weights = integer_weights([f / total for f in fractions])
        counts = [0] * len(weights)
        for k in range(1, 2000):
            counts[next_source(weights, counts)] += 1
            for w, c in zip(weights, counts):
                assert abs(c - Fraction(w, sum(weights)) * k) < 1, (fractions, k, counts)
        assert counts == counts_after(weights, [0] * len(weights), 1999)


def sources_of_samples(weights: list[int], n: int) -> list[int]:
    """The source of global samples 0 .. n-1: the Megatron greedy schedule's first T = sum(weights)
    picks (computed here), block b = k // T of samples reading them rotated by derived_seed(b, 0) % T."""
    counts, period = [0] * len(weights), []
    for _ in range(sum(weights)):
        period.append(next_source(weights, counts))
        counts[period[-1]] += 1
    assert list(schedule(weights)) == period
    T = len(period)
    return [period[(k % T + derived_seed(k // T, 0) % T) % T] for k in range(n)]


def test_windows_follow_the_schedule_each_from_its_own_source(corpus):
    """Global sample k is lane k % G's next sample; it comes from the source the schedule picks for k,
    and is that lane's next window of that source, as the source alone (same G) would give it to the lane."""
    G = 4
    cfg = mix_cfg(corpus)
    got = windows(build_dataloader(cfg, CHARS, 0, 1, G), 30)
    weights = integer_weights([Fraction(5, 10), Fraction(3, 10), Fraction(2, 10)])
    picks = sources_of_samples(weights, len(got))
    # Every block of T = 10 global samples holds each source's exact count, seen in the windows' alphabets.
    for b in range(0, len(got), 10):
        assert [[source_of(w) for w in got[b : b + 10]].count(i) for i in range(3)] == weights, b
    alone = []  # alone[i][p]: lane p's windows of source i read alone
    for i, p in enumerate(corpus):
        single = Training(dataset="tokens" if i == 2 else "local", dataset_path=str(p), seq_len=16, local_batch_size=G)
        read = windows(build_dataloader(single, CHARS, 0, 1, G), 30)
        alone.append([read[lane::G] for lane in range(G)])
    used = [[0] * G for _ in corpus]
    for k, window in enumerate(got):
        i, lane = picks[k], k % G
        assert source_of(window) == i, k
        assert window == alone[i][lane][used[i][lane]], (k, i, lane)
        used[i][lane] += 1
    assert all(used[i][lane] for i in range(3) for lane in range(G))  # every lane read every source here


def test_shares_within_one_point_of_the_weights_after_10k_sequences(corpus):
    # A global batch coprime with the schedule's period (10): every lane reads every source. (With G a
    # multiple of 10 each lane reads one source only, and data_epoch/I, the minimum over the rank's
    # lanes, stays 0 on the lanes that never read source I.)
    cfg = mix_cfg(corpus, seq_len=8, local_batch=101)
    loader = build_dataloader(cfg, CHARS, 0, 1, 101)
    got = windows(loader, 100)
    measured = [sum(source_of(w) == i for w in got) / len(got) for i in range(3)]
    for share, weight in zip(measured, (0.5, 0.3, 0.2)):
        assert abs(share - weight) < 0.01
    metrics = loader.dataset.mixture_metrics(len(got))
    assert [metrics[f"data_share/{i}"] for i in range(3)] == pytest.approx(measured, abs=1e-12)
    # 10k windows of 9 tokens from 40 short documents each: every lane went round its share of every
    # source more than once (the fewest: 13 windows of source 2 over 2 epochs of its share).
    assert all(metrics[f"data_epoch/{i}"] >= 2 for i in range(3))


def test_a_source_that_runs_out_starts_its_next_epoch_in_a_new_order(corpus):
    G = 4
    cfg = mix_cfg(corpus, weights=("0.1", "0.1", "0.8"))  # the token folder is shuffled by default
    loader = build_dataloader(cfg, CHARS, 0, 1, G)
    got = windows(loader, 120)
    metrics = loader.dataset.mixture_metrics(len(got))
    assert metrics["data_epoch/2"] >= 1 and metrics["data_epoch/0"] == 0
    # Each lane's documents of the token folder, in the order it read them. 40 documents in 40 units of
    # one document, 4 lanes: a lane reads 10 documents of each epoch, and the lanes together all 40.
    picks = [source_of(w) for w in got]
    from_tokens = [w if i == 2 else [] for w, i in zip(got, picks)]
    lanes = [framed_documents(stream) for stream in lane_streams(from_tokens, G)]
    docs = docs_in(ALPHABETS[2], 40, seed=2)
    assert all(len(read) > 20 for read in lanes)  # two whole epochs and a document of the third
    epochs = [[read[10 * e : 10 * e + 10] for read in lanes] for e in range(2)]
    for e in range(2):
        assert sorted(d for read in epochs[e] for d in read) == sorted(docs), e  # each document once an epoch
    # Epoch 1 is not epoch 0 again: no lane reads in epoch 1 what any lane read, in that order, in epoch 0.
    assert not {tuple(read) for read in epochs[1]} & {tuple(read) for read in epochs[0]}


# --- layouts, workers, resume ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
def test_same_samples_under_every_layout_and_worker_count(corpus):
    reference = global_samples(mix_cfg(corpus, local_batch=8), 1, 6, 8)
    assert global_samples(mix_cfg(corpus, local_batch=4), 2, 6, 8) == reference
    assert global_samples(mix_cfg(corpus, local_batch=1, data_workers=2), 4, 6, 8) == reference  # accumulation 2


def merged(states: list[dict]) -> dict:
    """One state with every lane, from the states of ranks simulated in one process (each holds its own
    lanes), as a multi-process run's all-gather makes it."""
    out = json.loads(json.dumps(states[0]))
    data = out["dataset_state"]
    lanes = {p: position for state in states for p, position in state["dataset_state"]["lanes"]}
    data["lanes"] = [[p, lanes[p]] for p in sorted(lanes)]
    data["next_sample"] = sum(state["dataset_state"]["next_sample"] for state in states)
    for i, source in enumerate(data["mixture"]):
        layouts = [state["dataset_state"]["mixture"][i]["source_layout"] or {} for state in states]
        sections = {key for layout in layouts for key in layout}
        source["source_layout"] = {
            key: {k: v for layout in layouts for k, v in layout.get(key, {}).items()} for key in sections
        } or None
    return out


def test_resume_under_another_data_parallel_degree(corpus):
    reference = global_samples(mix_cfg(corpus, local_batch=8), 1, 8, 8)
    cfg = mix_cfg(corpus, local_batch=4)
    loaders = [build_dataloader(cfg, CHARS, r, 2, 8) for r in range(2)]
    its = [iter(loader) for loader in loaders]
    for _ in range(3):
        for it in its:
            windows(it, 1)
    states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
    # One process per rank without an all-gather: each rank's state holds its own lanes.
    assert [[p for p, _ in state["dataset_state"]["lanes"]] for state in states] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    state = merged(states)
    assert state["dataset_state"]["next_sample"] == 24  # 3 steps of 8 samples, at a step boundary
    assert [m["source"] for m in state["dataset_state"]["mixture"]] == [str(p) for p in corpus]
    with pytest.raises(UserError, match="holds the positions of lanes 4-7, but this rank reads lanes 0-7"):
        one = build_dataloader(mix_cfg(corpus, local_batch=8), CHARS, 0, 1, 8)
        one.load_state_dict(states[1])
        iter(one)  # a loader applies a loaded state when its next iterator is made
    for dp, local in ((1, 8), (4, 2)):
        resumed = [build_dataloader(mix_cfg(corpus, local_batch=local), CHARS, r, dp, 8) for r in range(dp)]
        for loader in resumed:
            loader.load_state_dict(state)
        its = [iter(loader) for loader in resumed]
        got = []
        for _ in range(5):
            for it in its:
                got += windows(it, 1)
        assert got == reference[24:], f"dp {dp}"


def test_a_state_loads_only_into_the_same_mixture(corpus):
    loader = build_dataloader(mix_cfg(corpus), CHARS, 0, 1, 4)
    windows(loader, 2)
    state = loader.state_dict()
    other = build_dataloader(mix_cfg(corpus, weights=("0.2", "0.3", "0.5")), CHARS, 0, 1, 4)
    with pytest.raises(UserError, match="is for the mixture 1/2:.* but this job reads the mixture 1/5:"):
        other.load_state_dict(state)
        iter(other)  # a loader applies a loaded state when its next iterator is made

    def single():
        cfg = Training(dataset="local", dataset_path=str(corpus[0]), seq_len=16, local_batch_size=4)
        return build_dataloader(cfg, CHARS, 0, 1, 4)

    one = single()
    with pytest.raises(UserError, match="exclude_from_loading"):
        one.load_state_dict(state)
        iter(one)
    with pytest.raises(UserError, match="is for one dataset, but this job reads the mixture"):
        loader.load_state_dict(single().state_dict())
        iter(loader)


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mix, message",
    [
        (["-0.5:a", "1:b"], "'-0.5:a': the weight is negative"),
        (["0:a", "0:b"], "every weight is zero"),
        (["x:a"], "'x:a': the weight 'x' is not a number"),
        (["a"], "'a' is not WEIGHT:SOURCE"),
        (["1:a", "2:a"], "a appears more than once"),
    ],
)
def test_bad_weights_are_refused(mix, message):
    with pytest.raises(UserError, match=message):
        parse_mix(mix, "training.dataset_mix")


def test_mixture_on_the_command_line_and_with_a_dataset_set_too(tmp_path):
    cfg = load_config(["--training.dataset_mix", "0.6:python_stdlib,0.4:c4_test"])
    assert cfg.training.dataset_mix == ["0.6:python_stdlib", "0.4:c4_test"]
    with pytest.raises(UserError, match="training.dataset_mix is set, so training.dataset .* not used"):
        load_config(
            [
                "--training.dataset_mix",
                "1:python_stdlib",
                "--training.dataset",
                "local",
                "--training.dataset_path",
                str(tmp_path),
            ]
        )
    with pytest.raises(UserError, match="the weight is negative"):
        load_config(["--training.dataset_mix", "-1:python_stdlib"])


def test_bad_sources_name_the_entry(corpus, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "data.xlsx").write_bytes(b"PK")
    cases = [
        (str(tmp_path / "missing"), "does not exist"),
        (str(tmp_path / "empty"), "is empty"),
        (str(tmp_path / "odd"), "unsupported types: data.xlsx"),
    ]
    for path, message in cases:
        cfg = Training(dataset_mix=[f"1:{corpus[0]}", f"1:{path}"], seq_len=16, local_batch_size=4)
        with pytest.raises(UserError, match=f"training.dataset_mix source '{path}': .*{message}"):
            build_dataloader(cfg, CHARS, 0, 1, 4)


def test_no_lane_is_tied_to_one_source_when_the_period_divides_the_global_batch(corpus):
    """Weights 0.5/0.3/0.2 repeat every 10 samples; with a global batch of 10, lane p's samples are the
    global samples k = p mod 10. Each block of 10 samples is the pattern rotated by an offset drawn from
    the block, so every lane reads every source, and data_epoch/I counts the epochs of every source."""
    loader = build_dataloader(mix_cfg(corpus, seq_len=8, local_batch=10), CHARS, 0, 1, 10)
    got = windows(loader, 300)
    for lane in range(10):
        assert {source_of(w) for w in got[lane::10]} == {0, 1, 2}, lane
    for step in range(300):  # and every step still holds the weights' counts exactly
        assert sorted(source_of(w) for w in got[10 * step : 10 * step + 10]) == [0] * 5 + [1] * 3 + [2] * 2
    metrics = loader.dataset.mixture_metrics(len(got))
    assert all(metrics[f"data_epoch/{i}"] >= 1 for i in range(3)), metrics


def test_one_source_under_two_spellings_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "link").symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    for other in [f"{folder}/", "shards", "./shards/", str(tmp_path / "link"), f"{folder}/../shards"]:
        with pytest.raises(UserError, match=r"are the same source .*give each source once"):
            parse_mix([f"1:{folder}", f"2:{other}"], "training.dataset_mix")
    with pytest.raises(UserError, match=r"'shards/a.jsonl' is inside 'shards'"):
        parse_mix(["1:shards", "1:shards/a.jsonl"], "training.dataset_mix")
    with pytest.raises(UserError, match="hf:org/data appears more than once"):
        parse_mix(["1:hf:org/data", "1:hf:org/data"], "training.dataset_mix")
    assert parse_mix(["1:shards", "1:hf:org/data"], "training.dataset_mix")[1] == ["shards", "hf:org/data"]


def test_the_start_up_names_each_source_and_its_share(corpus, caplog):
    with caplog.at_level("INFO"):
        build_dataloader(mix_cfg(corpus), CHARS, 0, 1, 4)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert len(lines) == 3
    for line, share in zip(lines, ("50.0%", "30.0%", "20.0%")):
        assert f"({share} of the samples)" in line, lines


def test_each_source_of_a_mixture_may_name_its_text_field(tmp_path):
    """SOURCE#FIELD: a source whose records keep their text under another name is read without
    rewriting it; the others read training.dataset_text_field."""
    plain, other = tmp_path / "plain.jsonl", tmp_path / "other.jsonl"
    plain.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs_in(ALPHABETS[0], 20, seed=1)))
    other.write_text("".join(json.dumps({"content": d, "text": 7}) + "\n" for d in docs_in(ALPHABETS[1], 20, seed=2)))
    cfg = Training(dataset_mix=[f"0.5:{plain}", f"0.5:{other}#content"], seq_len=16, local_batch_size=4)
    assert not cfg.check()
    seen = {source_of(w) for w in windows(build_dataloader(cfg, CHARS, 0, 1, 4), 4)}
    assert seen == {0, 1}  # both sources, each read from its own field
    # Without its field the second source is refused, naming the key that sets the field.
    bare = Training(dataset_mix=[f"0.5:{plain}", f"0.5:{other}"], seq_len=16, local_batch_size=4)
    with pytest.raises(UserError, match="dataset_text_field"):
        windows(build_dataloader(bare, CHARS, 0, 1, 4), 4)
    with pytest.raises(UserError, match=r"write SOURCE#FIELD with a source and the name of its text field"):
        parse_mix([f"1:{other}#"], "training.dataset_mix")
