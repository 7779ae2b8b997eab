"""The shared MoE block against a token-by-token reference: routing (softmax/sigmoid, renormalized,
scaled, node-limited), grouped and looped expert matmuls, capacity dropping, aux-loss-free bias
balancing, auxiliary-loss gradients, and activation-checkpoint recomputation."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchtitan.models.common import moe as moe_module
from torchtitan.models.common.moe import MoE, MoEArgs, count_moe_parameters, update_expert_bias

DIM = 16


def build(seed: int = 0, **kw) -> MoE:
    args = MoEArgs(**{"num_experts": 8, "top_k": 2, "hidden_dim": 12, **kw})
    with torch.device("meta"):
        m = MoE(DIM, args)
    m.to_empty(device="cpu")
    m.reset_buffers()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that differences show
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return m


def reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, from the router's own choice."""
    tokens = x.reshape(-1, DIM)
    weights, ids, _, _ = m.router(tokens, m.expert_bias if m.args.load_balance_coeff is not None else None)
    out = torch.zeros_like(tokens)
    e = m.experts
    for t in range(tokens.shape[0]):
        for w, i in zip(weights[t], ids[t]):
            h = F.silu(e.w1[i] @ tokens[t]) * (e.w3[i] @ tokens[t])
            out[t] += w * (e.w2[i] @ h)
    if m.shared_experts is not None:
        out = out + m.shared_experts(tokens)
    return out.view(x.shape)


def tokens(batch=2, seq=10, seed=1):
    return torch.randn(batch, seq, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"score_func": "sigmoid", "route_norm": True, "route_scale": 2.5},
        {"num_shared_experts": 2},
        {"num_expert_groups": 4, "num_limited_groups": 2, "score_func": "sigmoid"},
        {"top_k": 8},
    ],
)
@pytest.mark.parametrize("grouped", [True, False])
def test_matches_token_by_token_reference(kw, grouped, monkeypatch):
    monkeypatch.setitem(moe_module._GROUPED_MM_OK, ("cpu", torch.float32), grouped)
    m = build(**kw)
    with torch.no_grad():
        m.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))  # the bias changes choices, not weights
    x = tokens()
    torch.testing.assert_close(m(x), reference(m, x), atol=1e-5, rtol=1e-5)


def test_grouped_and_looped_matmuls_agree_forward_and_backward(monkeypatch):
    x = tokens()
    results = []
    for grouped in (True, False):
        monkeypatch.setitem(moe_module._GROUPED_MM_OK, ("cpu", torch.float32), grouped)
        m = build()
        out = m(x)
        out.square().sum().backward()
        results.append((out, [p.grad for p in m.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert moe_module.grouped_mm_works(torch.device("cpu"), torch.float32) in (True, False)


def test_weights_scores_and_choice():
    m = build(score_func="softmax", route_norm=True)
    x = tokens().reshape(-1, DIM)
    weights, ids, scores, _ = m.router(x, None)
    assert scores.dtype == torch.float32 and torch.allclose(scores.sum(-1), torch.ones(20))
    torch.testing.assert_close(weights.sum(-1), torch.ones(20))  # renormalized
    assert torch.equal(ids.sort(-1).values, scores.topk(2, -1).indices.sort(-1).values)
    # A large bias on expert 5 puts it in every token's choice, without changing the weights' source.
    bias = torch.zeros(8)
    bias[5] = 10.0
    w_b, ids_b, scores_b, _ = m.router(x, bias)
    assert (ids_b == 5).any(-1).all()
    torch.testing.assert_close(scores_b, scores)


def test_node_limited_routing_uses_only_the_best_groups():
    m = build(num_experts=8, top_k=2, num_expert_groups=4, num_limited_groups=1)
    _, ids, scores, _ = m.router(tokens().reshape(-1, DIM), None)
    groups = ids // 2
    assert (groups[:, 0] == groups[:, 1]).all()  # both experts from the one allowed group
    best = scores.unflatten(-1, (4, 2)).topk(2, -1).values.sum(-1).argmax(-1)
    assert torch.equal(groups[:, 0], best)


def test_bad_args():
    for kw, pattern in [
        ({"top_k": 9}, "top_k = 9"),
        ({"score_func": "relu"}, "score_func"),
        ({"num_expert_groups": 3, "num_limited_groups": 1}, "does not divide"),
        ({"num_expert_groups": 4}, "go together"),
        ({"capacity_factor": 0.0}, "positive"),
    ]:
        assert any(pattern in p for p in MoEArgs(**kw).check()), kw
        with pytest.raises(ValueError, match=pattern):
            MoE(DIM, MoEArgs(**kw))


def test_capacity_keeps_the_highest_weighted_assignments():
    m = build(capacity_factor=0.5)
    x = tokens()
    out = m(x)
    weights, ids, _, _ = m.router(x.reshape(-1, DIM), m.expert_bias)
    capacity = 3  # ceil(0.5 x 20 tokens x 2 / 8 experts)
    flat_ids, flat_w = ids.flatten(), weights.flatten()
    kept = torch.zeros_like(flat_ids, dtype=torch.bool)
    for e in range(8):
        mine = (flat_ids == e).nonzero().flatten()
        kept[mine[flat_w[mine].argsort(descending=True)[:capacity]]] = True
    assert kept.sum() < kept.numel()  # something was dropped
    assert m.stats["dropped"].item() == pytest.approx(1 - kept.float().mean().item())
    # The reference with the dropped assignments' weights set to zero.
    e = m.experts
    expected = torch.zeros(20, DIM)
    tok = x.reshape(-1, DIM)
    for a in kept.nonzero().flatten().tolist():
        t, i = a // 2, flat_ids[a]
        expected[t] += flat_w[a] * (e.w2[i] @ (F.silu(e.w1[i] @ tok[t]) * (e.w3[i] @ tok[t])))
    torch.testing.assert_close(out.reshape(-1, DIM), expected, atol=1e-5, rtol=1e-5)
    assert m.tokens_per_expert.max().item() <= capacity


def test_bias_update_moves_toward_balance_and_counts_reset():
    m = build(load_balance_coeff=0.01)
    m(tokens())
    counts = m.tokens_per_expert.clone()
    assert counts.sum().item() == 2 * 10 * 2
    update_expert_bias([m])
    over, under = counts > counts.mean(), counts < counts.mean()
    assert (m.expert_bias[over] < m.expert_bias[under].min()).all()
    assert m.tokens_per_expert.sum().item() == 0 and torch.equal(m.last_tokens_per_expert, counts)
    # Off: the counts are still reset and reported, the bias stays zero and is not used.
    off = build(load_balance_coeff=None)
    off(tokens())
    update_expert_bias([off])
    assert off.expert_bias.abs().sum().item() == 0


@pytest.mark.parametrize("kw", [{"seq_aux_loss_coeff": 0.1}, {"z_loss_coeff": 0.01}])
def test_auxiliary_loss_adds_its_gradient_only(kw):
    x = tokens()
    m = build(**kw)
    out = m(x)
    (aux_name,) = [k for k in m.stats if k != "dropped"]
    main = out.square().mean()
    main.backward()
    with_aux = {n: p.grad.clone() for n, p in m.named_parameters()}
    # The same forward without injection: the gradient of main + aux must equal the above.
    m2 = build(**kw)
    m2.train(False)  # no injection outside training...
    out2 = m2(x)
    aux = m2._auxiliary_losses(*_router_outputs(m2, x), batch=2)[aux_name]
    (out2.square().mean() + aux).backward()
    for n, p in m2.named_parameters():
        torch.testing.assert_close(with_aux[n], p.grad, atol=1e-6, rtol=1e-5)
    assert m.stats[aux_name].item() == pytest.approx(aux.item())
    assert with_aux["router.gate.weight"].abs().sum() > 0


def _router_outputs(m, x):
    _, ids, scores, logits = m.router(x.reshape(-1, DIM), m.expert_bias)
    return scores, logits, ids


def test_recomputation_does_not_count_twice():
    m = build()
    x = tokens().requires_grad_()
    checkpoint(m, x, use_reentrant=False).sum().backward()
    assert m.tokens_per_expert.sum().item() == 2 * 10 * 2


def test_parameter_counts():
    args = MoEArgs(num_experts=128, top_k=8, hidden_dim=768)
    total, active = count_moe_parameters(args, 2048)
    assert total == 2048 * 128 + 128 * 3 * 2048 * 768 and active == 2048 * 128 + 8 * 3 * 2048 * 768
    m = build()
    assert sum(p.numel() for p in m.parameters()) == count_moe_parameters(m.args, DIM)[0]


# Published: Qwen3-30B-A3B "30.5B in total and 3.3B activated", Qwen3-235B-A22B "235B in total and
# 22B activated" (model cards); exact totals from the dimensions of their config.json.
@pytest.mark.parametrize(
    "flavor, total, active, card",
    [
        ("30B-A3B", 30_532_122_624, 3_353_032_704, (30.5, 3.3)),
        ("235B-A22B", 235_093_634_560, 22_190_763_520, (235, 22)),
    ],
)
def test_qwen3_moe_published_sizes(flavor, total, active, card):
    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec("qwen3")
    args = spec.flavors[flavor]
    size = spec.size(args)
    # Independently: embeddings (untied) + layers x (attention + norms + router + 128 experts) + final norm.
    a, m = args, args.moe
    attention = a.dim * a.n_heads * a.head_dim * 2 + a.dim * a.kv_heads * a.head_dim * 2 + 2 * a.head_dim
    routed = 3 * a.dim * m.hidden_dim
    per_layer = attention + 2 * a.dim + a.dim * m.num_experts + m.num_experts * routed
    expected = 2 * a.vocab_size * a.dim + a.n_layers * per_layer + a.dim
    assert size.total == expected == total
    assert size.active == total - a.n_layers * (m.num_experts - m.top_k) * routed == active

    # The cards' figures are the counts cut (not rounded) to the digits shown: 3.353B is "3.3B".
    def cut(n, ndigits):
        return int(n / 1e9 * 10**ndigits) / 10**ndigits

    assert cut(total, 1 if card[0] < 100 else 0) == card[0] and cut(active, 1 if card[1] < 10 else 0) == card[1]
    # FLOPs count the active parameters (minus the input embedding) and attention.
    # Causal attention: (4096 + 1) / 2 keys per query on average.
    assert spec.flops_per_token(args, 4096) == pytest.approx(
        6 * (active - size.embedding) + 12 * a.n_layers * a.n_heads * a.head_dim * 4097 / 2, rel=1e-12
    )


def test_an_expert_layer_without_the_expert_parallel_interface_is_named():
    from torchtitan.models.common.moe import check_expert_layer

    check_expert_layer(MoE(16, MoEArgs(num_experts=4, top_k=2, hidden_dim=8)))  # the shared block has it all

    class OwnMoE(nn.Module):  # a family's own class that forgot the interface
        def __init__(self):
            super().__init__()
            self.experts = nn.Linear(4, 4)

    with pytest.raises(TypeError, match=r"OwnMoE .* has no experts.num_experts, experts.grad_scale, a `dispatcher`"):
        check_expert_layer(OwnMoE())


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_experts_compute_in_autocasts_dtype_on_both_paths(grouped, input_dtype, monkeypatch):
    """The trainer's bf16 without FSDP: torch.autocast over float32 weights. autocast casts the loop's
    matmuls but has no rule for torch._grouped_mm, so both paths must cast for themselves: bf16 out
    for float32 tokens (a trunk block's norm output) and for bf16 ones (a block whose residual is a
    matmul's output), float32 gradients for the float32 weights, and the same values either way."""
    monkeypatch.setitem(moe_module._GROUPED_MM_OK, ("cpu", torch.bfloat16), grouped)
    calls = []
    monkeypatch.setattr(
        moe_module,
        "_grouped",
        lambda *a: calls.append(1) or torch._grouped_mm(a[0], a[1], offs=torch.cumsum(a[2], 0, dtype=torch.int32)),
    )
    experts = build(hidden_dim=16).experts  # bf16 rows of 32 bytes: torch._grouped_mm takes them
    counts = torch.tensor([3, 0, 5, 1, 0, 4, 2, 1])
    x = tokens(1, 16, seed=2).reshape(16, DIM).to(input_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, counts)
    assert out.dtype == torch.bfloat16
    assert len(calls) == (3 if grouped else 0)
    out.float().square().sum().backward()
    assert x.grad.dtype == input_dtype and all(p.grad.dtype == torch.float32 for p in experts.parameters())
    # Against the same matmuls run in bf16 by hand.
    w1, w2, w3 = (p.detach().bfloat16().transpose(-2, -1) for p in (experts.w1, experts.w2, experts.w3))
    xb = x.detach().bfloat16()
    h = F.silu(moe_module._looped(xb, w1, counts)) * moe_module._looped(xb, w3, counts)
    torch.testing.assert_close(out.detach(), moe_module._looped(h, w2, counts), atol=2e-2, rtol=2e-2)


def test_the_grouped_matmul_probe_is_not_fooled_by_autocast(monkeypatch):
    """First asked inside autocast (a model whose buffers were not reset first), the probe still
    judges the grouped matmul in the dtype it is asked about, not against autocast's bf16 loop."""
    cpu = torch.device("cpu")
    expected = moe_module._probe_grouped_mm(cpu, torch.float32)
    monkeypatch.delitem(moe_module._GROUPED_MM_OK, ("cpu", torch.float32), raising=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moe_module.grouped_mm_works(cpu, torch.float32) == expected
    assert expected  # torch._grouped_mm runs on CPU in float32 (torch 2.13)


def test_the_grouped_matmul_is_skipped_where_its_strides_would_be_refused(monkeypatch):
    """torch._grouped_mm needs each operand's inner stride to be a multiple of 16 bytes: an expert
    hidden size of 12 is 24 bytes in bf16 ("strides should be multiple of 16 bytes"). Such experts
    take the loop, with the loop's results, instead of failing at the first step."""
    monkeypatch.setitem(moe_module._GROUPED_MM_OK, ("cpu", torch.bfloat16), True)
    m = build(hidden_dim=12).to(torch.bfloat16)
    x = tokens().to(torch.bfloat16)
    out = m(x)
    monkeypatch.setitem(moe_module._GROUPED_MM_OK, ("cpu", torch.bfloat16), False)
    torch.testing.assert_close(out, m(x), atol=0, rtol=0)
