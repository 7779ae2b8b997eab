"""The planner's memory under context parallel depends on the method (torchtitan.planner.memory.
cp_attention_bytes): the gathered ring keeps the whole sequence's keys and values and a mask of its
queries against every key, the rotating ring its received blocks and each chunk pair's float32 output,
Ulysses nothing beyond the local flash kernel's tensors; the estimate, the layout names and the plan
follow."""

import pytest

from torchtitan.config import load_config
from torchtitan.planner.memory import GiB, cp_attention_bytes
from torchtitan.planner.search import candidates, estimate_config, rank_layouts, recipe_facts

from helpers.paths import REPO

DEBUG = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--training.compile", "false"]
GATHERED = ["--parallelism.context_parallel_rotate_method", "allgather"]
ROTATING = ["--parallelism.context_parallel_rotate_method", "alltoall"]
ULYSSES = ["--parallelism.context_parallel_method", "ulysses"]


def config(*args: str):
    return load_config(DEBUG + list(args))


@pytest.mark.parametrize(
    "act_bytes,measured",
    [
        (4, {"allgather": 10.000, "alltoall": 3.969, "ulysses": 0.031}),
        (2, {"allgather": 10.000, "alltoall": 6.938, "ulysses": 0.063}),
    ],
)
def test_counts_what_one_attention_call_keeps(act_bytes, measured):
    # Measured 2026-12-06 on 2 gloo ranks (llama3 debugmodel's 16 heads of 16, 1,024 local tokens of a
    # 2,048-token sequence): the bytes of the tensors one attention call saves for backward, less those
    # of SDPA on the local q, k and v, in units of one q-sized tensor. The gathered ring: 2 for the other
    # rank's keys and values and 8 for the [1,024 x 2,048] mask in the compute dtype; the rotating ring:
    # 2 for the received block, 5 chunk pairs' float32 outputs and log-sum-exps, less SDPA's output.
    p = recipe_facts(config())
    tokens, seq, unit = 1024, 2048, 1024 * 256 * act_bytes
    for method, got in measured.items():
        par = config(
            *(ULYSSES if method == "ulysses" else ["--parallelism.context_parallel_rotate_method", method]),
            "--parallelism.context_parallel_degree",
            "2",
        ).parallelism
        counted = cp_attention_bytes(p.args, par, 2, 1, tokens, seq, act_bytes, documents=False) / unit
        assert counted == pytest.approx(got, abs=0.07), method


def test_the_estimate_follows_the_method():
    long = [
        "--training.seq_len",
        "8192",
        "--training.local_batch_size",
        "1",
        "--parallelism.context_parallel_degree",
        "2",
        "--training.mixed_precision_param",
        "float32",
    ]
    est = {
        name: estimate_config(config(*long, *extra), 2, "cpu")
        for name, extra in (("gathered", GATHERED), ("rotating", ROTATING), ("ulysses", ULYSSES))
    }
    assert [e.layout() for e in est.values()] == ["cp2", "cp2r", "cp2u"]
    act = {name: e.memory.activations for name, e in est.items()}
    # Ulysses < the rotating ring < the gathered ring, whose mask of 4,096 x 8,192 float32 (128 MiB a
    # block, 6 blocks without checkpointing) outweighs the rotating ring's pair outputs.
    assert act["ulysses"] < act["rotating"] < act["gathered"]
    p = recipe_facts(config(*long))
    for name, extra in (("gathered", GATHERED), ("rotating", ROTATING)):
        par = config(*long, *extra).parallelism
        per_block = cp_attention_bytes(p.args, par, 2, 1, 4096, 8192, 4, documents=False)
        assert act[name] - act["ulysses"] == pytest.approx(p.args.n_layers * per_block)
    assert act["gathered"] - act["ulysses"] > p.args.n_layers * 128 * 2**20
    # Document masks: the gathered ring's mask is per sequence (2 sequences a micro-batch here).
    two = ["--training.local_batch_size", "2", "--training.global_batch_size", "2"]
    docs = estimate_config(config(*long, *two, *GATHERED, "--model.attn_mask_type", "block_causal"), 2, "cpu")
    causal = estimate_config(config(*long, *two, *GATHERED), 2, "cpu")
    assert docs.memory.activations - causal.memory.activations == pytest.approx(p.args.n_layers * 4096 * 8192 * 4)


def test_the_plan_picks_the_method_that_fits():
    args = [
        "--training.seq_len",
        "16384",
        "--parallelism.context_parallel_degree",
        "2",
        "--training.global_batch_size",
        "1",
        "--training.local_batch_size",
        "1",
    ]
    cfg = config(*args)
    p = recipe_facts(cfg)
    methods = [
        (c.parallelism.context_parallel_method, c.parallelism.context_parallel_rotate_method)
        for c in candidates(cfg, 2, 2, p.spec, p.args)
        if c.activation_checkpoint.mode == "none"
    ]
    assert methods == [("ring", "allgather"), ("ring", "alltoall"), ("ulysses", "allgather")]
    # Without checkpointing at 16,384 tokens: only Ulysses fits between its estimate and the rings'.
    none = ["--activation_checkpoint.mode", "none"]
    need = {
        name: estimate_config(config(*args, *none, *extra), 2, "cpu").memory.total
        for name, extra in (("cp2", GATHERED), ("cp2r", ROTATING), ("cp2u", ULYSSES))
    }
    assert need["cp2u"] < need["cp2r"] < need["cp2"]
    budget = (need["cp2u"] + need["cp2r"]) / 2
    ranking = rank_layouts(cfg, 2, 2, budget, device_type="cpu")
    chosen = {e.layout() for e in ranking.fits if e.ac() == "none"}
    assert chosen == {"cp2u"}, [(e.layout(), e.ac(), e.memory.total / GiB) for e in ranking.fits]
    # A recipe that sets the rotating ring keeps it.
    fixed = config("--training.seq_len", "16384", "--parallelism.context_parallel_degree", "2", *ROTATING)
    assert {c.parallelism.context_parallel_rotate_method for c in candidates(fixed, 2, 2, p.spec, p.args)} == {
        "alltoall"
    }
