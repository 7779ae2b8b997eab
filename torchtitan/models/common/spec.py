"""What the rest of torchtitan may ask of a model family: one `ModelSpec`, documented here.

The trainer, the components, the parallelisms and the scripts never import a family; they get its
`ModelSpec` from the registry (`torchtitan.models.registry.get_model_spec(name)`) and use only
what is listed below. A family is a folder `torchtitan/models/<family>/` that builds one spec.

The model built by `spec.model_cls(args)` (on the meta device) must have:
- `layers`: an `nn.ModuleDict` of the repeated blocks, keyed by layer id ("0", "1", ...).
  Activation checkpointing, compile and FSDP wrap these blocks; a pipeline stage drops entries
  while the names of the others stay those of the full model.
- the top-level modules named in `spec.pipeline` (before and after `layers`), each of which may be
  set to None on a pipeline stage that does not hold it; `forward` must skip a None module (the
  embedding passes its input through, the output returns its input), and also a module the stage
  only keeps for another to use (named in the model's `borrowed`; PipelineLayout.shared);
- `init_weights(seed, buffer_device=None)`: fill every parameter and buffer after `to_empty`, with
  values that depend only on `seed` and the parameter's name (see `torchtitan.models.common.init`), so
  that every parallel layout starts from the same weights;
- where `spec.cp_attention` is set: in each block, the submodule at that path has an
  `attention_fn` attribute (an AttentionFn, torchtitan.models.common.attention) that the trainer sets
  to the chosen kernel and context parallel replaces, and the model has
  `set_token_positions(positions)` for rotary embeddings at global positions;
- where `spec.document_masks` is set: `forward(tokens, doc_ids=ids)` ([batch, seq] document index
  of each token, attention.document_ids) attends within documents only; a pipeline stage's forward
  takes the same keyword.

The hyper-parameters (`args`) are a frozen dataclass with at least `n_layers`, `vocab_size` and
`max_seq_len`; `dataclasses.asdict(args)` is what a checkpoint records and `args_from_dict`
rebuilds it.
"""

import dataclasses
import typing
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config import ActivationCheckpoint, Parallelism, Training
from torchtitan.models.common.attention import attended_pairs

# A label that does not count: no loss, no gradient, not in the token count that normalizes the loss.
IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy summed over the positions whose label is not IGNORE_INDEX, in float32.
    The trainer divides by the optimizer step's global count of such labels."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of one flavor. `active` is what one token uses (all of it for a dense model);
    `embedding` is the input embedding, a lookup that costs no matmul FLOPs."""

    total: int
    active: int
    embedding: int


@dataclass(frozen=True)
class PipelineLayout:
    """The top-level modules in forward order around `layers`: what pipeline splitting cuts."""

    before: tuple[str, ...] = ("tok_embeddings",)
    after: tuple[str, ...] = ("norm", "output")
    # (module, reader): a stage that holds `reader` (not None) but not `module` keeps a copy of
    # `module` under its own name, for `reader` to use; the stage's forward does not apply it in its
    # own place (the model's `borrowed` names it). The copies are one weight, kept equal
    # (pipeline_parallel.shared_weights). E.g. multi-token prediction on the last stage embeds
    # tokens with the input embedding.
    shared: tuple[tuple[str, str], ...] = ()

    def module_names(self, n_layers: int) -> list[str]:
        return [*self.before, *(f"layers.{i}" for i in range(n_layers)), *self.after]


@dataclass(frozen=True)
class HFAdapter:
    """Conversion to and from a Hugging Face `transformers` model: names, layouts, config.json."""

    model_types: tuple[str, ...]  # the config.json "model_type" values this adapter reads (and writes)
    to_hf: Callable[[dict, Any], dict]  # (our state dict, args) -> HF state dict
    from_hf: Callable[[dict, Any], dict]  # (HF state dict, args) -> our state dict
    config: Callable[..., dict]  # (args, dtype, bos_id, eos_id) -> config.json dict
    args_from_config: Callable[[dict], Any]  # config.json dict -> args (UserError if not representable)
    # The same conversion one of our tensors at a time (to_hf / from_hf are these applied over every
    # name, after their key and shape checks), so that a loader or exporter need not hold the whole model.
    # (our name, args, all HF names present) -> the HF names our tensor is built from, in order ([]: none)
    hf_names: Callable[[str, Any, frozenset[str]], list[str]]
    # (our name, {HF name: tensor} for exactly hf_names' names, args) -> our tensor
    tensor_from_hf: Callable[[str, dict[str, torch.Tensor], Any], torch.Tensor]
    # (our name, our tensor, args) -> its HF tensors by name ({} for one that is not exported)
    tensor_to_hf: Callable[[str, torch.Tensor, Any], dict[str, torch.Tensor]]
    # For a tensor whose layout changes (stacked experts, permuted rows), one block of it read from
    # only the HF bytes that block needs, so that a sharded rank need not read the whole:
    # (our name, read, args, all HF names present, block offset, block shape) -> that block of
    # tensor_from_hf's result, or None where the family has no cheaper way (the loader then reads the
    # sources whole). read(HF name, offset, shape) returns that block of the stored tensor.
    block_from_hf: Callable[..., torch.Tensor | None] | None = None


def submesh(mesh, *names: str):
    """mesh[names] of a ParallelDims.build_mesh mesh, where names may be one flattened dim ('dp',
    'dp_shard_cp', 'dp_cp', 'dp_cp_tp') or HSDP's ('dp_replicate', 'dp_shard_cp'): the mesh kept when
    it was built (torch deprecates slicing a flattened dim from the root mesh)."""
    key = names[0] if len(names) == 1 else names
    kept = getattr(mesh, "titan_flattened", {})
    return kept[key] if key in kept else mesh[key]


class ParallelDegrees(Protocol):
    """What the models read of the parallel degrees (torchtitan.distributed.parallel_dims.ParallelDims,
    which has this shape): a family's hooks and checks get the degrees without importing the layer
    above them."""

    @property
    def tp(self) -> int: ...

    @property
    def cp(self) -> int: ...

    @property
    def ep(self) -> int: ...

    @property
    def pp_enabled(self) -> bool: ...

    def batch(self, local_batch_size: int, global_batch_size: int) -> tuple[int, int]: ...


@dataclass(frozen=True)
class ParallelizeInputs:
    """What the parallelization of a model (and a family's hooks) gets besides the model: the
    degrees, the mesh and the config sections that decide how to apply each technique (handed over
    by the trainer)."""

    parallel_dims: ParallelDegrees  # a torchtitan.distributed.parallel_dims.ParallelDims
    mesh: DeviceMesh | None  # dims (pp, dp_replicate, dp_shard, cp, tp); None for one process
    parallelism: Parallelism
    training: Training
    activation_checkpoint: ActivationCheckpoint
    expert_mesh: DeviceMesh | None = None  # with expert parallel: ParallelDims.build_expert_mesh's mesh


@dataclass(frozen=True)
class MoEHooks:
    """What a family with routed experts adds to its spec, as one value (ModelSpec.moe);
    torchtitan.models.common.decoder.moe_hooks() is the one for blocks of torchtitan.models.common.moe.MoE.
    Each hook stands for the ModelSpec field of the same name (documented there), which it fills
    where the spec leaves that field unset; the name patterns are added to the spec's."""

    expert_layers: Callable[[nn.Module], list[nn.Module]]
    high_precision: tuple[str, ...] = ()
    adamw_params: tuple[str, ...] = ()  # added only where the spec declares its own (not None)
    pre_parallelize: Callable[[nn.Module, ParallelizeInputs], None] | None = None
    post_optimizer_step: Callable[[list[nn.Module], ParallelizeInputs], None] | None = None
    post_skipped_step: Callable[[list[nn.Module], ParallelizeInputs], None] | None = None
    metrics: Callable[[list[nn.Module], ParallelizeInputs], dict[str, float]] | None = None


_MOE_HOOKS = ("expert_layers", "pre_parallelize", "post_optimizer_step", "post_skipped_step", "metrics")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args_cls: type
    flavors: dict[str, Any]  # flavor name -> args
    model_cls: Callable[[Any], nn.Module]  # args -> model (called under torch.device("meta"))
    size: Callable[[Any], ModelSize]  # args -> parameter counts
    # (args, document lengths, or one int: a single document) -> training FLOPs per token, counting
    # the attention each layer's mask lets through (transformer_flops_per_token).
    flops_per_token: Callable[[Any, "int | list[int]"], float]
    # The tensor-parallel plan as data (torchtitan.models.common.tp_plan.TensorParallelPlan; None:
    # no TP) and args -> {name: (size, why)}, every size it splits, each to divide by the TP degree.
    tp_plan: Any
    tp_sizes: Callable[[Any], dict[str, tuple[int, str]]]
    pipeline: PipelineLayout = field(default_factory=PipelineLayout)
    # (args, a block of the meta model, seq_len) -> torchtitan.models.common.activation_memory.ActivationCounts:
    # what the block keeps for backward per token. None: the layout planner (torchtitan.planner) and
    # [memory_estimation] refuse the family.
    activation_counts: Callable[[Any, nn.Module, int], Any] | None = None
    cp_attention: str | None = "attention"  # path in a block of the module with `attention_fn`; None: no CP
    # (model or pipeline stage) -> its blocks outside `layers` (e.g. multi-token prediction's), each
    # called like a layer: the trainer sets their attention kernel, context parallel makes it its
    # ring, and tensor parallel applies the TP plan's block plan to them (`blocks`). None: none.
    extra_blocks: Callable[[nn.Module], list[nn.Module]] | None = None
    # The model's (or a stage's) mixture-of-experts blocks, each as torchtitan.models.common.moe.MoE
    # presents itself to expert parallel (see "Experts" in that module): `.experts` with `num_experts`,
    # weights [num_experts, ...] and `grad_scale`, and a settable `.dispatcher`. None: no flavor of the
    # family has routed experts (expert parallel is refused before launch). A family with experts
    # usually sets this, the float8 and Muon exceptions of its router and its hooks, all at once: `moe`.
    expert_layers: Callable[[nn.Module], list[nn.Module]] | None = None
    # Module-name suffixes that float8 training leaves in high precision (e.g. an MoE router, whose
    # rounding would change the routing).
    high_precision: tuple[str, ...] = ()
    # Regular expressions searched in full parameter names: the matrices that are not hidden layers, which
    # optimizer.name = "Muon" leaves to AdamW (the output layer, MoE routers); embeddings (by their
    # nn.Embedding owner) and 1-D parameters go to AdamW without being named. None: not declared, and Muon
    # is refused for the family (it would orthogonalize the output layer's updates).
    adamw_params: tuple[str, ...] | None = None
    # forward(tokens, cache=layers.kv_caches(model, n), start_pos=p) decodes incrementally (generation).
    kv_cache: bool = False
    # (model or pipeline stage, ParallelizeInputs) before the parallelisms are applied: family-specific
    # settings that depend on the layout (e.g. the MoE auxiliary losses' gradient scale). The
    # parallelisms themselves follow tp_plan, cp_attention and expert_layers
    # (torchtitan.distributed.parallelize.parallelize_model).
    pre_parallelize: Callable[[nn.Module, ParallelizeInputs], None] | None = None
    hf: HFAdapter | None = None  # None: no Hugging Face export/import for this family
    # (logits, labels) -> the SUM of the token losses over labels that are not IGNORE_INDEX.
    loss_sum_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
    # The loss_sum_fn whose value the model's training forward(tokens, labels=labels, ...) returns
    # itself, the output layer and the loss computed chunk by chunk over the tokens, when the model's
    # loss_chunk_tokens is set (torchtitan.models.common.chunked_loss; training.loss_chunk_tokens;
    # decoder.Decoder does it). None, or another function than loss_sum_fn: the model does not, and
    # training.loss_chunk_tokens is refused.
    chunked_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (args, inputs, labels) of whole [batch, seq] windows, the labels that do not count already
    # IGNORE_INDEX, before context parallel cuts each rank's positions -> (labels, {name: tensor}):
    # the labels loss_sum_fn gets ([batch, seq], or [batch, seq, n] whose column 0 holds the
    # next-token labels, the ones counted) and more keyword inputs of forward, [batch, seq, ...] each
    # (every pipeline stage gets them). E.g. multi-token prediction's further tokens and labels,
    # which context parallel must take from the whole window. None: labels as they are.
    prepare_window: Callable[[Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]] | None = None
    document_masks: bool = False  # forward(tokens, doc_ids=...) attends within documents (block_causal)
    # (args, ParallelDims) -> None: family-specific checks before launch; raise UserError.
    validate: Callable[[Any, Any], None] | None = None
    # Hooks. (model parts, optimizers) after the optimizers are built; (model parts, ParallelizeInputs)
    # after every optimizer step (e.g. a load-balancing update that is not a gradient step); and at
    # every logged step, (model parts, ParallelizeInputs) -> extra metrics, global values (every rank
    # calls it; keys with a "/" go to metrics.jsonl and TensorBoard only, the others to the console too).
    post_optimizer_build: Callable[[list[nn.Module], list], None] | None = None
    post_optimizer_step: Callable[[list[nn.Module], ParallelizeInputs], None] | None = None
    # (model parts, ParallelizeInputs) after a step skipped as non-finite: drop what its forward recorded.
    post_skipped_step: Callable[[list[nn.Module], ParallelizeInputs], None] | None = None
    metrics: Callable[[list[nn.Module], ParallelizeInputs], dict[str, float]] | None = None
    # A family with routed experts: its expert_layers, high_precision, adamw_params and hooks in one
    # value, set once (MoEHooks), which fills those fields above. A copy made with
    # dataclasses.replace(spec, moe=None) keeps the filled fields: replace them too to drop them.
    moe: MoEHooks | None = None

    def __post_init__(self):
        if self.moe is None:
            return
        for hook in _MOE_HOOKS:
            own, theirs = getattr(self, hook), getattr(self.moe, hook)
            if own is None:
                object.__setattr__(self, hook, theirs)
            elif theirs is not None and own is not theirs:
                raise ValueError(
                    f"ModelSpec {self.name!r}: {hook} is set both in the spec and in its moe hooks; "
                    "set it once (one function may call both)"
                )
        # Filled once: a copy (dataclasses.replace) passes the merged tuples again, which changes nothing.
        object.__setattr__(self, "high_precision", _union(self.high_precision, self.moe.high_precision))
        if self.adamw_params is not None:
            object.__setattr__(self, "adamw_params", _union(self.adamw_params, self.moe.adamw_params))

    def args_for_training(
        self,
        flavor: str,
        vocab_size: int,
        seq_len: int,
        moe_overrides: dict | None = None,
        overrides: dict | None = None,
    ):
        """The flavor's args with the tokenizer's vocabulary (`vocab_size` tokens, padded up by
        padded_vocab_size) and positions for exactly `seq_len` tokens (the rotary table is built for
        max_seq_len positions), the fields in `overrides` replaced (each must be a field of the
        args: `missing_fields`), and, for a family whose args have an `moe` field
        (torchtitan.models.common.moe.MoEArgs), the given MoE settings replaced."""
        args = dataclasses.replace(
            self.flavors[flavor],
            vocab_size=padded_vocab_size(vocab_size),
            max_seq_len=max(seq_len, 1),
            **(overrides or {}),
        )
        if moe_overrides and getattr(args, "moe", None) is not None:
            args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, **moe_overrides))
        return args

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """Every block of a model or pipeline stage: those of `layers`, then `extra_blocks`'."""
        layers = cast(nn.ModuleDict, model.layers)
        return [*layers.values(), *(self.extra_blocks(model) if self.extra_blocks is not None else ())]

    def has_experts(self, args) -> bool:
        """Whether a model with `args` has routed experts (built on the meta device: costs nothing)."""
        if self.expert_layers is None:
            return False
        with torch.device("meta"):
            return bool(self.expert_layers(self.model_cls(args)))

    def missing_fields(self, names) -> list[str]:
        """The names that are not fields of this family's args."""
        known = {f.name for f in dataclasses.fields(self.args_cls)}
        return [name for name in names if name not in known]

    def args_from_dict(self, values: dict):
        """Rebuild args from `dataclasses.asdict(args)` (nested dataclasses included)."""
        return _dataclass_from_dict(self.args_cls, values)


_META_MODEL: dict = {}


def layers_of(model: nn.Module) -> nn.ModuleDict:
    """`model.layers`: the blocks of a model or pipeline stage, an nn.ModuleDict keyed by layer id (the
    contract above), which nn.Module's attribute lookup types as Tensor | Module."""
    return cast(nn.ModuleDict, model.layers)


def meta_model(spec: ModelSpec, args) -> nn.Module:
    """The model of `args` on the meta device, for reading its structure (blocks, experts, parameter
    names and shapes); callers change nothing in it. The last one is kept: a large model takes about a
    second to build even on meta, and the layout planner checks many layouts of one model."""
    try:
        key = (spec.name, spec.model_cls, args)
        hash(key)
    except TypeError:  # args with a list or dict field: built each time
        key = None
    if key is None or key not in _META_MODEL:
        with torch.device("meta"):
            model = spec.model_cls(args)
        if key is None:
            return model
        _META_MODEL.clear()
        _META_MODEL[key] = model
    return _META_MODEL[key]


def _union(a: tuple, b: tuple) -> tuple:
    """The items of a, then those of b that a lacks, in order."""
    return tuple(dict.fromkeys((*a, *b)))


# The model's vocabulary is the tokenizer's rounded up to a multiple of this: a multiple of every
# tensor-parallel degree that is a power of two up to 64 (the embedding and output rows are split
# evenly; any other degree is refused by check_tp_divisibility), and of the matmul tile sizes.
# Fixed, not derived from the TP degree, so a checkpoint resumes under any parallel layout.
VOCAB_MULTIPLE = 64


def padded_vocab_size(tokens: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The model's vocabulary for a tokenizer of `tokens` ids (special tokens included): `tokens`
    rounded up to a multiple of `multiple`. The extra rows are never produced by the tokenizer
    (their logits only learn to stay low); 128,256 (Llama 3) and 4,096 stay as they are."""
    if tokens < 1:
        raise ValueError(f"a vocabulary needs at least one token, not {tokens}")
    return -(-tokens // multiple) * multiple


def _dataclass_from_dict(cls: type, values: dict):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise KeyError(f"unknown fields {', '.join(unknown)} for {cls.__name__}")
    kwargs = {}
    for name, value in values.items():
        tp = hints[name]
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) == 1:  # X | None
            tp = options[0]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = _dataclass_from_dict(tp, value)
        elif isinstance(value, list):
            value = tuple(value) if typing.get_origin(tp) is tuple else value
        kwargs[name] = value
    return cls(**kwargs)


def count_parameters(model_cls: Callable[[Any], nn.Module], args) -> tuple[int, int]:
    """(all parameters, input-embedding parameters) of the model built on the meta device; a weight
    shared by two modules (tied embeddings) counts once."""
    with torch.device("meta"):
        model = model_cls(args)
    total = sum(p.numel() for p in model.parameters())
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    return total, embedding


def transformer_flops_per_token(
    matmul_params: int, attention_width: float, windows: list[int | None], doc_lengths: int | list[int]
) -> float:
    """Training FLOPs per token of a decoder: 6 per parameter used in a matmul (2 forward, 4
    backward), plus, per (query, key) pair that a layer's mask lets through, 12 x attention_width
    (scores and weighted values, 2 x 2 x width forward, twice that backward; attention_width =
    heads x head_dim), averaged over the tokens. `windows`: each layer's sliding window (None:
    none); `doc_lengths`: the documents the tokens attend within (an int: one such document, a
    causal window of that length: (seq + 1) / 2 keys per query on average)."""
    lengths = [doc_lengths] if isinstance(doc_lengths, int) else list(doc_lengths)
    pairs = sum(count * attended_pairs(lengths, window) for window, count in Counter(windows).items())
    return 6 * matmul_params + 12 * attention_width * pairs / sum(lengths)
