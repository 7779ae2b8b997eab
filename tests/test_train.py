"""The checks train.py makes before any process group exists, and the shipped recipes."""

import glob
import re
from pathlib import Path

import pytest
import torch

from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config import UserError, load_config
from torchtitan.models.registry import get_model_spec
from torchtitan.preflight import preflight

from helpers.checkpoints import CHECKPOINT_ARGS
from helpers.launch import debug_config as cfg
from helpers.paths import REPO


def test_global_batch_and_accumulation():
    plan = preflight(cfg("--training.local_batch_size", "2", "--training.global_batch_size", "16"), world_size=4)
    assert (plan.global_batch_size, plan.grad_accum_steps) == (16, 2)
    plan = preflight(cfg("--training.local_batch_size", "2"), world_size=4)
    assert (plan.global_batch_size, plan.grad_accum_steps) == (8, 1)


def test_global_batch_not_a_multiple():
    with pytest.raises(UserError, match="global_batch_size = 10 is not a multiple of .* = 8"):
        preflight(cfg("--training.local_batch_size", "2", "--training.global_batch_size", "10"), world_size=4)


def test_missing_tokenizer():
    with pytest.raises(UserError, match="tokenizer model not found at '/no/such.model'"):
        preflight(cfg("--model.tokenizer_path", "/no/such.model"), world_size=1)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"])
def test_split_backward_schedules_refuse_blocks_after_the_layers(schedule):
    # DeepSeek-V3's multi-token prediction blocks fail in the weight pass of a split backward (measured).
    argv = [
        "--model.name",
        "deepseek_v3",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--training.local_batch_size",
        "8",
    ]
    with pytest.raises(UserError, match=f"{schedule} splits each backward .* model.mtp_depth = 0"):
        preflight(cfg(*argv, "--model.mtp_depth", "1"), world_size=2)
    preflight(cfg(*argv), world_size=2)  # without them it runs


@pytest.mark.parametrize(
    "overrides, world, pattern",
    [
        # Each crashed at step 1 when it passed preflight (measured on torch 2.13, CPU).
        (
            ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"],
            1,
            "does not support the mixture-of-experts blocks",
        ),
        (
            ["--model.name", "deepseek_v3", "--model.mtp_depth", "1"],
            1,
            "does not support the mixture-of-experts blocks",
        ),
        (
            ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"],
            2,
            "tensor_parallel_degree = 2 fails on the CPU",
        ),
    ],
)
def test_compile_refuses_what_it_cannot_compile(overrides, world, pattern):
    with pytest.raises(UserError, match=pattern):
        preflight(cfg("--training.compile", *overrides), world_size=world)
    preflight(cfg(*overrides), world_size=world)  # eager runs it
    preflight(cfg("--training.compile", "--training.local_batch_size", "4"), world_size=2)  # and FSDP compiles


def test_unknown_flavor():
    with pytest.raises(UserError, match="unknown model.flavor '2B'"):
        preflight(cfg("--model.flavor", "2B"), world_size=1)


@pytest.mark.parametrize(
    "recipe, world",
    [
        ("debug_model.toml", 2),
        ("llama3_1b.toml", 1),
        ("llama3_8b.toml", 8),
        ("llama3_70b.toml", 64),
        ("llama3_405b.toml", 256),
    ],
)
def test_shipped_recipes_load_and_plan(recipe, world, monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name the tokenizer relative to the repository root
    config = load_config(["--job.config_file", str(REPO / "train_configs" / recipe)])
    plan = preflight(config, world_size=world)
    assert plan.parallel_dims.world_size == world
    spec = get_model_spec(config.model.name)
    args = spec.args_for_training(
        config.model.flavor, Tokenizer(config.model.tokenizer_path).vocab_size, config.training.seq_len
    )
    with torch.device("meta"):
        model = spec.model_cls(args)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_every_recipe_is_covered():
    shipped = {Path(p).name for p in glob.glob(str(REPO / "train_configs" / "*.toml"))}
    assert shipped == {"debug_model.toml", "llama3_1b.toml", "llama3_8b.toml", "llama3_70b.toml", "llama3_405b.toml"}


def test_tied_embeddings_can_be_split_over_pipeline_stages():
    # Each stage keeps its copy (distributed/shared_weights.py); the parity matrix trains it.
    preflight(
        cfg(
            "--model.name",
            "qwen3",
            "--model.flavor",
            "debugmodel_tied",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
        ),
        world_size=2,
    )


def test_custom_import_errors_name_the_module(tmp_path):
    with pytest.raises(UserError, match="cannot import module 'no_such_module_here'"):
        preflight(cfg("--experimental.custom_import", "no_such_module_here"), world_size=1)
    with pytest.raises(UserError, match="file .*missing.py not found"):
        preflight(cfg("--experimental.custom_import", str(tmp_path / "missing.py")), world_size=1)
    with pytest.raises(
        UserError, match="unknown model.name 'gpt9'; registered models: deepseek_v3, gpt_oss, llama3, (.* )?qwen3"
    ):
        preflight(cfg("--model.name", "gpt9"), world_size=1)


def test_a_custom_module_file_registers_a_model(tmp_path):
    module = tmp_path / "my_family.py"
    module.write_text(
        "import dataclasses\n"
        "from torchtitan.models.registry import get_model_spec, register_model\n"
        "register_model(dataclasses.replace(get_model_spec('llama3'), name='llama3_fork', cp_attention=None))\n"
    )
    plan = preflight(cfg("--experimental.custom_import", str(module), "--model.name", "llama3_fork"), world_size=1)
    assert plan.spec.name == "llama3_fork"
    # The spec says the fork has no context parallel: refused before launch.
    with pytest.raises(UserError, match="model 'llama3_fork' does not support context parallel"):
        preflight(
            cfg(
                "--experimental.custom_import",
                str(module),
                "--model.name",
                "llama3_fork",
                "--parallelism.context_parallel_degree",
                "2",
                "--training.seq_len",
                "64",
            ),
            world_size=2,
        )


MOE = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe")


@pytest.mark.parametrize(
    "overrides, world, pattern",
    [
        ((*MOE, "--moe.top_k", "9"), 1, r"top_k = 9 must be between 1 and num_experts = 8"),
        (("--moe.top_k", "2"), 1, r"\[moe\] sets top_k, but model llama3 debugmodel has no mixture of experts"),
        (
            (*MOE, "--parallelism.expert_parallel_degree", "3", "--training.local_batch_size", "2"),
            6,
            r"num_experts = 8 is not divisible by parallelism.expert_parallel_degree = 3",
        ),
        (
            (*MOE, "--parallelism.expert_parallel_degree", "4", "--training.local_batch_size", "2"),
            2,
            r"expert_parallel_degree = 4 must divide data_parallel_shard_degree x context_parallel_degree = 2 x 1",
        ),
        (
            ("--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"),
            2,
            r"splits the experts of a mixture-of-experts model, but model llama3 debugmodel has none",
        ),
        (
            (
                *MOE,
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ),
            2,
            r"must divide data_parallel_shard_degree x "
            r"context_parallel_degree = 1 x 1 = 1",
        ),  # DDP lends expert parallel no ranks
    ],
)
def test_moe_and_expert_parallel_mistakes_are_refused_before_launch(overrides, world, pattern):
    with pytest.raises(UserError, match=pattern):
        preflight(cfg(*overrides), world_size=world)


def test_moe_config_values():
    with pytest.raises(UserError, match=r"moe.capacity_factor must be 0 \(off\) or more, got -1.0"):
        cfg(*MOE, "--moe.capacity_factor", "-1")
    from torchtitan.models.common.moe import overrides_from_config

    section = cfg(
        *MOE, "--moe.load_balance_coeff", "0", "--moe.capacity_factor", "1.25", "--moe.z_loss_coeff", "0.001"
    ).moe
    assert overrides_from_config(section) == {
        "load_balance_coeff": None,
        "capacity_factor": 1.25,
        "z_loss_coeff": 0.001,
    }
    plan = preflight(cfg(*MOE, "--moe.top_k", "4"), world_size=1)
    assert plan.spec.name == "qwen3"


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (["--model.use_flex_attn"], r"FlexAttention does not support backward on CPU"),
        (["--model.attn_backend", "flex"], r"FlexAttention does not support backward on CPU"),
        (["--model.sliding_window", "16"], r"model.sliding_window is set, but model 'llama3' has no sliding-window"),
        (
            ["--model.name", "qwen3", "--model.flavor", "debugmodel", "--model.max_window_layers", "1"],
            r"max_window_layers = 1 has no effect: .* has no sliding window",
        ),
        (
            [
                "--model.name",
                "qwen3",
                "--model.flavor",
                "debugmodel",
                "--model.sliding_window",
                "8",
                "--model.max_window_layers",
                "99",
            ],
            r"none would have the sliding window",
        ),
    ],
)
def test_attention_mistakes_are_refused_before_launch(overrides, pattern):
    with pytest.raises(UserError, match=pattern):
        preflight(cfg(*overrides), world_size=1)


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (["--model.attn_mask_type", "blockwise"], r"model.attn_mask_type"),
        (["--model.name", "qwen3", "--model.sliding_window", "0"], r"model.sliding_window must be a positive"),
        (["--model.name", "qwen3", "--model.sliding_window", "-4"], r"model.sliding_window must be a positive"),
        (["--model.use_flex_attn", "--model.attn_backend", "split"], r"use_flex_attn = true asks for FlexAttention"),
    ],
)
def test_attention_values_are_refused_by_the_config(overrides, pattern):
    with pytest.raises(UserError, match=pattern):
        cfg(*overrides)


def test_a_window_reaches_the_model_args():
    plan = preflight(
        cfg(
            "--model.name",
            "qwen3",
            "--model.flavor",
            "debugmodel",
            "--model.sliding_window",
            "8",
            "--model.max_window_layers",
            "1",
        ),
        world_size=1,
    )
    from torchtitan.preflight import attention_overrides, model_args_for_run

    c = cfg(
        "--model.name",
        "qwen3",
        "--model.flavor",
        "debugmodel",
        "--model.sliding_window",
        "8",
        "--model.max_window_layers",
        "1",
    )
    args = model_args_for_run(plan.spec, c, 4096)
    assert attention_overrides(c.model) == {"sliding_window": 8, "max_window_layers": 1}
    assert [args.layer_window(i) for i in range(args.n_layers)] == [None] + [8] * (args.n_layers - 1)


def test_initial_hf_weights_bring_their_sliding_windows(tmp_path):
    import json

    import torch

    from torchtitan.preflight import model_args_for_run

    spec = get_model_spec("qwen3")
    windowed = spec.args_for_training("debugmodel", 4096, 64, overrides={"sliding_window": 8, "max_window_layers": 1})
    (tmp_path / "config.json").write_text(json.dumps(spec.hf.config(windowed, torch.float32, None, 2)))
    base = [
        "--model.name",
        "qwen3",
        "--model.flavor",
        "debugmodel",
        "--checkpoint.initial_load_path",
        str(tmp_path),
        "--checkpoint.initial_load_in_hf",
        "--training.seq_len",
        "64",
    ]
    args = model_args_for_run(spec, cfg(*base), 4096)
    assert (args.sliding_window, args.max_window_layers) == (8, 1)
    # [model] wins where it says otherwise.
    args = model_args_for_run(spec, cfg(*base, "--model.sliding_window", "16"), 4096)
    assert (args.sliding_window, args.max_window_layers) == (16, 1)


def test_a_broken_hf_folder_is_refused_before_launch(tmp_path):
    """preflight reads the folder's headers (no weights): a shard of the index missing is refused."""
    import torch

    from torchtitan.components.checkpoint import save_hf

    spec = get_model_spec("llama3")
    args = spec.args_for_training("debugmodel", 4096, 64)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    save_hf(tmp_path / "hf", model.state_dict(), spec.hf, args, torch.bfloat16, max_shard_bytes=2**20)
    sorted((tmp_path / "hf").glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(UserError, match=r"which does not exist; is the download complete"):
        preflight(
            cfg(
                "--checkpoint.initial_load_path",
                str(tmp_path / "hf"),
                "--checkpoint.initial_load_in_hf",
                "--training.seq_len",
                "64",
            ),
            world_size=1,
        )


def test_loss_chunk_tokens_mistakes_are_refused():
    with pytest.raises(UserError, match=r'training.loss_chunk_tokens must be "auto", 0 .* got -4'):
        cfg("--training.loss_chunk_tokens", "-4")
    with pytest.raises(UserError, match=r"training.loss_chunk_tokens: expected an integer or one of 'auto', got 'big'"):
        cfg("--training.loss_chunk_tokens", "big")
    chunk = ("--training.loss_chunk_tokens", "64")
    with pytest.raises(UserError, match=r"ZBVZeroBubble splits each backward into an input and a weight pass"):
        preflight(
            cfg(
                *chunk,
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
                "--training.local_batch_size",
                "8",
            ),
            world_size=2,
        )
    with pytest.raises(UserError, match=r"float8.filter_fqns \(\['wq'\]\) lets float8 convert it"):
        preflight(cfg(*chunk, "--model.converters", "float8", "--float8.filter_fqns", "wq"), world_size=1)
    assert preflight(cfg(*chunk), world_size=1).spec.chunked_loss is not None


def test_auto_loss_chunks_follow_the_rule():
    """ "auto" chunks at 1,024 tokens where one rank's micro-batch has 2,048 tokens or more and its float32
    logits take 256 MiB or more (models.common.chunked_loss.auto_chunk_tokens), where the layout can."""
    from torchtitan.models.common.chunked_loss import AUTO_CHUNK_TOKENS, auto_chunk_tokens

    assert AUTO_CHUNK_TOKENS == 1024
    assert auto_chunk_tokens(2048, 2**15) == 1024  # 2,048 x 32,768 x 4 bytes = 256 MiB
    assert auto_chunk_tokens(2048, 2**15 - 1) == 0  # a row short of it
    assert auto_chunk_tokens(2047, 248_320) == 0  # one chunk would hold (nearly) all
    assert auto_chunk_tokens(8192, 128_256) == 1024

    def chunks(*args, world_size=1):
        return preflight(cfg(*args), world_size=world_size).loss_chunk_tokens

    assert cfg().training.loss_chunk_tokens == "auto"
    assert chunks() == 0  # the debug recipe: micro-batches of 1,024 tokens x a 4,096-entry vocabulary
    big = ("--training.seq_len", "2048", "--training.local_batch_size", "8")  # 16,384 tokens x 4,096 x 4 B = 256 MiB
    assert chunks(*big) == 1024
    assert chunks(*big, "--parallelism.tensor_parallel_degree", "2", world_size=2) == 0  # half the vocabulary each
    assert chunks(*big, "--parallelism.context_parallel_degree", "2", world_size=2) == 0  # half the tokens each
    assert chunks(*big, "--parallelism.data_parallel_shard_degree", "2", world_size=2) == 1024
    assert chunks(*big, "--parallelism.pipeline_parallel_degree", "2", world_size=2) == 0  # micro-batches of 1
    assert (
        chunks(
            *big,
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "8",
            world_size=2,
        )
        == 1024
    )
    # Where it cannot chunk, auto takes the whole logits instead of refusing.
    assert (
        chunks(
            *big,
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
            "--parallelism.pipeline_parallel_microbatch_size",
            "8",
            world_size=2,
        )
        == 0
    )
    assert chunks(*big, "--model.converters", "float8", "--float8.filter_fqns", "wq") == 0
    assert chunks(*big, "--model.converters", "float8", "--float8.filter_fqns", "output") == 1024
    assert chunks(*big, "--training.loss_chunk_tokens", "0") == 0
    assert chunks("--training.loss_chunk_tokens", "64") == 64


def _own_loss(logits, labels):
    return logits.float().logsumexp(-1).sum()


def test_loss_chunk_tokens_is_refused_for_a_loss_the_model_does_not_compute():
    import dataclasses

    from torchtitan.models.registry import register_model

    register_model(dataclasses.replace(get_model_spec("llama3"), name="llama3_own_loss", loss_sum_fn=_own_loss))
    with pytest.raises(
        UserError, match=r"model llama3_own_loss's loss .* is not one its forward computes chunk by chunk"
    ):
        preflight(cfg("--model.name", "llama3_own_loss", "--training.loss_chunk_tokens", "64"), world_size=1)
    plan = preflight(
        cfg("--model.name", "llama3_own_loss", "--training.seq_len", "2048", "--training.local_batch_size", "8"),
        world_size=1,
    )
    assert plan.loss_chunk_tokens == 0  # auto, on a model that cannot chunk


# --- what used to pass preflight and fail later ------------------------------------------------------------------


def _csv_schedule(path: Path, split: bool) -> Path:
    """A 2-rank, one-stage-per-rank CSV schedule of 2 microbatches; `split`: the last stage's backward as input (I)
    and weight (W) passes."""
    last = ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"] if split else ["1F0", "1B0", "1F1", "1B1"]
    path.write_text(",".join(["0F0", "0F1", "0B0", "0B1"]) + "\n" + ",".join(last) + "\n")
    return path


def test_a_csv_schedule_is_judged_by_its_actions(tmp_path):
    """Chunked loss and multi-token prediction run each backward once: a CSV schedule with I and W actions is refused
    for them before launch, as a zero-bubble schedule is by name (before: a CSV passed preflight and the run failed
    in its first backward); the same CSV without them is accepted, and a malformed one is refused with its action."""
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"]
    split = ["--parallelism.pipeline_parallel_schedule_csv", str(_csv_schedule(tmp_path / "split.csv", True))]
    whole = ["--parallelism.pipeline_parallel_schedule_csv", str(_csv_schedule(tmp_path / "whole.csv", False))]
    chunk = ["--training.loss_chunk_tokens", "64"]
    with pytest.raises(
        UserError,
        match=r"split.csv \(its I and W actions\) splits each backward into an input and "
        r"a weight pass; choose 1F1B",
    ):
        preflight(cfg(*pp, *split, *chunk), world_size=2)
    assert preflight(cfg(*pp, *whole, *chunk), world_size=2).loss_chunk_tokens == 64
    mtp = ["--model.name", "deepseek_v3", "--model.mtp_depth", "1"]
    with pytest.raises(UserError, match=r"split.csv \(its I and W actions\) splits each backward .* model.mtp_depth"):
        preflight(cfg(*pp, *split, *mtp), world_size=2)
    preflight(cfg(*pp, *whole, *mtp), world_size=2)
    (tmp_path / "bad.csv").write_text("0F0,0X0\n1F0,1B0\n")
    with pytest.raises(UserError, match=r"pipeline_parallel_schedule_csv .*bad.csv: .*0X0"):
        preflight(cfg(*pp, "--parallelism.pipeline_parallel_schedule_csv", str(tmp_path / "bad.csv")), world_size=2)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--parallelism.context_parallel_method", "ulysses"],
            "context_parallel_method = 'ulysses' is only read with context parallel, and context_parallel_degree is 1",
        ),
        (
            ["--parallelism.context_parallel_rotate_method", "alltoall"],
            "context_parallel_rotate_method = 'alltoall' is only read with context parallel",
        ),
        (
            ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
            "pipeline_parallel_schedule = 'ZBVZeroBubble' is only read with pipeline parallel",
        ),
        (
            ["--parallelism.pipeline_parallel_microbatch_size", "2"],
            "pipeline_parallel_microbatch_size = 2 is only read with pipeline parallel",
        ),
        (["--parallelism.disable_loss_parallel"], "disable_loss_parallel = true is only read with tensor parallel"),
    ],
)
def test_a_parallelism_setting_without_its_parallelism_is_refused(argv, message):
    """How a parallelism splits the work, asked for while its degree is 1: the run would do without it (before:
    ulysses without a context-parallel degree trained as a plain run)."""
    with pytest.raises(UserError, match=re.escape(message)):
        preflight(cfg(*argv), world_size=1)


def test_the_hugging_face_export_is_checked_before_the_run(tmp_path):
    """checkpoint.last_save_in_hf writes step-N-hf after the last step: an export the format cannot hold (gpt-oss
    with a capacity factor) and an export folder that exists are refused before launch (before: at the last step,
    the weights lost with checkpointing off). A run that resumes at its last step exports nothing and is not
    refused."""
    export = ["--checkpoint.last_save_in_hf", "--job.dump_folder", str(tmp_path), "--training.steps", "6"]
    with pytest.raises(UserError, match=r"last_save_in_hf exports .* cannot be: GptOssForCausalLM drops no token"):
        preflight(cfg(*export, "--model.name", "gpt_oss", "--moe.capacity_factor", "1.5"), world_size=1)
    preflight(cfg(*export, "--model.name", "gpt_oss"), world_size=1)
    (tmp_path / "checkpoint" / "step-6-hf").mkdir(parents=True)
    preflight(cfg(*export), world_size=1)  # an empty folder takes the export
    (tmp_path / "checkpoint" / "step-6-hf" / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"export the model to .*step-6-hf after step 6, and it already exists"):
        preflight(cfg(*export), world_size=1)
    with pytest.raises(UserError, match=r"step-6-hf after step 6, and it already exists"):
        preflight(cfg(*export, "--checkpoint.enable_checkpoint"), world_size=1)


def test_a_resumed_run_that_has_reached_its_last_step_exports_nothing_and_is_not_refused(straight):
    """The straight run (tests/conftest.py) checkpointed step 6, its last: the same command again trains and exports
    nothing, so an existing step-6-hf is no obstacle."""
    folder = straight[0]
    (folder / "checkpoint" / "step-6-hf").mkdir(exist_ok=True)
    (folder / "checkpoint" / "step-6-hf" / "config.json").write_text("{}")
    try:
        preflight(
            load_config(
                [
                    *CHECKPOINT_ARGS,
                    "--job.dump_folder",
                    str(folder),
                    "--training.steps",
                    "6",
                    "--checkpoint.last_save_in_hf",
                ]
            ),
            1,
        )
    finally:
        (folder / "checkpoint" / "step-6-hf" / "config.json").unlink()
        (folder / "checkpoint" / "step-6-hf").rmdir()


def test_a_seed_checkpoint_into_a_folder_with_checkpoints_is_refused_before_launch(straight):
    with pytest.raises(
        UserError,
        match=r"create_seed_checkpoint writes step-0 into an empty checkpoint folder, and "
        r".* already holds checkpoints \(step-6\)",
    ):
        preflight(
            load_config(
                [*CHECKPOINT_ARGS, "--job.dump_folder", str(straight[0]), "--checkpoint.create_seed_checkpoint"]
            ),
            1,
        )
