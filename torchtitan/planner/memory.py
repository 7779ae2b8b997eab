"""The memory of one rank for a layout, counted from the model spec (torchtitan.planner).

Everything is computed for the rank at coordinate 0 of every mesh dimension but "pp" (it holds the
largest shard where sizes do not divide: DTensor and FSDP2 split like torch.chunk), once per
pipeline rank; the worst pipeline rank is the layout's figure.

Terms (bytes):
- params: this rank's shards in float32 (torch.chunk rules: TP from the spec's plan, EP on the expert
  dim, FSDP on dim 0 of what TP and EP left);
- grads: the same shapes, float32;
- optimizer: AdamW / Adam keep two moments per parameter element, Muon one momentum for the matrices
  it takes (two for the rest), in optimizer.state_dtype;
- with training.enable_cpu_offload, parameters, gradients and optimizer state are in host memory and
  not counted;
- activations: what the live micro-batches keep for backward (the spec's activation_counts per block,
  under the activation-checkpointing mode, times the pipeline schedule's live micro-batches), plus
  one block's worth for the backward's working set (and recomputation);
- logits: the last stage's output layer and loss (logits in the compute dtype, their float32 copy
  and log-softmax, the gradient);
- buffers: FSDP's gathered parameters (two blocks in the compute dtype, or the whole stage where it
  is not resharded after forward) and unsharded gradients before reduce-scatter (two blocks);
- the allocator's fragmentation, a stated factor on the sum.
"""

import dataclasses
import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchtitan.config import UserError
from torchtitan.distributed.pipeline_parallel import (
    ZERO_BUBBLE_SCHEDULES,
    is_single_stage_schedule,
    num_microbatches,
    plan_split,
    schedule_style,
    stage_ids_for_rank,
)

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The allocator's overhead on what is live at the peak (fragmentation, rounding): CUDA's caching
# allocator; glibc's heap on CPU (measured by scripts/validate_memory_estimate.py on this host).
FRAGMENTATION = {"cuda": 1.10, "cpu": 1.05}
# What a rank holds besides the training state: on CUDA, the context and communication buffers (not
# in torch.cuda.max_memory_allocated, but on the device); on CPU the comparison is made above the
# process's memory before the model is built.
RESERVED = {"cuda": 2 * GiB, "cpu": 0}


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
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "logits": self.logits, "buffers": self.buffers,
                "fragmentation": self.subtotal * (self.fragmentation - 1), "reserved": self.reserved}

    def largest(self) -> str:
        terms = self.terms()
        return max(terms, key=terms.get)


def missing_counts(spec) -> None:
    if spec.activation_counts is None:
        raise UserError(
            f"model '{spec.name}' cannot be planned: its spec has no activation_counts (what a block keeps for "
            "backward per token, torchtitan.models.common.activations); add it to the family's ModelSpec"
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
    for lid, block in model.layers.items():
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
            table.append(ParamInfo(name, _top_module(name), tuple(p.shape), id(p) in experts, tp_dims.get(name),
                                   first[id(p)]))
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
        held, taken = {}, set()
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
    return {i.name: held[i.name] for i in table if i.name in held and not (i.first_name != i.name and i.first_name in held)}


def _module_names_by_pp_rank(spec, model: nn.Module, dims, parallelism) -> dict[int, list[str]]:
    n_layers = len(model.layers)
    if dims.pp == 1:
        return {0: spec.pipeline.module_names(n_layers) + _extra_top_modules(spec, model)}
    parts = plan_split(spec.pipeline, n_layers, dims.pp, parallelism)
    style = schedule_style(parallelism.pipeline_parallel_schedule)
    return {r: [m for s in stage_ids_for_rank(r, dims.pp, len(parts), style) for m in parts[s]]
            for r in range(dims.pp)}


def _extra_top_modules(spec, model: nn.Module) -> list[str]:
    """Top-level modules with parameters that the pipeline layout does not list (e.g. multi-token
    prediction heads): one process holds them."""
    listed = set(spec.pipeline.module_names(len(model.layers))) | {"layers"}
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


def block_bytes_per_token(counts, tp: int, act_bytes: int, mode: str) -> float:
    """Bytes per token one block keeps: everything ("none"), or what the op policy keeps ("op")."""
    if mode == "op":
        return counts.op_kept / tp * act_bytes + counts.fp32 / tp * 4
    return (counts.split / tp + counts.gathered) * act_bytes + counts.fp32 / tp * 4 + counts.int64 / tp * 8


_COUNTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def block_counts(spec, args, block: nn.Module, seq_len: int):
    """spec.activation_counts of a block, computed once per block and sequence length (the planner
    asks for the same blocks of one meta model for every layout)."""
    per_seq = _COUNTS.setdefault(block, {})
    if seq_len not in per_seq:
        per_seq[seq_len] = spec.activation_counts(args, block, seq_len)
    return per_seq[seq_len]


def stage_activations(spec, args, blocks: list[nn.Module], tokens: int, seq_len: int, tp: int, act_bytes: int,
                      ac_mode: str, ac_option: str) -> tuple[float, float]:
    """(bytes one micro-batch of `tokens` keeps over these blocks, the backward's working set)."""
    per_block = [block_bytes_per_token(block_counts(spec, args, b, seq_len), tp, act_bytes, "none") * tokens
                 for b in blocks]
    if not per_block:
        return 0.0, 0.0
    dim = args.dim
    boundary = tokens * dim / tp * act_bytes  # a checkpointed block keeps its input (sequence-sharded under TP)
    if ac_mode == "full" or (ac_mode == "selective" and ac_option == "1"):
        kept = [boundary for _ in per_block]
    elif ac_mode == "selective" and ac_option == "op":
        kept = [block_bytes_per_token(block_counts(spec, args, b, seq_len), tp, act_bytes, "op") * tokens + boundary
                for b in blocks]
    elif ac_mode == "selective":
        n = int(ac_option)
        kept = [boundary if i % n == 0 else full for i, full in enumerate(per_block)]
    else:
        kept = per_block
    return float(sum(kept)), float(max(per_block))


def logits_bytes(args, tokens: int, tp: int, loss_parallel: bool, act_bytes: int) -> float:
    """The last stage's output and loss: the final norm's input and gathered output, the logits in the
    compute dtype, their float32 copy and log-softmax, and the gradient of both at the start of backward."""
    vocab = args.vocab_size / (tp if loss_parallel else 1)
    return tokens * (vocab * (2 * act_bytes + 12) + args.dim * (act_bytes + act_bytes / tp + 4))


# ---- the estimate ----


def optimizer_states(spec, model: nn.Module, optimizer_cfg) -> dict[str, int]:
    """{parameter name: state tensors per element}: AdamW's and Adam's two moments, Muon's one momentum
    (for the matrices Muon takes: torchtitan.components.optimizer decides, as in training)."""
    if optimizer_cfg.name != "Muon":
        return {name: 2 for name, _ in model.named_parameters(remove_duplicate=False)}
    from torchtitan.components.optimizer import classify_parameters

    groups, _ = classify_parameters(model, optimizer_cfg, spec.adamw_params or ())
    return {name: 1 if g.algorithm == "muon" else 2 for name, g in groups.items()}


def estimate_memory(spec, model: nn.Module, args, dims, cfg, device_type: str,
                    shards: dict[int, dict[str, Shard]] | None = None,
                    states: dict[str, int] | None = None) -> MemoryEstimate:
    """The largest rank's memory for `cfg`'s layout (`dims`: ParallelDims) of the meta `model`
    (`shards`: its param_shards and `states`: its optimizer_states, when already computed). With CPU
    offload the parameters, gradients and optimizer state are in host memory: not counted."""
    missing_counts(spec)
    states = states or optimizer_states(spec, model, cfg.optimizer)
    state_bytes = DTYPE_BYTES[cfg.optimizer.state_dtype]
    par, t, ac = cfg.parallelism, cfg.training, cfg.activation_checkpoint
    shards = shards or param_shards(spec, model, dims, par)
    fsdp = dims.fsdp_enabled
    # Without FSDP, bf16 runs under autocast, which keeps float32 inputs and their bf16 copies: about
    # what float32 keeps (tests/models/test_activation_counts.py measures the block kinds).
    act_bytes = DTYPE_BYTES[t.mixed_precision_param] if fsdp else 4
    reduce_bytes = DTYPE_BYTES[t.mixed_precision_reduce] if fsdp else 4
    seq = t.seq_len // dims.cp
    _, accum = dims.batch(t.local_batch_size, t.global_batch_size)
    if dims.pp > 1:
        micro = par.pipeline_parallel_microbatch_size
        n_micro = num_microbatches(t.local_batch_size * accum, micro)
    else:
        micro, n_micro = t.local_batch_size, 1
    tokens = micro * seq
    names = _module_names_by_pp_rank(spec, model, dims, par)
    best = None
    for pp_rank, modules in names.items():
        held = shards[pp_rank]
        n_params = sum(sh.local for sh in held.values())
        blocks = [model.get_submodule(m) for m in modules if m.startswith("layers.")]
        live, _ = live_microbatches(par.pipeline_parallel_schedule, dims.pp, pp_rank, n_micro) if dims.pp > 1 else (1, 1)
        kept, working = stage_activations(spec, args, blocks, tokens, seq, dims.tp, act_bytes, ac.mode,
                                          ac.selective_ac_option)
        activations = kept * live + working * (2 if ac.mode != "none" else 1)
        last = spec.pipeline.after[-1] in modules
        # Logits come out in the training dtype under FSDP's policy and under autocast alike.
        logit_bytes = DTYPE_BYTES[t.mixed_precision_param]
        logits = logits_bytes(args, tokens, dims.tp, not par.disable_loss_parallel, logit_bytes) if last else 0.0
        buffers = 0.0
        if fsdp:
            per_module: dict[str, int] = {}
            for sh in held.values():
                per_module[sh.module] = per_module.get(sh.module, 0) + sh.gathered
            block_gathered = [n for m, n in per_module.items() if m.startswith("layers.")]
            all_gathered = sum(sh.gathered for sh in held.values())
            largest = max(block_gathered, default=0)
            resharded = par.fsdp_reshard_after_forward != "never" and not (
                dims.pp > 1 and (par.fsdp_reshard_after_forward == "default"
                                 or par.pipeline_parallel_schedule.lower() in ZERO_BUBBLE_SCHEDULES))
            gathered = 2 * largest if resharded else sum(block_gathered)
            root = all_gathered - sum(block_gathered)
            buffers = (gathered + root) * act_bytes + 2 * largest * reduce_bytes
        state = state_bytes * sum(sh.local * states.get(name, 2) for name, sh in held.items())
        on_device = 0 if t.enable_cpu_offload else 1
        estimate = MemoryEstimate(
            params=4 * n_params * on_device, grads=4 * n_params * on_device, optimizer=state * on_device,
            activations=activations, logits=logits, buffers=buffers,
            fragmentation=FRAGMENTATION.get(device_type, 1.10), reserved=RESERVED.get(device_type, 0),
            pp_rank=pp_rank,
        )
        if best is None or estimate.total > best.total:
            best = estimate
    return best


def meta_model(spec, args) -> nn.Module:
    with torch.device("meta"):
        return spec.model_cls(args)


def replace(cfg, **sections):
    """`cfg` with some of its sections' keys replaced: replace(cfg, parallelism={"tensor_parallel_degree": 2})."""
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **values)
                                       for name, values in sections.items()})
