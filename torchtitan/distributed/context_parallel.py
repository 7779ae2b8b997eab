"""Context parallelism: every sequence is split over the ranks of the `cp` mesh dimension, and attention
sees the whole sequence through the project's own ring attention or, with
`parallelism.context_parallel_method = "ulysses"`, through all-to-alls around the run's own kernel
(UlyssesAttention, below) (PyTorch's experimental
context_parallel has no CPU path; this one runs on CPU with gloo and on CUDA with nccl alike). It
applies the mask rule of `torchtitan.models.common.attention`: query i sees key j when j <= i, i - j < window
(when the layer has a sliding window) and both are in the same document (when document ids are given).

Load balance: the sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r. Under a
causal mask a chunk late in the sequence attends to many keys and an early one to few, so pairing
them gives every rank the same amount of attention work. Document masks do not change that: the
chunk pairs are computed whether or not their documents meet (finding out would cost a host sync).
A sliding window also skips the chunk pairs entirely beyond its reach, which can leave the ranks
whose early chunk lies within a window of the sequence start with fewer pairs (less work, never more).

Everything outside attention is per token, so the rest of the model runs unchanged on the local
tokens. Rotary embeddings need the global position of each local token: the model's
`token_positions` holds them. Tokens, labels and document ids are cut with the same positions
(`shard_sequence`). The loss is a sum of token losses divided by the global count of valid labels
(over the dp and cp ranks and the gradient-accumulation micro-batches; the trainer computes it), so
no rank's loss depends on how many valid labels its own tokens hold, and the cp ranks' losses add up
to the whole sequences' share of the global-batch loss. FSDP shards over the cp ranks as over
data-parallel ranks.

The ring's rotate methods (`parallelism.context_parallel_rotate_method`):
- allgather: gather the keys, values and document ids of all ranks once, then one masked attention
  over the full sequence. Simple; holds the whole sequence's keys and values.
- alltoall: a ring of cp steps; at each step every rank attends to one rank's block of keys and
  values and passes the block (with its document ids) on to the next rank (an all-to-all in which
  each rank sends to one peer). Partial results are merged through their log-sum-exp, as in flash
  attention. Each chunk pair runs block_attention (torchtitan.models.common.attention), which keeps
  for backward only its inputs, output and log-sum-exp and recomputes the probabilities there, so
  no chunk pair's [q, k] scores outlive it. Fully masked chunk pairs (later chunks; chunks beyond
  the window) are skipped. The
  transfer of the next block is posted before the current block's attention and waited for after it
  (`context_parallel_ring_overlap`), in forward and in backward (_RotatePost / _RotateWait).
Both are differentiated by autograd: the backward of a gather is a reduce-scatter, the backward of a
rotation is the opposite rotation. Document ids carry no gradient and travel by plain collectives.
"""

import math
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan.config import UserError
from torchtitan.distributed.comms import all_to_all
from torchtitan.models.common.attention import AttentionFn, block_attention, visible
from torchtitan.models.common.spec import layers_of


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two of the 2 x cp sequence chunks that rank `cp_rank` holds (load-balanced pairing)."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the tokens that rank `cp_rank` holds, in local order."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(cp_rank, cp)])


def shard_sequence(x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """This rank's tokens of a [batch, seq, ...] tensor (all of it without context parallel)."""
    return x if positions is None else x.index_select(1, positions.to(x.device))


class _AllGather(torch.autograd.Function):
    """Stack the tensors of all ranks of `group` on a new leading dim; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # gloo wants the ranks concatenated on dim 0
        dist.all_gather_single(out, x.contiguous(), group=group)  # torch 2.13: all_gather_into_tensor is deprecated
        return out.unflatten(0, (size, x.shape[0]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); one per output
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(out, grad.contiguous().flatten(0, 1), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def _shift(x: torch.Tensor, group, offset: int) -> tuple[torch.Tensor, dist.Work]:
    """Send `x` to the rank `offset` ahead in the ring and receive what the rank `offset` behind sent:
    (the receive buffer, the transfer's work handle) at once, the buffer filled when the work is
    waited for."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = x.contiguous().view(-1)
    send, recv = [0] * size, [0] * size
    send[(rank + offset) % size] = flat.numel()
    recv[(rank - offset) % size] = flat.numel()
    out = torch.empty_like(flat)
    work = dist.all_to_all_single(
        out, flat, output_split_sizes=recv, input_split_sizes=send, group=group, async_op=True
    )
    # With async_op, torch returns the work handle (all_to_all_single's return is not annotated).
    return out.view(x.shape), cast(dist.Work, work)


class _Transfer:
    """The work handle of a ring transfer in flight: a block's, shared by the pair of Functions below,
    or its document ids'."""

    def __init__(self, group, overlap: bool):
        self.group, self.overlap = group, overlap
        self.work: dist.Work | None = None

    def post(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        out, self.work = _shift(x, self.group, offset)
        if not self.overlap:  # the non-overlapping ring: wait at once
            self.wait()
        return out

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class _RotatePost(torch.autograd.Function):
    """One ring step, first half: post the transfer of this rank's block to the next rank and return the
    receive buffer (filled once _RotateWait has run). Backward: wait for the gradient that
    _RotateWait's backward posted back, so that the posting rank computes meanwhile."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, transfer: _Transfer) -> torch.Tensor:
        ctx.transfer = transfer
        return transfer.post(x, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); one per output
        ctx.transfer.wait()
        return grad, None


class _RotateWait(torch.autograd.Function):
    """One ring step, second half: wait for the block posted by _RotatePost. Backward: post the
    gradient back to the rank the block came from (the receive buffer is _RotatePost's gradient: its
    only consumer is this Function, so nothing reads it before the wait)."""

    @staticmethod
    def forward(ctx, buffer: torch.Tensor, transfer: _Transfer) -> torch.Tensor:
        ctx.transfer = transfer
        transfer.wait()
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); one per output
        return ctx.transfer.post(grad, -1), None


class _Tie(torch.autograd.Function):
    """Return `out` unchanged, with `block` in its graph (gradient zero). A rotation's backward is a
    collective every rank must join, but autograd runs it only where the rotated block was used: under a
    sliding window a rank may skip every chunk pair of the last block it receives while its peers use
    theirs, and would then leave them waiting in the backward all-to-all. Tying the last block to the
    output puts the whole chain of rotations into every rank's graph."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        ctx.block_shape, ctx.block_dtype = block.shape, block.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); one per output
        return grad, grad.new_zeros(ctx.block_shape, dtype=ctx.block_dtype)


def _repeat_kv(x: torch.Tensor, repeats: int) -> torch.Tensor:
    return x.repeat_interleave(repeats, dim=1) if repeats > 1 else x


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention outputs over disjoint key blocks into the output over their union, and its
    log-sum-exp. Every query sees itself, so the merged log-sum-exp is finite and empty blocks (-inf)
    get weight 0."""
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    # parts is never empty (a query sees at least its own key): the sum is a tensor, not sum's start 0.
    return cast(torch.Tensor, sum(torch.exp(p_lse - lse).unsqueeze(-1) * out for out, p_lse in parts)), lse


def _chunk_positions(chunk_id: int, chunk: int, device) -> torch.Tensor:
    return torch.arange(chunk_id * chunk, (chunk_id + 1) * chunk, device=device)


def _pair_masked_out(q_id: int, k_id: int, chunk: int, window: int | None) -> bool:
    """Whether no query of chunk q_id sees any key of chunk k_id: the keys are all later, or all
    beyond the window (the earliest query is `window` or more past the last key)."""
    if k_id > q_id:
        return True
    return window is not None and q_id * chunk - ((k_id + 1) * chunk - 1) >= window


def _pair_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, window: int | None
):
    """The mask of a chunk pair as block_attention's function of query rows: built a slice at a time,
    in forward and again in backward, from the positions and document ids it holds."""

    def rows(start: int, stop: int) -> torch.Tensor:
        return visible(q_pos[start:stop], k_pos, None if q_doc is None else q_doc[:, start:stop], k_doc, window)

    return rows


class ContextParallelAttention:
    """Attention of this rank's queries to the keys of the whole sequence split over `cp_mesh`, under
    the mask rule of `torchtitan.models.common.attention` (causal, sliding window, document mask).

    Called as attention(q, k, v, doc_ids=None, window=None, return_lse=False) with q, k [batch, heads or kv_heads,
    local_seq, head_dim] and v [batch, kv_heads, local_seq, v_head_dim] (v_head_dim may differ from
    head_dim, as in MLA; grouped-query heads are repeated after communication,
    so only the kv heads travel), doc_ids [batch, local_seq] (this rank's document ids in local order,
    cut by `shard_sequence`; None: one document) and the layer's window (None: unlimited); with
    `return_lse` it returns (output, lse), lse [batch, heads, local_seq] over the keys of the whole
    sequence (the attention contract of torchtitan.models.common.attention)."""

    def __init__(self, cp_mesh, rotate_method: str, overlap: bool = True):
        if rotate_method not in ("allgather", "alltoall"):
            raise ValueError(f"unknown context_parallel_rotate_method {rotate_method!r}")
        self.group = cp_mesh.get_group()
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.rotate_method = rotate_method
        self.overlap = overlap  # the rotating ring: transfer the next block while computing on this one

    @torch._dynamo.disable  # collectives inside autograd Functions: run eagerly inside compiled blocks
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        window: int | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        repeats = q.shape[1] // k.shape[1]
        if self.rotate_method == "allgather":
            return self._allgather(q, k, v, repeats, doc_ids, window, return_lse)
        out, lse = self._ring(q, k, v, repeats, doc_ids, window)
        return (out, lse) if return_lse else out

    def _global_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """[cp, ..., 2 x chunk, d] blocks of all ranks -> [..., seq, d] in sequence order."""
        first, second = gathered.unflatten(-2, (2, -1)).unbind(-3)  # each [cp, ..., chunk, d]
        # Chunk c < cp is rank c's first; chunk 2cp-1-r is rank r's second, so those run backwards.
        return torch.cat([*first.unbind(0), *second.flip(0).unbind(0)], dim=-2)

    def _allgather(self, q, k, v, repeats: int, doc_ids, window, return_lse: bool):
        kv = self._global_order(_AllGather.apply(torch.cat([k, v], dim=-1), self.group))
        k_all, v_all = (_repeat_kv(x, repeats) for x in kv.split([k.shape[-1], v.shape[-1]], dim=-1))
        seq = k_all.shape[-2]
        q_pos = local_positions(seq, self.cp, self.rank).to(q.device)
        k_pos = torch.arange(seq, device=q.device)
        doc_all = None
        if doc_ids is not None:
            # Integer ids need no gradient; the same gather (forward only) with a unit last dim so
            # that _global_order sees the [..., seq, d] layout of k and v.
            doc_all = self._global_order(_AllGather.apply(doc_ids.unsqueeze(-1), self.group)).squeeze(-1)
        if return_lse:
            # block_attention, not math_attention: no [local, seq] scores (nor mask) kept for backward.
            out, lse = block_attention(q, k_all, v_all, _pair_mask(q_pos, k_pos, doc_ids, doc_all, window))
            return out.to(q.dtype), lse
        mask = visible(q_pos, k_pos, doc_ids, doc_all, window)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)

    def _ring(self, q, k, v, repeats: int, doc_ids, window) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = q.shape[-2] // 2
        q_chunks = q.chunk(2, dim=-2)
        q_docs = doc_ids.chunk(2, dim=-1) if doc_ids is not None else (None, None)
        q_ids = chunk_ids(self.rank, self.cp)
        parts: list[list] = [[], []]
        # Keys and values travel as one block, concatenated on the features (their head dims may differ).
        kv = torch.cat([k, v], dim=-1)
        kv_docs = doc_ids
        for step in range(self.cp):
            rotation = None  # the next block in flight (every step but the last): buffers and transfers
            if step < self.cp - 1:
                # Post the next block's transfer before computing on this one (with overlap, the wait
                # comes after the computation; without, at once). Its backward mirrors it.
                transfer = _Transfer(self.group, self.overlap)
                incoming = _RotatePost.apply(kv, transfer)
                # The block's document ids travel with it; no gradient.
                docs_transfer = _Transfer(self.group, self.overlap)
                docs_in = docs_transfer.post(kv_docs, 1) if kv_docs is not None else None
                rotation = (incoming, transfer, docs_in, docs_transfer)
            source = (self.rank - step) % self.cp  # whose block this rank holds at this step
            k_block, v_block = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
            k_chunks = _repeat_kv(k_block, repeats).chunk(2, dim=-2)
            v_chunks = _repeat_kv(v_block, repeats).chunk(2, dim=-2)
            k_docs = kv_docs.chunk(2, dim=-1) if kv_docs is not None else (None, None)
            for qi, q_id in enumerate(q_ids):
                for ki, k_id in enumerate(chunk_ids(source, self.cp)):
                    if _pair_masked_out(q_id, k_id, chunk, window):
                        continue
                    mask = None  # an earlier chunk with neither documents nor window: all visible
                    if k_id == q_id or doc_ids is not None or window is not None:
                        mask = _pair_mask(
                            _chunk_positions(q_id, chunk, q.device),
                            _chunk_positions(k_id, chunk, q.device),
                            q_docs[qi],
                            k_docs[ki],
                            window,
                        )
                    parts[qi].append(block_attention(q_chunks[qi], k_chunks[ki], v_chunks[ki], mask))
            if rotation is not None:
                incoming, transfer, docs_in, docs_transfer = rotation
                kv = _RotateWait.apply(incoming, transfer)
                docs_transfer.wait()
                kv_docs = docs_in
        outs, lses = zip(*(_merge(p) for p in parts))
        return _Tie.apply(torch.cat(outs, dim=-2), kv).to(q.dtype), torch.cat(lses, dim=-1)


def kv_replicas(heads: int, kv_heads: int, cp: int) -> int:
    """How many times Ulysses repeats each KV head so that the cp head groups each get whole KV heads
    matching their query heads: the least r with cp | kv_heads x r. r always divides heads / kv_heads
    when cp divides heads, so each query head still reads the copy of its own KV head."""
    if heads % cp or heads % kv_heads:
        raise ValueError(f"Ulysses context parallel {cp} cannot split {heads} query heads over {kv_heads} KV heads")
    return cp // math.gcd(kv_heads, cp)


def check_ulysses_degree(heads: int, tp: int, cp: int) -> None:
    """Raise UserError before launch when Ulysses cannot split a tensor-parallel rank's query heads
    evenly over `cp` ranks, naming the largest degree that would."""
    local = heads // max(tp, 1)
    if local % cp == 0:
        return
    best = max(d for d in range(1, cp + 1) if local % d == 0)
    on_tp = f" (tensor_parallel_degree = {tp} leaves {local} per rank)" if tp > 1 else ""
    raise UserError(
        f"parallelism.context_parallel_degree = {cp} with context_parallel_method = 'ulysses' must divide the model's "
        f"{heads} query heads{on_tp}: each rank attends over the whole sequence for heads / degree of them. The "
        f"largest degree that works is {best}; or use context_parallel_method = 'ring', which splits the sequence "
        "at any degree"
    )


class HeadExchange:
    """The all-to-all of Ulysses context parallel, for any layer that works head by head along the
    whole sequence (attention; gated DeltaNet's conv and recurrence). Each rank holds the
    load-balanced chunks of the sequence (local_positions) for all of its heads; `to_heads` gives
    every rank the whole sequence, in sequence order, for heads / cp of them (rank j the j-th
    contiguous group), and `to_tokens` brings each rank its own tokens of every head back."""

    def __init__(self, cp_mesh):
        self.group = cp_mesh.get_group()
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self._orders: dict = {}
        self._docs: tuple = (None, None)

    def order(self, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(perm, inverse): perm lists the global positions of the tokens grouped by rank (rank 0's
        local tokens, then rank 1's, ...); inverse puts that grouping into sequence order."""
        key = (seq, device)
        if key not in self._orders:
            perm = torch.cat([local_positions(seq, self.cp, r) for r in range(self.cp)]).to(device)
            self._orders[key] = (perm, torch.argsort(perm))
        return self._orders[key]

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[b, h, s_local, d] (all heads, local tokens) -> [b, h / cp, seq, d] (head group of this rank,
        every token in sequence order)."""
        b, h, s, d = x.shape
        _, inverse = self.order(s * self.cp, x.device)
        x = all_to_all(x.view(b, self.cp, h // self.cp, s, d).movedim(1, 0), self.group)
        return x.movedim(0, 2).flatten(2, 3).index_select(2, inverse)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[b, h / cp, seq, ...] -> [b, h, s_local, ...]: the inverse of to_heads (any trailing dims)."""
        perm, _ = self.order(x.shape[2], x.device)
        x = x.index_select(2, perm)
        x = x.unflatten(2, (self.cp, x.shape[2] // self.cp)).movedim(2, 0)
        return all_to_all(x, self.group).movedim(0, 1).flatten(1, 2)

    def gathered_docs(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """Document ids [b, s_local] of the whole sequence in sequence order, once per batch (every
        layer gets the same doc_ids tensor; holding it keeps its id from being reused)."""
        if self._docs[0] is not doc_ids:
            _, inverse = self.order(doc_ids.shape[1] * self.cp, doc_ids.device)
            gathered = _AllGather.apply(doc_ids, self.group)  # [cp, b, s_local]
            self._docs = (doc_ids, gathered.movedim(0, 1).flatten(1, 2).index_select(1, inverse))
        return self._docs[1]


class UlyssesAttention:
    """All-to-all ("Ulysses") context parallel around any attention kernel with the contract of
    torchtitan.models.common.attention: q, k and v go through a HeadExchange, so `kernel` runs
    unchanged on positions 0..seq-1 of heads / cp of the heads with the gathered document ids and the
    layer's window, and the output (and log-sum-exp) comes back to each rank's own tokens of every
    head, in its load-balanced order. Rotary positions are already applied to q and k by the caller
    (global positions of the local tokens). Grouped-query KV heads are repeated (`kv_replicas`) where
    fewer than cp would split unevenly.

    Per-head transforms on the log-sum-exp (gpt-oss's sinks) are applied by the family after this
    returns, on the local tokens of every head: each rank holds every sink and uses it on its own
    tokens (as under the ring); their gradient is summed over the cp ranks with the other replicated
    parameters. The result is the same as applying head group j's sinks on rank j during attention."""

    def __init__(self, cp_mesh, kernel: AttentionFn, exchange: HeadExchange | None = None):
        self.exchange = exchange or HeadExchange(cp_mesh)
        self.cp = self.exchange.cp
        self.kernel: AttentionFn = kernel

    @torch._dynamo.disable  # collectives inside autograd Functions: run eagerly inside compiled blocks
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        window: int | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads % self.cp:
            raise ValueError(
                f"context_parallel_method = 'ulysses' with degree {self.cp} cannot split the {heads} "
                "query heads of a rank (preflight refuses this)"
            )
        repeats = kv_replicas(heads, kv_heads, self.cp)
        ex = self.exchange
        q_all = ex.to_heads(q)
        # Keys and values travel as one block, concatenated on the features (their head dims may differ).
        kv_all = ex.to_heads(_repeat_kv(torch.cat([k, v], dim=-1), repeats))
        k_all, v_all = kv_all.split([k.shape[-1], v.shape[-1]], dim=-1)
        docs = ex.gathered_docs(doc_ids) if doc_ids is not None else None
        result = self.kernel(q_all, k_all, v_all, doc_ids=docs, window=window, return_lse=return_lse)
        if not return_lse:
            return ex.to_tokens(cast(torch.Tensor, result))
        out, lse = result
        return ex.to_tokens(out), ex.to_tokens(lse.unsqueeze(-1)).squeeze(-1)


def describe_cp(parallelism) -> str:
    """How context-parallel attention works under `parallelism.context_parallel_method`, for the log: the
    ring replaces the kernel, Ulysses wraps it."""
    if parallelism.context_parallel_method == "ring":
        rotate = parallelism.context_parallel_rotate_method
        if rotate == "alltoall":
            rotate += ", transfers overlapped" if parallelism.context_parallel_ring_overlap else ", no overlap"
        return f"ring attention ({rotate}) in place of the kernel"
    return "Ulysses, all-to-all around the kernel"


def apply_cp(
    model: nn.Module,
    cp_mesh,
    seq_len: int,
    rotate_method: str,
    attention_path: str,
    blocks=None,
    method: str = "ring",
    overlap: bool = True,
) -> None:
    """Make `model` (a decoder or a pipeline stage of one) run on this rank's share of each sequence:
    the attention of every block (`block.<attention_path>.attention_fn`; `blocks`, default the
    model's layers) becomes context-parallel and the model's rotary positions the global positions
    of the local tokens. `method` "ring": ContextParallelAttention with `rotate_method`; "ulysses":
    UlyssesAttention around each block's current attention_fn (the kernel the run chose). `overlap`:
    the rotating ring's transfers overlap its computation."""
    if method not in ("ring", "ulysses"):
        raise ValueError(f"unknown context_parallel_method {method!r}")
    ring: AttentionFn | None = ContextParallelAttention(cp_mesh, rotate_method, overlap) if method == "ring" else None
    exchange = HeadExchange(cp_mesh)  # one, so that its per-batch document gather is shared
    wrapped: dict[int, AttentionFn] = {}  # one Ulysses wrapper per kernel
    for block in layers_of(model).values() if blocks is None else blocks:
        module = block.get_submodule(attention_path)
        if hasattr(module, "set_head_exchange"):
            # A mixer that is not attention (gated DeltaNet) goes head-parallel by all-to-all itself.
            module.set_head_exchange(exchange)  # pyrefly: ignore[not-callable]  # torch types Module.__getattr__'s result Tensor | Module; a method here
        elif ring is not None:
            module.attention_fn = ring  # pyrefly: ignore[bad-argument-type]  # torch types Module.__setattr__'s value Tensor | Module; it takes any
        else:
            kernel = cast(AttentionFn, module.attention_fn)  # torch types a submodule attribute Tensor | Module
            if id(kernel) not in wrapped:
                wrapped[id(kernel)] = UlyssesAttention(cp_mesh, kernel, exchange)
            module.attention_fn = wrapped[id(kernel)]  # pyrefly: ignore[bad-argument-type]  # torch types Module.__setattr__'s value Tensor | Module; it takes any
    model.set_token_positions(local_positions(seq_len, cp_mesh.size(), cp_mesh.get_local_rank()))  # pyrefly: ignore[not-callable]  # torch types Module.__getattr__'s result Tensor | Module; a method here
