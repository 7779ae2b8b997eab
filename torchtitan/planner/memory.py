"""The memory of one rank for a layout, counted from the model spec (torchtitan.planner).

Everything is computed for the rank at coordinate 0 of every mesh dimension but "pp" (it holds the
largest shard where sizes do not divide: DTensor and FSDP2 split like torch.chunk), once per
pipeline rank; the worst pipeline rank is the layout's figure.

Terms (bytes), at the step's peak (the start of backward, when every micro-batch the schedule holds
has kept its activations and the loss's gradient is being computed):
- params: this rank's shards in float32 (torch.chunk rules: TP from the spec's plan, EP on the expert
  dim, FSDP on dim 0 of what TP and EP left);
- grads: float32 gradients of the same shapes where they are live at the peak: with gradient
  accumulation or a pipeline (earlier micro-batches have made them); otherwise they are freed before
  the forward (zero_grad) and count only where the end of backward, with all of them and one
  block's backward, is above the peak of the forward;
- optimizer: AdamW / Adam keep two moments per parameter element, Muon one momentum for the matrices
  it takes (two for the rest), in optimizer.state_dtype;
- with training.enable_cpu_offload, parameters, gradients and optimizer state are in host memory and
  not counted;
- activations: what the live micro-batches keep for backward (the spec's activation_counts per block,
  plus what context parallel's method keeps in attention beyond them (cp_attention_bytes),
  under the activation-checkpointing mode, times the pipeline schedule's live micro-batches); with
  checkpointing, plus the one block being recomputed where that is more than the loss's backward;
- logits: the last stage's output and loss: the final norm's tensors, the logits in the compute
  dtype and the float32 log-softmax that cross-entropy keeps, and the two float32 gradients of the
  loss's backward;
- buffers: FSDP's gathered parameters (two blocks in the compute dtype, float8 weights in one byte
  with float8 all-gather, or the whole stage where it is not resharded after forward) and unsharded
  gradients before reduce-scatter (two blocks; a pipeline stage's whole); autocast's bf16 copies of
  the parameters;
- what the device holds beyond the allocator's peak: a stated factor on the sum and a constant.
"""

import dataclasses
import math
import weakref
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchtitan.config import UserError
from torchtitan.distributed.pipeline_parallel import (
    is_single_stage_schedule,
    num_microbatches,
    schedule_style,
    splits_backward,
    stage_ids_for_rank,
    stage_modules,
)
from torchtitan.models.common.chunked_loss import resolve_chunk_tokens
from torchtitan.models.common.spec import layers_of

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What a device holds beyond the allocator's peak, as a factor on that peak and a constant. CUDA: the
# caching allocator's fragmentation and rounding; the context and communication buffers (not in
# torch.cuda.max_memory_allocated, but on the device). CPU: a process's resident memory over the CPU
# allocator's peak (glibc's heap, gloo, the interpreter) is 1.2x to 3.1x that peak for the debug
# models, the most for DeepSeek-V3's many small routing tensors; 2x and 0.75 GiB bound every row of
# scripts/validate_memory_estimate.py (docs/benchmarks.md#memory-and-step-time-estimates).
FRAGMENTATION = {"cuda": 1.10, "cpu": 2.0}
RESERVED = {"cuda": 2 * GiB, "cpu": 3 * GiB // 4}


@dataclass(frozen=True)
class MemoryEstimate:
    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float
    fragmentation: float  # factor on the sum of the terms above
    reserved: float  # outside the allocator (CUDA context), added after the factor
    pp_rank: int  # the pipeline rank these figures are for (the largest)

    @property
    def total(self) -> float:
        return self.subtotal * self.fragmentation + self.reserved

    @property
    def subtotal(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.buffers

    def terms(self) -> dict[str, float]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
            "buffers": self.buffers,
            "fragmentation": self.subtotal * (self.fragmentation - 1),
            "reserved": self.reserved,
        }

    def largest(self) -> str:
        """The largest of the terms a layout can change (fragmentation and the reserve follow them)."""
        terms = {k: v for k, v in self.terms().items() if k not in ("fragmentation", "reserved")}
        return max(terms, key=terms.__getitem__)


def missing_counts(spec) -> None:
    if spec.activation_counts is None:
        raise UserError(
            f"model '{spec.name}' cannot be planned: its spec has no activation_counts (what a block keeps for "
            "backward per token, torchtitan.models.common.activation_memory); add it to the family's ModelSpec"
        )


# ---- parameters: which rank holds what ----


def _tp_shard_dims(model: nn.Module, plan, loss_parallel: bool) -> dict[str, int]:
    """{parameter name: the dim TP splits} for the parameters the spec's plan splits."""
    dims: dict[str, int] = {}

    def visit(prefix: str, root: nn.Module, styles: dict):
        for path, style in styles.items():
            module = root.get_submodule(path) if path else root
            if module is None or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
                continue
            embedding = isinstance(module, nn.Embedding)
            col = isinstance(style, ColwiseParallel)
            for pname, _ in module.named_parameters(recurse=False):
                if pname == "bias" and not col:
                    continue  # a row-wise layer's bias is replicated
                dims[f"{prefix}{path}.{pname}"] = (1 if col else 0) if embedding else (0 if col else 1)

    visit("", model, {k: v for k, v in plan.top(loss_parallel).items() if getattr(model, k, None) is not None})
    for lid, block in layers_of(model).items():
        visit(f"layers.{lid}.", block, plan.block(block))
    return dims


def _chunk(size: int, parts: int) -> int:
    """Rows of the first chunk of torch.chunk(size rows, parts): the largest."""
    return min(size, -(-size // parts)) if parts > 1 else size


@dataclass(frozen=True)
class Shard:
    local: int  # elements this rank holds
    gathered: int  # elements FSDP all-gathers for compute (after TP and EP: what the rank computes with)
    module: str = ""  # its top-level module or block


@dataclass(frozen=True)
class ParamInfo:
    name: str
    module: str  # its top-level module or block ("layers.N"): what a pipeline stage holds
    shape: tuple[int, ...]
    expert: bool  # a routed expert's weight (split by expert parallel)
    tp_dim: int | None  # the dim the TP plan splits (None: replicated)
    first_name: str  # the first name of its Parameter (a tied weight has two)


_PARAMS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def param_table(spec, model: nn.Module, loss_parallel: bool) -> list[ParamInfo]:
    """Every parameter name of `model` with what decides its shards (computed once per model)."""
    per_model = _PARAMS.setdefault(model, {})
    if loss_parallel not in per_model:
        tp_dims = _tp_shard_dims(model, spec.tp_plan, loss_parallel) if spec.tp_plan is not None else {}
        experts = set()
        if spec.expert_layers is not None:
            for moe in spec.expert_layers(model):
                experts |= {id(p) for p in moe.experts.parameters()}
        first: dict[int, str] = {}
        table = []
        for name, p in model.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), name)
            table.append(
                ParamInfo(name, _top_module(name), tuple(p.shape), id(p) in experts, tp_dims.get(name), first[id(p)])
            )
        per_model[loss_parallel] = table
    return per_model[loss_parallel]


def param_shards(spec, model: nn.Module, dims, parallelism) -> dict[int, dict[str, Shard]]:
    """{pp rank: {parameter name: Shard}} for the meta `model` under `dims` (ParallelDims), at
    coordinate 0 of the other mesh dimensions. A weight tied across pipeline stages is held (a copy)
    by each stage that uses it; on one stage it is one tensor (under its first name)."""
    table = param_table(spec, model, not parallelism.disable_loss_parallel)
    fsdp = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    shards: dict[int, dict[str, Shard]] = {}
    for pp_rank, modules in _module_names_by_pp_rank(spec, model, dims, parallelism).items():
        modules = set(modules)
        held = {}
        for info in table:
            if info.module not in modules:
                continue
            shape = list(info.shape)
            if info.expert and dims.ep > 1:
                shape[0] = _chunk(shape[0], dims.ep)
                gathered = math.prod(shape)
                shape[0] = _chunk(shape[0], fsdp // dims.ep)
            else:
                if info.tp_dim is not None and dims.tp > 1:
                    shape[info.tp_dim] = _chunk(shape[info.tp_dim], dims.tp)
                gathered = math.prod(shape)
                shape[0] = _chunk(shape[0], fsdp)
            held[info.name] = Shard(math.prod(shape), gathered, info.module)
        shards[pp_rank] = _dedup_tied(table, held)
    return shards


def _top_module(name: str) -> str:
    """The top-level module (or block, "layers.N") a parameter name belongs to."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _dedup_tied(table: list[ParamInfo], held: dict[str, Shard]) -> dict[str, Shard]:
    """One entry per Parameter object: a tied embedding and output layer held by one stage are one
    tensor, under its first name."""
    return {
        i.name: held[i.name] for i in table if i.name in held and not (i.first_name != i.name and i.first_name in held)
    }


def _module_names_by_pp_rank(spec, model: nn.Module, dims, parallelism) -> dict[int, list[str]]:
    n_layers = len(layers_of(model))
    if dims.pp == 1:
        return {0: spec.pipeline.module_names(n_layers) + _extra_top_modules(spec, model)}
    parts = stage_modules(spec.pipeline, n_layers, dims.pp, parallelism)
    style = schedule_style(parallelism.pipeline_parallel_schedule)
    return {
        r: [
            m
            for s in stage_ids_for_rank(r, dims.pp, len(parts), style)
            for m in parts[s] + _borrowed(spec, model, parts[s])
        ]
        for r in range(dims.pp)
    }


def _borrowed(spec, model: nn.Module, part: list[str]) -> list[str]:
    """The modules a stage keeps a copy of for a module it holds (spec.pipeline.shared, e.g. the input
    embedding for multi-token prediction on the last stage), as pipeline_parallel.build_stage_model
    does. (Two stages of one rank that both hold it count it once here.)"""
    return [
        module
        for module, reader in spec.pipeline.shared
        if reader in part and module not in part and getattr(model, reader, None) is not None
    ]


def _float8_gathered(spec, model: nn.Module, cfg) -> set[str]:
    """The weights FSDP all-gathers in float8 (float8.enable_fsdp_float8_all_gather): those of the
    Linear layers convert_to_float8 converts."""
    if "float8" not in cfg.model.converters or not cfg.float8.enable_fsdp_float8_all_gather:
        return set()
    from torchtitan.components.float8 import high_precision_reason

    return {
        f"{fqn}.weight"
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear) and high_precision_reason(fqn, m, cfg.float8, spec.high_precision) is None
    }


def _extra_blocks(spec, model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The spec's extra blocks (e.g. multi-token prediction's), each with its top-level module's name."""
    if spec.extra_blocks is None:
        return []
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(b)].split(".")[0], b) for b in spec.extra_blocks(model)]


def _extra_top_modules(spec, model: nn.Module) -> list[str]:
    """Top-level modules with parameters that the pipeline layout does not list (e.g. multi-token
    prediction heads): one process holds them."""
    listed = set(spec.pipeline.module_names(len(layers_of(model)))) | {"layers"}
    return [n for n, m in model.named_children() if n not in listed and any(True for _ in m.parameters())]


# ---- activations ----


def live_microbatches(schedule: str, pp: int, pp_rank: int, n_micro: int) -> tuple[float, int]:
    """(micro-batches whose activations a stage of `pp_rank` holds at once, stages per rank) under a
    schedule: GPipe all of them; 1F1B pp - rank; the multi-stage schedules pp - rank per stage for the
    first and the rank's own count for the later (a bound: their warm-up runs each chunk once more)."""
    name = schedule.lower()
    if is_single_stage_schedule(schedule):
        return (n_micro if name == "gpipe" else min(pp - pp_rank, n_micro)), 1
    if name in ("loopedbfs",):
        return n_micro, 2
    return min(pp - pp_rank + 1, n_micro), 2


def block_bytes_per_token(counts, tp: int, act_bytes: int, mode: str, autocast: bool = False) -> float:
    """Bytes per token one block keeps: everything ("none"), or what the op policy keeps ("op");
    `autocast`: bf16 under torch.autocast over float32 parameters (act_bytes 2)."""
    if mode == "op":
        return counts.op_kept / tp * act_bytes + counts.op_fp32 / tp * 4
    if autocast:
        return (
            ((counts.split - counts.autocast_moved) / tp + counts.gathered + counts.autocast_casts) * act_bytes
            + (counts.fp32 + counts.autocast_moved) / tp * 4
            + counts.int64 / tp * 8
        )
    return (counts.split / tp + counts.gathered) * act_bytes + counts.fp32 / tp * 4 + counts.int64 / tp * 8


_COUNTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def block_counts(spec, args, block: nn.Module, seq_len: int):
    """spec.activation_counts of a block, computed once per block and sequence length (the planner
    asks for the same blocks of one meta model for every layout)."""
    per_seq = _COUNTS.setdefault(block, {})
    if seq_len not in per_seq:
        per_seq[seq_len] = spec.activation_counts(args, block, seq_len)
    return per_seq[seq_len]


def _attention_dims(args) -> tuple[int, int, int]:
    """(query heads, query/key head dim, value head dim) of a family's args (MLA's differ)."""
    heads = args.n_heads
    qk = getattr(args, "qk_head_dim", None) or getattr(args, "head_dim", None) or args.dim // heads
    return heads, qk, getattr(args, "v_head_dim", None) or qk


def cp_attention_bytes(
    args, par, cp: int, tp: int, tokens: int, seq_len: int, act_bytes: int, documents: bool
) -> float:
    """What one block's context-parallel attention keeps for backward beyond what the family's counts hold
    for a flash kernel on the local tokens (q, k and v repeated to every query head, the output and
    the log-sum-exp), for a micro-batch of `tokens` local tokens of sequences of `seq_len`. Saved tensors
    of one attention call on 2 gloo ranks (docs/planning.md), per method:
    - Ulysses: nothing more. Each rank holds the whole sequence for heads / cp of the heads: as many
      elements as its own tokens of every head;
    - the gathered ring: the whole sequence's keys and values (cp - 1 more blocks of them) and the mask
      of its queries against every key, which SDPA keeps in the compute dtype (one per sequence with
      document masks, else one for the micro-batch; a family that needs the log-sum-exp, gpt-oss's
      sinks, runs block_attention instead, which keeps no mask: counted all the same, a bound);
    - the rotating ring: the received blocks of keys and values (cp - 1 more, kept for backward though
      its attention holds one chunk pair at a time: block_attention), each chunk pair's float32 output
      and log-sum-exp with the merge's weights (2 cp + 1 pairs of half the local tokens under the
      causal mask: a window skips some), and no kernel output."""
    if cp == 1 or par.context_parallel_method == "ulysses":
        return 0.0
    heads, qk, v = _attention_dims(args)
    heads /= tp
    kv = (cp - 1) * tokens * heads * (qk + v) * act_bytes
    if par.context_parallel_rotate_method == "allgather":
        local = seq_len // cp
        masks = tokens // local if documents else 1
        return kv + masks * local * seq_len * act_bytes
    pairs = (2 * cp + 1) / 2 * tokens * heads * (v + 3) * 4
    return kv + pairs - tokens * heads * v * act_bytes


def stage_activations(
    spec,
    args,
    blocks: list[nn.Module],
    tokens: int,
    seq_len: int,
    tp: int,
    act_bytes: int,
    ac_mode: str,
    ac_option: str,
    autocast: bool = False,
    attention_extra: float = 0.0,
) -> tuple[float, float]:
    """(bytes one micro-batch of `tokens` keeps over these blocks, the largest block's own: what its
    recomputation brings back under checkpointing). `attention_extra`: what each block's attention keeps
    beyond the counts (cp_attention_bytes), without checkpointing and under the op policy."""
    per_block = [
        block_bytes_per_token(block_counts(spec, args, b, seq_len), tp, act_bytes, "none", autocast) * tokens
        + attention_extra
        for b in blocks
    ]
    if not per_block:
        return 0.0, 0.0
    dim = args.dim
    # A checkpointed block keeps its input (sequence-sharded under TP; float32 under autocast).
    boundary = tokens * dim / tp * (4 if autocast else act_bytes)
    if ac_mode == "full" or (ac_mode == "selective" and ac_option == "1"):
        kept = [boundary for _ in per_block]
    elif ac_mode == "selective" and ac_option == "op":
        kept = [
            block_bytes_per_token(block_counts(spec, args, b, seq_len), tp, act_bytes, "op") * tokens
            + boundary
            + attention_extra
            for b in blocks
        ]
    elif ac_mode == "selective":
        n = int(ac_option)
        kept = [boundary if i % n == 0 else full for i, full in enumerate(per_block)]
    else:
        kept = per_block
    return float(sum(kept)), float(max(per_block))


def logits_bytes(
    args, tokens: int, tp: int, loss_parallel: bool, act_bytes: int, output_kept: bool
) -> tuple[float, float]:
    """The last stage's output and loss: (what stays until the loss's backward: the final norm's input
    and gathered output, cross-entropy's float32 log-softmax and, where something holds the model's
    output (`output_kept`: a pipeline stage keeps it for its backward), the logits in the compute
    dtype, which the loss does not save; what its backward adds: the float32 gradients of the
    log-softmax and of its input, live together, and under loss parallel a third, DTensor's sharded
    log-softmax backward's own)."""
    sharded = loss_parallel and tp > 1
    vocab = args.vocab_size / (tp if sharded else 1)
    kept = tokens * (vocab * ((act_bytes if output_kept else 0) + 4) + args.dim * (act_bytes + act_bytes / tp + 4))
    return kept, tokens * vocab * (12 if sharded else 8)


def chunked_logits_bytes(args, tokens: int, tp: int, act_bytes: int, chunk_tokens: int) -> tuple[float, float]:
    """logits_bytes under training.loss_chunk_tokens (torchtitan.models.common.chunked_loss), whose
    forward computes the loss and its gradients a chunk of tokens at a time: (what stays until the
    backward: the final norm's tensors, as above, and the gradients the forward computed, for the
    final norm's output (every token, float32 at most) and for the output weight (this rank's rows
    of the vocabulary, float32); what one chunk adds while it is computed: its float32 logits, which
    become the softmax and the gradient in place, and under a lower compute dtype the matmul's
    output, then the gradient's copy in that dtype, either beside the float32 tensor). Under TP each
    rank computes its vocabulary shard's logits whether or not loss parallel is on; a pipeline
    stage's output is the loss itself."""
    vocab = args.vocab_size / tp
    kept = tokens * args.dim * (act_bytes + act_bytes / tp + 4 + 4) + vocab * args.dim * 4
    return kept, min(chunk_tokens, tokens) * vocab * (4 + (act_bytes if act_bytes < 4 else 0))


# ---- the estimate ----


def optimizer_states(spec, model: nn.Module, optimizer_cfg) -> dict[str, int]:
    """{parameter name: state tensors per element}: AdamW's and Adam's two moments, Muon's one momentum
    (for the matrices Muon takes: torchtitan.components.optimizer decides, as in training)."""
    if optimizer_cfg.name != "Muon":
        return {name: 2 for name, _ in model.named_parameters(remove_duplicate=False)}
    from torchtitan.components.optimizer import classify_parameters

    groups, _ = classify_parameters(model, optimizer_cfg, spec.adamw_params or ())
    return {name: 1 if g.algorithm == "muon" else 2 for name, g in groups.items()}


def estimate_memory(
    spec,
    model: nn.Module,
    args,
    dims,
    cfg,
    device_type: str,
    shards: dict[int, dict[str, Shard]] | None = None,
    states: dict[str, int] | None = None,
) -> MemoryEstimate:
    """The largest rank's memory for `cfg`'s layout (`dims`: ParallelDims) of the meta `model`
    (`shards`: its param_shards and `states`: its optimizer_states, when already computed). With CPU
    offload the parameters, gradients and optimizer state are in host memory: not counted."""
    missing_counts(spec)
    states = states or optimizer_states(spec, model, cfg.optimizer)
    state_bytes = DTYPE_BYTES[cfg.optimizer.state_dtype]
    par, t, ac = cfg.parallelism, cfg.training, cfg.activation_checkpoint
    shards = shards or param_shards(spec, model, dims, par)
    fsdp = dims.fsdp_enabled
    # Without FSDP, bf16 runs under autocast over the float32 parameters: bf16 matmuls, float32 norms
    # and residuals, a bf16 copy of each matmul's float32 input and of each parameter (the family's
    # autocast counts; tests/models/test_activation_counts.py measures them).
    autocast = not fsdp and t.mixed_precision_param != "float32"
    act_bytes = DTYPE_BYTES[t.mixed_precision_param]
    reduce_bytes = DTYPE_BYTES[t.mixed_precision_reduce] if fsdp else 4
    seq = t.seq_len // dims.cp
    _, accum = dims.batch(t.local_batch_size, t.global_batch_size)
    if dims.pp > 1:
        micro = par.pipeline_parallel_microbatch_size
        n_micro = num_microbatches(t.local_batch_size * accum, micro)
    else:
        micro, n_micro = t.local_batch_size, 1
    tokens = micro * seq
    split_backward = dims.pp > 1 and splits_backward(par.pipeline_parallel_schedule, par.pipeline_parallel_schedule_csv)
    chunk_tokens = resolve_chunk_tokens(cfg, spec, dims.tp, dims.cp, dims.pp, args.vocab_size, split_backward)
    # The methods of context parallel keep different tensors in attention (cp_attention_bytes).
    attention_extra = (
        cp_attention_bytes(
            args, par, dims.cp, dims.tp, tokens, t.seq_len, act_bytes, cfg.model.attn_mask_type == "block_causal"
        )
        if spec.cp_attention
        else 0.0
    )
    names = _module_names_by_pp_rank(spec, model, dims, par)
    float8_gathered = _float8_gathered(spec, model, cfg) if fsdp else set()
    extra_blocks = _extra_blocks(spec, model)
    best = None
    for pp_rank, modules in names.items():
        held = shards[pp_rank]
        n_params = sum(sh.local for sh in held.values())
        blocks = [model.get_submodule(m) for m in modules if m.startswith("layers.")]
        blocks += [b for top, b in extra_blocks if top in modules]
        live, _ = (
            live_microbatches(par.pipeline_parallel_schedule, dims.pp, pp_rank, n_micro) if dims.pp > 1 else (1, 1)
        )
        kept, recomputed = stage_activations(
            spec,
            args,
            blocks,
            tokens,
            seq,
            dims.tp,
            act_bytes,
            ac.mode,
            ac.selective_ac_option,
            autocast,
            attention_extra,
        )
        last = spec.pipeline.after[-1] in modules
        # Logits come out in the training dtype under FSDP's policy and under autocast alike.
        logit_bytes = DTYPE_BYTES[t.mixed_precision_param]
        if not last:
            logits_kept, loss_backward = 0.0, 0.0
        elif chunk_tokens:
            logits_kept, loss_backward = chunked_logits_bytes(args, tokens, dims.tp, logit_bytes, chunk_tokens)
        else:
            logits_kept, loss_backward = logits_bytes(
                args, tokens, dims.tp, not par.disable_loss_parallel, logit_bytes, output_kept=dims.pp > 1
            )
        # Multi-token prediction's blocks feed the output layer and the loss again: their logits and
        # log-softmax are kept together; the loss's backward runs one output at a time.
        logits_kept *= 1 + sum(block_counts(spec, args, b, seq).outputs for b in blocks)
        # The peak is at the start of backward: the loss's gradients or, under checkpointing, the first
        # recomputed block on top of everything kept (a stage without the loss: the recomputed block).
        activations = kept * live + max(recomputed if ac.mode != "none" else 0.0, loss_backward)
        logits = logits_kept
        grads = 4 * n_params
        if not (accum > 1 or dims.pp > 1):
            # Freed by zero_grad before the forward: they count where the end of backward (all of them,
            # one block's working set, the last kept boundary) is above the start of backward.
            grads = max(0.0, grads + recomputed - activations - logits)
        # Autocast's bf16 copies of the parameters, cached for the forward and kept for backward.
        buffers = n_params * act_bytes if autocast else 0.0
        if fsdp:
            # Gathered bytes and elements per module (float8 all-gather sends converted weights in 1 byte).
            per_module: dict[str, list[float]] = {}
            for name, sh in held.items():
                entry = per_module.setdefault(sh.module, [0.0, 0])
                entry[0] += sh.gathered * (1 if name in float8_gathered else act_bytes)
                entry[1] += sh.gathered
            blocks_gathered = [v for m, v in per_module.items() if m.startswith("layers.")]
            largest_bytes, largest = max(blocks_gathered, default=(0.0, 0))
            resharded = par.fsdp_reshard_after_forward != "never" and not (
                dims.pp > 1 and (par.fsdp_reshard_after_forward == "default" or split_backward)
            )
            gathered = 2 * largest_bytes if resharded else sum(b for b, _ in blocks_gathered)
            root = sum(b for m, (b, _) in per_module.items() if not m.startswith("layers."))
            # A pipeline stage's backward skips the gradient reduce-scatter until its last micro-batch
            # (torch.distributed.pipelining): the stage's unsharded gradients accumulate meanwhile.
            unsharded_grads = sum(sh.gathered for sh in held.values()) if dims.pp > 1 else 2 * largest
            buffers = gathered + root + unsharded_grads * reduce_bytes
        state = state_bytes * sum(sh.local * states.get(name, 2) for name, sh in held.items())
        on_device = 0 if t.enable_cpu_offload else 1
        estimate = MemoryEstimate(
            params=4 * n_params * on_device,
            grads=grads * on_device,
            optimizer=state * on_device,
            activations=activations,
            logits=logits,
            buffers=buffers,
            fragmentation=FRAGMENTATION.get(device_type, 1.10),
            reserved=RESERVED.get(device_type, 0),
            pp_rank=pp_rank,
        )
        if best is None or estimate.total > best.total:
            best = estimate
    assert best is not None  # every layout has a pipeline rank 0
    return best


def replace(cfg, **sections):
    """`cfg` with some of its sections' keys replaced: replace(cfg, parallelism={"tensor_parallel_degree": 2})."""
    return dataclasses.replace(
        cfg, **{name: dataclasses.replace(getattr(cfg, name), **values) for name, values in sections.items()}
    )
