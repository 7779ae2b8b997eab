"""Convert Qwen3 weights between our names and Hugging Face `Qwen3ForCausalLM` names, and Qwen3-MoE
weights (`args.moe` set) to and from `Qwen3MoeForCausalLM`.

Pure tensor functions, no I/O, and for everything but the experts a pure rename: our rotary
embedding already uses Hugging Face's `rotate_half` layout, so no row is permuted. With tied
embeddings Hugging Face stores no `lm_head.weight` (it ties it to `model.embed_tokens.weight` on
load): `to_hf` writes none, and `from_hf` accepts its absence (or a copy equal to the embedding) and
returns `output.weight` as the very tensor of `tok_embeddings.weight`, as our tied model's state dict
has both names.

Qwen3-MoE experts. Ours are 3-D tensors per layer, experts first: w1 (gate) and w3 (up)
[experts, hidden, dim], w2 (down) [experts, dim, hidden]. Hugging Face has two layouts:
- the hub files (Qwen's own checkpoints, and what transformers 5.x `save_pretrained` writes: it
  converts back on save): one tensor per expert and projection,
  `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` ([hidden, dim], [hidden, dim], [dim, hidden]);
- transformers 5.x in memory (its `state_dict()`): fused `model.layers.N.mlp.experts.gate_up_proj`
  [experts, 2 x hidden, dim] (gate rows first, then up: its forward splits `x @ gate_up_proj[e].T`
  into gate, up with `chunk(2)`) and `model.layers.N.mlp.experts.down_proj` [experts, dim, hidden].
`to_hf` writes the hub layout, which transformers 4.51+ loads as such and 5.x fuses on load
(checked with 5.24: same logits); `from_hf` reads either, layer by layer. The router's gate is
`model.layers.N.mlp.gate.weight` [experts, dim] in both.

Our `expert_bias` (the aux-loss-free balancing bias, added to the router scores only to choose the
experts) has no counterpart in Qwen3-MoE, whose router chooses by score alone: `to_hf` drops it (a
model exported with a non-zero bias may choose other experts in transformers than it did here; a
warning says so), and `from_hf` returns zeros, a fresh balancing state.
"""

import logging

import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.hf_conversion import (
    EXPERT_PROJECTIONS,
    FUSED_DOWN,
    FUSED_GATE_UP,
    HF_ATTENTION,
    HF_BLOCK_NORMS,
    HF_FEED_FORWARD,
    HF_LM_HEAD,
    HF_QK_NORMS,
    HF_ROUTER,
    HF_TOP_LEVEL,
    ROTARY_INV_FREQ,
    check_keys,
    check_tied_copy,
    convert_from_hf,
    expert_block_from_hf,
    expert_from_hf,
    expert_hf_names,
    expert_key,
    expert_to_hf,
    experts_fused,
    split_layer_name,
    tied_output_from_hf,
    tied_output_hf_names,
)
from torchtitan.models.common.spec import HFAdapter
from torchtitan.models.qwen3.args import ModelArgs
from torchtitan.models.qwen3.hf_config import MODEL_TYPES, args_from_hf_config, check_exportable, hf_config

logger = logging.getLogger(__name__)

_PER_LAYER = {**HF_ATTENTION, **HF_QK_NORMS, **HF_BLOCK_NORMS}
_EXPERTS = EXPERT_PROJECTIONS  # our 3-D expert weight -> the hub's per-expert projection
_EXPERT_BIAS = "feed_forward.expert_bias"
_OURS_TIED = "output.weight"


def _per_layer(args: ModelArgs) -> dict[str, str]:
    """Our layer-local name -> HF layer-local name of the renamed tensors of each layer."""
    return {**_PER_LAYER, **(HF_ROUTER if args.moe is not None else HF_FEED_FORWARD)}


def _split(ours: str, args: ModelArgs) -> tuple[int | None, str]:
    """(layer, layer-local name) of our tensor `ours`; (None, ours) for a top-level one."""
    return split_layer_name(ours, args.n_layers, _describe(args))


def _hf_name(ours: str, args: ModelArgs) -> str:
    """The HF name of our renamed tensor `ours` (KeyError for the experts, the bias or an unknown name)."""
    layer, local = _split(ours, args)
    renames = HF_TOP_LEVEL if layer is None else _per_layer(args)
    if local not in renames:
        raise KeyError(f"{ours} is not a renamed tensor of {_describe(args)}")
    return renames[local] if layer is None else f"model.layers.{layer}.{renames[local]}"


def _name_pairs(args: ModelArgs) -> dict[str, str]:
    """Our name -> HF name for every renamed parameter of a model with `args` (the output layer
    included, even when tied); not the MoE experts (not a rename) nor the expert bias (no HF name)."""
    ours = list(HF_TOP_LEVEL) + [f"layers.{i}.{local}" for i in range(args.n_layers) for local in _per_layer(args)]
    return {name: _hf_name(name, args) for name in ours}


def _describe(args: ModelArgs) -> str:
    tied = "tied" if args.tie_word_embeddings else "untied"
    if args.moe is None:
        return f"a Qwen3 model with {args.n_layers} layers and {tied} embeddings"
    return f"a Qwen3-MoE model with {args.n_layers} layers, {args.moe.num_experts} experts and {tied} embeddings"


def _check_keys(found, expected, optional: tuple[str, ...], what: str, args: ModelArgs):
    check_keys(found, expected, what, _describe(args), optional=optional)


def _our_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Our name -> shape of every tensor in the state dict of a model with `args`."""
    hd, dim = args.head_dim, args.dim
    vocab = (args.vocab_size, dim)
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": vocab, "norm.weight": (dim,), "output.weight": vocab}
    per_layer: dict[str, tuple[int, ...]] = {
        "attention.wq.weight": (args.n_heads * hd, dim),
        "attention.wk.weight": (args.kv_heads * hd, dim),
        "attention.wv.weight": (args.kv_heads * hd, dim),
        "attention.wo.weight": (dim, args.n_heads * hd),
        "attention.q_norm.weight": (hd,),
        "attention.k_norm.weight": (hd,),
        "attention_norm.weight": (dim,),
        "ffn_norm.weight": (dim,),
    }
    if args.moe is None:
        per_layer.update(
            {
                "feed_forward.w1.weight": (args.hidden_dim, dim),
                "feed_forward.w2.weight": (dim, args.hidden_dim),
                "feed_forward.w3.weight": (args.hidden_dim, dim),
            }
        )
    else:
        e, h = args.moe.num_experts, args.moe.hidden_dim
        per_layer.update(
            {
                "feed_forward.router.gate.weight": (e, dim),
                "feed_forward.experts.w1": (e, h, dim),
                "feed_forward.experts.w3": (e, h, dim),
                "feed_forward.experts.w2": (e, dim, h),
                _EXPERT_BIAS: (e,),
            }
        )
    for i in range(args.n_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in per_layer.items()})
    return shapes


def _hf_shapes(args: ModelArgs, fused_layers: set[int]) -> dict[str, tuple]:
    """HF name -> shape of every tensor of a Hugging Face state dict for `args`, the experts of the
    layers in `fused_layers` fused (transformers 5.x in memory), the others per expert (hub files)."""
    ours = _our_shapes(args)
    shapes = {hf: ours[name] for name, hf in _name_pairs(args).items()}
    if args.moe is not None:
        e, h, dim = args.moe.num_experts, args.moe.hidden_dim, args.dim
        for i in range(args.n_layers):
            if i in fused_layers:
                shapes[f"model.layers.{i}.{FUSED_GATE_UP}"] = (e, 2 * h, dim)
                shapes[f"model.layers.{i}.{FUSED_DOWN}"] = (e, dim, h)
            else:
                for x in range(e):
                    shapes[expert_key(i, x, "gate_proj")] = (h, dim)
                    shapes[expert_key(i, x, "up_proj")] = (h, dim)
                    shapes[expert_key(i, x, "down_proj")] = (dim, h)
    return shapes


def _check_shapes(sd: dict, expected: dict[str, tuple]):
    """UserError naming the first tensors of `sd` whose shape differs from `expected` (in its order)."""
    wrong = [
        f"{key} has shape {tuple(sd[key].shape)}, expected {shape}"
        for key, shape in expected.items()
        if key in sd and tuple(sd[key].shape) != shape
    ]
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise UserError(
            f"tensors do not fit the Qwen3 configuration: {'; '.join(wrong[:3])}{more}. "
            "Check that the weights and the model configuration belong together."
        )


def _fused_layers(hf_sd, args: ModelArgs) -> set[int]:
    """The layers whose experts `hf_sd` holds fused."""
    return set() if args.moe is None else {i for i in range(args.n_layers) if experts_fused(hf_sd, i)}


# The per-tensor conversion (HFAdapter.hf_names / tensor_from_hf / tensor_to_hf). The whole-dict to_hf /
# from_hf below check keys and shapes (and the routing), then apply these to every tensor.


def hf_names(ours: str, args: ModelArgs, present: frozenset[str]) -> list[str]:
    """The HF tensors our tensor `ours` is read from, given the HF names `present` in the folder:
    - tied output.weight: the embedding, then lm_head.weight if the folder stores one (a copy that
      tensor_from_hf checks, as from_hf does); untied: lm_head.weight;
    - experts.w1 / w3: the layer's fused gate_up_proj if the folder fuses that layer (either fused
      tensor present), else the per-expert gate_proj / up_proj in expert order; w2 likewise with down_proj;
    - expert_bias: none (zeros);
    - everything else: its one renamed tensor."""
    layer, local = _split(ours, args)
    if args.tie_word_embeddings and ours == _OURS_TIED:
        return tied_output_hf_names(present)
    if args.moe is not None and local == _EXPERT_BIAS:
        return []
    if args.moe is not None and layer is not None and local in _EXPERTS:
        return expert_hf_names(layer, local, args.moe.num_experts, present)
    return [_hf_name(ours, args)]


def tensor_from_hf(ours: str, tensors: dict[str, torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """Our tensor `ours` from {HF name: tensor} for exactly hf_names(ours, args, folder). Tied output.weight
    is the embedding tensor itself (UserError if a stored lm_head.weight differs from it); experts are
    stacked per expert or sliced from the fused gate_up_proj (gate rows first); expert_bias is zeros.
    Works on meta tensors (shapes only; the lm_head value check is skipped)."""
    layer, local = _split(ours, args)
    if args.tie_word_embeddings and ours == _OURS_TIED:
        return tied_output_from_hf(tensors)
    if args.moe is not None and local == _EXPERT_BIAS:
        # No Hugging Face counterpart: a fresh balancing state, float32 like the model's own buffer.
        return torch.zeros(args.moe.num_experts)
    if args.moe is not None and layer is not None and local in _EXPERTS:
        return expert_from_hf(layer, local, tensors, args.moe.num_experts, args.moe.hidden_dim)
    return tensors[_hf_name(ours, args)]


def block_from_hf(ours: str, read, args: ModelArgs, present: frozenset[str], offset, shape) -> torch.Tensor | None:
    """A block of the experts read from only its experts' bytes (HFAdapter.block_from_hf); None for
    the rest (renames, which the loader reads by block anyway)."""
    layer, local = _split(ours, args)
    if args.moe is None or layer is None or local not in _EXPERTS:
        return None
    return expert_block_from_hf(layer, local, read, present, args.moe.hidden_dim, offset, shape)


def tensor_to_hf(ours: str, w: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    """{HF name: tensor} of our tensor `ours`: {} for a tied output.weight (Hugging Face ties it to the
    embedding on load) and for expert_bias (no counterpart; to_hf warns when it is non-zero); the
    experts one tensor per expert (hub layout, views of ours); the rest renamed."""
    layer, local = _split(ours, args)
    if (args.tie_word_embeddings and ours == _OURS_TIED) or (args.moe is not None and local == _EXPERT_BIAS):
        return {}
    if args.moe is not None and layer is not None and local in _EXPERTS:
        return expert_to_hf(layer, local, w)
    return {_hf_name(ours, args): w}


def to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM state dict (no
    lm_head.weight when tied; MoE experts one tensor per expert, as views of ours; no expert bias)."""
    check_exportable(args)
    tied = args.tie_word_embeddings
    expected = _our_shapes(args)
    # The expert bias may be absent: it is dropped anyway.
    optional = ((_OURS_TIED,) if tied else ()) + tuple(k for k in expected if k.endswith(_EXPERT_BIAS))
    _check_keys(sd, expected, optional, "the model state dict", args)
    _check_shapes(sd, expected)
    if tied:
        check_tied_copy(sd, _OURS_TIED, "tok_embeddings.weight")
    out, biased = {}, []
    for ours, w in sd.items():
        if ours.endswith(_EXPERT_BIAS) and not w.is_meta and torch.any(w != 0):
            biased.append(ours)
        out.update(tensor_to_hf(ours, w, args))
    if biased:
        logger.warning(
            f"dropping the non-zero MoE balancing bias ({biased[0]}"
            + (f" and {len(biased) - 1} more" if len(biased) > 1 else "")
            + "): Hugging Face "
            "Qwen3-MoE has none and chooses experts by router score alone, so the exported model may route "
            "some tokens to other experts than this one does"
        )
    return out


def from_hf(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM state dict -> our state dict; the inverse
    of to_hf. Tied: output.weight is the tok_embeddings.weight tensor itself. MoE: experts from the
    hub's per-expert tensors or transformers 5's fused ones; expert_bias zeros (float32). Runs on meta
    tensors as well (every key and shape check; value checks skipped): a folder can be checked from
    its headers."""
    check_exportable(args)
    tied = args.tie_word_embeddings
    hf_sd = {k: v for k, v in hf_sd.items() if not ROTARY_INV_FREQ.fullmatch(k)}
    expected = _hf_shapes(args, _fused_layers(hf_sd, args))
    _check_keys(hf_sd, expected, (HF_LM_HEAD,) if tied else (), "the Hugging Face state dict", args)
    _check_shapes(hf_sd, expected)
    return convert_from_hf(_our_shapes(args), hf_sd, args, hf_names, tensor_from_hf)


ADAPTER = HFAdapter(
    model_types=MODEL_TYPES,
    to_hf=to_hf,
    from_hf=from_hf,
    config=hf_config,
    args_from_config=args_from_hf_config,
    hf_names=hf_names,
    tensor_from_hf=tensor_from_hf,
    tensor_to_hf=tensor_to_hf,
    block_from_hf=block_from_hf,
)
