"""DeepSeek-V3 (and Kimi K2): the family's spec, built from its args, model, TP plan and HF adapter."""

from torchtitan.models.common.spec import ModelSpec, PipelineLayout


def build_spec() -> ModelSpec:
    from torchtitan.models.deepseek_v3.activations import block_counts
    from torchtitan.models.common import moe
    from torchtitan.models.deepseek_v3 import args, model, parallelize, state_dict_adapter

    return ModelSpec(
        name="deepseek_v3",
        args_cls=args.ModelArgs,
        flavors=args.flavors,
        model_cls=model.Transformer,
        size=model.model_size,
        flops_per_token=model.flops_per_token,
        tp_plan=parallelize.TP_PLAN,
        tp_sizes=parallelize.tp_sizes,
        activation_counts=block_counts,  # what a block keeps for backward (the layout planner)
        cp_attention="attention",  # where each block calls attention: context parallel replaces its attention_fn
        extra_blocks=model.mtp_blocks,
        kv_cache=True,
        expert_layers=moe.expert_layers,
        high_precision=("router.gate",),
        pre_parallelize=moe.configure_moe,
        document_masks=True,
        loss_sum_fn=model.mtp_loss_sum,
        prepare_window=model.prepare_window,
        # Multi-token prediction (on the last stage) embeds further tokens with the input embedding.
        pipeline=PipelineLayout(after=("norm", "output", "mtp"), shared=(("tok_embeddings", "mtp"),)),
        adamw_params=(r"^output\.", r"\.router\.gate\."),  # Muon leaves these to AdamW
        hf=state_dict_adapter.ADAPTER,
        validate=args.validate,
        post_optimizer_step=moe.balance_after_step,
        post_skipped_step=moe.drop_step_counts,
        metrics=moe.expert_load_metrics,
    )
