"""Context-parallel attention against single-process attention (`sdpa_attention` on the full
tensors), forward and backward, for both rotate methods of the ring and for Ulysses (all-to-all
around sdpa_attention, and around the per-document split_attention: "ulysses_split"), on a 4-rank CP
group and on the 2-rank CP groups of a 2 x 2 mesh, with grouped-query heads (4 query heads over 2 KV
heads: on 4 ranks Ulysses repeats each KV head twice): plain causal, and under the full mask rule of
torchtitan.models.common.attention (documents whose boundaries fall inside chunks, sliding windows shorter
and longer than a chunk, and both). Each case also runs with return_lse (name + "_lse"), where the
log-sum-exp is compared too and the backward flows through it as well; and gpt-oss's per-head sinks
on the ring's output and log-sum-exp, with documents and windows, against an explicit softmax with a
sink column (name + "_sinks"); the rotating ring with overlapped transfers against the same ring
without overlap, bitwise (name "*_overlap_bitwise_*": 0 when equal); the rotating ring with its
chunk pairs computed a few query rows at a time ("*_alltoall_sliced*"). Rank 0 writes {case: max abs
diff of output (and lse) and of the q, k, v gradients}, inf where any of them holds a NaN or inf.

    torchrun --nproc_per_node 4 tests/distributed/cp_worker.py OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.distributed.context_parallel import (
    ContextParallelAttention,
    UlyssesAttention,
    local_positions,
    shard_sequence,
)
from torchtitan.distributed.process_group import exit_process
from torchtitan.models.common import attention
from torchtitan.models.common.attention import sdpa_attention, split_attention, visible

METHODS = ("allgather", "alltoall", "ulysses", "ulysses_split")


def cp_attention(cp_mesh, method: str):
    """The context-parallel attention a case names: a ring rotate method, or Ulysses around a kernel."""
    if method == "ulysses":
        return UlyssesAttention(cp_mesh, sdpa_attention)
    if method == "ulysses_split":
        return UlyssesAttention(cp_mesh, split_attention)
    return ContextParallelAttention(cp_mesh, method)


# Document lengths of the first row, repeated to fill it. Their boundaries (3, 9, 14, 25, 27, 36, 39,
# 45, 50, 61, 63) miss every multiple of 8, the chunk edges below, so documents start inside chunks
# and some queries see no key at all in a whole block.
SHORT_DOCS = [3, 6, 5, 11, 2, 9]
CHUNK = 8  # tokens per chunk (the sequence is 2 x cp chunks) in the masked cases
# (name, documents?, window): a window shorter than a chunk, and longer ones. Chunk pairs two chunks
# apart are 9 positions apart at their closest (first query, last key): window 10 lets exactly that
# one pair through, so skipping a chunk pair one position too early fails; window 20 reaches three
# chunks back.
MASKED_CASES = [
    ("docs", True, None),
    ("win5", False, 5),
    ("win10", False, 10),
    ("win20", False, 20),
    ("docs_win5", True, 5),
    ("docs_win10", True, 10),
]


def document_rows(seq: int) -> torch.Tensor:
    """[2, seq] int32 document ids: row 0 many short documents, row 1 one document that spans every
    chunk between two short ones (boundaries at 2 and seq - 3, inside chunks too)."""
    rows = []
    for lengths in (SHORT_DOCS * seq, [2, seq - 5, 3]):
        ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
        rows.append(ids[:seq])
    return torch.stack(rows)


def compare(
    cp_mesh, method: str, chunk: int = 4, docs: bool = False, window: int | None = None, lse: bool = False
) -> float:
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    torch.manual_seed(0)  # the same full tensors on every rank
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 2 * chunk * cp, 16
    q = torch.randn(batch, heads, seq, dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, requires_grad=True)
    grad_out = torch.randn(batch, heads, seq, dim)
    grad_lse = torch.randn(batch, heads, seq)
    doc_ids = document_rows(seq) if docs else None
    ref = sdpa_attention(q, k, v, doc_ids, window, return_lse=lse)
    ref_out, ref_lse = ref if lse else (ref, None)
    torch.autograd.backward([ref_out, ref_lse] if lse else [ref_out], [grad_out, grad_lse] if lse else [grad_out])

    pos = local_positions(seq, cp, rank)
    local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    # Document ids are cut like the tokens: [batch, seq] along dim 1, as the trainer does.
    local_docs = shard_sequence(doc_ids, pos) if docs else None
    got = cp_attention(cp_mesh, method)(*local, doc_ids=local_docs, window=window, return_lse=lse)
    out, out_lse = got if lse else (got, None)
    torch.autograd.backward(
        [out, out_lse] if lse else [out], [grad_out[:, :, pos], grad_lse[:, :, pos]] if lse else [grad_out[:, :, pos]]
    )
    results = [out] + [t.grad for t in local] + ([out_lse] if lse else [])
    diffs = [(out - ref_out.detach()[:, :, pos]).abs().max()]
    if lse:
        diffs.append((out_lse - ref_lse.detach()[:, :, pos]).abs().max())
    diffs += [(mine.grad - full.grad[:, :, pos]).abs().max() for mine, full in zip(local, (q, k, v))]
    worst = torch.stack(diffs).max()
    if not all(torch.isfinite(t).all() for t in results):
        worst = torch.tensor(float("inf"))  # a NaN would not survive the max reduction reliably
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def compare_sinks(cp_mesh, method: str, window: int) -> float:
    """gpt-oss's sinks on the ring: out * sigmoid(lse - sink) from this rank's output and the ring's lse
    against an explicit float64 softmax over the masked logits with a sink column (documents and a
    window); output and the gradients of q, k, v and the sinks (every CP rank holds all the sinks: their
    gradient is summed over the ranks)."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    torch.manual_seed(1)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 2 * CHUNK * cp, 16
    q, k, v = (torch.randn(batch, n, seq, dim, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    sinks = (torch.randn(heads) * 2).requires_grad_()
    grad_out = torch.randn(batch, heads, seq, dim)
    doc_ids = document_rows(seq)
    full = torch.arange(seq)
    logits = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * dim**-0.5
    logits = logits.masked_fill(~visible(full, full, doc_ids, doc_ids, window), float("-inf"))
    column = sinks.double()[None, :, None, None].expand(batch, heads, seq, 1)
    probs = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]
    ref = probs @ v.double().repeat_interleave(2, 1)
    ref.backward(grad_out.double())

    pos = local_positions(seq, cp, rank)
    local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    mine = sinks.detach().clone().requires_grad_()
    out, lse = cp_attention(cp_mesh, method)(
        *local, doc_ids=shard_sequence(doc_ids, pos), window=window, return_lse=True
    )
    out = out * torch.sigmoid(lse - mine[None, :, None]).unsqueeze(-1)
    out.backward(grad_out[:, :, pos])
    sink_grad = mine.grad.clone()
    dist.all_reduce(sink_grad, group=cp_mesh.get_group())
    diffs = [(out.double() - ref.detach()[:, :, pos]).abs().max(), (sink_grad.double() - sinks.grad).abs().max()]
    diffs += [(m.grad.double() - f.grad[:, :, pos]).abs().max() for m, f in zip(local, (q, k, v))]
    worst = torch.stack(diffs).max().float()
    if not all(torch.isfinite(t).all() for t in (out, sink_grad, *[t.grad for t in local])):
        worst = torch.tensor(float("inf"))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def compare_overlap(cp_mesh, window: int | None) -> float:
    """The rotating ring with its transfers overlapped against the same ring waiting for each transfer at
    once: 0.0 when output, log-sum-exp and the q, k, v gradients are bitwise equal (torch.equal), else
    1.0 (documents, a window, grouped-query heads)."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    torch.manual_seed(2)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 2 * CHUNK * cp, 16
    full = [torch.randn(batch, n, seq, dim) for n in (heads, kv_heads, kv_heads)]
    grad_out, grad_lse = torch.randn(batch, heads, seq, dim), torch.randn(batch, heads, seq)
    pos = local_positions(seq, cp, rank)
    docs = shard_sequence(document_rows(seq), pos)
    results = []
    for overlap in (True, False):
        local = [t[:, :, pos].clone().requires_grad_() for t in full]
        out, lse = ContextParallelAttention(cp_mesh, "alltoall", overlap)(
            *local, doc_ids=docs, window=window, return_lse=True
        )
        torch.autograd.backward([out, lse], [grad_out[:, :, pos], grad_lse[:, :, pos]])
        results.append([out, lse] + [t.grad for t in local])
    same = torch.tensor(0.0 if all(torch.equal(a, b) for a, b in zip(*results)) else 1.0)
    dist.all_reduce(same, op=dist.ReduceOp.MAX)
    return same.item()


def main(out_path: str):
    dist.init_process_group("gloo")
    results = {}
    mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    mesh2x2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    for method in METHODS:
        for prefix, mesh in (("cp4", mesh4["cp"]), ("cp2", mesh2x2["cp"])):
            for lse, suffix in ((False, ""), (True, "_lse")):
                results[f"{prefix}_{method}{suffix}"] = compare(mesh, method, lse=lse)
                for name, docs, window in MASKED_CASES:
                    results[f"{prefix}_{method}_{name}{suffix}"] = compare(mesh, method, CHUNK, docs, window, lse)
            for window in (5, 10):
                results[f"{prefix}_{method}_docs_win{window}_sinks"] = compare_sinks(mesh, method, window)
    for prefix, mesh in (("cp4", mesh4["cp"]), ("cp2", mesh2x2["cp"])):
        for window in (None, 10):
            results[f"{prefix}_alltoall_overlap_bitwise_win{window}"] = compare_overlap(mesh, window)
    # The rotating ring's block_attention with 3 query rows per slice (chunks of 8 rows: slices of 3, 3
    # and 2), as a long block runs: the slices' masks are cut from the chunk pair's positions and documents.
    whole = attention.BLOCK_SLICE_ELEMENTS
    attention.BLOCK_SLICE_ELEMENTS = 2 * 4 * CHUNK * 3  # batch x heads x keys x rows
    for prefix, mesh in (("cp4", mesh4["cp"]), ("cp2", mesh2x2["cp"])):
        for name, docs, window in (("", False, None), ("_docs_win10", True, 10)):
            results[f"{prefix}_alltoall_sliced{name}_lse"] = compare(mesh, "alltoall", CHUNK, docs, window, True)
    attention.BLOCK_SLICE_ELEMENTS = whole
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)
