"""Qwen3.5-MoE (the qwen3_5 family's MoE flavors): the published size's parameter count equals
transformers' Qwen3_5MoeForCausalLM of Qwen3_5MoeTextConfig(); the common MoE block with a shared
expert of its own width and a sigmoid shared gate computes transformers' Qwen3_5MoeSparseMoeBlock;
bad settings are refused before launch. Its Hugging Face round trip is tests/models/test_qwen3_5.py's,
parametrized over the dense and MoE flavors."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.moe import MoE, MoEArgs, count_moe_parameters
from torchtitan.models.registry import get_model_spec

SPEC = get_model_spec("qwen3_5")
DEBUG = SPEC.flavors["debugmodel_moe"]


def dims(cp=1, tp=1, ep=1):
    return SimpleNamespace(cp=cp, tp=tp, ep=ep)


def test_debugmodel_moe_has_both_layer_kinds_twice_and_moe_in_every_block():
    assert DEBUG.layer_types.count("full_attention") == 2 and DEBUG.layer_types.count("linear_attention") == 6
    with torch.device("meta"):
        model = SPEC.model_cls(DEBUG)
    assert all(isinstance(b.feed_forward, MoE) for b in model.layers.values())
    assert len(SPEC.moe.expert_layers(model)) == DEBUG.n_layers
    # Head counts divide TP 2 and 4, as debugmodel's.
    for tp in (2, 4):
        SPEC.validate(DEBUG, dims(tp=tp))
        assert all(n % tp == 0 for n, _ in SPEC.tp_sizes(DEBUG).values())


def test_published_size_counts_as_transformers():
    qwen3_5_moe = pytest.importorskip("transformers.models.qwen3_5_moe")
    args = SPEC.flavors["35B-A3B"]
    config = qwen3_5_moe.Qwen3_5MoeTextConfig()
    assert list(args.layer_types) == list(config.layer_types)
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
    ) == (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim, args.vocab_size)
    assert (
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        config.shared_expert_intermediate_size,
    ) == (args.moe.num_experts, args.moe.top_k, args.moe.hidden_dim, args.moe.shared_width)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in qwen3_5_moe.Qwen3_5MoeForCausalLM(config).parameters())
    size = SPEC.size(args)
    assert size.total == theirs == 34_660_610_688
    # A token uses 8 of the 256 routed experts: "A3B".
    assert 3.4e9 < size.active < 3.5e9
    with torch.device("meta"):
        ours = SPEC.model_cls(DEBUG)
    assert SPEC.size(DEBUG).total == sum(p.numel() for p in ours.parameters())


def test_parameter_count_of_the_shared_expert_and_its_gate():
    a = MoEArgs(num_experts=4, top_k=1, hidden_dim=8, num_shared_experts=1, shared_hidden_dim=24, shared_gate=True)
    block = MoE(16, a)
    total, active = count_moe_parameters(a, 16)
    assert total == sum(p.numel() for p in block.parameters())
    assert total - active == 3 * 3 * 16 * 8  # three idle routed experts
    assert block.shared_experts.w1.out_features == 24 and block.shared_gate.weight.shape == (1, 16)


def test_moe_block_computes_transformers_sparse_moe_block():
    """Softmax over the router logits, top-k renormalized, the routed experts of moe_intermediate_size,
    and the shared expert of shared_expert_intermediate_size times sigmoid(shared_expert_gate(x))."""
    qwen3_5_moe = pytest.importorskip("transformers.models.qwen3_5_moe")
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    dim, e, h, sh = 32, 8, 16, 24
    config = qwen3_5_moe.Qwen3_5MoeTextConfig(
        hidden_size=dim,
        num_experts=e,
        num_experts_per_tok=2,
        moe_intermediate_size=h,
        shared_expert_intermediate_size=sh,
    )
    torch.manual_seed(0)
    theirs = Qwen3_5MoeSparseMoeBlock(config).float()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = MoE(
        dim,
        MoEArgs(
            num_experts=e,
            top_k=2,
            hidden_dim=h,
            num_shared_experts=1,
            shared_hidden_dim=sh,
            shared_gate=True,
            route_norm=True,
            load_balance_coeff=None,
        ),
    )
    with torch.no_grad():
        ours.router.gate.weight.copy_(theirs.gate.weight)
        gate, up = theirs.experts.gate_up_proj.chunk(2, dim=1)
        ours.experts.w1.copy_(gate)
        ours.experts.w3.copy_(up)
        ours.experts.w2.copy_(theirs.experts.down_proj)
        for o, t in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            getattr(ours.shared_experts, o).weight.copy_(getattr(theirs.shared_expert, t).weight)
        ours.shared_gate.weight.copy_(theirs.shared_expert_gate.weight)
    x = torch.randn(2, 10, dim)
    with torch.no_grad():
        assert (ours(x) - theirs(x)).abs().max() < 1e-5


@pytest.mark.parametrize(
    "change, dims_, says",
    [
        ({}, dims(ep=3), r"num_experts = 8 is not divisible by parallelism.expert_parallel_degree = 3"),
        ({"moe": MoEArgs(num_experts=8, top_k=2, shared_gate=True)}, dims(), "num_shared_experts = 0"),
        ({"moe": MoEArgs(num_experts=8, top_k=9)}, dims(), "top_k = 9 must be between 1 and num_experts = 8"),
    ],
)
def test_refused_before_launch(change, dims_, says):
    with pytest.raises(UserError, match=says):
        SPEC.validate(dataclasses.replace(DEBUG, **change), dims_)


def test_export_of_a_routing_transformers_cannot_compute_is_refused():
    args = dataclasses.replace(DEBUG, moe=dataclasses.replace(DEBUG.moe, route_norm=False))
    with pytest.raises(UserError, match="route_norm = False"):
        SPEC.hf.config(args)


def test_the_planner_ranks_expert_parallel_layouts_of_the_moe_flavor():
    """The MoE blocks are counted (common moe_counts with the shared gate, checked against traced
    blocks in tests/models/test_activation_counts.py), so scripts/plan.py ranks the flavor's layouts,
    expert parallel among them."""
    import subprocess
    import sys

    from helpers.paths import REPO

    config = [
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        "--model.name",
        "qwen3_5",
        "--model.flavor",
        "debugmodel_moe",
    ]
    planned = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "plan.py"),
            *config,
            "--ngpu",
            "4",
            "--gpus_per_node",
            "4",
            "--gpu_memory_gib",
            "80",
            "--no-simulate",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "qwen3_5 debugmodel_moe" in planned.stdout and "layouts fit" in planned.stdout
    assert "xep2" in planned.stdout
