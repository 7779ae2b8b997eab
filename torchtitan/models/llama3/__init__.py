"""Llama 3 / 3.1: the family's spec, built from its args, model, parallelize plan and HF adapter."""

from torchtitan.models.common.spec import ModelSpec


def build_spec() -> ModelSpec:
    from torchtitan.models.common.decoder import decoder_spec
    from torchtitan.models.llama3 import args, model, parallelize, state_dict_adapter

    return decoder_spec(
        model.Transformer,
        name="llama3",
        args_cls=args.ModelArgs,
        flavors=args.flavors,
        tp_plan=parallelize.TP_PLAN,
        tp_sizes=parallelize.tp_sizes,
        hf=state_dict_adapter.ADAPTER,
    )
