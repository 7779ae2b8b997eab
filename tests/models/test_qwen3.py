"""Qwen3 dense: published sizes, the model's own behaviour (q/k norms, explicit head_dim, tied
embeddings), logit parity with Hugging Face transformers' Qwen3ForCausalLM, and the TP plan's names."""

import json
import math

import pytest
import torch

from torchtitan.config.errors import UserError
from torchtitan.models.qwen3.args import ModelArgs, flavors
from torchtitan.models.qwen3.hf_config import args_from_hf_config, hf_config
from torchtitan.models.qwen3.model import Transformer, flops_per_token, model_size
from torchtitan.models.qwen3.state_dict_adapter import from_hf, to_hf
from torchtitan.models.registry import get_model_spec

from helpers.tiny_models import materialized, meta_model

VOCAB = 151936


def small_args(**kw) -> ModelArgs:
    # head_dim 32 with 4 heads: 128 attention features for dim 64, as Qwen3 decouples them; GQA 4:2.
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, vocab_size=128, max_seq_len=64)
    base.update(kw)
    return ModelArgs(**base)


# ---- sizes ----

# Published config.json numbers (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
# tie_word_embeddings; all have 8 KV heads of head_dim 128) and the model cards' totals in billions
# (all parameters; non-embedding, i.e. without the embedding and an untied lm_head).
PUBLISHED = {
    "0.6B": ((1024, 3072, 28, 16, True), "0.6", "0.44"),
    "1.7B": ((2048, 6144, 28, 16, True), "1.7", "1.4"),
    "4B": ((2560, 9728, 36, 32, True), "4.0", "3.6"),
    "8B": ((4096, 12288, 36, 32, False), "8.2", "6.95"),
    "14B": ((5120, 17408, 40, 40, False), "14.8", "13.2"),
    "32B": ((5120, 25600, 64, 64, False), "32.8", "31.2"),
}


def _rounds_to(n: int, published: str) -> bool:
    decimals = len(published.partition(".")[2])
    return f"{n / 1e9:.{decimals}f}" == published


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts(flavor):
    (dim, ffn, layers, heads, tied), total_b, non_embedding_b = PUBLISHED[flavor]
    kv, hd = 8, 128
    per_layer = dim * heads * hd + 2 * dim * kv * hd + heads * hd * dim + 2 * hd + 3 * dim * ffn + 2 * dim
    embedding = VOCAB * dim
    expected = embedding + (0 if tied else embedding) + layers * per_layer + dim

    spec = get_model_spec("qwen3")
    args = spec.flavors[flavor]
    assert args.tie_word_embeddings == tied
    model = meta_model(Transformer, args)
    assert sum(p.numel() for p in model.parameters()) == expected  # a tied weight counts once
    assert all(p.is_meta for p in model.parameters())  # nothing was allocated
    size = spec.size(args)
    assert (size.total, size.active, size.embedding) == (expected, expected, embedding)
    assert _rounds_to(expected, total_b)
    assert _rounds_to(expected - embedding * (1 if tied else 2), non_embedding_b)


def test_flops_per_token_tied_and_untied():
    # Tied (0.6B): the output layer is still a matmul over the shared weight, so every parameter counts.
    args = flavors["0.6B"]
    assert flops_per_token(args, 4096) == pytest.approx(6 * 596_049_920 + 12 * 28 * (16 * 128) * 4097 / 2, rel=1e-12)
    # Untied (8B): everything but the input embedding; attention width 32 x 128.
    args = flavors["8B"]
    assert model_size(args).embedding == VOCAB * 4096
    assert flops_per_token(args, 8192) == pytest.approx(
        6 * (8_190_735_360 - VOCAB * 4096) + 12 * 36 * (32 * 128) * 8193 / 2, rel=1e-12
    )
    # Tying changes the parameter count, not the FLOPs.
    d = flavors["debugmodel"]
    assert model_size(flavors["debugmodel_tied"]).total == model_size(d).total - d.vocab_size * d.dim
    assert flops_per_token(flavors["debugmodel_tied"], 256) == flops_per_token(d, 256)


def test_debug_flavors_fit_tensor_parallel_up_to_4():
    spec = get_model_spec("qwen3")
    for name in ("debugmodel", "debugmodel_tied"):
        args = spec.args_for_training(name, vocab_size=4096, seq_len=256)
        assert args.tie_word_embeddings == (name == "debugmodel_tied")
        assert args.head_dim % 2 == 0
        for what, (size, _) in spec.tp_sizes(args).items():
            assert size % 4 == 0, what


# ---- the model ----


def test_forward_shape_causality_and_explicit_head_dim():
    args = small_args()
    model = materialized(Transformer, args)
    attention = model.layers["0"].attention
    assert attention.wq.weight.shape == (4 * 32, 64) and attention.wk.weight.shape == (2 * 32, 64)
    assert attention.wo.weight.shape == (64, 4 * 32)
    assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (32,)
    tokens = torch.randint(0, 128, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 128)
    # Changing a later token must not change earlier logits.
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 128
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_pipeline_stages_skip_absent_modules():
    model = materialized(Transformer, small_args())
    tokens = torch.randint(0, 128, (1, 8))
    full = model(tokens)
    first, second = materialized(Transformer, small_args()), materialized(Transformer, small_args())
    first.norm = first.output = None
    del first.layers["1"]
    second.tok_embeddings = None
    del second.layers["0"]
    torch.testing.assert_close(second(first(tokens)), full, rtol=0, atol=0)


def test_token_positions_index_the_rotary_table():
    model = materialized(Transformer, small_args())
    full = model.rope.clone()
    positions = torch.tensor([5, 6, 60, 61])
    model.set_token_positions(positions)
    assert torch.equal(model.rope, full[positions])
    model.init_weights(seed=0)  # rebuilt for the same positions
    assert torch.equal(model.rope, full[positions])


def test_init_statistics():
    model = materialized(Transformer, small_args(dim=256, vocab_size=512))
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.05
    assert abs(model.output.weight.std().item() - 256**-0.5) < 0.01
    assert model.layers["0"].attention.wq.weight.abs().max().item() <= 2 * 0.02 + 1e-6
    assert model.layers["1"].attention.wo.weight.std() < model.layers["0"].attention.wo.weight.std()
    assert torch.equal(model.layers["1"].attention.q_norm.weight, torch.ones(32))
    assert torch.equal(model.layers["1"].attention.k_norm.weight, torch.ones(32))


# ---- tied embeddings ----


def test_tied_weight_survives_materialization_and_is_initialized_once():
    args = small_args(dim=256, vocab_size=512, tie_word_embeddings=True)
    model = materialized(Transformer, args)
    assert model.output.weight is model.tok_embeddings.weight
    assert [n for n, _ in model.named_parameters() if n.endswith(("tok_embeddings.weight", "output.weight"))] == [
        "tok_embeddings.weight"
    ]
    w = model.tok_embeddings.weight
    # std 0.02 (Hugging Face's initializer_range), truncated at 3 std; not the untied embedding's 1.0.
    assert abs(w.std().item() - 0.02) < 2e-3 and w.abs().max().item() <= 3 * 0.02 + 1e-6
    # Initial predictions are near uniform: the loss starts within a nat of ln(vocab).
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(loss.item() - math.log(512)) < 1.0
    sd = model.state_dict()
    assert "output.weight" in sd and "tok_embeddings.weight" in sd
    assert sd["output.weight"].data_ptr() == sd["tok_embeddings.weight"].data_ptr()
    converted = model.to(torch.bfloat16)
    assert converted.output.weight is converted.tok_embeddings.weight


def test_tied_gradient_is_both_uses_and_one_update():
    args = small_args(tie_word_embeddings=True)
    tied = materialized(Transformer, args)
    untied = materialized(Transformer, small_args())
    # Same values, but the output layer gets its own copy of the embedding.
    untied.load_state_dict({k: v.clone() for k, v in tied.state_dict().items()})
    tokens = torch.randint(0, 128, (2, 12))
    for model in (tied, untied):
        model(tokens).logsumexp(-1).mean().backward()
    expected = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(tied.tok_embeddings.weight.grad, expected)

    params = list(tied.parameters())
    assert sum(p is tied.tok_embeddings.weight for p in params) == 1
    before = tied.tok_embeddings.weight.detach().clone()
    torch.optim.SGD(params, lr=0.5).step()
    torch.testing.assert_close(tied.output.weight, before - 0.5 * expected)
    assert tied.output.weight is tied.tok_embeddings.weight


# ---- Hugging Face ----


def _randomize_norms(model: Transformer, seed: int = 1):
    # Norm weights start at ones, which commute with the rotary embedding (a rotation keeps each
    # pair's length) and hide whether q/k norms come before rope: make them per-feature.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def _save_hf(folder, model: Transformer, args: ModelArgs):
    from safetensors.torch import save_file

    hf_sd = {k: v.contiguous() for k, v in to_hf(model.state_dict(), args).items()}
    save_file(hf_sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(args)))


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_qwen3(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    args = small_args(tie_word_embeddings=tied)
    model = materialized(Transformer, args, seed=3)
    _randomize_norms(model)
    _save_hf(tmp_path, model, args)
    if tied:
        assert "lm_head.weight" not in to_hf(model.state_dict(), args)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert hf.config.tie_word_embeddings == tied
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4

    # Round trips: our weights through HF names and back, the config through config.json and back.
    sd = model.state_dict()
    back = from_hf(to_hf(sd, args), args)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    assert args_from_hf_config(hf_config(args)) == args

    # HF's own state dict (which lists lm_head.weight even when tied) loads into our model.
    hf_sd = hf.state_dict()
    converted = from_hf(hf_sd, args)
    if tied:
        assert converted["output.weight"] is converted["tok_embeddings.weight"]
    fresh = materialized(Transformer, args, seed=7)
    fresh.load_state_dict(converted)
    with torch.no_grad():
        assert (fresh(tokens) - theirs).abs().max().item() < 1e-4


def test_hf_config_is_read_by_transformers_as_qwen3():
    transformers = pytest.importorskip("transformers")
    args = flavors["0.6B"]
    written = hf_config(args, torch.bfloat16)
    config = transformers.Qwen3Config(**{k: v for k, v in written.items() if k != "architectures"})
    assert (config.hidden_size, config.intermediate_size, config.head_dim) == (1024, 3072, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (16, 8, True)
    assert config.rope_parameters["rope_theta"] == 1e6 and set(config.layer_types) == {"full_attention"}
    # A published config.json (transformers 4.51 spelling) gives the flavor's args.
    published = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    assert args_from_hf_config(published) == flavors["8B"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_bias": True}, r"attention_bias = True"),
        # Sliding windows convert (tests/models/test_qwen3_sliding_window.py), but not a sliding layer before a
        # full one (our args slide layers max_window_layers and later), nor sliding layers without a window.
        (
            {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
            r"layer_types = '1 x sliding_attention, 1 x full_attention'.*later layer attends fully",
        ),
        ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types = .*but no window"),
        ({"hidden_size": None}, r"lacks hidden_size"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, r"rope_parameters"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_scaling"),
        ({"hidden_act": "gelu"}, r"hidden_act = 'gelu'"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads = 3"),
        ({"model_type": "qwen3_moe"}, r"model_type = 'qwen3_moe'"),
    ],
)
def test_unrepresentable_hf_configs_are_user_errors(change, message):
    config = hf_config(small_args())
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None or k not in change}
    with pytest.raises(UserError, match=message):
        args_from_hf_config(config)


def test_wrong_keys_and_shapes_are_named():
    args = small_args()
    hf = to_hf(materialized(Transformer, args).state_dict(), args)
    del hf["model.layers.1.self_attn.q_norm.weight"]
    hf["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(128)
    with pytest.raises(
        UserError,
        match=r"unknown keys model\.layers\.0\.self_attn\.q_proj\.bias.*missing keys "
        r"model\.layers\.1\.self_attn\.q_norm\.weight",
    ):
        from_hf(hf, args)
    # Untied weights given to a tied model (and back): lm_head is unknown / differs, missing when untied.
    hf = to_hf(materialized(Transformer, args).state_dict(), args)
    with pytest.raises(UserError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        from_hf(hf, small_args(tie_word_embeddings=True))
    tied_args = small_args(tie_word_embeddings=True)
    with pytest.raises(UserError, match=r"missing keys lm_head\.weight"):
        from_hf(to_hf(materialized(Transformer, tied_args).state_dict(), tied_args), args)
    # Stored rotary frequencies are recomputed, not an error; wrong head counts are named with shapes.
    hf = to_hf(materialized(Transformer, args).state_dict(), args)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    assert "layers.0.attention.wq.weight" in from_hf(hf, args)
    with pytest.raises(UserError, match=r"k_proj\.weight has shape \(64, 64\), expected \(128, 64\)"):
        from_hf(hf, small_args(n_kv_heads=4))


# ---- parallelism hooks ----


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_spec_and_tp_plan_names_match_the_model(flavor):
    spec = get_model_spec("qwen3")
    assert spec.name == "qwen3" and spec.kv_cache and "qwen3" in spec.hf.model_types
    TP_PLAN = spec.tp_plan
    args = spec.flavors[flavor]
    sizes = {"n_heads", "n_kv_heads", "vocab_size"} | ({"ffn hidden dim"} if args.moe is None else set())
    assert set(spec.tp_sizes(args)) == sizes
    model = meta_model(Transformer, args)
    block = model.layers["0"]
    plan = TP_PLAN.block(block)
    for key in plan:
        block.get_submodule(key)
    # Every parameter of a block is under a module the plan shards or replicates, so all become DTensors.
    for name, _ in block.named_parameters():
        assert any(name.startswith(key + ".") for key in plan), name
    for key in TP_PLAN.top(True):
        model.get_submodule(key)
    assert callable(block.get_submodule(spec.cp_attention).attention_fn)
