"""Llama 3 / 3.1: the family's spec, built from its args, model, parallelize plan and HF adapter."""

from torchtitan.models.common.spec import ModelSpec


def build_spec() -> ModelSpec:
    from torchtitan.models.common.activations import standard_block_counts
    from torchtitan.models.llama3 import args, model, parallelize, state_dict_adapter

    return ModelSpec(
        name="llama3",
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
        document_masks=True,
        adamw_params=(r"^output\.",),  # Muon leaves the output layer to AdamW
        hf=state_dict_adapter.ADAPTER,
    )
