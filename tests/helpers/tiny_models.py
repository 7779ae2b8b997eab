"""Small models for unit tests: built on the meta device, materialized on the CPU as the trainer builds them,
and a small Llama 3's arguments with a fixed batch."""


def meta_model(model_cls, args):
    """A `model_cls` of `args` on the meta device: its parameters' shapes, no storage."""
    import torch

    with torch.device("meta"):
        return model_cls(args)


def materialized(model_cls, args, seed: int = 0):
    """A `model_cls` of `args` on the CPU, initialized by its init_weights with `seed` (built on the meta
    device first, as the trainer builds it)."""
    model = meta_model(model_cls, args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def small_llama3_args(**kw):
    """The arguments of a small Llama 3 (2 layers of width 64, GQA 4:2, 128 tokens), with `kw` changed."""
    from torchtitan.models.registry import get_model_spec

    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64)
    base.update(kw)
    return get_model_spec("llama3").args_cls(**base)


def small_qwen3_5_args(**kw):
    """The arguments of a small Qwen3.5 (4 layers of width 64: DeltaNet, attention, DeltaNet, attention; GQA 4:2,
    DeltaNet heads 2:4, 128 tokens), with `kw` changed."""
    from torchtitan.models.registry import get_model_spec

    base = dict(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=128,
        vocab_size=128,
        max_seq_len=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        full_attention_interval=2,
    )
    base.update(kw)
    return get_model_spec("qwen3_5").args_cls(**base)


def llama3_and_batch():
    """A Llama 3 of 4 layers of width 128 (256 tokens, 128 positions) and a fixed batch of 4 windows
    (inputs and labels) for it: what the activation checkpointing and compile tests train."""
    import torch

    from torchtitan.models.registry import get_model_spec

    args = get_model_spec("llama3").args_cls(dim=128, n_layers=4, n_heads=4, vocab_size=256, max_seq_len=128)
    tokens = torch.randint(0, args.vocab_size, (4, args.max_seq_len + 1), generator=torch.Generator().manual_seed(1))
    return args, tokens
