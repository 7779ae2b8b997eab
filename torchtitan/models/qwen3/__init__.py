"""Qwen3 (dense): the family's spec, built from its args, model, parallelize plan and HF adapter."""

from torchtitan.models.common.spec import ModelSpec


def build_spec() -> ModelSpec:
    from torchtitan.models.common.activations import standard_block_counts
    from torchtitan.models.common import moe
    from torchtitan.models.qwen3 import args, model, parallelize, state_dict_adapter

    return ModelSpec(
        name="qwen3",
        args_cls=args.ModelArgs,
        flavors=args.flavors,
        model_cls=model.Transformer,
        size=model.model_size,
        flops_per_token=model.flops_per_token,
        tp_plan=parallelize.TP_PLAN,
        tp_sizes=parallelize.tp_sizes,
        activation_counts=standard_block_counts,  # what a block keeps for backward (the layout planner)
        cp_attention="attention",  # where each block calls attention: context parallel replaces its attention_fn
        kv_cache=True,
        # Qwen3-MoE flavors: the MoE blocks, the router kept out of float8, the auxiliary losses'
        # gradient scale set for the layout; none of it acts on a dense flavor.
        expert_layers=moe.expert_layers,
        high_precision=("router.gate",),
        pre_parallelize=moe.configure_moe,
        document_masks=True,
        adamw_params=(r"^output\.", r"\.router\.gate\."),  # Muon leaves these to AdamW
        hf=state_dict_adapter.ADAPTER,
        validate=args.validate,
        # Qwen3-MoE flavors balance their experts and report the load; no-ops for dense flavors.
        post_optimizer_step=moe.balance_after_step,
        post_skipped_step=moe.drop_step_counts,
        metrics=moe.expert_load_metrics,
    )
