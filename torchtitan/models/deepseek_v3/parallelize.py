"""DeepSeek-V3's tensor-parallel plan (as data) and the sizes it splits; the trainer applies the
parallelisms from the spec (torchtitan.distributed.parallelize.parallelize_model).

MLA under TP: the block's input is gathered to the full sequence as in the standard plan; the
per-head projections are split by heads (wq or wq_b and wkv_b column-wise, wo row-wise); the
low-rank projections and their norms (wq_a, q_norm, wkv_a, kv_norm) are computed whole on every
rank with replicated weights (see MLA.forward). MoE blocks run token-locally (TokenLocal), as
Qwen3-MoE's; the dense first layers use the standard feed-forward plan.

Multi-token prediction: each module's block has the plan of a layer (the spec's extra_blocks); its
norms run on the sequence-sharded stream like the final norm, and its projection eh_proj gathers the
sequence, splits its output features and hands back a sequence slice (ColwiseParallel from and to
Shard(1)). The embedding and output layer it uses are the model's.
"""

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

from torchtitan.models.common.tp_plan import (
    ReplicatedParams,
    TensorParallelPlan,
    decoder_block_tp_plan,
    decoder_top_tp_plan,
)


def block_tp_plan(block: nn.Module) -> dict:
    attention = block.attention
    # The standard block's, its MoE feed-forward token-local; MLA's per-head projections split as wq.
    plan = {
        k: v
        for k, v in decoder_block_tp_plan(block).items()
        if k not in ("attention.wq", "attention.wk", "attention.wv")
    }
    query = "attention.wq_b" if hasattr(attention, "wq_a") else "attention.wq"
    plan[query] = decoder_block_tp_plan(block)["attention.wq"]
    plan["attention.wkv_b"] = decoder_block_tp_plan(block)["attention.wq"]
    for name in ("wq_a", "q_norm", "wkv_a", "kv_norm"):
        if hasattr(attention, name):
            plan[f"attention.{name}"] = ReplicatedParams()
    return plan


def top_tp_plan(loss_parallel: bool) -> dict:
    return {
        **decoder_top_tp_plan(loss_parallel),
        "mtp.*.enorm": SequenceParallel(),
        "mtp.*.hnorm": SequenceParallel(),
        "mtp.*.eh_proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1)),
        "mtp.*.norm": SequenceParallel(),
    }


TP_PLAN = TensorParallelPlan(top=top_tp_plan, block=block_tp_plan)


def tp_sizes(args) -> dict[str, tuple[int, str]]:
    sizes = {
        "n_heads": (args.n_heads, "query/key/value heads are split across ranks"),
        "vocab_size": (args.vocab_size, "embedding rows and output logits are split across ranks"),
    }
    if args.n_dense_layers:
        sizes["inter_dim"] = (args.inter_dim, "the dense layers' w1/w3 outputs and w2 inputs are split across ranks")
    return sizes
