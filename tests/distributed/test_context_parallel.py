"""Context parallel: the load-balanced split of the sequence, and the ring attention and Ulysses
(around the SDPA and per-document split kernels) against single-process attention (forward and
backward, both rotate methods, 2 and 4 ranks; causal, document
masks, sliding windows and both; gpt-oss's sinks from the ring's log-sum-exp against an explicit sink
softmax) in one 4-process launch of cp_worker.py. Training parity of every CP
layout is in test_data_parallel_parity.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan.config import UserError, load_config
from torchtitan.distributed.context_parallel import (
    check_ulysses_degree,
    chunk_ids,
    kv_replicas,
    local_positions,
    shard_sequence,
)
from torchtitan.distributed.parallel_dims import ParallelDims

WORKER = Path(__file__).resolve().parent / "cp_worker.py"


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_ranks_cover_the_sequence_once(cp):
    seq = 2 * cp * 5
    held = torch.cat([local_positions(seq, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq))
    for r in range(cp):
        assert local_positions(seq, cp, r).tolist() == sorted(local_positions(seq, cp, r).tolist())


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_causal_work_is_balanced(cp):
    # Chunk pairs (query chunk, key chunk) that a causal mask leaves visible, per rank.
    work = [sum(k <= q for q in chunk_ids(r, cp) for k in range(2 * cp)) for r in range(cp)]
    assert len(set(work)) == 1, work
    # A naive contiguous split would give the last rank cp times the work of the first.
    naive = [sum(k <= q for q in (2 * r, 2 * r + 1) for k in range(2 * cp)) for r in range(cp)]
    assert len(set(naive)) > 1


def test_shard_sequence_takes_positions_along_dim_1():
    x = torch.arange(2 * 8).view(2, 8)
    pos = local_positions(8, 2, 1)
    assert shard_sequence(x, pos).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert shard_sequence(x, None) is x


def test_cp_joins_the_fsdp_shard_dimension():
    cfg = load_config(["--parallelism.context_parallel_degree", "2"])
    dims = ParallelDims.from_config(cfg.parallelism, 8)
    assert (dims.dp_shard, dims.cp) == (4, 2) and dims.fsdp_enabled and dims.describe().startswith("FSDP x CP")
    alone = ParallelDims.from_config(cfg.parallelism, 2)
    assert (alone.dp_shard, alone.cp) == (1, 2) and alone.fsdp_enabled and not alone.ddp_enabled


def test_seq_len_must_split_into_cp_and_tp_chunks():
    with pytest.raises(
        UserError,
        match=r"seq_len = 100 must be divisible by 2 x context_parallel_degree x "
        r"tensor_parallel_degree = 2 x 2 x 2 = 8",
    ):
        load_config(
            [
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--training.seq_len",
                "100",
            ]
        )


def test_unknown_rotate_method_is_refused():
    with pytest.raises(UserError, match="context_parallel_rotate_method"):
        load_config(["--parallelism.context_parallel_rotate_method", "ring"])


def test_ulysses_refuses_rotate_method():
    with pytest.raises(UserError, match="context_parallel_method = 'ulysses' has no ring"):
        load_config(
            [
                "--parallelism.context_parallel_method",
                "ulysses",
                "--parallelism.context_parallel_rotate_method",
                "alltoall",
            ]
        )


@pytest.mark.parametrize(
    "heads,kv_heads,cp,replicas",
    [(4, 2, 4, 2), (4, 2, 2, 1), (8, 1, 4, 4), (16, 16, 4, 1), (12, 4, 3, 3), (12, 4, 6, 3), (8, 2, 8, 4)],
)
def test_ulysses_kv_replicas_give_each_head_group_its_own_kv_heads(heads, kv_heads, cp, replicas):
    assert kv_replicas(heads, kv_heads, cp) == replicas
    kv = kv_heads * replicas
    for rank in range(cp):  # the query heads of a rank read KV copies that the same rank holds
        q_heads = range(rank * heads // cp, (rank + 1) * heads // cp)
        held = range(rank * kv // cp, (rank + 1) * kv // cp)
        assert all(h // (heads // kv) in held for h in q_heads)
        assert all((h // (heads // kv)) // replicas == h // (heads // kv_heads) for h in q_heads)  # same KV head


def test_ulysses_degree_must_divide_heads_per_tp_rank():
    check_ulysses_degree(16, 2, 8)
    with pytest.raises(
        UserError,
        match=r"16 query heads \(tensor_parallel_degree = 4 leaves 4 per rank\).*"
        r"largest degree that works is 4",
    ):
        check_ulysses_degree(16, 4, 8)
    with pytest.raises(UserError, match="largest degree that works is 2"):
        check_ulysses_degree(8, 1, 3)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cp_attention_matches_single_process_attention(tmp_path):
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        str(WORKER),
        str(out),
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"launch failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    results = json.loads(out.read_text())
    masked = ("docs", "win5", "win10", "win20", "docs_win5", "docs_win10")
    layouts = [
        f"{cp}_{method}" for cp in ("cp4", "cp2") for method in ("allgather", "alltoall", "ulysses", "ulysses_split")
    ]
    cases = {*layouts, *(f"{layout}_{m}" for layout in layouts for m in masked)}
    sinks = {f"{layout}_docs_win{w}_sinks" for layout in layouts for w in (5, 10)}
    bitwise = {f"{cp}_alltoall_overlap_bitwise_win{w}" for cp in ("cp4", "cp2") for w in (None, 10)}
    sliced = {f"{cp}_alltoall_sliced{m}_lse" for cp in ("cp4", "cp2") for m in ("", "_docs_win10")}
    assert set(results) == cases | {f"{case}_lse" for case in cases} | sinks | bitwise | sliced
    for case in bitwise:  # overlapping the ring's transfers changes no bit of the results
        assert results[case] == 0.0, f"{case}: overlapped ring differs from the non-overlapping one"
    for case, diff in results.items():  # the worker reports inf for any NaN or inf
        assert diff < 1e-5, f"{case}: output/gradient differs by {diff}"
