"""Qwen3.5 (dense and MoE, text) hyper-parameters and the table of sizes (flavors).

The layer pattern is Hugging Face's `layer_types`: layer i is full attention when (i + 1) is a
multiple of `full_attention_interval`, gated DeltaNet ("linear_attention") otherwise.
"""

from dataclasses import dataclass

from torchtitan.config.errors import UserError
from torchtitan.models.common.moe import MoEArgs

FULL, LINEAR = "full_attention", "linear_attention"


@dataclass(frozen=True)
class ModelArgs:
    """The defaults are transformers' Qwen3_5TextConfig defaults (its docstring: a Qwen3.5-9B style
    configuration); config.json names in the comments."""

    dim: int = 4096  # hidden_size
    n_layers: int = 32  # num_hidden_layers
    # Full-attention layers: grouped-query heads, a sigmoid output gate per head (q_proj twice as wide),
    # per-head q/k RMSNorm, rotary on the first partial_rotary_factor of each head.
    n_heads: int = 16
    n_kv_heads: int = 4
    head_dim: int = 256
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    # Gated DeltaNet layers (linear_*): key heads (queries share them) and value heads, a multiple of them.
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    conv_kernel: int = 4  # linear_conv_kernel_dim: the depthwise causal conv on q, k and v
    full_attention_interval: int = 4
    hidden_dim: int = 12288  # intermediate_size (SwiGLU)
    vocab_size: int = 248320
    norm_eps: float = 1e-6
    max_seq_len: int = 32768
    tie_word_embeddings: bool = False
    depth_init: bool = True
    delta_chunk: int = 64  # the chunk of the chunked gated delta rule (models/common/delta_rule.py)
    # "torch": that chunked rule (every device, the reference); "fla": flash-linear-attention's Triton kernel for
    # training on CUDA (model.delta_rule_kernel; an optional package). Decoding with a cache runs "torch".
    delta_rule_kernel: str = "torch"
    # Qwen3.5-MoE: every block's feed-forward is a mixture of experts (models/common/moe.py; hidden_dim is
    # then unused): softmax top-k with renormalized weights, plus one shared expert of its own width whose
    # output is scaled by a sigmoid gate (shared_gate).
    moe: MoEArgs | None = None

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR for i in range(self.n_layers))

    def is_full_attention(self, layer_id: int) -> bool:
        return (layer_id + 1) % self.full_attention_interval == 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

    @property
    def rotary_dim(self) -> int:
        """The features of each head that rotate (Hugging Face: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)


# debugmodel: CPU-sized, 8 layers (DeltaNet x3, full, DeltaNet x3, full: both kinds at least twice);
# 8 query heads over 4 KV heads, 4 DeltaNet key heads under 8 value heads: every head count divides TP 2
# and 4. The trainer replaces vocab_size with the tokenizer's (padded).
flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        hidden_dim=768,
        vocab_size=4096,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        rope_theta=10000.0,
        max_seq_len=2048,
    ),
    # transformers 5.25 Qwen3_5TextConfig() as it is (its parameter count is tested against it).
    "9B": ModelArgs(),
    # Qwen3.5-MoE (hidden_dim, unused, set to the experts' width as the adapter reads it from a config).
    # debugmodel_moe: debugmodel's mixers with 8 experts of width 256, top-2, and one shared expert of
    # width 256; its balancing bias moves 1e-2 per step as Qwen3's debugmodel_moe's.
    "debugmodel_moe": ModelArgs(
        dim=256,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        hidden_dim=256,
        vocab_size=4096,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        rope_theta=10000.0,
        max_seq_len=2048,
        moe=MoEArgs(
            num_experts=8,
            top_k=2,
            hidden_dim=256,
            num_shared_experts=1,
            shared_hidden_dim=256,
            shared_gate=True,
            route_norm=True,
            load_balance_coeff=1e-2,
        ),
    ),
    # transformers 5.25 Qwen3_5MoeTextConfig() (its docstring's checkpoint: Qwen/Qwen3.5-35B-A3B): 40 layers
    # of dim 2048, 16 query heads over 2 KV heads, 256 experts of width 512, top-8, one shared expert of
    # width 512. Its parameter count is tested against that config.
    "35B-A3B": ModelArgs(
        dim=2048,
        n_layers=40,
        n_heads=16,
        n_kv_heads=2,
        head_dim=256,
        hidden_dim=512,
        moe=MoEArgs(
            num_experts=256,
            top_k=8,
            hidden_dim=512,
            num_shared_experts=1,
            shared_hidden_dim=512,
            shared_gate=True,
            route_norm=True,
        ),
    ),
}


def validate(args: ModelArgs, parallel_dims) -> None:
    """Before launch (spec.validate). TP against every split head count is preflight's generic check
    (parallelize.tp_sizes)."""
    problems = args.moe.check() if args.moe is not None else []
    if args.moe is not None and args.moe.num_experts % parallel_dims.ep:
        problems.append(
            f"num_experts = {args.moe.num_experts} is not divisible by parallelism.expert_parallel_degree = "
            f"{parallel_dims.ep}; choose a degree that divides {args.moe.num_experts}"
        )
    local_key_heads = args.linear_num_key_heads // max(parallel_dims.tp, 1)
    if parallel_dims.cp > 1 and local_key_heads % parallel_dims.cp:
        # Under context parallel each rank runs the recurrence for key heads / cp of the key heads.
        best = max(d for d in range(1, parallel_dims.cp + 1) if local_key_heads % d == 0)
        problems.append(
            f"parallelism.context_parallel_degree = {parallel_dims.cp} must divide the {local_key_heads} DeltaNet key "
            f"heads of a tensor-parallel rank (linear_num_key_heads = {args.linear_num_key_heads}, "
            f"tensor_parallel_degree = {parallel_dims.tp}): each rank runs the recurrence for 1 / degree of them "
            f"over the whole sequence; the largest degree that works is {best}"
        )
    if args.linear_num_key_heads < 1 or args.linear_num_value_heads % args.linear_num_key_heads:
        problems.append(
            f"linear_num_value_heads = {args.linear_num_value_heads} is not a multiple of linear_num_key_heads = "
            f"{args.linear_num_key_heads} (each key head serves a whole number of value heads)"
        )
    if args.delta_rule_kernel not in ("torch", "fla"):
        problems.append(f"delta_rule_kernel = {args.delta_rule_kernel!r} must be 'torch' or 'fla'")
    if args.conv_kernel < 1:
        problems.append(f"conv_kernel = {args.conv_kernel}: the causal convolution needs a kernel of at least 1")
    if args.full_attention_interval < 1:
        problems.append(f"full_attention_interval = {args.full_attention_interval} must be at least 1")
    if args.rotary_dim % 2 or args.rotary_dim < 2:
        problems.append(f"head_dim x partial_rotary_factor = {args.rotary_dim} must be an even number >= 2")
    if problems:
        raise UserError(f"model args of this qwen3_5 flavor: {'; '.join(problems)}")
