"""Llama 3's tensor-parallel plan (as data) and its parallelize function; the order of techniques is
the shared one of torchtitan.distributed.parallelize."""

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.distributed.tensor_parallel import TensorParallelPlan, decoder_top_plan, gather_sequence_input

# Where each block calls attention: context parallel replaces `attention.attention_fn`.
CP_ATTENTION = "attention"


def block_plan() -> dict:
    return {
        "attention_norm": SequenceParallel(),
        # (x, freqs_cis): the rotary table is a plain buffer, passed through untouched.
        "attention": gather_sequence_input(n_inputs=2),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gather_sequence_input(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


TP_PLAN = TensorParallelPlan(top=decoder_top_plan, block=block_plan)


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
