"""Llama 3 hyper-parameters and the table of sizes (flavors)."""

from dataclasses import dataclass


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
    max_seq_len: int = 131072
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


# Published Llama 3 / 3.1 dimensions (8B, 70B, 405B); "1B" uses Llama 3.2 1B's dimensions with an
# untied output layer; "debugmodel" trains in minutes on a CPU; "10M" is the size the CPU benchmark uses.
flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=4096, rope_theta=500000),
    "10M": ModelArgs(dim=320, n_layers=6, n_heads=8, vocab_size=4096, rope_theta=500000),  # the CPU benchmark size
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096),
}
