"""DeepSeek-V3 hyper-parameters and the table of sizes (flavors)."""

from dataclasses import dataclass

from torchtitan.config.errors import UserError
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.rotary import YarnScaling


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 2048
    n_layers: int = 27
    n_dense_layers: int = 1  # the first layers have a dense SwiGLU feed-forward, the others experts
    n_heads: int = 16
    vocab_size: int = 102400
    inter_dim: int = 10944  # the dense layers' feed-forward width
    moe: MoEArgs | None = None
    # Multi-head latent attention (MLA): queries through a low-rank bottleneck of q_lora_rank (0: one
    # projection), keys and values through one of kv_lora_rank; each head's query/key has a part
    # without position (nope) and a rotary part shared by all heads' keys (rope).
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    max_seq_len: int = 4096
    # Scale each block's output-projection init by its depth (True) or by the model depth (False).
    depth_init: bool = True
    # Multi-token prediction: mtp_depth modules after the last layer, module k predicting the token
    # k + 1 positions further than the main output; their mean loss enters the gradient times
    # mtp_loss_weight (the logged loss stays the next-token loss).
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def validate(args: ModelArgs, dims) -> None:
    """Before launch: the flavor's own consistency (UserError names the field)."""
    problems = []
    if not 0 <= args.n_dense_layers <= args.n_layers:
        problems.append(f"n_dense_layers = {args.n_dense_layers} must be between 0 and n_layers = {args.n_layers}")
    if args.qk_rope_head_dim % 2:
        problems.append(f"qk_rope_head_dim = {args.qk_rope_head_dim} must be even (features rotate in pairs)")
    if args.n_dense_layers < args.n_layers and args.moe is None:
        problems.append("layers after n_dense_layers have experts: the flavor needs moe settings")
    if args.mtp_depth < 0:
        problems.append(f"mtp_depth = {args.mtp_depth} must be 0 (no multi-token prediction) or more")
    if args.mtp_loss_weight < 0:
        problems.append(f"mtp_loss_weight = {args.mtp_loss_weight} must be 0 or more")
    if args.moe is not None:
        problems += [f"moe: {p}" for p in args.moe.check()]
        if args.moe.num_experts % dims.ep:
            problems.append(
                f"num_experts = {args.moe.num_experts} is not divisible by "
                f"parallelism.expert_parallel_degree = {dims.ep}; choose a degree that divides it"
            )
    if problems:
        raise UserError("deepseek_v3 flavor: " + "; ".join(problems))


def _moe(**kw) -> MoEArgs:
    return MoEArgs(**kw)


# DeepSeek-V3 671B and Kimi K2 (1T) with their published configs; 16B has DeepSeek-V2-Lite's
# dimensions (MLA without a query bottleneck, softmax routing). debugmodel trains on a CPU and has
# every part: a query bottleneck, values narrower than queries/keys, a dense first layer,
# shared experts, sigmoid group-limited routing, YaRN.
flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=4,
        n_dense_layers=1,
        n_heads=8,
        vocab_size=4096,
        inter_dim=512,
        moe=_moe(
            num_experts=8,
            top_k=2,
            hidden_dim=128,
            num_shared_experts=1,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            num_expert_groups=4,
            num_limited_groups=2,
        ),
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rope_scaling=YarnScaling(
            factor=4.0,
            original_max_position_embeddings=32,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    "16B": ModelArgs(
        dim=2048,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        vocab_size=102400,
        inter_dim=10944,
        moe=_moe(
            num_experts=64,
            top_k=6,
            hidden_dim=1408,
            num_shared_experts=2,
            score_func="softmax",
            route_norm=False,
            route_scale=1.0,
        ),
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling=YarnScaling(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        max_seq_len=163840,
    ),
    "671B": ModelArgs(
        dim=7168,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        vocab_size=129280,
        inter_dim=18432,
        moe=_moe(
            num_experts=256,
            top_k=8,
            hidden_dim=2048,
            num_shared_experts=1,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            num_expert_groups=8,
            num_limited_groups=4,
        ),
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_scaling=YarnScaling(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_seq_len=163840,
    ),
    "kimi_k2": ModelArgs(
        dim=7168,
        n_layers=61,
        n_dense_layers=1,
        n_heads=64,
        vocab_size=163840,
        inter_dim=18432,
        moe=_moe(
            num_experts=384,
            top_k=8,
            hidden_dim=2048,
            num_shared_experts=1,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.827,
        ),
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_theta=50000.0,
        rope_scaling=YarnScaling(
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=1.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_seq_len=131072,
    ),
}
