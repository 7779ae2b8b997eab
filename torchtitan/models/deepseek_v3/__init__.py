"""DeepSeek-V3 (and Kimi K2): the family's spec, built from its args, model, TP plan and HF adapter."""

from torchtitan.models.common.spec import ModelSpec, PipelineLayout


def build_spec() -> ModelSpec:
    from torchtitan.models.common.decoder import decoder_spec, moe_hooks
    from torchtitan.models.deepseek_v3 import activation_memory, args, model, parallelize, state_dict_adapter

    return decoder_spec(
        model.Transformer,
        name="deepseek_v3",
        args_cls=args.ModelArgs,
        flavors=args.flavors,
        tp_plan=parallelize.TP_PLAN,
        tp_sizes=parallelize.tp_sizes,
        hf=state_dict_adapter.ADAPTER,
        validate=args.validate,
        moe=moe_hooks(),
        activation_counts=activation_memory.block_counts,  # MLA's, and multi-token prediction's
        # Multi-token prediction: more blocks, more outputs and labels, and (on the last pipeline
        # stage) the input embedding for further tokens.
        extra_blocks=model.mtp_blocks,
        loss_sum_fn=model.mtp_loss_sum,
        prepare_window=model.prepare_window,
        pipeline=PipelineLayout(after=("norm", "output", "mtp"), shared=(("tok_embeddings", "mtp"),)),
    )
