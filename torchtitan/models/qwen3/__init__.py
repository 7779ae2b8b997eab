"""Qwen3 and Qwen3-MoE: the family's spec, built from its args, model, parallelize plan and HF adapter."""

from torchtitan.models.common.spec import ModelSpec


def build_spec() -> ModelSpec:
    from torchtitan.models.common.decoder import decoder_spec, moe_hooks
    from torchtitan.models.qwen3 import args, model, parallelize, state_dict_adapter

    return decoder_spec(
        model.Transformer,
        name="qwen3",
        args_cls=args.ModelArgs,
        flavors=args.flavors,
        tp_plan=parallelize.TP_PLAN,
        tp_sizes=parallelize.tp_sizes,
        hf=state_dict_adapter.ADAPTER,
        validate=args.validate,
        moe=moe_hooks(),  # Qwen3-MoE flavors; none of it acts on a dense one
    )
