"""DeepSeek-V3's tensor-parallel plan (as data) and the sizes it splits; the trainer applies the
parallelisms from the spec (torchtitan.distributed.parallelize.parallelize_model).

MLA under TP: the block's input is gathered to the full sequence as in the standard plan; the
per-head projections are split by heads (wq or wq_b and wkv_b column-wise, wo row-wise); the
low-rank projections and their norms (wq_a, q_norm, wkv_a, kv_norm) are computed whole on every
rank with replicated weights (see MLA.forward). MoE blocks run token-locally (TokenLocal), as
Qwen3-MoE's; the dense first layers use the standard feed-forward plan.
"""

from torch import nn

from torchtitan.models.common.moe import MoE
from torchtitan.models.common.tp_plan import (
    ReplicatedParams, TensorParallelPlan, TokenLocal, decoder_block_plan, decoder_top_plan,
)


def block_plan(block: nn.Module) -> dict:
    attention = block.attention
    plan = {k: v for k, v in decoder_block_plan(block).items() if k not in ("attention.wq", "attention.wk", "attention.wv")}
    query = "attention.wq_b" if hasattr(attention, "wq_a") else "attention.wq"
    plan[query] = decoder_block_plan(block)["attention.wq"]
    plan["attention.wkv_b"] = decoder_block_plan(block)["attention.wq"]
    for name in ("wq_a", "q_norm", "wkv_a", "kv_norm"):
        if hasattr(attention, name):
            plan[f"attention.{name}"] = ReplicatedParams()
    if isinstance(block.feed_forward, MoE):
        plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")}
        plan["feed_forward"] = TokenLocal()
    return plan


TP_PLAN = TensorParallelPlan(top=decoder_top_plan, block=block_plan)


def tp_sizes(args) -> dict[str, tuple[int, str]]:
    sizes = {
        "n_heads": (args.n_heads, "query/key/value heads are split across ranks"),
        "vocab_size": (args.vocab_size, "embedding rows and output logits are split across ranks"),
    }
    if args.n_dense_layers:
        sizes["inter_dim"] = (args.inter_dim, "the dense layers' w1/w3 outputs and w2 inputs are split across ranks")
    return sizes
