"""bf16 mixed precision where no FSDP policy casts the parameters. One process and the layouts
without FSDP (TP 2, PP 2, DDP 2) train under torch.autocast over float32 parameters, whose casts
cover nn.Linear and the matmuls but not every op (torch._grouped_mm, which runs an MoE's experts,
has no autocast rule); EP 2 shards the other parameters with FSDP, the experts apart under their
own FSDP policy. Every family's debug flavor (Llama 3; Qwen3 dense, tied and MoE; DeepSeek-V3 with
and without multi-token prediction; gpt-oss) trains a few steps in each of these layouts that it supports,
with finite losses that fall, and every layout of a family stays within LAYOUT_TOL of its single
process. Also: multi-token prediction deeper than a context-parallel rank's share of the window
trains under CP 2 (its labels come from the whole window, so only training.seq_len bounds it).

The multi-process jobs share one launch (tests/distributed/run_jobs.py)."""

import math

import pytest

from helpers.launch import launch, train_in_process

# Sequences of 32 tokens (TINY's 64 halved): bf16 matmuls are tens of times slower than float32 ones on a CPU
# without native bf16, and the dtype paths under test do not depend on the length.
BF16 = ["--training.mixed_precision_param", "bfloat16", "--training.steps", "4", "--training.seq_len", "32"]
FAMILIES = {
    "llama3": [],
    "qwen3": ["--model.name", "qwen3", "--model.flavor", "debugmodel"],
    "qwen3_tied": ["--model.name", "qwen3", "--model.flavor", "debugmodel_tied"],
    "qwen3_moe": ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"],
    "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"],
    "deepseek_v3_mtp": ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.mtp_depth", "2"],
    "gpt_oss": ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"],
}
MOE_FAMILIES = ["qwen3_moe", "deepseek_v3", "deepseek_v3_mtp", "gpt_oss"]
LAYOUTS = {
    "tp2": ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
    "pp2": [
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ],
    "ep2": ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"],
    "ddp2": [
        "--training.local_batch_size",
        "4",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ],
}
# DDP adds only a gradient all-reduce to the single process's dtype path: one family, the one with
# every part (MLA, experts, multi-token prediction).
DDP_FAMILIES = ["deepseek_v3_mtp"]
# Losses of the same 4 steps in bf16 under autocast (one process, TP, PP, DDP) and under FSDP's bf16
# policy (EP 2) differ by rounding only: at most 2.6e-3 from the single process's (measured: the
# EP 2 jobs; 1e-3 or less for the others), against 0.5 to 1 from step 1 to step 4.
LAYOUT_TOL = 2e-2


def two_process_jobs() -> dict[str, list[str]]:
    jobs = {}
    for family, model in FAMILIES.items():
        for layout, extra in LAYOUTS.items():
            if layout == "ep2" and family not in MOE_FAMILIES or layout == "ddp2" and family not in DDP_FAMILIES:
                continue
            jobs[f"{family}_{layout}"] = BF16 + model + extra
    # 5 depths against 4 positions per CP rank (8 per window).
    jobs["deepseek_v3_mtp5_cp2_seq8"] = (
        BF16
        + FAMILIES["deepseek_v3"]
        + [
            "--model.mtp_depth",
            "5",
            "--training.seq_len",
            "8",
            "--training.local_batch_size",
            "8",
            "--parallelism.context_parallel_degree",
            "2",
        ]
    )
    return jobs


def assert_trains(records: list[dict], what: str):
    losses = [r["loss"] for r in records]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), f"{what}: {losses}"
    assert losses[-1] < losses[0], f"{what}: the loss did not fall: {losses}"


@pytest.fixture(scope="module")
def singles(tmp_path_factory) -> dict[str, list[dict] | BaseException]:
    """Each family's one-process bf16 run, in this process (or what it raised)."""
    tmp = tmp_path_factory.mktemp("bf16_single")
    runs = {}
    for family, model in FAMILIES.items():
        try:
            runs[family] = train_in_process(tmp / family, *BF16, *model, "--training.local_batch_size", "8")
        except Exception as e:  # reported by the family's own test
            runs[family] = e
    return runs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_process_trains_in_bf16_under_autocast(singles, family):
    run = singles[family]
    if isinstance(run, BaseException):
        raise run
    assert_trains(run, family)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_layouts_without_fsdp_train_in_bf16(singles, tmp_path_factory):
    runs = launch(two_process_jobs(), 2, tmp_path_factory.mktemp("bf16_layouts"))
    for name, records in runs.items():
        assert_trains(records, name)
        family = name.rsplit("_", 1)[0]
        single = singles.get(family)
        if isinstance(single, list):
            assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in single], abs=LAYOUT_TOL), name
