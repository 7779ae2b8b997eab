"""Mixtures (training.dataset_mix): which source each global sample comes from, the measured shares,
the same samples under every layout and worker count, exact resume under another data-parallel
degree, each source's own epochs, and refusals of bad mixtures.

The corpus is three sources as corpora are published (a parquet folder, a jsonl.zst folder, a token
folder), each written in its own alphabet, so a window's tokens tell which source it came from."""

import json
import random
from fractions import Fraction

import pytest

from conftest import CharTokenizer, mixture_corpus
from torchtitan.components.data import build_dataloader
from torchtitan.components.data.mixing import counts_after, integer_weights, next_source
from torchtitan.config import load_config
from torchtitan.config.errors import UserError
from torchtitan.config.job_config import Training, parse_mix

CHARS = CharTokenizer()
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


def test_windows_follow_the_schedule_each_from_its_own_source(corpus):
    """Sample k is the next window of the source the schedule picks, as that source alone would give it."""
    cfg = mix_cfg(corpus)
    got = windows(build_dataloader(cfg, CHARS, 0, 1, 4), 30)
    weights = integer_weights([Fraction(5, 10), Fraction(3, 10), Fraction(2, 10)])
    counts = [0, 0, 0]
    alone = [iter(build_dataloader(Training(dataset="tokens" if i == 2 else "local", dataset_path=str(p), seq_len=16,
                                            local_batch_size=1), CHARS, 0, 1, 1)) for i, p in enumerate(corpus)]
    for window in got:
        i = next_source(weights, counts)
        counts[i] += 1
        assert source_of(window) == i
        assert window == windows(alone[i], 1)[0]


def test_shares_within_one_point_of_the_weights_after_10k_sequences(corpus):
    cfg = mix_cfg(corpus, seq_len=8, local_batch=100)
    loader = build_dataloader(cfg, CHARS, 0, 1, 100)
    got = windows(loader, 100)
    measured = [sum(source_of(w) == i for w in got) / len(got) for i in range(3)]
    for share, weight in zip(measured, (0.5, 0.3, 0.2)):
        assert abs(share - weight) < 0.01
    metrics = loader.dataset.mixture_metrics(len(got))
    assert [metrics[f"data_share/{i}"] for i in range(3)] == pytest.approx(measured, abs=1e-12)
    # 10k windows of 9 tokens from 40 short documents each: every source went round several times.
    assert all(metrics[f"data_epoch/{i}"] >= 3 for i in range(3))


def test_a_source_that_runs_out_starts_its_next_epoch_in_a_new_order(corpus):
    cfg = mix_cfg(corpus, weights=("0.1", "0.1", "0.8"))  # the token folder is shuffled by default
    loader = build_dataloader(cfg, CHARS, 0, 1, 4)
    from_tokens = [w for w in windows(loader, 120) if source_of(w) == 2]
    metrics = loader.dataset.mixture_metrics(480)
    assert metrics["data_epoch/2"] >= 1 and metrics["data_epoch/0"] == 0
    per_epoch = sum(len(d) + 2 for d in docs_in(ALPHABETS[2], 40, seed=2)) // 17
    first, second = from_tokens[:per_epoch - 1], from_tokens[per_epoch + 1:2 * per_epoch - 1]
    assert first != second  # epoch 1 is not epoch 0 again


# --- layouts, workers, resume ----------------------------------------------------------------------


def test_same_samples_under_every_layout_and_worker_count(corpus):
    reference = global_samples(mix_cfg(corpus, local_batch=8), 1, 6, 8)
    assert global_samples(mix_cfg(corpus, local_batch=4), 2, 6, 8) == reference
    assert global_samples(mix_cfg(corpus, local_batch=1, data_workers=2), 4, 6, 8) == reference  # accumulation 2


def test_resume_under_another_data_parallel_degree(corpus):
    reference = global_samples(mix_cfg(corpus, local_batch=8), 1, 8, 8)
    cfg = mix_cfg(corpus, local_batch=4)
    loaders = [build_dataloader(cfg, CHARS, r, 2, 8) for r in range(2)]
    its = [iter(loader) for loader in loaders]
    for _ in range(3):
        for it in its:
            windows(it, 1)
    states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
    assert states[0] == states[1]  # at a step boundary every rank holds the same state
    assert [m["source"] for m in states[0]["dataset_state"]["mixture"]] == [str(p) for p in corpus]
    for dp, local in ((1, 8), (4, 2)):
        resumed = [build_dataloader(mix_cfg(corpus, local_batch=local), CHARS, r, dp, 8) for r in range(dp)]
        for loader in resumed:
            loader.load_state_dict(states[0])
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


@pytest.mark.parametrize("mix, message", [
    (["-0.5:a", "1:b"], "'-0.5:a': the weight is negative"),
    (["0:a", "0:b"], "every weight is zero"),
    (["x:a"], "'x:a': the weight 'x' is not a number"),
    (["a"], "'a' is not WEIGHT:SOURCE"),
    (["1:a", "2:a"], "a appears more than once"),
])
def test_bad_weights_are_refused(mix, message):
    with pytest.raises(UserError, match=message):
        parse_mix(mix, "training.dataset_mix")


def test_mixture_on_the_command_line_and_with_a_dataset_set_too(tmp_path):
    cfg = load_config(["--training.dataset_mix", "0.6:python_stdlib,0.4:c4_test"])
    assert cfg.training.dataset_mix == ["0.6:python_stdlib", "0.4:c4_test"]
    with pytest.raises(UserError, match="training.dataset_mix is set, so training.dataset .* not used"):
        load_config(["--training.dataset_mix", "1:python_stdlib", "--training.dataset", "local",
                     "--training.dataset_path", str(tmp_path)])
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
