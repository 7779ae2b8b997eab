"""block_attention (torchtitan/models/common/attention.py), the rotating ring's per-chunk-pair attention:
the same output, log-sum-exp and q, k, v gradients as math_attention's autograd, with gradients flowing
into both the output and the lse, under the mask rule's masks and with rows that see no key; what it keeps
for backward; its dtypes under autocast."""

import pytest
import torch

from torchtitan.models.common import attention
from torchtitan.models.common.attention import block_attention, math_attention, visible

BATCH, HEADS, Q, K, DIM, V_DIM = 2, 3, 12, 10, 8, 6
Q_POS = torch.arange(Q) + 2  # queries 2..13 against keys 0..9: causal rows see 3 to 10 keys
K_POS = torch.arange(K)


def masks() -> dict:
    g = torch.Generator().manual_seed(1)
    q_doc, k_doc = torch.randint(0, 3, (BATCH, Q), generator=g), torch.randint(0, 3, (BATCH, K), generator=g)
    return {
        "none": None,
        "causal": visible(Q_POS, K_POS, None, None, None),
        "documents": visible(Q_POS, K_POS, q_doc, k_doc, None),
        "window": visible(Q_POS, K_POS, None, None, 4),
        # Queries 0..11 against keys 4..13: queries 0-3 see no key (output 0, lse -inf).
        "empty_rows": visible(torch.arange(Q), K_POS + 4, None, None, None),
        "documents_window_empty_rows": visible(torch.arange(Q), K_POS + 4, q_doc, k_doc, 3),
    }


def inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, n, d, generator=g) for n, d in ((Q, DIM), (K, DIM), (K, V_DIM)))
    grad_out, grad_lse = torch.randn(BATCH, HEADS, Q, V_DIM, generator=g), torch.randn(BATCH, HEADS, Q, generator=g)
    return [x.to(dtype) for x in (q, k, v)], grad_out, grad_lse


def run(fn, q, k, v, mask, grad_out, grad_lse):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v, mask)
    torch.autograd.backward([out, lse], [grad_out, grad_lse])
    return out, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("name", list(masks()))
@pytest.mark.parametrize("slice_elements", [None, 2 * HEADS * K * 5], ids=["whole", "rows_of_5"])
@pytest.mark.parametrize("as_function", [False, True], ids=["tensor", "function"])
def test_matches_math_attention_and_its_gradients(monkeypatch, name, slice_elements, as_function):
    if slice_elements is not None:  # query rows 0-4, 5-9, 10-11: slices that do not divide the block
        monkeypatch.setattr(attention, "BLOCK_SLICE_ELEMENTS", slice_elements)
    mask = masks()[name]
    (q, k, v), grad_out, grad_lse = inputs()
    asked = []

    def rows(start, stop):
        asked.append((start, stop))
        return mask[..., start:stop, :]

    given = rows if as_function and mask is not None else mask
    ref = run(math_attention, q, k, v, mask, grad_out, grad_lse)
    got = run(block_attention, q, k, v, given, grad_out, grad_lse)
    for what, r, g in zip(("out", "lse", "dq", "dk", "dv"), ref, got):
        assert not g.isnan().any(), f"{what} has NaN"
        assert torch.equal(r.isinf(), g.isinf()), what  # the same rows get lse -inf
        # 1e-6 of the largest entry (up to 5 here): a float32 ulp at 4 is already 4.8e-7, and the two
        # compute the gradients in different orders.
        diff = (r - g).masked_fill(r.isinf(), 0).abs().max().item()
        assert diff <= 1e-6 * max(1.0, r.masked_fill(r.isinf(), 0).abs().max().item()), f"{what} differs by {diff}"
    if name.endswith("empty_rows"):
        assert got[1][..., :4].isneginf().all() and got[0][..., :4, :].eq(0).all()
        assert got[2][..., :4, :].eq(0).all()  # a row that sees nothing has no gradient either
    if given is rows:  # built a slice at a time, in forward and again in backward
        expected = [(0, Q)] if slice_elements is None else [(0, 5), (5, 10), (10, 12)]
        assert asked == expected * 2


def saved_numels(fn, *args) -> list[int]:
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sizes


def test_keeps_no_scores_for_backward():
    (q, k, v), _, _ = inputs()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mask = masks()["causal"]
    scores = BATCH * HEADS * Q * K
    # math_attention's autograd keeps [q, k] tensors (the check below would see them) ...
    assert max(saved_numels(math_attention, q, k, v, mask)) >= scores
    # ... block_attention keeps q, k, v, the mask, the output and the lse: nothing of [batch, heads, q, k].
    kept = saved_numels(block_attention, q, k, v, mask)
    assert sorted(kept) == sorted(
        [q.numel(), k.numel(), v.numel(), Q * K, BATCH * HEADS * Q * V_DIM, BATCH * HEADS * Q]
    )
    assert max(kept) < scores
    assert len(saved_numels(block_attention, q, k, v, lambda a, b: mask[..., a:b, :])) == 5  # a function: no mask kept


def test_computes_in_float32_under_autocast():
    (q, k, v), grad_out, grad_lse = inputs(torch.bfloat16)
    mask = masks()["documents"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = run(math_attention, q, k, v, mask, grad_out, grad_lse)
        got = run(block_attention, q, k, v, mask, grad_out, grad_lse)
    assert [x.dtype for x in got] == [x.dtype for x in ref] == [torch.float32] * 2 + [torch.bfloat16] * 3
    for r, g in zip(ref, got):
        assert (r.float() - g.float()).masked_fill(r.isinf(), 0).abs().max().item() < 2e-2  # bf16 gradient rounding


def test_refuses_grouped_heads():
    (q, k, v), _, _ = inputs()
    with pytest.raises(ValueError, match="share their leading dims"):
        block_attention(q, k[:, :1], v[:, :1])
