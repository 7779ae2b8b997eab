"""Validation ([validation]): the held-out set and how it is split over data-parallel ranks, the
checks before launch, and one validation run against a direct computation (one process; the parallel
layouts are compared in tests/distributed/test_data_parallel_parity.py)."""

import json
import math
from fractions import Fraction

import pytest
import torch

from torchtitan.components import validation
from torchtitan.components.batch import BatchPreparation
from torchtitan.components.data import stdlib_files
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.training_sections import Validation
from torchtitan.models.registry import get_model_spec
from torchtitan.train import main

from helpers.data import CharTokenizer
from helpers.paths import MODEL, RECIPE, REPO


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


DOCS = [f"document {i} " + "xyz" * (i % 7) for i in range(40)]  # 40 docs, about 700 characters


def expected_windows(docs, length):
    stream = [t for d in docs if d for t in CharTokenizer().encode(d, True, True)]
    return [stream[k * length : (k + 1) * length] for k in range(len(stream) // length)]


def read_all(data):
    return [torch.cat([x, y[:, -1:]], dim=1) for x, y in data.batches()]


def local_data(path, seq_len, lb, dp, rank, steps, tok=None):
    source = validation.build_source(Validation(enabled=True, dataset="local", dataset_path=path))
    return validation.ValidationData(source, tok or CharTokenizer(), seq_len, lb, rank, dp, steps)


@pytest.mark.parametrize("cache_tokens", [validation.CACHE_TOKENS, 10])
def test_global_batches_are_split_over_ranks_like_training_batches(tmp_path, monkeypatch, cache_tokens):
    monkeypatch.setattr(validation, "CACHE_TOKENS", cache_tokens)  # 10: too small, every run reads again
    path = write_jsonl(tmp_path / "val.jsonl", DOCS + [""])
    windows = expected_windows(DOCS, 16)
    full = len(windows) // 8  # complete global batches of 8; the rest of the set is left out
    assert full >= 3 and len(windows) % 8
    single = read_all(local_data(path, 15, 8, 1, 0, -1))
    assert [b.tolist() for b in single] == [windows[8 * b : 8 * b + 8] for b in range(full)]
    for dp in (2, 4):
        ranks = [local_data(path, 15, 8 // dp, dp, r, -1) for r in range(dp)]
        for _ in range(2):  # every run starts from the beginning of the set
            got = [torch.cat(parts) for parts in zip(*(read_all(d) for d in ranks))]
            assert [b.tolist() for b in got] == [b.tolist() for b in single]
    limited = local_data(path, 15, 4, 2, 1, 2)
    assert [b.tolist() for b in read_all(limited)] == [windows[8 * b + 4 : 8 * b + 8] for b in range(2)]
    assert len(read_all(limited)) == 2


def test_python_stdlib_test_is_held_out_from_the_training_corpus():
    held_out = validation._stdlib_test_files()
    if not held_out:
        pytest.skip("this interpreter ships no standard-library tests")
    training = set(stdlib_files())
    assert not training & set(held_out)
    root = validation.sources.stdlib_root()
    for path in held_out:
        rel = path.relative_to(root).as_posix()
        assert "/test/" in f"/{rel}" or "/tests/" in f"/{rel}" or rel.startswith("idlelib/idle_test/")
        assert "site-packages" not in rel


def tiny_argv(tmp_path, *extra):
    return [
        *RECIPE,
        "--job.dump_folder",
        str(tmp_path / "out"),
        "--training.seq_len",
        "32",
        "--training.steps",
        "2",
        "--validation.enabled",
        *extra,
    ]


def test_a_mixture_takes_each_window_from_the_source_its_schedule_picks(tmp_path):
    from torchtitan.components.data.files import FilesSource
    from torchtitan.components.data.mixing import integer_weights, next_source
    from torchtitan.components.data.token_folder import pretokenize

    other = [f"other {i} " + "q" * (i % 5) for i in range(30)]
    a = write_jsonl(tmp_path / "a.jsonl", DOCS)
    b_text = tmp_path / "b"
    b_text.mkdir()
    write_jsonl(b_text / "b.jsonl", other)
    pretokenize(
        FilesSource(str(b_text)),
        CharTokenizer(),
        tmp_path / "b_tokens",
        source_description={"description": "b"},
        workers=1,
        log=lambda *_: None,
    )
    cfg = Validation(enabled=True, dataset_mix=[f"0.75:{a}", f"0.25:{tmp_path / 'b_tokens'}"])
    # The two sources' own windows, interleaved by the schedule until it asks one past its end.
    own = [expected_windows(DOCS, 16), expected_windows(other, 16)]
    weights, counts, windows = integer_weights([Fraction(3, 4), Fraction(1, 4)]), [0, 0], []
    while counts[i := next_source(weights, counts)] < len(own[i]):
        windows.append(own[i][counts[i]])
        counts[i] += 1
    full = len(windows) // 8
    assert full >= 2 and counts[1] > 0
    for dp in (1, 2):
        ranks = [
            validation.ValidationData(
                validation.build_source(cfg, None, CharTokenizer()), CharTokenizer(), 15, 8 // dp, r, dp, -1
            )
            for r in range(dp)
        ]
        got = [torch.cat(parts) for parts in zip(*(read_all(d) for d in ranks))]
        assert [b.tolist() for b in got] == [windows[8 * b : 8 * b + 8] for b in range(full)]


def test_a_validation_mixture_with_a_dataset_too_is_refused(tmp_path, capsys):
    argv = tiny_argv(tmp_path, "--validation.dataset_mix", "1:python_stdlib_test", "--validation.dataset", "local")
    assert main(argv) == 2
    assert "validation.dataset_mix is set, so validation.dataset ('local')" in capsys.readouterr().err


@pytest.mark.parametrize(
    "docs, expected",
    [
        (
            ["def f(x):\n    return x\n"],
            "validation set local at {path} is too small: it holds 0 sequence(s) of "
            "validation.seq_len + 1 = 33 tokens, "
            "fewer than one global validation batch of validation.local_batch_size x "
            "data-parallel degree = 8 x 1 = 8 sequences",
        ),
        (["", ""], "validation: dataset local at {path} is empty: it has no non-empty document"),
    ],
)
def test_a_set_smaller_than_one_batch_stops_the_run_before_training(tmp_path, capsys, docs, expected):
    path = write_jsonl(tmp_path / "val.jsonl", docs)
    argv = tiny_argv(tmp_path, "--validation.dataset", "local", "--validation.dataset_path", path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: " + expected.format(path=path) in err
    assert not (tmp_path / "out").exists()  # nothing started


def test_a_missing_validation_path_is_named(tmp_path, capsys):
    argv = tiny_argv(tmp_path, "--validation.dataset", "local", "--validation.dataset_path", str(tmp_path / "no.jsonl"))
    assert main(argv) == 2
    assert f"validation.dataset_path {tmp_path / 'no.jsonl'} does not exist" in capsys.readouterr().err


def build_model(name, flavor, seq_len):
    spec = get_model_spec(name)
    args = spec.args_for_training(flavor, Tokenizer(str(MODEL)).vocab_size, seq_len)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0, buffer_device=torch.device("cpu"))
    return spec, model.train()


def make_validator(spec, model, data, cfg, training_steps=7):
    def loss_fn(inputs, labels, kwargs):  # the trainer's forward_loss of one process
        return spec.loss_sum_fn(model(inputs, **kwargs), labels)

    return validation.Validator(
        cfg, training_steps, data, [model], loss_fn, BatchPreparation(None), lambda sums: sums, torch.device("cpu")
    )


def test_a_run_is_the_mean_loss_over_the_tokens_in_eval_mode(tmp_path):
    spec, model = build_model("llama3", "debugmodel", 64)
    docs = [p.read_text() for p in sorted((REPO / "torchtitan" / "config").glob("*.py"))]
    path = write_jsonl(tmp_path / "val.jsonl", docs)
    cfg = Validation(enabled=True, freq=3, steps=3, local_batch_size=2, seq_len=32)
    # Shorter sequences than training's: the model's positions cover them.
    data = local_data(path, 32, 2, 1, 0, 3, tok=Tokenizer(str(MODEL)))
    validator = make_validator(spec, model, data, cfg)
    assert [s for s in range(1, 8) if validator.due(s)] == [3, 6, 7]
    rng = torch.get_rng_state()
    record = validator.run(6)
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    model.eval()
    with torch.no_grad():
        losses = [spec.loss_sum_fn(model(x), y).item() / y.numel() for x, y in data.batches()]
    assert len(losses) == 3
    assert record["validation_loss"] == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert record["validation_perplexity"] == pytest.approx(math.exp(record["validation_loss"]))
    assert (record["step"], record["validation_batches"], record["validation_tokens"]) == (6, 3, 3 * 2 * 32)


def test_a_run_leaves_the_expert_statistics_alone():
    spec, model = build_model("qwen3", "debugmodel_moe", 32)
    moe = [m for m in model.modules() if hasattr(m, "tokens_per_expert")]
    assert moe
    for m in moe:
        m.tokens_per_expert += torch.arange(m.tokens_per_expert.numel()).float()
        m.expert_bias += 0.5
    before = [(m.tokens_per_expert.clone(), m.expert_bias.clone()) for m in moe]
    source = validation.build_source(Validation(enabled=True, dataset="python_stdlib"))
    data = validation.ValidationData(source, Tokenizer(str(MODEL)), 32, 2, 0, 1, 1)
    record = make_validator(spec, model, data, Validation(enabled=True, steps=1)).run(1)
    assert math.isfinite(record["validation_loss"])
    for m, (counts, bias) in zip(moe, before):
        assert torch.equal(m.tokens_per_expert, counts) and torch.equal(m.expert_bias, bias)
