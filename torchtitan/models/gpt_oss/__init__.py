"""gpt-oss (20b, 120b): attention sinks, alternating sliding windows, biased experts with the clamped SwiGLU."""

from torchtitan.models.common.spec import ModelSpec


def build_spec() -> ModelSpec:
    from torchtitan.models.common.decoder import decoder_spec, moe_hooks
    from torchtitan.models.gpt_oss import args, model, parallelize, state_dict_adapter

    return decoder_spec(
        model.Transformer, name="gpt_oss", args_cls=args.ModelArgs, flavors=args.flavors, tp_plan=parallelize.TP_PLAN,
        tp_sizes=parallelize.tp_sizes, validate=args.validate, moe=moe_hooks(), hf=state_dict_adapter.ADAPTER,
        # The standard block's count reads w1/w3 experts, which this family fuses (gate_up_proj): without a
        # count of its own, the layout planner and [memory_estimation] refuse the family (no guess).
        activation_counts=None,
    )
