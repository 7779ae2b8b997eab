"""The gated delta rule (models/common/delta_rule.py): the chunked form equals the token-by-token one
(outputs, final state and gradients, in float32 within 1e-5, at several lengths and chunk sizes, with
and without documents and an initial state); the token-by-token one equals transformers' Qwen3.5
reference; a document's outputs do not depend on the documents before it in the window; the causal
convolution does not reach across a document start."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common import delta_rule


def inputs(batch=2, seq=150, heads=3, dk=16, dv=8, seed=0):
    """q and k L2-normalized (q scaled by dk^-0.5), as gated DeltaNet feeds the rule; decays of up to
    exp(-2) per token; write strengths in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, seq, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(batch, seq, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, seq, heads, dv, generator=gen)
    g = -2 * torch.rand(batch, seq, heads, generator=gen)
    beta = torch.rand(batch, seq, heads, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def documents(batch, seq, lengths):
    """[batch, seq] document ids: each row's documents of the given lengths, the last one cut at seq."""
    return torch.tensor(
        [([i for i, n in enumerate(row) for _ in range(n)] + [len(row)] * seq)[:seq] for row in lengths]
    )


@pytest.mark.parametrize("seq, chunk", [(1, 64), (63, 64), (64, 64), (150, 64), (150, 16), (257, 32)])
@pytest.mark.parametrize("with_docs", [False, True])
def test_chunked_equals_token_by_token(seq, chunk, with_docs):
    x = inputs(seq=seq)
    docs = documents(2, seq, [[seq // 3, seq // 3 + 5, seq], [1, seq]]) if with_docs else None
    state = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(1))
    ref, ref_state = delta_rule.recurrent(*x, state=state, doc_ids=docs)
    got, got_state = delta_rule.chunked(*x, chunk=chunk, state=state, doc_ids=docs)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_state, ref_state, atol=1e-5, rtol=0)
    weights = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * weights).sum() + ref_state.sum(), x)
    got_grads = torch.autograd.grad((got * weights).sum() + got_state.sum(), x)
    for name, a, b in zip(["q", "k", "v", "g", "beta"], got_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_token_by_token_equals_transformers_reference():
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta = (t.detach() for t in inputs(seq=40))
    state = torch.randn(2, 3, 16, 8)
    ours, ours_state = delta_rule.recurrent(q, k, v, g, beta, state=state)
    # transformers scales q by dk^-0.5 itself and takes the state as [batch, heads, dk, dv].
    theirs, theirs_state = qwen3_5.torch_recurrent_gated_delta_rule(
        q * 16**0.5, k, v, g, beta, initial_state=state, output_final_state=True
    )
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_state, theirs_state.float(), atol=1e-5, rtol=0)


def test_a_document_does_not_see_the_documents_before_it():
    # The last document's outputs are the same whatever precedes it in the window.
    q, k, v, g, beta = (t.detach() for t in inputs(batch=1, seq=130))
    docs = documents(1, 130, [[50, 80]])
    other = [t.clone() for t in (q, k, v, g, beta)]
    for t in other:
        t[:, :50] = torch.randn_like(t[:, :50]).abs().neg() if t is other[3] else torch.rand_like(t[:, :50])
    a, _ = delta_rule.chunked(q, k, v, g, beta, chunk=32, doc_ids=docs)
    b, _ = delta_rule.chunked(*other, chunk=32, doc_ids=docs)
    alone, _ = delta_rule.chunked(*(t[:, 50:] for t in (q, k, v, g, beta)), chunk=32)
    assert not torch.allclose(a[:, :50], b[:, :50])
    torch.testing.assert_close(a[:, 50:], b[:, 50:], atol=1e-6, rtol=0)
    torch.testing.assert_close(a[:, 50:], alone, atol=1e-5, rtol=0)


def test_the_causal_convolution_restarts_at_each_document():
    x = torch.randn(1, 12, 5)
    weight = torch.randn(5, 4)
    docs = documents(1, 12, [[7, 5]])
    out = delta_rule.causal_conv(x, weight, docs)
    # As torch's depthwise conv1d with left padding, run on each document alone.
    expect = torch.cat(
        [
            F.conv1d(F.pad(part.transpose(1, 2), (3, 0)), weight[:, None], groups=5).transpose(1, 2)
            for part in (x[:, :7], x[:, 7:])
        ],
        dim=1,
    )
    torch.testing.assert_close(out, expect, atol=1e-6, rtol=0)


def _fla_stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """flash-linear-attention's chunk_gated_delta_rule as its documentation states it, computed by the token-by-token
    rule: q, k, v, g, beta of one row [1, T, ...] holding the sequences cu_seqlens cuts it into, each from a zero
    state; q scaled by `scale` (default dk^-0.5); q, k, v in one dtype."""
    assert q.shape[0] == 1 and cu_seqlens is not None and initial_state is None and not output_final_state
    assert q.dtype == k.dtype == v.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = cu_seqlens.tolist()
    pieces = [
        delta_rule.recurrent(q[:, a:b] * scale, k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])[0]
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(pieces, dim=1), None


@pytest.mark.parametrize("with_docs", [False, True])
def test_the_fla_kernel_gets_the_batch_and_documents_it_should(monkeypatch, with_docs):
    """model.delta_rule_kernel = "fla" (CUDA only, not run here): the glue to flash-linear-attention's varlen kernel
    (rows joined, cut at row and document starts, scale 1 for the already scaled q) against a stand-in that computes
    what the kernel is documented to compute; its result equals the project's chunked rule."""
    import sys
    import types

    fla = types.ModuleType("fla.ops.gated_delta_rule")
    fla.chunk_gated_delta_rule = _fla_stand_in
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fla)
    x = inputs(seq=70)
    docs = documents(2, 70, [[20, 30, 70], [1, 70]]) if with_docs else None
    got, _ = delta_rule.fla_chunked(*x, doc_ids=docs)
    ref, _ = delta_rule.chunked(*x, chunk=32, doc_ids=docs)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
