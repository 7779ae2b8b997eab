"""The training loop in this process: a few steps of the debug model on one process."""

import json
import math
import os

import pytest
import torch

from torchtitan.config import load_config
from torchtitan.train import train

from helpers.paths import REPO


def short_config(folder, *overrides):
    """The debug model's config for a 4-step run of 2 windows of 32 tokens a step, dumping to `folder`."""
    return load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs" / "debug_model.toml"),
            "--model.tokenizer_path",
            str(REPO / "assets" / "tokenizer" / "python_stdlib_4k.model"),
            "--job.dump_folder",
            str(folder),
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "4",
            "--lr_scheduler.warmup_steps",
            "2",
            "--metrics.log_freq",
            "2",
            "--metrics.device_peak_tflops",
            "1",
            *overrides,
        ]
    )


def short_run(tmp_path, *overrides):
    return train(short_config(tmp_path, *overrides))


def test_logs_first_every_log_freq_and_last_step(tmp_path, caplog):
    caplog.set_level("INFO")
    history = short_run(tmp_path, "--training.steps", "5")
    # The last line says what the run left: no checkpoint (the recipe's default), and how to keep one.
    assert (
        f"left in {tmp_path}: config.toml, metrics.jsonl, tb/ (TensorBoard); no checkpoint: checkpointing is off"
        in caplog.text
    )
    assert [r["step"] for r in history] == [1, 2, 4, 5]
    on_disk = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == history
    assert (tmp_path / "config.toml").exists()
    first = history[0]
    assert first["loss"] == pytest.approx(8.7, abs=0.5)  # about ln(4096) at init
    assert first["lr"] == pytest.approx(2e-3 / 2)  # first warmup step of lr 2e-3
    assert first["tokens"] == 2 * 32
    assert first["mfu"] == pytest.approx(100 * first["tflops"] / 1.0)


def test_a_resumed_run_logs_its_first_step_and_counts_its_own_steps(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO)
    ckpt = [
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "3",
        "--metrics.log_freq",
        "10",
        "--lr_scheduler.warmup_steps",
        "3",
    ]
    short_run(tmp_path, "--training.steps", "3", *ckpt)
    # A warmup as long as the run: the learning rate never decays, and the start-up says so.
    assert "lr_scheduler.warmup_steps (3) is not below training.steps (3)" in caplog.text
    assert "training done: 3 steps in" in caplog.text
    # The last line says what the run left, its last checkpoint included.
    assert (
        f"left in {tmp_path}: config.toml, metrics.jsonl, tb/ (TensorBoard); "
        f"checkpoint {tmp_path / 'checkpoint' / 'step-3'}" in caplog.text
    )
    caplog.clear()
    history = short_run(tmp_path, "--training.steps", "6", *ckpt)
    assert "resumed from" in caplog.text and "warmup_steps" not in caplog.text
    assert [r["step"] for r in history] == [4, 6]  # the first step of this launch, then the last
    assert "training done: 3 steps (steps 4-6, resumed from step 3) in" in caplog.text


@pytest.fixture
def restore_determinism():
    yield
    torch.use_deterministic_algorithms(False)


def test_seeded_runs_repeat_exactly_and_seeds_differ(tmp_path, restore_determinism):
    a = short_run(tmp_path / "a", "--training.mixed_precision_param", "float32", "--training.deterministic")
    b = short_run(tmp_path / "b", "--training.mixed_precision_param", "float32", "--training.deterministic")
    c = short_run(tmp_path / "c", "--training.mixed_precision_param", "float32", "--training.seed", "1")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["loss"] for r in a] != [r["loss"] for r in c]


def test_clipping_changes_the_trajectory(tmp_path):
    clipped = short_run(tmp_path / "a", "--training.mixed_precision_param", "float32", "--training.max_norm", "0.01")
    free = short_run(tmp_path / "b", "--training.mixed_precision_param", "float32", "--training.max_norm", "0")
    assert clipped[0]["loss"] == free[0]["loss"]
    assert clipped[-1]["loss"] != free[-1]["loss"]


def test_a_fork_replaces_one_step_by_subclassing(tmp_path):
    from torchtitan.train import Trainer

    calls = []

    class FrozenTrainer(Trainer):
        """Skips the optimizer: the model never changes, so every step sees the initial weights."""

        def optimizer_step(self):
            calls.append(self.preflight_result.grad_accum_steps)

    same = ["--training.steps", "3", "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32"]
    frozen = train(short_config(tmp_path, *same), FrozenTrainer)
    normal = short_run(tmp_path / "b", *same)
    assert len(calls) == 3
    assert frozen[0]["loss"] == normal[0]["loss"]  # the same first step
    assert frozen[2]["loss"] != normal[2]["loss"]  # but no learning afterwards


def test_the_specs_loss_function_is_the_one_trained(tmp_path):
    import dataclasses

    import torch.nn.functional as F

    from torchtitan.models.registry import get_model_spec, register_model

    def smoothed(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), label_smoothing=0.5, reduction="sum")

    register_model(dataclasses.replace(get_model_spec("llama3"), name="llama3_smoothed_loss", loss_sum_fn=smoothed))
    plain = short_run(tmp_path / "a", "--training.mixed_precision_param", "float32")
    custom = short_run(
        tmp_path / "b", "--training.mixed_precision_param", "float32", "--model.name", "llama3_smoothed_loss"
    )
    # Same weights and batch at step 1: only the loss function differs. Label smoothing against a
    # near-uniform prediction changes the first loss by well under a nat, but it must change it.
    assert custom[0]["loss"] != plain[0]["loss"]
    assert abs(custom[0]["loss"] - plain[0]["loss"]) < 1.0


def test_console_keys_of_the_reference_schema_act(tmp_path, caplog):
    import logging

    from torchtitan.components.metrics import step_line

    caplog.set_level(logging.INFO)
    short_run(tmp_path / "a", "--training.steps", "1", "--job.print_args")
    assert "[training]" in caplog.text and "LlamaModel" not in caplog.text
    caplog.clear()
    short_run(tmp_path / "b", "--training.steps", "1", "--model.print_after_conversion")
    # By default one line says where the resolved config is.
    assert "[training]" not in caplog.text
    assert f"written to {tmp_path / 'b' / 'config.toml'}" in caplog.text
    assert "model after conversion (no converters):" in caplog.text and "(tok_embeddings): Embedding(" in caplog.text
    values = {
        "step": 1,
        "loss": 2.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "memory_gib": 1.0,
        "tps": 10.0,
        "tflops": 0.1,
        "mfu": 1.0,
    }
    assert "\033[" not in step_line(values) and "\033[32mloss:\033[0m" in step_line(values, color=True)


def test_flight_recorder_size_reaches_the_environment(monkeypatch):
    from torchtitan.distributed.process_group import init_distributed

    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    init_distributed(10, trace_buf_size=1234)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "1234"
    # Not the deprecated name: torch 2.13 warns about it on every rank when it is set.
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "7")  # the environment wins
    init_distributed(10, trace_buf_size=1234)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "7"
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "9")  # so does a user's setting of the older name
    init_distributed(10, trace_buf_size=1234)
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ


class PoisonedSteps:
    """A Trainer mixin for a bad batch on chosen steps: after backward, every gradient is NaN."""

    poisoned: set[int] = set()

    def train_step(self, step, data_iter):
        self.step_now = step
        return super().train_step(step, data_iter)

    def forward_backward(self, inputs, labels, doc_ids, scale):
        loss = super().forward_backward(inputs, labels, doc_ids, scale)
        if self.step_now in self.poisoned:
            for part in self.ctx.parts:
                for p in part.parameters():
                    p.grad.fill_(float("nan"))
        return loss


def poisoned_trainer(steps: set[int]):
    from torchtitan.train import Trainer

    return type("Poisoned", (PoisonedSteps, Trainer), {"poisoned": steps})


def nan_run_config(tmp_path, *extra):
    return short_config(
        tmp_path,
        "--training.steps",
        "6",
        "--metrics.log_freq",
        "5",
        "--training.mixed_precision_param",
        "float32",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "1",
        "--checkpoint.no-last_save_model_only",
        *extra,
    )


def test_non_finite_gradient_norm_stops_the_run_on_an_unlogged_step(tmp_path):
    from torchtitan.components.checkpoint import complete_checkpoints
    from torchtitan.config import UserError

    with pytest.raises(
        UserError, match=r"training stopped at step 3: the gradient norm is not finite \(gradient norm nan"
    ):
        train(nan_run_config(tmp_path), poisoned_trainer({3}))
    assert complete_checkpoints(str(tmp_path / "checkpoint")) == [1, 2]  # the bad state never saved


def test_skip_nonfinite_steps_drops_the_bad_step_only(tmp_path):
    """Skipping step 3 leaves the weights of step 2: the run then equals one whose step 3 never
    happened, except that the learning rate and data moved on (so compare with the saved state)."""
    from torchtitan.components.checkpoint import read_train_state
    from torchtitan.config import UserError

    skipped = train(
        nan_run_config(
            tmp_path / "skip",
            "--training.skip_nonfinite_steps",
            "--metrics.log_freq",
            "1",
            "--checkpoint.keep_latest_k",
            "0",
        ),
        poisoned_trainer({3}),
    )
    clean = train(nan_run_config(tmp_path / "clean", "--metrics.log_freq", "1"))
    assert [r["skipped_steps"] for r in skipped] == [0, 0, 1, 1, 1, 1]
    assert [r["loss"] for r in skipped[:3]] == [r["loss"] for r in clean[:3]]  # step 3's forward ran normally
    assert skipped[3]["loss"] != clean[3]["loss"]  # step 4 sees step-2 weights, not step-3 ones
    assert [r["lr"] for r in skipped] == [r["lr"] for r in clean]  # the schedule kept its pace
    assert all(math.isfinite(r["loss"]) for r in skipped)
    # The weights saved at step 3 are those of step 2: nothing changed them.
    from torch.distributed.checkpoint import load

    from torchtitan.components.checkpoint import read_metadata

    def model_at(step):
        path = str(tmp_path / "skip" / "checkpoint" / f"step-{step}")
        size = read_metadata(path).state_dict_metadata["model.output.weight"].size
        sd = {"model": {"output.weight": torch.zeros(size)}}
        load(sd, checkpoint_id=path, no_dist=True)
        return sd["model"]["output.weight"]

    assert torch.equal(model_at(2), model_at(3)) and not torch.equal(model_at(3), model_at(4))
    assert read_train_state(str(tmp_path / "skip" / "checkpoint" / "step-6"))["counters"] == {"skipped_steps": 1}
    # Too many in a row still stops the run.
    with pytest.raises(UserError, match=r"training stopped at step 4: 2 steps in a row had a non-finite"):
        train(
            nan_run_config(
                tmp_path / "many", "--training.skip_nonfinite_steps", "--training.max_skipped_steps_in_a_row", "2"
            ),
            poisoned_trainer({3, 4}),
        )


@pytest.mark.multiprocess
def test_data_wait_is_measured_per_step(tmp_path):
    import time

    from torchtitan.train import Trainer

    class SlowData(Trainer):
        """Every batch takes 50 ms to arrive."""

        def build_dataloader(self):
            loader = super().build_dataloader()

            class Slow:
                def __iter__(self):
                    for batch in loader:
                        time.sleep(0.05)
                        yield batch

            return Slow()

    slow = train(short_config(tmp_path / "slow"), SlowData)
    # Documents tokenized by a worker process: the same batches, so the same losses.
    normal = short_run(tmp_path / "normal", "--training.data_workers", "1")
    assert [r["step"] for r in slow] == [1, 2, 4]
    assert all(r["data_wait_s"] >= 0.05 for r in slow)  # the mean over the steps since the previous record
    assert all(r["data_wait_s"] < 0.05 for r in normal[1:])
    assert [r["loss"] for r in normal] == pytest.approx([r["loss"] for r in slow], rel=1e-6)


def test_block_causal_needs_document_boundaries_from_the_loader(tmp_path, capsys):
    """A fork's loader whose dataset does not say which token ends a document: block_causal (and
    ignoring cross-document labels) is refused with exit 2 before the model is built."""
    from torchtitan.train import Trainer, main

    class PlainBatches(Trainer):
        def build_dataloader(self):
            return [(torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long))] * 4

        def build_model(self):
            raise AssertionError("the model must not be built")

    args = [
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "2",
    ]
    for flag in (["--model.attn_mask_type", "block_causal"], ["--training.ignore_cross_document_labels"]):
        assert main(args + flag, trainer_cls=PlainBatches) == 2
        err = capsys.readouterr().err
        assert "carries no document boundaries" in err and "Traceback" not in err
        assert flag[0].removeprefix("--") in err.replace(" = 'block_causal'", "")


class DocumentIdBatches:
    """A fork's loader giving (inputs, labels, doc_ids): the standard batches with the document ids of
    `ids(inputs)`."""

    def __init__(self, loader, ids):
        import types

        self.loader, self.ids = loader, ids
        self.dataset = types.SimpleNamespace(yields_document_ids=True)

    def __iter__(self):
        for inputs, labels in self.loader:
            yield inputs, labels, self.ids(inputs)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


def test_a_loader_may_carry_document_ids(tmp_path):
    """Ids equal to those from the EOS give the EOS run's losses exactly; other ids (each row cut in
    halves) change them: the batch's ids are what attention and the ignored labels follow."""
    from torchtitan.models.common.attention import document_ids
    from torchtitan.train import Trainer

    def trainer(ids):
        class WithIds(Trainer):
            def build_dataloader(self):
                return DocumentIdBatches(super().build_dataloader(), lambda x: ids(x, self.tokenizer.eos_id))

        return WithIds

    flags = [
        "--model.attn_mask_type",
        "block_causal",
        "--training.ignore_cross_document_labels",
        "--training.mixed_precision_param",
        "float32",
    ]

    def run(folder, trainer_cls=None):
        cfg = load_config(
            [
                "--job.config_file",
                str(REPO / "train_configs" / "debug_model.toml"),
                "--job.dump_folder",
                str(folder),
                "--training.seq_len",
                "32",
                "--training.local_batch_size",
                "2",
                "--training.steps",
                "3",
                "--metrics.log_freq",
                "1",
                "--metrics.device_peak_tflops",
                "1",
                *flags,
            ]
        )
        return [r["loss"] for r in train(cfg, trainer_cls)]

    from_eos = run(tmp_path / "eos")
    assert run(tmp_path / "same", trainer(document_ids)) == from_eos
    halves = run(tmp_path / "halves", trainer(lambda x, eos: (torch.arange(x.shape[1]) >= 16).int().expand_as(x)))
    assert halves[0] != from_eos[0]
