"""Qwen3 (dense) hyper-parameters and the table of sizes (flavors)."""

from dataclasses import dataclass

from torchtitan.config.errors import UserError
from torchtitan.models.common.moe import MoEArgs


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int | None = 8  # None: as many as n_heads (no grouped-query attention)
    # Set explicitly, not dim / n_heads: Qwen3 uses 128 at every size, so n_heads x head_dim may
    # differ from dim (0.6B: 16 x 128 = 2048 for dim 1024).
    head_dim: int = 128
    vocab_size: int = 151936
    hidden_dim: int = 12288  # feed-forward width, given outright as HF's intermediate_size
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    # The output layer reuses the input embedding (one weight), as the published 0.6B, 1.7B and 4B do.
    tie_word_embeddings: bool = False
    # Scale each block's output-projection init by its depth (True) or by the model depth (False).
    depth_init: bool = True
    # Qwen3-MoE: every block's feed-forward is a mixture of experts (hidden_dim is then unused).
    moe: MoEArgs | None = None
    # Sliding-window attention (Hugging Face's use_sliding_window, sliding_window, max_window_layers):
    # layers max_window_layers, ... attend to the last `sliding_window` positions (themselves
    # included); None: every layer attends to every earlier position.
    sliding_window: int | None = None
    max_window_layers: int = 0

    def layer_window(self, layer_id: int) -> int | None:
        return self.sliding_window if layer_id >= self.max_window_layers else None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim


def _published(dim: int, hidden_dim: int, n_layers: int, n_heads: int, tied: bool) -> ModelArgs:
    # What every published Qwen3 dense config.json shares: 8 KV heads of 128 features, the 151,936-token
    # vocabulary, rope_theta 1e6, rms_norm_eps 1e-6 and max_position_embeddings 40960.
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=hidden_dim,
        tie_word_embeddings=tied,
    )


# The published Qwen3 dense dimensions (Hugging Face config.json of Qwen/Qwen3-<size>). "debugmodel"
# trains in minutes on a CPU and is untied, so that every parallel layout (pipeline splits included)
# runs it; n_heads 8, n_kv_heads 4 and hidden_dim 768 divide by tensor-parallel degrees up to 4, and
# 8 x 64 attention features != dim 256, as in the published sizes. The trainer replaces vocab_size
# with the tokenizer's.
_DEBUG = dict(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768, vocab_size=4096)
flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_DEBUG),
    "debugmodel_tied": ModelArgs(**_DEBUG, tie_word_embeddings=True),
    "0.6B": _published(dim=1024, hidden_dim=3072, n_layers=28, n_heads=16, tied=True),
    "1.7B": _published(dim=2048, hidden_dim=6144, n_layers=28, n_heads=16, tied=True),
    "4B": _published(dim=2560, hidden_dim=9728, n_layers=36, n_heads=32, tied=True),
    "8B": _published(dim=4096, hidden_dim=12288, n_layers=36, n_heads=32, tied=False),
    "14B": _published(dim=5120, hidden_dim=17408, n_layers=40, n_heads=40, tied=False),
    "32B": _published(dim=5120, hidden_dim=25600, n_layers=64, n_heads=64, tied=False),
    # Qwen3-MoE. debugmodel_moe: 8 experts, top-2, CPU-sized, so that the parity matrix stays fast;
    # its bias moves 1e-2 per step: the default 1e-3 balances too slowly for a 200-step run, and 2e-2
    # oscillates (docs/models.md has the final expert loads of each).
    # The published sizes (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B): 128 experts, top-8 with
    # renormalized weights (norm_topk_prob), 4 KV heads.
    "debugmodel_moe": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        hidden_dim=768,
        vocab_size=4096,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, route_norm=True, load_balance_coeff=1e-2),
    ),
    "30B-A3B": ModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=6144,
        moe=MoEArgs(num_experts=128, top_k=8, hidden_dim=768, route_norm=True),
    ),
    "235B-A22B": ModelArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=12288,
        moe=MoEArgs(num_experts=128, top_k=8, hidden_dim=1536, route_norm=True),
    ),
}


def validate(args: ModelArgs, parallel_dims) -> None:
    """Before launch: the flavor's mixture-of-experts settings make sense."""
    problems = args.moe.check() if args.moe is not None else []
    if args.moe is not None and args.moe.num_experts % parallel_dims.ep:
        problems.append(
            f"num_experts = {args.moe.num_experts} is not divisible by parallelism.expert_parallel_degree = "
            f"{parallel_dims.ep}; choose a degree that divides {args.moe.num_experts}"
        )
    if problems:
        raise UserError(f"model args of this Qwen3-MoE flavor: {'; '.join(problems)}")
