"""Llama 3's tensor-parallel plan (as data) and the sizes it splits. The trainer applies the
parallelisms from the spec (torchtitan.distributed.parallelize.parallelize_model)."""

from torchtitan.models.common.tp_plan import TensorParallelPlan, decoder_block_tp_plan, decoder_top_tp_plan

# Llama's blocks are the standard decoder block (attention with a rotary table).
TP_PLAN = TensorParallelPlan(top=decoder_top_tp_plan, block=decoder_block_tp_plan)


def tp_sizes(args) -> dict[str, tuple[int, str]]:
    return {
        "n_heads": (args.n_heads, "query heads are split across ranks"),
        "n_kv_heads": (args.kv_heads, "key/value heads are split across ranks"),
        "ffn hidden dim": (args.ffn_hidden_dim, "w1/w3 outputs and w2 inputs are split across ranks"),
        "dim": (args.dim, "model width"),
        "vocab_size": (args.vocab_size, "embedding rows and output logits are split across ranks"),
    }
