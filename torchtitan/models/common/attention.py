"""Which keys a query may see, and the kernels that apply it.

A training window packs several documents. Under a causal mask (`model.attn_mask_type = "causal"`)
every token sees all earlier tokens of the window; under "block_causal" only the earlier tokens of
its own document. Documents are numbered per window by `document_ids` from the EOS the packer writes
after every document, so a token after an EOS starts the next document.

A family's attention module calls `attention_fn(q, k, v, doc_ids=None, window=None, return_lse=False)`,
an `AttentionFn` (its docstring is the contract: shapes, documents, window, and what it returns). With
`return_lse` it also returns the log-sum-exp of each query's scores, with which a family applies its
own transform inside its folder: attention sinks, for example, are a softmax over the keys plus one
learned logit s per head, which is out * sigmoid(lse - s).
Every kernel gives the same outputs and lse within round-off:
- `sdpa_attention`: PyTorch's scaled_dot_product_attention, causal, or with a boolean mask built
  from the document ids and the window. Every device; the default. With `return_lse`, the same
  mask through `math_attention` (SDPA does not return the log-sum-exp).
- `split_attention`: one causal call per document (a loop over the documents of each row), so
  no [seq, seq] mask is built; costs a host sync and a kernel launch per document.
- `flex_attention_fn()`: FlexAttention with a block mask, compiled; it skips the tiles the mask
  removes. Trains only on CUDA (torch 2.13 has no FlexAttention backward on CPU).
Context parallel replaces `attention_fn` with its ring attention, which applies the same rule, and
decoding calls the layer's KV cache (layers.KVCache.attend) with the same contract.
"""

import logging
from collections.abc import Iterable
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

MASK_TYPES = ("causal", "block_causal")
BACKENDS = ("auto", "sdpa", "split", "flex")


class AttentionFn(Protocol):
    """The attention contract: the type of an attention module's `attention_fn` and of every kernel
    (sdpa_attention, split_attention, flex_attention_fn()'s; context parallel's ring and Ulysses).

    - q [batch, heads, seq, head_dim]; k [batch, kv_heads, seq, head_dim] and v [batch, kv_heads, seq,
      v_head_dim] (grouped-query attention: each KV head serves heads / kv_heads query heads; MLA's
      v_head_dim differs from its head_dim);
    - `doc_ids` [batch, seq]: each token's document within its window (document_ids); None: one
      document per window;
    - `window`: the layer's sliding window; None: unlimited. Query i sees key j when j <= i,
      i - j < window and both are in the same document;
    - returns the output [batch, heads, seq, v_head_dim], or with `return_lse` (output, lse): lse
      [batch, heads, seq] in float32 is the log-sum-exp of each query's scaled scores over the keys it
      sees, differentiable like the output."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        window: int | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[batch, seq] int32: the index of each token's document within its window. A document ends
    with its EOS; the token after an EOS starts the next one."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=-1, dtype=torch.int32) - ends


def visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, window: int | None
) -> torch.Tensor:
    """Boolean [batch or 1, 1, q, k]: which keys each query sees. Positions are global positions in
    the window ([q] and [k]); documents [batch, q] and [batch, k], or None for one document."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
    mask = mask[None, None]
    if q_doc is not None:
        assert k_doc is not None, "documents are given for both the queries and the keys, or for neither"
        mask = mask & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    return mask


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: repeat each KV head for the heads / kv_heads query heads it serves."""
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    return k, v


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q to as many heads of keys (repeat_kv first), in float32, written out so that the
    log-sum-exp is differentiable: (output [..., q, v_dim], lse [..., q]). `mask` (boolean, broadcastable
    to the scores; None: every key visible) may hide every key of a query row: such a row gets output 0
    and lse -inf (it then adds nothing where partial results are merged), without NaN either way."""
    if q.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(q.device.type):
        # Autocast would run the two matmuls, and so the softmax after them, in bf16.
        with torch.autocast(q.device.type, enabled=False):
            return math_attention(q, k, v, mask)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # Shift by the row max for stability. The shift cancels in both results, so it needs no
    # gradient; an empty row (max -inf) is shifted by 0 instead, which keeps exp() at 0, not NaN.
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    # A row with a visible key has total >= 1 (its max scores exp(0)), so clamping at 1 changes
    # nothing there and keeps an empty row (total 0) away from 0/0 and log(0) and their NaN gradients.
    out = (weights @ v.float()) / total.clamp_min(1.0)
    lse = torch.where(total > 0, row_max + torch.log(total.clamp_min(1.0)), torch.full_like(total, float("-inf")))
    return out, lse.squeeze(-1)


# Query rows per slice of block_attention: a slice's scores, and in backward their gradient, are
# [..., rows, keys] float32 tensors of at most this many elements (64 MiB), whatever the block's length.
BLOCK_SLICE_ELEMENTS = 1 << 24


def _row_slices(q: torch.Tensor, k_len: int) -> list[tuple[int, int]]:
    per_row = max(q[..., :1, :1].numel() * k_len, 1)  # the leading dims times the keys
    rows = max(1, BLOCK_SLICE_ELEMENTS // per_row)
    return [(a, min(a + rows, q.shape[-2])) for a in range(0, q.shape[-2], rows)]


def _mask_rows(mask, start: int, stop: int) -> torch.Tensor | None:
    """The mask of query rows start:stop: `mask` is None, a boolean tensor broadcastable to the scores,
    or a function (start, stop) -> such a tensor for those rows."""
    if mask is None or callable(mask):
        return mask if mask is None else mask(start, stop)
    return mask[..., start:stop, :] if mask.dim() >= 2 and mask.shape[-2] > 1 else mask


class _BlockAttention(torch.autograd.Function):
    """math_attention's (output, lse) computed as flash attention does: the forward keeps only q, k, v,
    the mask (or the function that builds it), the output and the lse, and the backward recomputes the
    probabilities P = exp(S - lse) from them, so no [q, k] tensor outlives its slice of query rows. The
    lse has a gradient of its own (the ring merges blocks through it): with D = rowsum(dO * O),
    dS = P * (dO @ V^T - D + dlse)."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        scale = q.shape[-1] ** -0.5
        qf, kf, vf = q.float(), k.float(), v.float()
        out = qf.new_empty((*qf.shape[:-1], vf.shape[-1]))
        lse = qf.new_empty(qf.shape[:-1])
        for a, b in _row_slices(q, k.shape[-2]):
            scores = (qf[..., a:b, :] @ kf.transpose(-1, -2)).mul_(scale)
            rows_mask = _mask_rows(mask, a, b)
            if rows_mask is not None:
                scores.masked_fill_(~rows_mask, float("-inf"))
            # The row-max shift and the empty-row rules of math_attention: output 0, lse -inf, no NaN.
            row_max = scores.amax(dim=-1, keepdim=True)
            row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
            weights = scores.sub_(row_max).exp_()
            total = weights.sum(dim=-1, keepdim=True)
            out[..., a:b, :] = (weights @ vf) / total.clamp_min(1.0)
            lse[..., a:b] = torch.where(
                total > 0, row_max + torch.log(total.clamp_min(1.0)), torch.full_like(total, float("-inf"))
            ).squeeze(-1)
        tensor_mask = isinstance(mask, torch.Tensor)
        # A mask tensor goes through save_for_backward so that activation checkpointing frees it with
        # the rest; a function (it holds only positions and document ids) stays on ctx.
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if tensor_mask else []))
        ctx.mask = None if tensor_mask else mask
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); one per output
        q, k, v, out, lse, *saved_mask = ctx.saved_tensors
        mask = saved_mask[0] if saved_mask else ctx.mask
        with torch.autocast(q.device.type, enabled=False):
            scale = q.shape[-1] ** -0.5
            qf, kf, vf = q.float(), k.float(), v.float()
            grad_out, grad_lse = grad_out.float(), grad_lse.float()
            # A fully masked row has lse -inf: exp(S - 0) of its -inf scores is 0, where -inf - -inf is NaN.
            lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            dq, dk, dv = torch.empty_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
            for a, b in _row_slices(q, k.shape[-2]):
                q_rows, d_out = qf[..., a:b, :], grad_out[..., a:b, :]
                probs = (q_rows @ kf.transpose(-1, -2)).mul_(scale)
                rows_mask = _mask_rows(mask, a, b)
                if rows_mask is not None:
                    probs.masked_fill_(~rows_mask, float("-inf"))
                probs.sub_(lse[..., a:b, None]).exp_()
                dv += probs.transpose(-1, -2) @ d_out
                rowsum = (d_out * out[..., a:b, :]).sum(dim=-1, keepdim=True)
                d_scores = (d_out @ vf.transpose(-1, -2)).sub_(rowsum).add_(grad_lse[..., a:b, None]).mul_(probs)
                del probs
                dq[..., a:b, :] = (d_scores @ kf).mul_(scale)
                dk += (d_scores.transpose(-1, -2) @ q_rows).mul_(scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """math_attention's (output, lse), same dtypes and mask rules, with the memory of flash attention:
    autograd keeps q, k, v, output and lse instead of the [q, k] scores and probabilities, and forward
    and backward work on slices of the query rows (BLOCK_SLICE_ELEMENTS). `mask`: None (every key
    visible), a boolean tensor broadcastable to the scores, or a function (start, stop) returning the
    mask of query rows start:stop (so that a long block's mask need not exist whole). q, k and v have
    the same leading dims (repeat_kv first)."""
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            f"block_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} "
            "must share their leading dims"
        )
    if q.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):  # float32, as math_attention
            return _BlockAttention.apply(q, k, v, mask)
    return _BlockAttention.apply(q, k, v, mask)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """SDPA: with is_causal when every key before a query counts, else with a boolean mask."""
    k, v = repeat_kv(q, k, v)
    pos = torch.arange(q.shape[2], device=q.device)
    if return_lse:
        out, lse = math_attention(q, k, v, visible(pos, pos, doc_ids, doc_ids, window))
        return out.to(q.dtype), lse
    if doc_ids is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible(pos, pos, doc_ids, doc_ids, window))


def split_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One SDPA call per document: each document's queries see only its own keys, causally."""
    if doc_ids is None:
        return sdpa_attention(q, k, v, None, window, return_lse)
    k, v = repeat_kv(q, k, v)
    rows, row_lses = [], []
    for b, lengths in enumerate(document_lengths(doc_ids)):
        parts, lses, start = [], [], 0
        for length in lengths:
            span = slice(start, start + length)
            part = sdpa_attention(
                q[b : b + 1, :, span], k[b : b + 1, :, span], v[b : b + 1, :, span], None, window, return_lse
            )
            parts.append(part[0] if return_lse else part)
            lses.append(part[1] if return_lse else None)
            start += length
        rows.append(torch.cat(parts, dim=2))
        row_lses.append(torch.cat(lses, dim=2) if return_lse else None)
    out = torch.cat(rows, dim=0)
    return (out, torch.cat(row_lses, dim=0)) if return_lse else out


def document_lengths(doc_ids: torch.Tensor) -> list[list[int]]:
    """The length of each document of each row, in order (one host sync)."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    seq = doc_ids.shape[1]
    lengths = []
    for row in starts.cpu():
        idx = row.nonzero().flatten().tolist() + [seq]
        lengths.append([b - a for a, b in zip(idx, idx[1:])])
    return lengths


def flex_attention_fn(compiled: bool = True) -> AttentionFn:
    """FlexAttention with a block mask from the document ids and the window. The block mask is built
    once per batch (every layer of a forward gets the same doc_ids tensor) and per window size, outside
    any compiled region (a model compiled block by block calls it from its compiled forwards)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    kernel = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    cache: dict = {}

    @torch.compiler.disable
    def block_mask(doc_ids, window, batch, q_len, kv_len, device):
        key = (window, batch, q_len, kv_len, device)
        if cache.get("doc_ids") is not doc_ids:
            cache.clear()
            cache["doc_ids"] = doc_ids  # held, so its id cannot be reused by a later batch's tensor
        if key not in cache:
            cache[key] = create_block_mask(
                _mask_mod(doc_ids, window), None if doc_ids is None else batch, None, q_len, kv_len, device=device
            )
        return cache[key]

    def attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        window: int | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        mask = block_mask(doc_ids, window, q.shape[0], q.shape[2], k.shape[2], q.device)
        if not return_lse:
            return kernel(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        out, aux = kernel(
            q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True)
        )
        assert aux.lse is not None  # requested by AuxRequest(lse=True)
        return out, aux.lse.float()

    return attention


def _mask_mod(doc_ids: torch.Tensor | None, window: int | None):
    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if doc_ids is not None:
            keep = keep & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
        return keep

    return mask_mod


# Off CUDA, from this window length on, one SDPA call per document beats one masked SDPA call over
# the whole window (docs/models.md, "Attention masks and the loss": measured on CPU at 256, 1024 and 2048).
SPLIT_FROM_SEQ_LEN = 1024


def choose_attention_kernel(
    name: str, device_type: str, masked: bool, documents: bool = False, seq_len: int = 0
) -> str:
    """The kernel `model.attn_backend` = `name` means on this device. "auto": FlexAttention on CUDA
    when the mask is more than causal (documents or sliding windows), where it skips the masked
    tiles; elsewhere, with document masks (`documents`) in windows of SPLIT_FROM_SEQ_LEN tokens or
    more, the per-document split; SDPA otherwise (a plain causal mask runs SDPA's flash kernel)."""
    if name != "auto":
        return name
    if device_type == "cuda" and masked:
        return "flex"
    if documents and seq_len >= SPLIT_FROM_SEQ_LEN:
        return "split"
    return "sdpa"


def attention_kernel(name: str) -> AttentionFn:
    """The attention_fn of a chosen kernel ("sdpa", "split" or "flex")."""
    if name == "flex":
        return flex_attention_fn()
    return {"sdpa": sdpa_attention, "split": split_attention}[name]


def set_attention_fn(model: nn.Module, path: str, fn: AttentionFn, blocks: Iterable[nn.Module] | None = None) -> None:
    """Make every block of `model` (a decoder or a pipeline stage of one) attend with `fn`: the
    `attention_fn` of the submodule at `path` (the spec's cp_attention) in each block (`blocks`,
    default the model's layers; spec.blocks(model) adds the others)."""
    for block in cast(nn.ModuleDict, model.layers).values() if blocks is None else blocks:
        block.get_submodule(path).attention_fn = fn  # pyrefly: ignore[bad-argument-type]  # torch types Module.__setattr__'s value Tensor | Module; it takes any


def attended_pairs(lengths: list[int], window: int | None) -> int:
    """The (query, key) pairs a causal mask with this window lets through in documents of these
    lengths: sum over documents of sum_i min(i + 1, window)."""
    total = 0
    for n in lengths:
        if window is None or n <= window:
            total += n * (n + 1) // 2
        else:
            total += window * (window + 1) // 2 + (n - window) * window
    return total
