"""The standard decoder and its spec (torchtitan.models.common.decoder): the MoE hooks set once fill
the spec's fields, and the attention knobs no shipped flavor uses (biases) build and initialize."""

import dataclasses

import pytest
import torch

from torchtitan.models.common import decoder, moe
from torchtitan.models.common.layers import Attention
from torchtitan.models.common.rotary import HALVES
from torchtitan.models.common.spec import ModelSpec
from torchtitan.models.registry import get_model_spec


def test_moe_hooks_fill_the_spec_fields_once():
    spec = get_model_spec("qwen3")
    assert spec.moe == decoder.moe_hooks()
    assert (
        spec.expert_layers,
        spec.pre_parallelize,
        spec.post_optimizer_step,
        spec.post_skipped_step,
        spec.metrics,
    ) == (moe.expert_layers, moe.configure_moe, moe.balance_after_step, moe.drop_step_counts, moe.expert_load_metrics)
    assert spec.high_precision == ("router.gate", "shared_gate")
    assert spec.adamw_params == (r"^output\.", r"\.router\.gate\.", r"\.shared_gate\.")
    # A copy passes the filled fields again: nothing is added twice.
    assert dataclasses.replace(spec, name="qwen3_copy").adamw_params == spec.adamw_params
    llama = get_model_spec("llama3")
    assert llama.moe is None and llama.expert_layers is None and llama.adamw_params == (r"^output\.",)


def test_a_hook_set_both_in_the_spec_and_in_its_moe_hooks_is_refused():
    llama = get_model_spec("llama3")
    with pytest.raises(ValueError, match="post_optimizer_step is set both"):
        ModelSpec(
            **{
                f.name: getattr(llama, f.name)
                for f in dataclasses.fields(llama)
                if f.name not in ("post_optimizer_step", "moe")
            },
            post_optimizer_step=lambda parts, inputs: None,
            moe=decoder.moe_hooks(),
        )


class BiasedQwen3(decoder.Transformer):
    rotary = HALVES
    qk_norm = True

    def block(self, layer_id):
        block = super().block(layer_id)
        a = self.args
        block.attention = Attention(a.dim, a.n_heads, a.kv_heads, a.head_dim, HALVES, a.norm_eps, bias=True)
        return block


def test_attention_biases_start_at_zero_and_the_rest_as_without_them():
    spec = get_model_spec("qwen3")
    args = spec.args_for_training("debugmodel", 4096, 16)
    models = {}
    for cls in (spec.model_cls, BiasedQwen3):
        with torch.device("meta"):
            models[cls] = cls(args)
        models[cls].to_empty(device="cpu")
        models[cls].init_weights(seed=0)
    plain, biased = (models[c].state_dict() for c in (spec.model_cls, BiasedQwen3))
    biases = [k for k in biased if k.endswith(".bias")]
    assert len(biases) == 4 * args.n_layers and all(not biased[k].any() for k in biases)
    assert all(torch.equal(plain[k], biased[k]) for k in plain)
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(models[BiasedQwen3](tokens), models[spec.model_cls](tokens), atol=1e-6, rtol=0)
