"""Qwen3.5 (dense): the layer pattern is transformers' layer_types; the published size's parameter
count equals transformers' Qwen3_5ForCausalLM of the same config; under block-causal masks a
document's outputs do not depend on the documents before it (the DeltaNet state and conv window
reset, the attention masked); bad settings are refused before launch; a transformers checkpoint of
the dense and of the MoE flavor imports to transformers' logits and our export loads back in transformers."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from torchtitan.config.errors import UserError
from torchtitan.distributed.tensor_parallel import check_tp_divisibility
from torchtitan.models.registry import get_model_spec

SPEC = get_model_spec("qwen3_5")
DEBUG = SPEC.flavors["debugmodel"]


def dims(cp=1, tp=1, ep=1):
    return SimpleNamespace(cp=cp, tp=tp, ep=ep)


def hf_text_config(args, **extra):
    """transformers' text config of our `args`: Qwen3_5TextConfig, or Qwen3_5MoeTextConfig for an MoE flavor."""
    common = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        linear_num_key_heads=args.linear_num_key_heads,
        linear_num_value_heads=args.linear_num_value_heads,
        linear_key_head_dim=args.linear_key_head_dim,
        linear_value_head_dim=args.linear_value_head_dim,
        linear_conv_kernel_dim=args.conv_kernel,
        full_attention_interval=args.full_attention_interval,
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_seq_len,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        tie_word_embeddings=args.tie_word_embeddings,
    )
    if args.moe is None:
        from transformers.models.qwen3_5 import Qwen3_5TextConfig

        return Qwen3_5TextConfig(intermediate_size=args.hidden_dim, **common, **extra)
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        num_experts=args.moe.num_experts,
        num_experts_per_tok=args.moe.top_k,
        moe_intermediate_size=args.moe.hidden_dim,
        shared_expert_intermediate_size=args.moe.shared_width,
        **common,
        **extra,
    )


def test_layer_types_are_transformers():
    pytest.importorskip("transformers.models.qwen3_5")
    assert list(DEBUG.layer_types) == list(hf_text_config(DEBUG).layer_types)
    assert DEBUG.layer_types.count("full_attention") == 2 and DEBUG.layer_types.count("linear_attention") == 6
    with torch.device("meta"):
        model = SPEC.model_cls(DEBUG)
    kinds = ["full_attention" if hasattr(b.attention, "wq") else "linear_attention" for b in model.layers.values()]
    assert kinds == list(DEBUG.layer_types)


def test_published_size_counts_as_transformers():
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5")
    args = SPEC.flavors["9B"]
    config = qwen3_5.Qwen3_5TextConfig()
    assert list(args.layer_types) == list(config.layer_types)
    assert hf_text_config(args).to_dict() | {"layer_types": None} == config.to_dict() | {"layer_types": None}
    with torch.device("meta"):
        theirs = sum(p.numel() for p in qwen3_5.Qwen3_5ForCausalLM(config).parameters())
    assert SPEC.size(args).total == theirs
    assert SPEC.size(SPEC.flavors["debugmodel"]).total == 9_478_944


def test_a_document_does_not_see_the_documents_before_it():
    torch.manual_seed(0)
    args = dataclasses.replace(DEBUG, max_seq_len=96, delta_chunk=16)
    model = SPEC.model_cls(args)
    model.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (1, 96))
    # Document 1 starts at 37 (not a chunk boundary); alone, it is at positions 0.. of its own window, so
    # compare against the same tokens with the earlier document replaced by other tokens.
    other = tokens.clone()
    other[:, :37] = torch.randint(0, args.vocab_size, (1, 37))
    docs = torch.tensor([[0] * 37 + [1] * 59])
    with torch.no_grad():
        a = model(tokens, doc_ids=docs)[:, 37:]
        b = model(other, doc_ids=docs)[:, 37:]
        causal = model(other)[:, 37:]
    # The attention layers' rotary positions differ from a window of its own, but not between a and b.
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert (a - causal).abs().max() > 1e-2  # without the mask the earlier document does reach it


@pytest.mark.parametrize(
    "change, dims_, says",
    [
        (
            {},
            dims(cp=4, tp=2),
            r"context_parallel_degree = 4 must divide the 2 DeltaNet key heads .* the largest degree "
            r"that works is 2",
        ),
        ({"linear_num_key_heads": 3, "linear_num_value_heads": 6}, dims(cp=2), "the largest degree that works is 1"),
        ({"linear_num_value_heads": 6}, dims(), "not a multiple of linear_num_key_heads"),
        ({"conv_kernel": 0}, dims(), "kernel of at least 1"),
    ],
)
def test_refused_before_launch(change, dims_, says):
    with pytest.raises(UserError, match=says):
        SPEC.validate(dataclasses.replace(DEBUG, **change), dims_)


def test_tp_must_divide_the_deltanet_heads():
    SPEC.validate(DEBUG, dims(tp=4))
    check_tp_divisibility(SPEC.tp_sizes(DEBUG), 4, 64)
    args = dataclasses.replace(DEBUG, linear_num_key_heads=2, linear_num_value_heads=6)
    with pytest.raises(UserError, match="linear_num_key_heads = 2"):
        check_tp_divisibility(SPEC.tp_sizes(args), 4, 64)


def _random_hf_model(args, seed=0):
    """A random Qwen3_5ForCausalLM (Qwen3_5MoeForCausalLM for an MoE flavor) of `args`, in fp32."""
    if args.moe is None:
        model_cls = pytest.importorskip("transformers.models.qwen3_5").Qwen3_5ForCausalLM
    else:
        model_cls = pytest.importorskip("transformers.models.qwen3_5_moe").Qwen3_5MoeForCausalLM
    torch.manual_seed(seed)
    model = model_cls(hf_text_config(args)).float().eval()
    with torch.no_grad():  # every tensor away from its init (zero-centered norms at 0, dt_bias at 1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02))
    return model


@pytest.mark.parametrize(
    "flavor, hub_key",
    [
        ("debugmodel", "model.layers.0.mlp.gate_proj.weight"),
        ("debugmodel_moe", "model.layers.0.mlp.experts.7.gate_proj.weight"),  # one tensor per expert
    ],
    ids=["dense", "moe"],
)
def test_transformers_weights_give_transformers_logits_and_export_back(tmp_path, flavor, hub_key):
    """A random Qwen3_5ForCausalLM (Qwen3_5MoeForCausalLM for the MoE flavor) saved by transformers and its
    in-memory state dict (the MoE's experts fused) both import to our logits within 1e-4; our export loads
    in a fresh transformers model (strict: every tensor, no other) with the same logits; the config round
    trips."""
    import json

    from safetensors.torch import load_file, save_file

    args = dataclasses.replace(SPEC.flavors[flavor], vocab_size=512, max_seq_len=80, delta_chunk=32)
    theirs = _random_hf_model(args)
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    hub = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    assert hub_key in hub
    read = SPEC.hf.args_from_config(json.loads((tmp_path / "config.json").read_text()))
    moe_read = {} if args.moe is None else {"moe": dataclasses.replace(args.moe, load_balance_coeff=1e-3)}
    assert read == dataclasses.replace(args, delta_chunk=64, **moe_read)
    tokens = torch.randint(0, args.vocab_size, (2, 80), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = theirs(tokens).logits
    for hf_sd in (hub, theirs.state_dict()):
        ours = SPEC.model_cls(args)
        ours.init_weights(seed=0)
        ours.load_state_dict(SPEC.hf.from_hf(hf_sd, args))
        with torch.no_grad():
            got = ours(tokens)
        assert (got - expected).abs().max() < 1e-4
    # Export: our tensors (the hub layout) and config.json load in transformers with no missing or unexpected
    # key and give our logits.
    folder = tmp_path / "ours"
    folder.mkdir()
    save_file(
        {k: v.contiguous() for k, v in SPEC.hf.to_hf(ours.state_dict(), args).items()},
        str(folder / "model.safetensors"),
    )
    (folder / "config.json").write_text(json.dumps(SPEC.hf.config(args)))
    back, info = type(theirs).from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert (back.float().eval()(tokens).logits - got).abs().max() < 1e-4
    assert SPEC.hf.args_from_config(SPEC.hf.config(args)) == read


def test_context_parallel_that_splits_a_deltanet_head_is_refused_before_launch_with_exit_2(tmp_path):
    import os
    import subprocess
    import sys

    from helpers.paths import REPO

    # Checked before any process starts: 8 "processes" (TP 2 x CP 4) on this 2-core host start none.
    env = dict(os.environ, NGPU="8", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    done = subprocess.run(
        [
            "./run_train.sh",
            "--model.name",
            "qwen3_5",
            "--parallelism.context_parallel_degree",
            "4",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--job.dump_folder",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "must divide the 2 DeltaNet key heads of a tensor-parallel rank" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_the_planner_and_memory_estimation_estimate_the_family():
    """The spec has activation counts for both block kinds (qwen3_5/activation_memory.py, checked against
    traced blocks in tests/models/test_activation_counts.py): [memory_estimation] prints an estimate
    before launch and scripts/plan.py ranks layouts, where both refused the family before."""
    import os
    import subprocess
    import sys

    from helpers.paths import REPO

    config = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--model.name", "qwen3_5"]
    done = subprocess.run(
        [sys.executable, "-m", "torchtitan.preflight", *config, "--memory_estimation.enabled"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "WORLD_SIZE": "2"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("memory estimate for fsdp2 with AC none: ") and "activations" in done.stdout
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
    assert "qwen3_5 debugmodel" in planned.stdout and "layouts fit" in planned.stdout
    assert "activation_counts" not in planned.stdout + planned.stderr


def test_a_folder_with_the_vision_tower_only_is_refused_before_launch(tmp_path):
    import json

    from safetensors.torch import save_file

    from torchtitan.config import UserError
    from torchtitan.preflight import model_args_for_run

    from helpers.launch import debug_config

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3_5VisionModel"],
                "model_type": "qwen3_5",
                "vision_config": {"depth": 2, "hidden_size": 64},
            }
        )
    )
    save_file({"model.visual.patch_embed.proj.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    cfg = debug_config(
        "--model.name", "qwen3_5", "--checkpoint.initial_load_path", str(tmp_path), "--checkpoint.initial_load_in_hf"
    )
    with pytest.raises(
        UserError, match=r"config\.json describes a vision tower only \(vision_config, no text_config\)"
    ):
        model_args_for_run(SPEC, cfg, 4096)


def test_the_language_model_of_a_multimodal_folder_gives_transformers_logits(tmp_path):
    """A published Qwen3.5 folder is transformers' Qwen3_5ForConditionalGeneration: its language model under
    model.language_model., a vision tower beside it, the text settings in text_config with multimodal rotary
    (mrope_section, interleaved). The import reads the language model alone; on text its logits are
    transformers'."""
    import json

    from torchtitan.components.checkpoint.hf import check_hf_folder, load_hf, meta_shapes

    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5")
    args = dataclasses.replace(DEBUG, vocab_size=512, max_seq_len=80, delta_chunk=32)
    text = SPEC.hf.config(args)
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True, "mrope_section": [3, 3, 2]}
    vision = qwen3_5.configuration_qwen3_5.Qwen3_5VisionConfig(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=args.dim
    )
    torch.manual_seed(0)
    theirs = (
        qwen3_5.Qwen3_5ForConditionalGeneration(qwen3_5.Qwen3_5Config(text_config=text, vision_config=vision.to_dict()))
        .float()
        .eval()
    )
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02))
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5"
    check_hf_folder(tmp_path, SPEC.hf, meta_shapes(SPEC, args))
    sd, loaded = load_hf(tmp_path, SPEC.hf)
    assert loaded == dataclasses.replace(args, delta_chunk=64)
    ours = SPEC.model_cls(args)
    ours.init_weights(seed=0)
    ours.load_state_dict(sd)
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(input_ids=tokens).logits - ours(tokens)).abs().max() < 1e-4


def test_the_fla_kernel_is_refused_where_it_cannot_run():
    """model.delta_rule_kernel = "fla" on this CPU, for a family without a delta rule, and a bad value: refused
    before launch with exit 2 and one line."""
    import os
    import subprocess
    import sys

    from helpers.paths import REPO, TINY

    env = dict(os.environ, NGPU="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])

    def refused(*args: str) -> str:
        proc = subprocess.run(
            ["./run_train.sh", *TINY, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
        return proc.stderr

    assert "model.delta_rule_kernel = 'fla' runs flash-linear-attention's Triton kernel, which needs CUDA" in refused(
        "--model.name", "qwen3_5", "--model.delta_rule_kernel", "fla"
    )
    assert "model.delta_rule_kernel is set, but model 'llama3' has no gated delta rule" in refused(
        "--model.delta_rule_kernel", "torch"
    )
    assert "delta_rule_kernel" in refused("--model.name", "qwen3_5", "--model.delta_rule_kernel", "triton")
