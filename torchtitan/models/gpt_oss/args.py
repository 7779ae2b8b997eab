"""gpt-oss hyper-parameters and the table of sizes (flavors).

Layer types as transformers' GptOssConfig builds them when config.json gives none: layer i slides
when i is even ("sliding_attention" first), full attention on the odd layers. The sliding window
has Hugging Face's meaning, which is ours (torchtitan.models.common.attention.visible): query i sees
key j when i - window < j <= i, the last `window` positions with itself.
"""

import logging
from dataclasses import dataclass, field

from torchtitan.config.errors import UserError
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.rotary import YarnScaling

logger = logging.getLogger(__name__)


def _published_moe(num_experts: int) -> MoEArgs:
    # Top-4 over a softmax of the chosen experts' logits (the router in model.py); no shared experts.
    # load_balance_coeff None: the published format has no balancing bias (docs/models.md, gpt-oss).
    return MoEArgs(num_experts=num_experts, top_k=4, hidden_dim=2880, load_balance_coeff=None)


# The published YaRN: theta 150,000 stretched 32 times from an original context of 4,096, the ramp
# between the fractional bounds (truncate false), rotation magnitude 0.1 ln 32 + 1.
PUBLISHED_YARN = YarnScaling(
    factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False
)


@dataclass(frozen=True)
class ModelArgs:
    """The defaults are gpt-oss-20b's (config.json names: hidden_size, num_hidden_layers, ...)."""

    dim: int = 2880
    n_layers: int = 24
    # Attention: grouped-query heads with sinks, alternate layers windowed (layer_window).
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    sliding_window: int | None = 128  # the window of the sliding layers (0, 2, 4, ...); None: every layer full
    rope_theta: float = 150000.0
    rope_scaling: YarnScaling | None = PUBLISHED_YARN
    max_seq_len: int = 131072
    vocab_size: int = 201088  # o200k_harmony, padded
    norm_eps: float = 1e-5
    # Every layer's feed-forward is a mixture of experts with the clamped SwiGLU below.
    moe: MoEArgs = field(default_factory=lambda: _published_moe(32))
    swiglu_limit: float = 7.0  # the gate clamped above, the linear part to +-limit
    swiglu_alpha: float = 1.702  # gate * sigmoid(alpha * gate)
    depth_init: bool = True
    tie_word_embeddings: bool = False

    def layer_window(self, layer_id: int) -> int | None:
        return self.sliding_window if layer_id % 2 == 0 else None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.moe.hidden_dim


# debugmodel: CPU-sized, both window kinds (4 layers: sliding, full, sliding, full), sinks, 8 experts
# top-4; its window of 16 is a quarter of the tests' 64-token windows and an eighth of the recipe's
# 128, so the sliding layers see less than the full ones. 8 query heads over 4 KV heads and 8 experts
# divide by TP, CP and EP degrees up to 4 (8 for the experts). Like the published flavors it has no
# balancing bias (the format has none); --moe.load_balance_coeff turns it on. Measured with the bias on
# (1e-2 a step): the bias brings experts' choice values together at the top-k boundary, and under
# FSDP 2 one assignment of step 4 went to another expert than in one process (a round-off tie), which
# moved the loss by 1.7e-5; with it off, 6 steps of every layout stay within 1e-5.
flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        vocab_size=4096,
        sliding_window=16,
        moe=MoEArgs(num_experts=8, top_k=4, hidden_dim=256, load_balance_coeff=None),
    ),
    # openai/gpt-oss-20b and openai/gpt-oss-120b config.json.
    "20b": ModelArgs(n_layers=24, moe=_published_moe(32)),
    "120b": ModelArgs(n_layers=36, moe=_published_moe(128)),
}


def validate(args: ModelArgs, parallel_dims) -> None:
    """Before launch (spec.validate): the MoE args, EP against the experts, the window. TP against the
    heads is preflight's generic check (tp_sizes); ring context parallel splits the sequence, not the
    heads, so any CP degree suits the heads (the sinks stay whole on every CP rank); Ulysses splits the
    heads during attention, and preflight checks its degree against n_heads / tp for every family."""
    problems = args.moe.check()
    if args.moe.num_experts % parallel_dims.ep:
        problems.append(
            f"num_experts = {args.moe.num_experts} is not divisible by parallelism.expert_parallel_degree = "
            f"{parallel_dims.ep}; choose a degree that divides {args.moe.num_experts}"
        )
    if args.sliding_window is not None and args.sliding_window < 1:
        problems.append(f"sliding_window = {args.sliding_window} must be a positive number of positions")
    if problems:
        raise UserError(f"model args of this gpt-oss flavor: {'; '.join(problems)}")
    # max_seq_len is training.seq_len here (ModelSpec.args_for_training). A window that covers the whole
    # training window is not a mistake: the sliding layers then attend like the full ones (short-context
    # training of a published model keeps its window for later long-context use). Said once.
    if args.sliding_window is not None and args.sliding_window >= args.max_seq_len:
        logger.warning(
            f"gpt-oss: the sliding window ({args.sliding_window}) is not shorter than training.seq_len "
            f"({args.max_seq_len}): the sliding layers attend to every earlier position, like the full ones"
        )
