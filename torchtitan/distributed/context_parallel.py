"""Context parallelism: every sequence is split over the ranks of the `cp` mesh dimension, and causal
attention sees the whole sequence through the project's own ring attention (PyTorch's experimental
context_parallel has no CPU path; this one runs on CPU with gloo and on CUDA with nccl alike).

Load balance: the sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r. Under a
causal mask a chunk late in the sequence attends to many keys and an early one to few, so pairing
them gives every rank the same amount of attention work.

Everything outside attention is per token, so the rest of the model runs unchanged on the local
tokens. Rotary embeddings need the global position of each local token: the model's
`token_positions` holds them. Tokens and labels are cut with the same positions
(`shard_sequence`), so each rank's loss is the mean over its tokens and, all ranks holding equally
many, the mean over the cp ranks is the loss of the whole sequence. FSDP shards over the cp ranks
as over data-parallel ranks, which averages their gradients.

Rotate methods (`parallelism.context_parallel_rotate_method`):
- allgather: gather the keys and values of all ranks once, then one masked attention over the full
  sequence. Simple; holds the whole sequence's keys and values.
- alltoall: a ring of cp steps; at each step every rank attends to one rank's block of keys and
  values and passes the block on to the next rank (an all-to-all in which each rank sends to one
  peer). Partial results are merged through their log-sum-exp, as in flash attention. Fully masked
  chunk pairs are skipped, so each step costs every rank the same.
Both are differentiated by autograd: the backward of a gather is a reduce-scatter, the backward of a
rotation is the opposite rotation.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


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
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.unflatten(0, (size, x.shape[0]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous().flatten(0, 1), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def _shift(x: torch.Tensor, group, offset: int) -> torch.Tensor:
    """Send `x` to the rank `offset` ahead in the ring and return what the rank `offset` behind sent."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = x.contiguous().view(-1)
    send, recv = [0] * size, [0] * size
    send[(rank + offset) % size] = flat.numel()
    recv[(rank - offset) % size] = flat.numel()
    out = torch.empty_like(flat)
    dist.all_to_all_single(out, flat, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out.view(x.shape)


class _Rotate(torch.autograd.Function):
    """One ring step: receive the previous rank's block; backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad, ctx.group, -1), None


def _repeat_kv(x: torch.Tensor, repeats: int) -> torch.Tensor:
    return x.repeat_interleave(repeats, dim=1) if repeats > 1 else x


def _block_attention(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q to one block of keys, in float32: (output, log-sum-exp of the scores)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:  # q and k are the same chunk: the diagonal block of the causal mask
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v.float(), lse


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine attention outputs over disjoint key blocks into the output over their union."""
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    return sum(torch.exp(p_lse - lse) * out for out, p_lse in parts)


class ContextParallelAttention:
    """Causal attention of this rank's queries to the keys of the whole sequence split over `cp_mesh`.

    Called as attention(q, k, v) with q [batch, heads, local_seq, head_dim] and k, v with
    [batch, kv_heads, local_seq, head_dim] (grouped-query heads are repeated after communication,
    so only the kv heads travel)."""

    def __init__(self, cp_mesh, rotate_method: str):
        if rotate_method not in ("allgather", "alltoall"):
            raise ValueError(f"unknown context_parallel_rotate_method {rotate_method!r}")
        self.group = cp_mesh.get_group()
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.rotate_method = rotate_method

    @torch._dynamo.disable  # collectives inside autograd Functions: run eagerly inside compiled blocks
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        repeats = q.shape[1] // k.shape[1]
        if self.rotate_method == "allgather":
            return self._allgather(q, k, v, repeats)
        return self._ring(q, k, v, repeats)

    def _global_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """[cp, ..., 2 x chunk, d] blocks of all ranks -> [..., seq, d] in sequence order."""
        first, second = gathered.unflatten(-2, (2, -1)).unbind(-3)  # each [cp, ..., chunk, d]
        # Chunk c < cp is rank c's first; chunk 2cp-1-r is rank r's second, so those run backwards.
        return torch.cat([*first.unbind(0), *second.flip(0).unbind(0)], dim=-2)

    def _allgather(self, q, k, v, repeats: int) -> torch.Tensor:
        kv = self._global_order(_AllGather.apply(torch.stack([k, v]), self.group))
        k_all, v_all = _repeat_kv(kv[0], repeats), _repeat_kv(kv[1], repeats)
        seq = k_all.shape[-2]
        q_pos = local_positions(seq, self.cp, self.rank).to(q.device)
        visible = torch.arange(seq, device=q.device)[None, :] <= q_pos[:, None]
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=visible)

    def _ring(self, q, k, v, repeats: int) -> torch.Tensor:
        q_chunks = q.chunk(2, dim=-2)
        q_ids = chunk_ids(self.rank, self.cp)
        parts: list[list] = [[], []]
        kv = torch.stack([k, v])
        for step in range(self.cp):
            if step > 0:
                kv = _Rotate.apply(kv, self.group)
            source = (self.rank - step) % self.cp  # whose block this rank holds at this step
            k_chunks = _repeat_kv(kv[0], repeats).chunk(2, dim=-2)
            v_chunks = _repeat_kv(kv[1], repeats).chunk(2, dim=-2)
            for qi, q_id in enumerate(q_ids):
                for ki, k_id in enumerate(chunk_ids(source, self.cp)):
                    if k_id <= q_id:  # later chunks are masked out entirely
                        parts[qi].append(_block_attention(q_chunks[qi], k_chunks[ki], v_chunks[ki], k_id == q_id))
        return torch.cat([_merge(p) for p in parts], dim=-2).to(q.dtype)


def apply_cp(model: nn.Module, cp_mesh, seq_len: int, rotate_method: str, attention_path: str) -> None:
    """Make `model` (a decoder or a pipeline stage of one) run on this rank's share of each sequence:
    the attention of every block (`block.<attention_path>.attention_fn`) becomes context-parallel
    and the model's rotary positions the global positions of the local tokens."""
    attention = ContextParallelAttention(cp_mesh, rotate_method)
    for block in model.layers.values():
        block.get_submodule(attention_path).attention_fn = attention
    model.set_token_positions(local_positions(seq_len, cp_mesh.size(), cp_mesh.get_local_rank()))
