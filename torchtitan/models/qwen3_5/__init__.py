"""Qwen3.5 (dense and MoE, text): gated DeltaNet layers with a gated full-attention layer every fourth."""

from torchtitan.models.common.spec import ModelSpec


def build_spec() -> ModelSpec:
    from torchtitan.models.common.decoder import decoder_spec, moe_hooks
    from torchtitan.models.qwen3_5 import activation_memory, args, model, parallelize, state_dict_adapter

    return decoder_spec(
        model.Transformer,
        name="qwen3_5",
        args_cls=args.ModelArgs,
        flavors=args.flavors,
        tp_plan=parallelize.TP_PLAN,
        tp_sizes=parallelize.tp_sizes,
        validate=args.validate,
        hf=state_dict_adapter.ADAPTER,
        activation_counts=activation_memory.block_counts,  # DeltaNet blocks (the chunked rule's) and gated attention's
        moe=moe_hooks(),  # Qwen3.5-MoE flavors; none of it acts on a dense one
    )
