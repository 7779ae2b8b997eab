"""Llama 3 hyper-parameters and the table of sizes (flavors)."""

from dataclasses import dataclass

from torchtitan.models.common.rotary import RopeScaling


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouped-query attention)
    vocab_size: int = 128256
    multiple_of: int = 256  # the feed-forward width is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None  # Llama 3.1's long-context scaling (None: plain rotary)
    max_seq_len: int = 131072
    tie_word_embeddings: bool = False  # the output layer IS the embedding (Llama 3.2 1B and 3B)
    # Scale each block's output-projection init by its depth (True) or by the model depth (False).
    depth_init: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# Published dimensions: Llama 3.2 1B and 3B (tied embeddings, rotary scaled for 32 x 8192 positions),
# Llama 3.1 8B, 70B and 405B (rotary scaled for 8 x 8192 positions); "debugmodel" trains in minutes on
# a CPU; "10M" is the size the CPU benchmark uses.
LLAMA_3_1_ROPE = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
LLAMA_3_2_ROPE = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=4096, rope_theta=500000),
    "10M": ModelArgs(dim=320, n_layers=6, n_heads=8, vocab_size=4096, rope_theta=500000),  # the CPU benchmark size
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling=LLAMA_3_2_ROPE,
        tie_word_embeddings=True,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling=LLAMA_3_2_ROPE,
        tie_word_embeddings=True,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_scaling=LLAMA_3_1_ROPE,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=LLAMA_3_1_ROPE,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_scaling=LLAMA_3_1_ROPE,
    ),
}
