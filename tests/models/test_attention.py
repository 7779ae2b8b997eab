"""The mask rule (torchtitan/models/common/attention.py), its kernels, and the loss over valid labels."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common.attention import (
    attended_pairs,
    document_ids,
    flex_attention_fn,
    sdpa_attention,
    set_attention_fn,
    split_attention,
    visible,
)
from torchtitan.models.common.spec import IGNORE_INDEX, cross_entropy_sum
from torchtitan.models.registry import get_model_spec

from helpers.tiny_models import materialized

EOS = 2
# Eager FlexAttention: its forward runs on CPU (torch 2.13 has no CPU backward, so training uses the others).
KERNELS = {"sdpa": sdpa_attention, "split": split_attention, "flex": flex_attention_fn(compiled=False)}


def test_documents_end_at_eos():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 3, 3, 3, 3, 3, 3, 3]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]


def reference_attention(q, k, v, doc_ids, window, return_lse=False):
    """Float64 attention with the rule written out: key j is seen by query i iff j <= i, i - j <
    window, same document; with return_lse also the log-sum-exp of each query's visible scores."""
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    seq = q.shape[2]
    allowed = torch.zeros(q.shape[0], 1, seq, seq, dtype=torch.bool)
    for b, i, j in itertools.product(range(q.shape[0]), range(seq), range(seq)):
        allowed[b, 0, i, j] = (
            j <= i and (window is None or i - j < window) and (doc_ids is None or doc_ids[b, i] == doc_ids[b, j])
        )
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return (out, torch.logsumexp(scores, dim=-1)) if return_lse else out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("masked,window", [(False, None), (True, None), (False, 3), (True, 3)])
def test_every_kernel_applies_the_rule(kernel, masked, window):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    tokens = torch.randint(3, 50, (2, 24))
    tokens[0, [4, 5, 11, 20]] = EOS  # a one-token document at 5, one cut by the window's end
    tokens[1, 9] = EOS
    doc_ids = document_ids(tokens, EOS) if masked else None
    got = KERNELS[kernel](q, k, v, doc_ids, window)
    expected = reference_attention(q, k, v, doc_ids, window)
    assert (got.double() - expected).abs().max() < 1e-5


def inputs_with_documents(masked: bool, grad: bool = False):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    tokens = torch.randint(3, 50, (2, 24))
    tokens[0, [4, 5, 11, 20]] = EOS
    tokens[1, 9] = EOS
    return [t.requires_grad_(grad) for t in (q, k, v)], document_ids(tokens, EOS) if masked else None


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("masked,window", [(False, None), (True, None), (True, 3)])
def test_every_kernel_returns_the_log_sum_exp(kernel, masked, window):
    (q, k, v), doc_ids = inputs_with_documents(masked)
    out, lse = KERNELS[kernel](q, k, v, doc_ids, window, return_lse=True)
    expected_out, expected_lse = reference_attention(q, k, v, doc_ids, window, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 24)
    assert (lse.double() - expected_lse).abs().max() < 1e-5
    assert (out.double() - expected_out).abs().max() < 1e-5


def sink_output(out, lse, sinks):
    """Attention with one extra learned logit per head in the softmax (sinks [heads]): the contract's
    example of an output transform."""
    return out * torch.sigmoid(lse - sinks[None, :, None])[..., None]


@pytest.mark.parametrize("kernel", ["sdpa", "split"])  # the kernels that train on CPU
def test_the_log_sum_exp_carries_gradients_to_q_k_and_a_transform(kernel):
    (q, k, v), doc_ids = inputs_with_documents(True, grad=True)
    sinks = torch.randn(4, requires_grad=True)
    upstream = torch.randn(2, 4, 24, 16)
    got = sink_output(*KERNELS[kernel](q, k, v, doc_ids, 5, return_lse=True), sinks)
    grads = torch.autograd.grad(got, (q, k, v, sinks), upstream)
    # The reference: the softmax over the visible keys and the sink logit, written out in float64.
    q64, k64, v64, s64 = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    out, lse = reference_attention(q64, k64, v64, doc_ids, 5, return_lse=True)
    expected = out * torch.exp(lse - torch.logaddexp(lse, s64[None, :, None]))[..., None]
    expected_grads = torch.autograd.grad(expected, (q64, k64, v64, s64), upstream.double())
    assert (got.double() - expected).abs().max() < 1e-5
    for name, a, b in zip("qkv", grads, expected_grads):
        assert (a.double() - b).abs().max() < 1e-5, name
    assert (grads[3].double() - expected_grads[3]).abs().max() < 1e-4  # a sum over every query of its head


def test_the_kv_cache_returns_the_log_sum_exp_of_the_full_forward():
    from torchtitan.models.common.layers import KVCache

    (q, k, v), _ = inputs_with_documents(False)
    full_out, full_lse = sdpa_attention(q, k, v, None, 7, return_lse=True)
    cache, outs, lses = KVCache(24), [], []
    for start, end in [(0, 10), (10, 11), (11, 17), (17, 24)]:  # a prompt, one token, then chunks
        out, lse = cache.attend(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], start, 7, return_lse=True)
        outs.append(out)
        lses.append(lse)
    assert (torch.cat(outs, dim=2) - full_out).abs().max() < 1e-5
    assert (torch.cat(lses, dim=2) - full_lse).abs().max() < 1e-5


def tiny(family: str, flavor: str):
    spec = get_model_spec(family)
    return spec, materialized(spec.model_cls, spec.args_for_training(flavor, 256, 48)).eval()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "family,flavor", [("llama3", "debugmodel"), ("qwen3", "debugmodel"), ("qwen3", "debugmodel_moe")]
)
def test_changing_a_document_changes_no_logit_of_another(kernel, family, flavor):
    spec, model = tiny(family, flavor)
    set_attention_fn(model, spec.cp_attention, KERNELS[kernel])
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 256, (2, 48), generator=g)
    tokens[:, [9, 25, 33]] = EOS  # documents [0, 9], [10, 25] (A), [26, 33], [34, 47]
    other = tokens.clone()
    other[:, 10:25] = torch.randint(3, 256, (2, 15), generator=g)  # every token of A but its EOS
    a = slice(10, 26)
    outside = torch.ones(48, dtype=torch.bool)
    outside[a] = False
    with torch.no_grad():
        before = model(tokens, doc_ids=document_ids(tokens, EOS))
        after = model(other, doc_ids=document_ids(other, EOS))
        causal_before, causal_after = model(tokens), model(other)
    assert torch.equal(before[:, outside], after[:, outside])
    assert not torch.equal(before[:, a], after[:, a])
    # Without the document mask the documents after A see it (the test can fail).
    assert (causal_before[:, 26:] - causal_after[:, 26:]).abs().max() > 1e-3
    if family == "qwen3" and flavor == "debugmodel":  # and with sliding windows too
        spec_w = get_model_spec("qwen3")
        args = spec_w.args_for_training(flavor, 256, 48, overrides={"sliding_window": 6})
        with torch.device("meta"):
            windowed = spec_w.model_cls(args)
        windowed.to_empty(device="cpu")
        windowed.init_weights(seed=0)
        set_attention_fn(windowed, spec_w.cp_attention, KERNELS[kernel])
        with torch.no_grad():
            w_before = windowed(tokens, doc_ids=document_ids(tokens, EOS))
            w_after = windowed(other, doc_ids=document_ids(other, EOS))
        assert torch.equal(w_before[:, outside], w_after[:, outside])


def test_attended_pairs_count_the_mask():
    for lengths, window in [([7], None), ([7], 3), ([1, 5, 12, 2], None), ([1, 5, 12, 2], 4), ([9], 9), ([9], 20)]:
        tokens = torch.cat([torch.tensor([5] * (n - 1) + [EOS]) for n in lengths])[None]
        pos = torch.arange(tokens.shape[1])
        doc = document_ids(tokens, EOS)
        assert attended_pairs(lengths, window) == int(visible(pos, pos, doc, doc, window).sum())


def test_flops_count_the_attention_the_mask_computes():
    spec = get_model_spec("qwen3")
    args = spec.args_for_training("debugmodel", 4096, 2048)
    whole, short = spec.flops_per_token(args, 2048), spec.flops_per_token(args, [64] * 32)
    width = args.n_heads * args.head_dim
    # Per token, 12 x width FLOPs per key attended, per layer: (2048 + 1) / 2 keys against (64 + 1) / 2.
    assert whole - short == pytest.approx(12 * width * args.n_layers * (2049 - 65) / 2, rel=1e-9)
    windowed = spec.args_for_training(
        "debugmodel", 4096, 2048, overrides={"sliding_window": 128, "max_window_layers": 1}
    )
    # Layer 0 attends fully; the others to at most 128 keys.
    pairs = 2048 * 2049 // 2 + (args.n_layers - 1) * attended_pairs([2048], 128)
    assert spec.flops_per_token(windowed, 2048) == pytest.approx(
        whole - 12 * width * args.n_layers * 2049 / 2 + 12 * width * pairs / 2048, rel=1e-9
    )


def test_loss_sums_the_labels_that_count():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    # Nothing ignored: the sum over the count is the mean cross entropy.
    assert cross_entropy_sum(logits, labels) / labels.numel() == pytest.approx(
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item(), rel=1e-6
    )
    ignored = labels.clone()
    ignored[0, 2] = ignored[1, 5] = IGNORE_INDEX
    keep = ignored != IGNORE_INDEX
    by_hand = -torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0][keep].sum()
    assert cross_entropy_sum(logits, ignored).item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_auto_picks_the_kernel_measured_fastest():
    from torchtitan.models.common.attention import choose_attention_kernel

    pick = lambda *a: choose_attention_kernel("auto", *a)  # noqa: E731
    assert pick("cuda", True, True, 256) == pick("cuda", True, False, 4096) == "flex"
    assert pick("cuda", False) == "sdpa"  # causal: SDPA's flash kernel
    assert pick("cpu", True, True, 2048) == pick("cpu", True, True, 1024) == "split"
    assert pick("cpu", True, True, 512) == pick("cpu", True, False, 4096) == pick("cpu", False) == "sdpa"
    assert choose_attention_kernel("split", "cuda", True) == "split"  # asked for: as asked
