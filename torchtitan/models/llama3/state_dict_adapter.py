"""Convert Llama 3 weights between our (Meta) names and Hugging Face `LlamaForCausalLM` names.

Pure tensor functions, no I/O. Besides renaming, the query and key projections are permuted: our
rotary embedding treats adjacent features (2i, 2i+1) of a head as one complex number, while Hugging
Face's `rotate_half` pairs feature i with feature i + head_dim/2. Reordering the output rows of wq
and wk within each head turns one layout into the other; attention scores are unchanged because q
and k get the same order.

HF configs have no `multiple_of` / `ffn_dim_multiplier`, only the resulting width, so an imported
config gets a pair chosen to reproduce `intermediate_size` exactly (see `args_from_hf_config`).

Tied embeddings (Llama 3.2 1B and 3B): Hugging Face stores the embedding only, and our tied
output.weight is read from it (an lm_head.weight stored beside it must be an equal copy).
"""

import torch

from torchtitan.config.errors import UserError
from torchtitan.models.common.hf_conversion import (
    HF_ATTENTION,
    HF_BLOCK_NORMS,
    HF_FEED_FORWARD,
    HF_LM_HEAD,
    HF_TOP_LEVEL,
    ROTARY_INV_FREQ,
    check_keys,
    check_tied_copy,
    convert_from_hf,
    decoder_config,
    rope_from_config,
    tied_output_from_hf,
    tied_output_hf_names,
    unsupported,
    with_token_ids,
)
from torchtitan.models.common.spec import HFAdapter
from torchtitan.models.llama3.args import ModelArgs

_PER_LAYER = {**HF_ATTENTION, **HF_FEED_FORWARD, **HF_BLOCK_NORMS}


def _hf_name(ours: str, args: ModelArgs) -> str:
    """The HF name of our (Meta) tensor `ours` (KeyError if a model with `args` has no such tensor)."""
    if ours in HF_TOP_LEVEL:
        return HF_TOP_LEVEL[ours]
    prefix, layer, local = ours.split(".", 2) if ours.count(".") >= 2 else ("", "", "")
    if prefix != "layers" or not layer.isdigit() or int(layer) >= args.n_layers or local not in _PER_LAYER:
        raise KeyError(f"{ours} is not a tensor of a Llama 3 model with {args.n_layers} layers")
    return f"model.layers.{layer}.{_PER_LAYER[local]}"


def _name_pairs(args: ModelArgs) -> dict[str, str]:
    """Meta name -> HF name for every parameter of a model with `args`."""
    ours = list(HF_TOP_LEVEL) + [f"layers.{i}.{local}" for i in range(args.n_layers) for local in _PER_LAYER]
    return {name: _hf_name(name, args) for name in ours}


def _check_keys(found, expected, what: str, args: ModelArgs, optional: tuple[str, ...] = ()):
    tied = "tied" if args.tie_word_embeddings else "untied"
    check_keys(found, expected, what, f"a Llama 3 model with {args.n_layers} layers and {tied} embeddings", optional)


def _check_heads(w: torch.Tensor, n_heads: int, head_dim: int, name: str):
    if w.dim() != 2 or w.shape[0] != n_heads * head_dim:
        raise UserError(
            f"{name} has shape {tuple(w.shape)}; expected {n_heads * head_dim} rows ({n_heads} heads x {head_dim}). "
            "Check that the weights and the model configuration belong together."
        )


def _pairs_to_halves(w: torch.Tensor, n_heads: int, head_dim: int, name: str) -> torch.Tensor:
    _check_heads(w, n_heads, head_dim, name)
    return w.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _halves_to_pairs(w: torch.Tensor, n_heads: int, head_dim: int, name: str) -> torch.Tensor:
    _check_heads(w, n_heads, head_dim, name)
    return w.view(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


# The per-tensor conversion (HFAdapter.hf_names / tensor_from_hf / tensor_to_hf): a rename, and the
# q/k row permutation. The whole-dict to_hf / from_hf below check the keys, then apply these to every tensor.


def hf_names(ours: str, args: ModelArgs, present: frozenset[str]) -> list[str]:
    """The HF tensors our tensor `ours` is read from: for a tied output.weight the embedding (and
    lm_head.weight when `present` has it, to check it is a copy); otherwise its one renamed tensor."""
    if args.tie_word_embeddings and ours == "output.weight":
        return tied_output_hf_names(present)
    return [_hf_name(ours, args)]


def _heads(ours: str, args: ModelArgs) -> int | None:
    """The number of heads whose rows are permuted in `ours` (None: a plain rename)."""
    if ours.endswith("attention.wq.weight"):
        return args.n_heads
    if ours.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def tensor_from_hf(ours: str, tensors: dict[str, torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """Our tensor `ours` from its HF tensor ({hf_names(ours)[0]: tensor}): that tensor itself, or for q and
    k its rows permuted (a copy; a meta tensor stays on meta, its shape checked)."""
    if args.tie_word_embeddings and ours == "output.weight":
        return tied_output_from_hf(tensors)
    ((hf, w),) = tensors.items()
    heads = _heads(ours, args)
    return w if heads is None else _halves_to_pairs(w, heads, args.head_dim, hf)


def block_from_hf(ours: str, read, args: ModelArgs, present: frozenset[str], offset, shape) -> torch.Tensor | None:
    """A block of q or k from only the rows of the heads it overlaps (HFAdapter.block_from_hf): the
    permutation moves rows within a head, so those heads' rows, permuted, hold the block. None for
    the rest (renames, which the loader reads by block anyway)."""
    heads = _heads(ours, args)
    if heads is None:
        return None
    hd = args.head_dim
    first, end = offset[0] // hd, -(-(offset[0] + shape[0]) // hd)
    rows = read(_hf_name(ours, args), (first * hd, *offset[1:]), ((end - first) * hd, *shape[1:]))
    start = offset[0] - first * hd
    return _halves_to_pairs(rows, end - first, hd, _hf_name(ours, args))[start : start + shape[0]]


def tensor_to_hf(ours: str, w: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    """{HF name: tensor} of our tensor `ours`; q and k permuted (a copy), the rest as they are; {} for
    a tied output.weight (Hugging Face ties it to the embedding on load)."""
    if args.tie_word_embeddings and ours == "output.weight":
        return {}
    heads = _heads(ours, args)
    return {_hf_name(ours, args): w if heads is None else _pairs_to_halves(w, heads, args.head_dim, ours)}


def to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict (Meta names) -> Hugging Face LlamaForCausalLM state dict (no lm_head.weight when tied)."""
    tied = args.tie_word_embeddings
    _check_keys(sd, _name_pairs(args), "the model state dict", args, ("output.weight",) if tied else ())
    if tied:
        check_tied_copy(sd, "output.weight", "tok_embeddings.weight")
    out = {}
    for meta, w in sd.items():
        out.update(tensor_to_hf(meta, w, args))
    return out


def from_hf(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hugging Face LlamaForCausalLM state dict -> our state dict (Meta names); the inverse of to_hf.
    Runs on meta tensors as well (shapes only): a folder can be checked from its headers."""
    names = _name_pairs(args)
    hf_sd = {k: v for k, v in hf_sd.items() if not ROTARY_INV_FREQ.fullmatch(k)}
    optional = (HF_LM_HEAD,) if args.tie_word_embeddings else ()
    _check_keys(hf_sd, {hf: meta for meta, hf in names.items()}, "the Hugging Face state dict", args, optional)
    return convert_from_hf(names, hf_sd, args, hf_names, tensor_from_hf)


def hf_config(
    args: ModelArgs, dtype: torch.dtype = torch.float32, bos_id: int | None = None, eos_id: int | None = None
) -> dict:
    """A config.json for LlamaForCausalLM describing a model with `args`, stored in `dtype`."""
    config = {
        **decoder_config(args, "LlamaForCausalLM", "llama"),
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return with_token_ids(config, bos_id, eos_id)


def _unsupported(field: str, value, why: str) -> UserError:
    return unsupported(field, value, why, "Llama")


def args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs for the LlamaForCausalLM described by a config.json dict; UserError if we cannot represent it."""
    required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    absent = [f for f in required if f not in config]
    if absent:
        raise UserError(f"Hugging Face config lacks {', '.join(absent)}; is this a LlamaForCausalLM config.json?")
    for field, wanted in [("model_type", "llama"), ("hidden_act", "silu")]:
        if config.get(field, wanted) != wanted:
            raise _unsupported(field, config[field], f"our model needs {wanted!r}")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            raise _unsupported(field, config[field], "our model has no biases")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // n_heads
    if dim % n_heads or head_dim != dim // n_heads:
        raise _unsupported("head_dim", head_dim, f"our model needs hidden_size / num_attention_heads = {dim / n_heads}")
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise _unsupported("num_key_value_heads", n_kv_heads, f"it must divide num_attention_heads = {n_heads}")

    # ffn_hidden_dim rounds int(8 dim / 3), optionally scaled, up to a multiple of multiple_of. With
    # multiple_of = intermediate_size the rounding lands on it from any start in [1, intermediate_size].
    theta, scaling = rope_from_config(config, 10000.0, "Llama", kinds=("llama3",))
    intermediate = config["intermediate_size"]
    base = int(2 * (4 * dim) / 3)
    args = ModelArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        vocab_size=config["vocab_size"],
        multiple_of=intermediate,
        ffn_dim_multiplier=None if intermediate >= base else intermediate / base,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        # LlamaConfig's default is untied; the published 1B and 3B configs say true.
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_seq_len=config.get("max_position_embeddings", 2048),
    )
    if intermediate < 1 or args.ffn_hidden_dim != intermediate:
        raise _unsupported("intermediate_size", intermediate, "no feed-forward width setting reproduces it")
    return args


ADAPTER = HFAdapter(
    model_types=("llama",),
    to_hf=to_hf,
    from_hf=from_hf,
    config=hf_config,
    args_from_config=args_from_hf_config,
    hf_names=hf_names,
    tensor_from_hf=tensor_from_hf,
    tensor_to_hf=tensor_to_hf,
    block_from_hf=block_from_hf,
)
