"""Meta <-> Hugging Face Llama weight conversion (pure tensors). Logit parity against transformers
itself is checked in tests/components/checkpoint/test_hf.py."""

import pytest
import torch

from torchtitan.config import UserError
from torchtitan.models.common.rotary import complex_table, rotate_pairs
from torchtitan.models.llama3.args import ModelArgs, flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.state_dict_adapter import args_from_hf_config, from_hf, hf_config, to_hf

from helpers.tiny_models import materialized, small_llama3_args


def state_dict(args: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    return materialized(Transformer, args, seed).state_dict()


@pytest.mark.parametrize("n_kv_heads", [2, None])
def test_round_trip_is_exact(n_kv_heads):
    args = small_llama3_args(n_kv_heads=n_kv_heads)
    sd = state_dict(args)
    hf = to_hf(sd, args)
    assert "model.layers.1.self_attn.k_proj.weight" in hf and "lm_head.weight" in hf
    assert hf["model.layers.0.mlp.gate_proj.weight"] is sd["layers.0.feed_forward.w1.weight"]
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"])
    back = from_hf(hf, args)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_permutation_turns_interleaved_rope_into_rotate_half():
    # Rotating Meta's q then reordering each head's features equals rotating HF's q with rotate_half.
    args = small_llama3_args()
    sd = state_dict(args, seed=1)
    wq = sd["layers.0.attention.wq.weight"]
    wq_hf = to_hf(sd, args)["model.layers.0.self_attn.q_proj.weight"]
    x = torch.randn(1, 5, args.dim)
    hd = args.head_dim
    freqs = complex_table(hd, 5, args.rope_theta)
    q_meta = rotate_pairs((x @ wq.T).view(1, 5, -1, hd), freqs)

    q = (x @ wq_hf.T).view(1, 5, -1, hd)
    angles = torch.cat([freqs.angle(), freqs.angle()], dim=-1).view(1, 5, 1, hd)
    rotate_half = torch.cat([-q[..., hd // 2 :], q[..., : hd // 2]], dim=-1)
    q_hf = q * angles.cos() + rotate_half * angles.sin()

    reordered = q_meta.view(1, 5, -1, hd // 2, 2).transpose(-1, -2).flatten(-2)
    torch.testing.assert_close(reordered, q_hf, rtol=1e-5, atol=1e-6)


def test_unknown_and_missing_keys_are_named():
    args = small_llama3_args()
    hf = to_hf(state_dict(args), args)
    hf["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    del hf["lm_head.weight"]
    with pytest.raises(UserError, match=r"unknown keys model\.layers\.0\.self_attn\.q_norm\.weight.*missing keys lm_"):
        from_hf(hf, args)
    with pytest.raises(UserError, match=r"unknown keys layers\.2\.attention\.wq\.weight"):
        to_hf({**state_dict(args), "layers.2.attention.wq.weight": torch.zeros(64, 64)}, args)
    # Stored rotary frequencies of older exports are recomputed, not an error.
    hf = to_hf(state_dict(args), args)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    assert "layers.0.attention.wq.weight" in from_hf(hf, args)


def test_wrong_head_layout_is_a_user_error():
    args = small_llama3_args()
    hf = to_hf(state_dict(args), args)
    with pytest.raises(UserError, match=r"k_proj\.weight has shape \(32, 64\); expected 64 rows"):
        from_hf(hf, small_llama3_args(n_kv_heads=4))


@pytest.mark.parametrize("name", ["debugmodel", "1B", "3B", "8B", "70B", "405B"])
def test_config_round_trip_keeps_every_dimension(name):
    args = flavors[name]
    config = hf_config(args, torch.bfloat16, bos_id=1, eos_id=2)
    assert config["intermediate_size"] == args.ffn_hidden_dim
    assert (config["torch_dtype"], config["bos_token_id"], config["eos_token_id"]) == ("bfloat16", 1, 2)
    assert (config["rope_scaling"] is None) == (args.rope_scaling is None)
    back = args_from_hf_config(config)
    for field in (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "ffn_hidden_dim",
        "norm_eps",
        "rope_theta",
        "rope_scaling",
        "tie_word_embeddings",
        "max_seq_len",
        "head_dim",
    ):
        assert getattr(back, field) == getattr(args, field), field


def test_config_accepts_transformers5_rope_parameters_and_narrow_ffn():
    config = hf_config(small_llama3_args())
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    config["intermediate_size"] = 100  # below 8/3 * dim: needs ffn_dim_multiplier < 1
    args = args_from_hf_config(config)
    assert args.rope_theta == 1234.0 and args.ffn_hidden_dim == 100
    config["num_key_value_heads"] = 4
    assert args_from_hf_config(config).n_kv_heads is None  # no grouped-query attention


@pytest.mark.parametrize(
    "field, value",
    [
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}),
        ("head_dim", 32),
        ("hidden_act", "gelu"),
        ("model_type", "mistral"),
        ("num_key_value_heads", 3),
    ],
)
def test_unrepresentable_configs_are_rejected_naming_the_field(field, value):
    config = {**hf_config(small_llama3_args()), field: value}
    with pytest.raises(UserError, match=f"{field} = "):
        args_from_hf_config(config)
