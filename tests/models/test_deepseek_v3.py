"""DeepSeek-V3: published sizes, MLA's shapes, YaRN against transformers, FLOPs, and flavors refused
before launch. Its parallel layouts are in tests/distributed/test_data_parallel_parity.py."""

import dataclasses

import pytest
import torch

from torchtitan.config import UserError
from torchtitan.models.common.rotary import YarnScaling, yarn_frequencies, yarn_softmax_factor
from torchtitan.models.registry import get_model_spec

from helpers.tiny_models import materialized

SPEC = get_model_spec("deepseek_v3")

# (total, active) as the model cards give them: DeepSeek-V3 671B total / 37B activated; DeepSeek-V2-Lite
# (our 16B) 15.7B / 2.4B; Kimi K2 1T / 32B. Activated counts exclude the input embedding (a lookup).
PUBLISHED = {"671B": (671e9, 37e9), "16B": (15.7e9, 2.4e9), "kimi_k2": (1.0e12, 32e9)}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_parameter_counts_match_the_published_figures(flavor):
    total, active = PUBLISHED[flavor]
    size = SPEC.size(SPEC.flavors[flavor])
    # The cards round: totals to their last digit (Kimi's "1T" to 3%), activated to 3%.
    assert abs(size.total / total - 1) < (0.03 if flavor == "kimi_k2" else 0.001), size.total
    assert abs((size.active - size.embedding) / active - 1) < 0.03, size.active - size.embedding


def test_671b_counts_to_the_parameter():
    # Independently: embedding + output, 3 dense and 58 MoE layers, final norm.
    d, v, h = 7168, 129280, 128
    mla = (d * 1536 + 1536 + 1536 * h * 192) + (d * (512 + 64) + 512 + 512 * h * (128 + 128)) + h * 128 * d
    dense = 3 * d * 18432
    moe = d * 256 + 3 * d * 2048 * (256 + 1)
    norms = 2 * d
    layers = 3 * (mla + dense + norms) + 58 * (mla + moe + norms)
    assert SPEC.size(SPEC.flavors["671B"]).total == 2 * v * d + layers + d


def test_mla_has_value_heads_of_their_own_width_and_trains():
    args = SPEC.args_for_training("debugmodel", 4096, 64)
    assert args.v_head_dim != args.qk_head_dim
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    attention = model.layers["1"].attention
    assert attention.wkv_b.weight.shape == (args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank)
    assert attention.wo.weight.shape == (args.dim, args.n_heads * args.v_head_dim)
    assert type(model.layers["0"].feed_forward).__name__ == "FeedForward"  # the dense first layer
    assert SPEC.has_experts(args) and len(SPEC.expert_layers(model)) == args.n_layers - args.n_dense_layers
    tokens = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = SPEC.loss_sum_fn(model(tokens), tokens) / tokens.numel()
    loss.backward()
    assert torch.isfinite(loss) and model.layers["1"].attention.wkv_a.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "scaling",
    [
        YarnScaling(40, 4096, 32, 1, 1.0, 1.0),
        YarnScaling(40, 4096, 32, 1, 0.707, 0.707),
        YarnScaling(32, 4096, 1, 1, 1.0, 1.0),
        YarnScaling(4, 32, 32, 1, 1.0, 1.0),
    ],
)
def test_yarn_frequencies_are_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.DeepseekV3Config(
        qk_rope_head_dim=64,
        max_position_embeddings=scaling.factor * scaling.original_max_position_embeddings,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            **{k: v for k, v in dataclasses.asdict(scaling).items()},
        },
    )
    theirs, magnitude = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours, our_magnitude = yarn_frequencies(64, 10000.0, scaling)
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=0) and our_magnitude == pytest.approx(magnitude)
    # The logits' extra factor: 1 without mscale_all_dim, else mscale(factor, mscale_all_dim)^2.
    assert yarn_softmax_factor(scaling) == pytest.approx(
        (0.1 * scaling.mscale_all_dim * torch.log(torch.tensor(scaling.factor)).item() + 1) ** 2
    )


def test_flops_count_active_parameters_and_mla_attention():
    args = SPEC.flavors["671B"]
    size = SPEC.size(args)
    seq = 4096
    pairs_per_token = (seq + 1) / 2
    # Per layer and attended pair: scores over qk_head_dim and weighted values over v_head_dim, 2 FLOPs
    # per multiply-add, 3x for forward and backward.
    attention = args.n_layers * 6 * args.n_heads * (args.qk_head_dim + args.v_head_dim) * pairs_per_token
    assert SPEC.flops_per_token(args, seq) == pytest.approx(6 * (size.active - size.embedding) + attention)


@pytest.mark.parametrize(
    "moe, message",
    [
        ({"num_expert_groups": 3}, r"num_expert_groups = 3 does not divide num_experts = 8"),
        ({"num_limited_groups": 5}, r"num_limited_groups = 5 must be in \[1, 4\]"),
    ],
)
def test_a_flavor_with_impossible_groups_is_refused_before_launch(monkeypatch, moe, message):
    from torchtitan.config import load_config
    from torchtitan.models import registry
    from torchtitan.preflight import preflight

    monkeypatch.setattr(registry, "_ADDED_FLAVORS", {})
    monkeypatch.setattr(registry, "_WITH_ADDED", {})
    base = SPEC.flavors["debugmodel"]
    registry.register_flavor(
        "deepseek_v3", "bad_groups", dataclasses.replace(base, moe=dataclasses.replace(base.moe, **moe))
    )
    from helpers.paths import REPO

    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs" / "debug_model.toml"),
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "bad_groups",
            "--training.seq_len",
            "64",
        ]
    )
    with pytest.raises(UserError, match=message):
        preflight(cfg, world_size=1)


# ---- Hugging Face ----


def test_export_is_deepseek_v3_for_transformers_with_the_balancing_bias(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torchtitan.components.checkpoint import load_hf, save_hf

    args = SPEC.args_for_training("debugmodel", 4096, 64)
    model = materialized(SPEC.model_cls, args, seed=1).eval()
    with torch.no_grad():  # a trained balancing state: it changes which experts tokens go to
        for layer in SPEC.expert_layers(model):
            layer.expert_bias.uniform_(-0.05, 0.05, generator=torch.Generator().manual_seed(2))
    save_hf(tmp_path / "hf", model.state_dict(), SPEC.hf, args, torch.float32, max_shard_bytes=2_000_000)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        assert (theirs(tokens).logits - ours).abs().max().item() < 1e-4
        # The bias matters: without it transformers routes other tokens elsewhere.
        for layer in theirs.model.layers[args.n_dense_layers :]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert (theirs(tokens).logits - ours).abs().max().item() > 1e-3
    # Import reads it back: the same args and tensors.
    sd, back = load_hf(tmp_path / "hf", SPEC.hf)
    assert back.rope_scaling == args.rope_scaling and back.moe == args.moe and back.q_lora_rank == args.q_lora_rank
    for name, tensor in model.state_dict().items():
        assert torch.equal(sd[name], tensor), name


def test_import_skips_the_multi_token_prediction_layers_and_refuses_softmax_routing(tmp_path):
    from safetensors.torch import load_file, save_file

    from torchtitan.components.checkpoint import load_hf, save_hf

    args = SPEC.args_for_training("debugmodel", 4096, 64)
    save_hf(tmp_path / "hf", materialized(SPEC.model_cls, args, seed=1).state_dict(), SPEC.hf, args, torch.float32)
    # As the published checkpoints: one more layer (model.layers.<n_layers>) holding the MTP module.
    shard = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(shard)
    tensors[f"model.layers.{args.n_layers}.eh_proj.weight"] = torch.zeros(args.dim, 2 * args.dim)
    save_file(tensors, shard)
    sd, _ = load_hf(tmp_path / "hf", SPEC.hf)
    assert not any(k.startswith(f"layers.{args.n_layers}.") for k in sd)
    softmax = dataclasses.replace(args, moe=dataclasses.replace(args.moe, score_func="softmax"))
    with pytest.raises(UserError, match="routes with sigmoid scores; this flavor uses 'softmax'"):
        SPEC.hf.config(softmax)


# ---- multi-token prediction ----


def test_mtp_logits_predict_further_tokens_and_the_logged_loss_stays_the_next_token_loss():
    from torchtitan.models.common.spec import IGNORE_INDEX, cross_entropy_sum

    args = dataclasses.replace(SPEC.args_for_training("debugmodel", 4096, 64), mtp_depth=2)
    model = materialized(SPEC.model_cls, args, seed=1).train()
    window = torch.randint(0, 4096, (2, 65), generator=torch.Generator().manual_seed(0))
    tokens, labels = window[:, :-1], window[:, 1:].clone()
    labels[0, 10] = IGNORE_INDEX  # e.g. the label after a document's end
    logits = model(tokens)
    assert logits.shape == (2, 64, 3, 4096)
    loss = SPEC.loss_sum_fn(logits, labels)
    assert torch.equal(loss, cross_entropy_sum(logits[:, :, 0], labels))  # the value: next-token only
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".eh_proj" in n)
    # Depth 2's target at position i is label i + 2, counted only where labels i .. i + 2 all count.
    from torchtitan.models.deepseek_v3.model import mtp_loss_sum

    probe = torch.zeros(1, 6, 3, 8)
    counted = []
    for k in (1, 2):
        one_hot = torch.zeros_like(probe)
        one_hot[:, :, k] = 1.0  # only depth k's logits carry a gradient-bearing value
        x = one_hot.clone().requires_grad_()
        mtp_loss_sum(x, torch.tensor([[1, 2, IGNORE_INDEX, 3, 4, 5]])).backward()
        counted.append(x.grad[0, :, k].abs().sum(-1).gt(0).tolist())
    assert counted[0] == [True, False, False, True, True, False]  # labels i and i + 1 count, i + 1 in the window
    assert counted[1] == [False, False, False, True, False, False]
    # Evaluation (validation, generation) returns the next-token logits alone.
    assert model.eval()(tokens).shape == (2, 64, 4096)


def test_mtp_is_refused_below_0_and_for_families_without_it():
    from torchtitan.config import load_config
    from torchtitan.preflight import preflight

    from helpers.paths import REPO

    def cfg(*extra):
        return load_config(
            [
                "--job.config_file",
                str(REPO / "train_configs" / "debug_model.toml"),
                "--model.name",
                "deepseek_v3",
                "--training.seq_len",
                "64",
                *extra,
            ]
        )

    with pytest.raises(UserError, match="model.mtp_depth must be 0 .* or more, got -1"):
        cfg("--model.mtp_depth", "-1")
    # Every layout runs it (tests/distributed/test_data_parallel_parity.py): PP 2 passes preflight.
    preflight(
        cfg(
            "--model.mtp_depth", "1", "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"
        ),
        world_size=2,
    )
    with pytest.raises(UserError, match="model.mtp_depth is set, but model 'llama3' has no multi-token prediction"):
        preflight(
            load_config(
                ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--model.mtp_depth", "1"]
            ),
            world_size=1,
        )


def test_mtp_modules_export_where_the_published_checkpoints_put_them(tmp_path):
    from safetensors import safe_open

    from torchtitan.components.checkpoint import load_hf, save_hf

    args = dataclasses.replace(SPEC.args_for_training("debugmodel", 4096, 64), mtp_depth=1)
    model = materialized(SPEC.model_cls, args, seed=1).eval()
    save_hf(tmp_path / "hf", model.state_dict(), SPEC.hf, args, torch.float32)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        mtp = {
            k.split(f"model.layers.{args.n_layers}.")[1]
            for k in f.keys()  # noqa: SIM118 (a safetensors file, not a dict: no `in`)
            if k.startswith(f"model.layers.{args.n_layers}.")
        }
    assert {
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
        "self_attn.q_a_proj.weight",
        "mlp.gate.e_score_correction_bias",
    } <= mtp
    sd, back = load_hf(tmp_path / "hf", SPEC.hf)
    assert back.mtp_depth == 1 and sd.keys() == model.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_mtp_blocks_keep_the_trunks_dtype_under_autocast():
    """bf16 without FSDP is torch.autocast over float32 weights, where the trunk's residual stream
    stays float32 (the embedding's). An MTP block's input is eh_proj's output, bf16 under autocast:
    the block must still get the trunk's dtype, or its norms, its residual and its experts see bf16
    where the trunk's see float32 (and torch._grouped_mm got bf16 tokens with float32 weights)."""
    args = dataclasses.replace(SPEC.args_for_training("debugmodel", 4096, 32), mtp_depth=2)
    model = materialized(SPEC.model_cls, args, seed=1).train()
    seen = {}
    for name, block in [*model.layers.items(), *((f"mtp.{k}", m.block) for k, m in model.mtp.items())]:
        block.register_forward_pre_hook(lambda _, inputs, name=name: seen.__setitem__(name, inputs[0].dtype))
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
        loss = SPEC.loss_sum_fn(logits, tokens)
    loss.backward()
    assert seen == {name: torch.float32 for name in seen} and len(seen) == args.n_layers + 2
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32


def test_mtp_targets_of_a_window_shorter_than_the_depth_are_all_ignored():
    """Validation may read shorter windows (validation.seq_len) than the depth trained on: the
    depths past the window get no target, and the shapes stay the window's."""
    from torchtitan.models.common.spec import IGNORE_INDEX
    from torchtitan.models.deepseek_v3.model import prepare_window

    args = dataclasses.replace(SPEC.args_for_training("debugmodel", 4096, 16), mtp_depth=6)
    tokens = torch.arange(10, 14).view(1, 4)
    labels, extra = prepare_window(args, tokens, tokens + 1)
    assert labels.shape == (1, 4, 7) and extra["future_tokens"].shape == (1, 4, 6)
    assert labels[0, :, 0].tolist() == [11, 12, 13, 14]
    assert labels[0, 0, :5].tolist() == [11, 12, 13, 14, IGNORE_INDEX]
    assert (labels[0, :, 4:] == IGNORE_INDEX).all()  # depth 4 on: beyond every position
    assert extra["future_tokens"][0, 0].tolist() == [11, 12, 13, 0, 0, 0]


def test_mtp_deeper_than_the_window_is_refused_before_launch(tmp_path):
    """Depth k predicts the token k positions ahead; past training.seq_len no position has it (and
    the trainer failed at its first step with a shape error). The bound is the whole window under
    context parallel too (the labels are built before CP cuts it), and validation windows may be
    shorter."""
    import subprocess
    import sys

    from torchtitan.config import load_config
    from torchtitan.preflight import preflight

    from helpers.paths import REPO

    argv = [
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        "--model.name",
        "deepseek_v3",
        "--training.seq_len",
        "16",
        "--job.dump_folder",
        str(tmp_path),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.preflight", *argv, "--model.mtp_depth", "17"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: model.mtp_depth = 17 is more than training.seq_len = 16: depth k predicts the token k positions "
        "ahead of each position, which a 16-token window does not hold for k > 16; set model.mtp_depth to 16 or "
        "less, or raise training.seq_len"
    ]
    preflight(load_config(argv + ["--model.mtp_depth", "16"]), world_size=1)
    preflight(
        load_config(
            argv
            + [
                "--model.mtp_depth",
                "12",
                "--parallelism.context_parallel_degree",
                "2",
                "--training.local_batch_size",
                "8",
            ]
        ),
        world_size=2,
    )
    preflight(
        load_config(argv + ["--model.mtp_depth", "12", "--validation.enabled", "--validation.seq_len", "4"]),
        world_size=1,
    )


def test_mtp_as_deep_as_the_window_trains_and_validates_on_shorter_windows(tmp_path):
    from helpers.launch import train_in_process

    history = train_in_process(
        tmp_path,
        "--model.name",
        "deepseek_v3",
        "--model.mtp_depth",
        "8",
        "--training.seq_len",
        "8",
        "--training.steps",
        "2",
        "--training.local_batch_size",
        "8",
        "--validation.enabled",
        "--validation.seq_len",
        "4",
        "--validation.freq",
        "2",
        "--validation.steps",
        "1",
        "--validation.local_batch_size",
        "8",
    )
    training = [r for r in history if "loss" in r]
    validation = [r for r in history if "validation_loss" in r]
    assert [r["step"] for r in training] == [1, 2] and [r["step"] for r in validation] == [2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in training)
    assert torch.isfinite(torch.tensor(validation[0]["validation_loss"]))
