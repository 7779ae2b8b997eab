"""Llama 3's tensor-parallel plan (as data) and its parallelize function; the order of techniques is
the shared one of torchtitan.distributed.parallelize."""

from torch import nn

from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.distributed.tensor_parallel import TensorParallelPlan, decoder_block_plan, decoder_top_plan

# Where each block calls attention: context parallel replaces `attention.attention_fn`.
CP_ATTENTION = "attention"
# Llama's blocks are the standard decoder block (attention with the rotary table freqs_cis).
TP_PLAN = TensorParallelPlan(top=decoder_top_plan, block=decoder_block_plan)


def tp_sizes(args) -> dict[str, tuple[int, str]]:
    return {
        "n_heads": (args.n_heads, "query heads are split across ranks"),
        "n_kv_heads": (args.kv_heads, "key/value heads are split across ranks"),
        "ffn hidden dim": (args.ffn_hidden_dim, "w1/w3 outputs and w2 inputs are split across ranks"),
        "dim": (args.dim, "model width"),
        "vocab_size": (args.vocab_size, "embedding rows and output logits are split across ranks"),
    }


def parallelize_llama(model: nn.Module, inputs) -> nn.Module:
    return parallelize_decoder(model, inputs, TP_PLAN, CP_ATTENTION)
