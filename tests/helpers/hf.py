"""Hugging Face model folders written offline, laid out as published checkpoints store them: gpt-oss with
MXFP4 experts and Qwen3.5 as a multimodal model."""

import json
from pathlib import Path


def gpt_oss_mxfp4_folder(path: Path, args, bad_scales: bool = False) -> dict:
    """A Hugging Face folder of a gpt-oss model with `args` (its training init, biases drawn) whose experts
    are stored as the published checkpoints store them: MXFP4 blocks and scales of random codes (never
    +-0, so that a still training step moves no weight) and exponents 2^-9 .. 2^-3; `bad_scales`: one group
    too many. Returns {HF name: tensor} of the blocks and scales written."""
    import torch
    from safetensors.torch import save_file

    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec("gpt_oss")
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    g = torch.Generator().manual_seed(5)
    hf_sd = {
        k: v + 0.02 * torch.randn(v.shape, generator=g) if k.endswith("bias") else v
        for k, v in spec.hf.to_hf(model.state_dict(), args).items()
    }
    nonzero = torch.tensor([c for c in range(16) if c not in (0, 8)], dtype=torch.uint8)  # FP4 codes of +-0 left out
    quantized = {}
    for name in [k for k in hf_sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, fan_in, rows = hf_sd.pop(name).shape  # stored transposed: [experts, rows, fan_in / 32, 16]
        codes = nonzero[torch.randint(0, 14, (2, experts, rows, fan_in // 32, 16), generator=g)]
        quantized[name + "_blocks"] = codes[0] | (codes[1] << 4)
        groups = fan_in // 32 + (1 if bad_scales else 0)
        # 2^-9 .. 2^-3: weights of at most 0.75, outputs of order 1 (large ones would magnify round-off).
        quantized[name + "_scales"] = torch.randint(118, 125, (experts, rows, groups), dtype=torch.uint8, generator=g)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(spec.hf.config(args, torch.float32, 1, 2)))
    save_file({**hf_sd, **quantized}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return quantized


def qwen3_5_multimodal_folder(path: Path, args, sd: dict):
    """A folder laid out as the published Qwen3.5 checkpoints, written by transformers' save_pretrained:
    a Qwen3_5ForConditionalGeneration (config.json model_type 'qwen3_5', the language model's settings in
    text_config with multimodal rotary, a one-block vision tower beside it) whose language model holds our
    state dict `sd` of the dense qwen3_5 `args`. Returns that transformers model, in eval mode."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5VisionConfig

    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec("qwen3_5")
    text = spec.hf.config(args)
    # Multimodal rotary (a time, height and width share of the frequencies, interleaved), as published:
    # on text the three positions are equal, so it must import as plain rotary.
    freqs = int(args.head_dim * args.partial_rotary_factor) // 2
    text["rope_parameters"] = {
        **text["rope_parameters"],
        "mrope_interleaved": True,
        "mrope_section": [freqs - 2 * (freqs // 3), freqs // 3, freqs // 3],
    }
    vision = Qwen3_5VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=args.dim)
    model = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision.to_dict(), tie_word_embeddings=args.tie_word_embeddings)
    )
    # Ours as transformers names them (model.X, lm_head.weight), the language model under model.language_model.
    hf_sd = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in spec.hf.to_hf(sd, args).items()
    }
    missing, unexpected = model.float().load_state_dict(hf_sd, strict=False)
    assert not unexpected and missing and all(k.startswith("model.visual.") for k in missing), (missing, unexpected)
    model.save_pretrained(path, safe_serialization=True)
    assert json.loads((path / "config.json").read_text())["text_config"]["model_type"] == "qwen3_5_text"
    return model.eval()
