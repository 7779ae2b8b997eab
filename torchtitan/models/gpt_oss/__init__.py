"""gpt-oss (20b, 120b): attention sinks, alternating sliding windows, biased experts with the clamped SwiGLU."""

from torchtitan.models.common.spec import ModelSpec


def build_spec() -> ModelSpec:
    from torchtitan.models.common.decoder import decoder_spec, moe_hooks
    from torchtitan.models.gpt_oss import activation_memory, args, model, parallelize, state_dict_adapter

    return decoder_spec(
        model.Transformer,
        name="gpt_oss",
        args_cls=args.ModelArgs,
        flavors=args.flavors,
        tp_plan=parallelize.TP_PLAN,
        tp_sizes=parallelize.tp_sizes,
        validate=args.validate,
        moe=moe_hooks(),
        hf=state_dict_adapter.ADAPTER,
        activation_counts=activation_memory.block_counts,  # sinks through the math kernel, the clamped experts
    )
