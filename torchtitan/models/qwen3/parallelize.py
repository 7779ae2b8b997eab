"""Qwen3's tensor-parallel plan (as data) and the sizes it splits; the trainer applies the
parallelisms from the spec (torchtitan.distributed.parallelize.parallelize_model).

The plan is the standard decoder block's (Llama 3's module names) plus the per-head q/k norms. Those
run inside attention on this rank's heads: the input [batch, seq, local heads, head_dim] is declared
sharded on the heads (dim 2), each head is normalized over its own features, and the norm weight
becomes a replicated DTensor whose gradient (partial on each rank, from its heads) is summed over
the TP ranks. Declaring it so, rather than leaving the norms alone, also makes every parameter a
DTensor on the tp mesh, as gradient clipping and FSDP on top expect.
"""

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from torchtitan.models.common.tp_plan import TensorParallelPlan, decoder_block_tp_plan, decoder_top_tp_plan


def block_tp_plan(block: nn.Module) -> dict:
    return {
        **decoder_block_tp_plan(block),  # its MoE feed-forward (Qwen3-MoE) token-local
        # Sharded on the heads (dim 2), not the sequence: SequenceParallel only marks the input's
        # sharded dim and replicates the weight, which is what a norm over head_dim needs.
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


TP_PLAN = TensorParallelPlan(top=decoder_top_tp_plan, block=block_tp_plan)


def tp_sizes(args) -> dict[str, tuple[int, str]]:
    sizes = {
        "n_heads": (args.n_heads, "query heads are split across ranks"),
        "n_kv_heads": (args.kv_heads, "key/value heads are split across ranks"),
        "ffn hidden dim": (args.ffn_hidden_dim, "w1/w3 outputs and w2 inputs are split across ranks"),
        "vocab_size": (args.vocab_size, "embedding rows and output logits are split across ranks"),
    }
    if args.moe is not None:  # experts are not split by tensor parallel (tp_plan.decoder_block_tp_plan)
        del sizes["ffn hidden dim"]
    return sizes
