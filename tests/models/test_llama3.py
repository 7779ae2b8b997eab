import pytest
import torch

from torchtitan.config import UserError
from torchtitan.models.llama3.args import ModelArgs, flavors
from torchtitan.models.llama3.model import Transformer, flops_per_token, model_size
from torchtitan.models.registry import get_model_args, get_model_spec

from helpers.tiny_models import materialized, meta_model


# Published totals (Llama 3.1 model card: 8.03B, 70.55B, 405.85B with the 128,256-token vocabulary).
@pytest.mark.parametrize(
    "flavor, published",
    [("8B", 8_030_261_248), ("70B", 70_553_706_496), ("405B", 405_853_388_800)],
)
def test_published_parameter_counts(flavor, published):
    model = meta_model(Transformer, flavors[flavor])
    assert sum(p.numel() for p in model.parameters()) == published
    assert model_size(flavors[flavor]).total == model_size(flavors[flavor]).active == published
    assert all(p.is_meta for p in model.parameters())  # nothing was allocated


def test_8b_layer_shapes_match_meta_checkpoint_names():
    shapes = {n: tuple(p.shape) for n, p in meta_model(Transformer, flavors["8B"]).named_parameters()}
    assert shapes["tok_embeddings.weight"] == (128256, 4096)
    assert shapes["layers.0.attention.wq.weight"] == (4096, 4096)
    assert shapes["layers.0.attention.wk.weight"] == (1024, 4096)
    assert shapes["layers.31.feed_forward.w1.weight"] == (14336, 4096)
    assert shapes["layers.31.feed_forward.w2.weight"] == (4096, 14336)
    assert shapes["norm.weight"] == (4096,)
    assert shapes["output.weight"] == (128256, 4096)
    assert "layers.32.attention.wq.weight" not in shapes


def test_flops_per_token_8b():
    args = flavors["8B"]
    size = model_size(args)
    non_embedding = size.total - size.embedding
    assert size.embedding == 128256 * 4096
    assert non_embedding == 8_030_261_248 - 128256 * 4096
    # 6N plus the attention term 12 * layers * dim * seq
    # Causal attention: a query at position i attends to i + 1 keys, (8192 + 1) / 2 on average.
    assert flops_per_token(args, 8192) == pytest.approx(6 * non_embedding + 12 * 32 * 4096 * 8193 / 2, rel=1e-12)


def small_args(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32)
    base.update(kw)
    return ModelArgs(**base)


def test_forward_shape_and_causality():
    model = materialized(Transformer, small_args())
    tokens = torch.randint(0, 97, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 97)
    # Changing a later token must not change earlier logits.
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 97
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_init_is_seeded_and_independent_of_construction_order():
    a = materialized(Transformer, small_args(), seed=3)
    b = materialized(Transformer, small_args(), seed=3)
    c = materialized(Transformer, small_args(), seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    # A model with a layer removed (as on a pipeline stage) keeps the same values for the rest.
    d = meta_model(Transformer, small_args())
    del d.layers["0"]
    d.to_empty(device="cpu")
    d.init_weights(seed=3)
    torch.testing.assert_close(d.layers["1"].attention.wq.weight, a.layers["1"].attention.wq.weight, rtol=0, atol=0)


def test_init_statistics():
    args = small_args(dim=256, n_heads=8, n_kv_heads=8, vocab_size=512)
    model = materialized(Transformer, args)
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.05
    wq = model.layers["0"].attention.wq.weight
    assert wq.abs().max().item() <= 2 * 0.02 + 1e-6  # truncated at 2 std
    # depth-scaled output projections: deeper layers start smaller
    assert model.layers["1"].attention.wo.weight.std() < model.layers["0"].attention.wo.weight.std()
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_grouped_query_attention_matches_repeated_heads():
    # With n_kv_heads=2 of 4, heads 0,1 share KV head 0: same as an MHA model whose wk/wv repeat rows.
    gqa = materialized(Transformer, small_args(n_layers=1))
    mha = materialized(Transformer, small_args(n_layers=1, n_kv_heads=4))
    sd = gqa.state_dict()
    hd = 16
    for w in ("wk", "wv"):
        key = f"layers.0.attention.{w}.weight"
        sd[key] = sd[key].view(2, hd, 64).repeat_interleave(2, dim=0).reshape(4 * hd, 64)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 97, (1, 12))
    torch.testing.assert_close(mha(tokens), gqa(tokens))


def test_registry_errors_name_the_choices():
    with pytest.raises(UserError, match="registered models: deepseek_v3, gpt_oss, llama3, (.* )?qwen3"):
        get_model_spec("gpt2")
    with pytest.raises(UserError, match="available flavors: debugmodel, 10M, 1B, 3B, 8B, 70B, 405B"):
        get_model_args("llama3", "7B")
    assert get_model_spec("llama3").flavors["debugmodel"].dim == 256
