"""Pipeline parallelism: split a decoder into model parts by module name, place the parts ("stages")
on the ranks of the "pp" mesh dimension, and run them with torch.distributed.pipelining schedules.

What is unusual here:
- No tracing. A stage is a deep copy of the meta model with the modules it does not own deleted
  (the top-level modules of the spec's PipelineLayout set to None, entries of the `layers`
  ModuleDict removed), so every
  remaining parameter keeps the FQN it has in the full model: `init_weights(seed)` gives each stage
  exactly the values of the full model, and checkpoints use the full model's names.
- Loss scaling: the trainer's loss is a sum of token losses times a per-step scale (1 / the step's
  global count of labels that count, times the data- and context-parallel ranks, whose gradients
  FSDP averages). Each microbatch's loss is backpropagated separately and the stage gradients add
  up, which is already the gradient of the step's loss: the schedules are built with
  `scale_grads=False` (torch 2.13 defaults to dividing by n_microbatches). `StepLoss` is the
  schedule's loss_fn and holds the scale; `pipeline_step` returns the sum of the microbatch losses.
- Document ids (block-causal attention) and a family's own per-token inputs (batch.BatchPreparation) are
  keyword inputs of every stage: the schedule cuts tensor kwargs into microbatches like the inputs
  and hands them to each stage's forward.
- Gradient clipping must see every stage: `distributed.grad_norm.clip_grad_norm_` with the pp group
  all-reduces the sum of squares over it (FSDP shards are already combined by DTensor).
- Weights shared by modules on different stages (tied embeddings; a module another stage borrows,
  PipelineLayout.shared, e.g. the input embedding for multi-token prediction on the last stage):
  each stage gets its own copy, kept equal by distributed.shared_weights (`Pipeline.ties` lists them).
  A borrowed module keeps its name, so a checkpoint holds one copy under it.
- FSDP under the zero-bubble schedules: see `apply_fsdp_to_stage`.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _PipelineScheduleRuntime,
    get_schedule_class,
)

from torchtitan.config.errors import UserError
from torchtitan.config.parallelism_sections import ZERO_BUBBLE_SCHEDULES
from torchtitan.models.common.spec import PipelineLayout, layers_of

# What build_pipeline_schedule returns (a CSV schedule is a PipelineScheduleMulti).
PipelineSchedule = PipelineScheduleSingle | PipelineScheduleMulti

# Schedules that place two stages per rank in a "V": rank r holds stages r and 2*pp-1-r.
V_SCHEDULES = {"zbvzerobubble", "dualpipev"}
# torch raises (or deadlocks) for these when there are fewer microbatches than stages.
_NEED_MB_GE_STAGES = {"1f1b", "interleaved1f1b", "interleavedzerobubble", "zbvzerobubble", "dualpipev"}


def _schedule_class(schedule_name: str):
    try:
        return get_schedule_class(schedule_name)
    except ValueError as e:
        raise UserError(f"parallelism.pipeline_parallel_schedule = {schedule_name!r}: {e}") from None


def csv_schedule_actions(csv_path: str) -> list[list]:
    """The compute actions of each pipeline rank in a CSV schedule (one row per rank, e.g. 0F0,0I0,0W0), read as
    torch reads them; UserError for a file that cannot be read or an action it would not parse."""
    import csv

    from torch.distributed.pipelining.schedules import _Action

    where = f"parallelism.pipeline_parallel_schedule_csv {csv_path}"
    try:
        with open(csv_path, newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{where} cannot be read: {e}") from None
    try:
        actions = [[a for a in (_Action.from_str(text) for text in row) if a is not None] for row in rows]
    except (RuntimeError, ValueError) as e:
        raise UserError(f"{where}: {e}") from None
    if not any(actions):
        raise UserError(f"{where} holds no action; write one row of actions (e.g. 0F0,0B0) per pipeline rank")
    return actions


def splits_backward(schedule_name: str, csv_path: str | None) -> bool:
    """Whether the pipeline schedule splits a backward into an input-gradient pass and a later weight-gradient pass:
    the zero-bubble schedules, or a CSV schedule with an I or W action. Read from the schedule's actions, not its
    name: a CSV names none."""
    if csv_path:
        from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT

        return any(
            a.computation_type in (BACKWARD_INPUT, BACKWARD_WEIGHT)
            for row in csv_schedule_actions(csv_path)
            for a in row
        )
    return schedule_name.lower() in ZERO_BUBBLE_SCHEDULES


def is_single_stage_schedule(schedule_name: str) -> bool:
    return issubclass(_schedule_class(schedule_name), PipelineScheduleSingle)


def schedule_style(schedule_name: str) -> str:
    """ "v" for the V-shaped schedules, "loop" (stage i on rank i % pp) for all others."""
    _schedule_class(schedule_name)
    return "v" if schedule_name.lower() in V_SCHEDULES else "loop"


def resolve_num_stages(
    n_layers: int,
    pp_degree: int,
    schedule_name: str,
    layers_per_stage: int | None = None,
    first_less: int = 0,
    last_less: int = 0,
) -> int:
    """Total number of stages: one per rank for GPipe/1F1B, two per rank for multi-stage schedules,
    or as many as `layers_per_stage` implies (then it must be a multiple of the pp degree)."""
    single = is_single_stage_schedule(schedule_name)
    if layers_per_stage is None:
        return pp_degree if single else 2 * pp_degree
    if layers_per_stage < 1:
        raise UserError(f"parallelism.pipeline_parallel_layers_per_stage = {layers_per_stage} must be >= 1")
    effective = n_layers + first_less + last_less
    if effective % layers_per_stage != 0:
        raise UserError(
            f"parallelism.pipeline_parallel_layers_per_stage = {layers_per_stage} does not divide model n_layers = "
            f"{n_layers} + pipeline_parallel_first_stage_less_layers = {first_less} + "
            f"pipeline_parallel_last_stage_less_layers = {last_less} = {effective}"
        )
    num_stages = effective // layers_per_stage
    check_placement(num_stages, pp_degree, schedule_name, f"pipeline_parallel_layers_per_stage = {layers_per_stage}")
    return num_stages


def check_placement(num_stages: int, pp_degree: int, schedule_name: str, source: str) -> None:
    """Raise UserError unless the schedule can place `num_stages` stages on `pp_degree` ranks."""
    if is_single_stage_schedule(schedule_name):
        needed, fits = "1 stage per rank", num_stages == pp_degree
    elif schedule_style(schedule_name) == "v":
        needed, fits = "2 stages per rank", num_stages == 2 * pp_degree
    else:
        needed, fits = "the same number of stages on every rank", num_stages % pp_degree == 0
    if not fits:
        raise UserError(
            f"parallelism.{source} gives {num_stages} stages, which schedule {schedule_name!r} cannot place on "
            f"pipeline_parallel_degree = {pp_degree} ranks ({needed})"
        )


def parts_from_split_points(layout: PipelineLayout, n_layers: int, split_points: list[str]) -> list[list[str]]:
    """Module names per stage when each name in `split_points` begins a new stage."""
    rank_of = _module_order(layout, n_layers)
    order = sorted(rank_of, key=rank_of.__getitem__)
    unknown = [name for name in split_points if name not in order]
    if unknown:
        raise UserError(
            f"parallelism.pipeline_parallel_split_points: unknown module names {unknown} (model n_layers = {n_layers}; "
            f"use names like 'layers.2')"
        )
    cuts = [order.index(name) for name in split_points]
    if cuts != sorted(set(cuts)) or cuts[0] == 0:
        raise UserError(
            f"parallelism.pipeline_parallel_split_points = {split_points} must be distinct, in model order, and "
            f"not the first module"
        )
    bounds = [0, *cuts, len(order)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


def stage_modules(layout: PipelineLayout, n_layers: int, pp_degree: int, parallelism) -> list[list[str]]:
    """The module names of every stage (all ranks), from the config; raises UserError when the
    split does not fit the model or the schedule. Runs in preflight, before any process starts."""
    p = parallelism
    explicit = p.module_fqns_per_model_part
    if p.pipeline_parallel_split_points:
        explicit = parts_from_split_points(layout, n_layers, p.pipeline_parallel_split_points)
    if explicit:
        source = "module_fqns_per_model_part" if p.module_fqns_per_model_part else "pipeline_parallel_split_points"
        check_placement(len(explicit), pp_degree, p.pipeline_parallel_schedule, source)
        return split_module_names(layout, n_layers, len(explicit), module_fqns_per_model_part=explicit)
    less = (p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers)
    num_stages = resolve_num_stages(
        n_layers, pp_degree, p.pipeline_parallel_schedule, p.pipeline_parallel_layers_per_stage, *less
    )
    return split_module_names(layout, n_layers, num_stages, p.pipeline_parallel_layers_per_stage, *less)


def split_module_names(
    layout: PipelineLayout,
    n_layers: int,
    num_stages: int,
    layers_per_stage: int | None = None,
    first_less: int = 0,
    last_less: int = 0,
    module_fqns_per_model_part: list[list[str]] | None = None,
) -> list[list[str]]:
    """Module FQNs of each model part, in model order.

    Each stage counts as `layers_per_stage` layer slots (default: spread evenly); the first stage gives
    `first_less` slots to the modules before the layers (the embedding) and the last gives `last_less`
    to those after them (norm + output). An explicit
    `module_fqns_per_model_part` replaces the computed split after checking it covers the model once, in order.
    """
    if module_fqns_per_model_part:
        return _check_explicit_split(layout, n_layers, num_stages, module_fqns_per_model_part)
    if num_stages < 1 or n_layers < 1:
        raise UserError(f"cannot split model n_layers = {n_layers} into {num_stages} pipeline stages")
    if first_less < 0 or last_less < 0:  # refused, with the keys named, by the config validator
        raise ValueError(f"negative layer reductions for the first/last stage: {first_less}, {last_less}")
    if num_stages == 1:
        counts = [n_layers]
    else:
        effective = n_layers + first_less + last_less
        if layers_per_stage is not None:
            if layers_per_stage * num_stages != effective:
                raise UserError(
                    f"parallelism.pipeline_parallel_layers_per_stage = {layers_per_stage} x {num_stages} stages != "
                    f"model n_layers = {n_layers} + pipeline_parallel_first_stage_less_layers = {first_less} + "
                    f"pipeline_parallel_last_stage_less_layers = {last_less} = {effective}"
                )
            slots = [layers_per_stage] * num_stages
        else:
            base, extra = divmod(effective, num_stages)
            # Leftover slots go to the stages right after the first: the first stage is the one that
            # already carries the embedding, and the last one the (large) output projection.
            slots = [base + (1 if 1 <= i <= extra else 0) for i in range(num_stages)]
        counts = list(slots)
        counts[0] -= first_less
        counts[-1] -= last_less
        # First and last stages still own embedding / output with no layers; a middle stage needs >= 1.
        if min(counts) < 0 or min(counts[1:-1], default=1) < 1:
            raise UserError(
                f"cannot split model n_layers = {n_layers} into {num_stages} pipeline stages with "
                f"pipeline_parallel_layers_per_stage = {layers_per_stage}, pipeline_parallel_first_stage_less_layers = "
                f"{first_less}, pipeline_parallel_last_stage_less_layers = {last_less}: "
                f"layers per stage would be {counts}"
            )
    parts, start = [], 0
    for i, count in enumerate(counts):
        names = [f"layers.{j}" for j in range(start, start + count)]
        start += count
        if i == 0:
            names = [*layout.before, *names]
        if i == num_stages - 1:
            names += layout.after
        parts.append(names)
    return parts


def _module_order(layout: PipelineLayout, n_layers: int) -> dict[str, int]:
    return {name: i for i, name in enumerate(layout.module_names(n_layers))}


def _check_explicit_split(
    layout: PipelineLayout, n_layers: int, num_stages: int, parts: list[list[str]]
) -> list[list[str]]:
    key = "parallelism.module_fqns_per_model_part"
    if len(parts) != num_stages:
        raise UserError(f"{key} has {len(parts)} model parts but the pipeline has {num_stages} stages")
    order = _module_order(layout, n_layers)
    flat = [name for part in parts for name in part]
    unknown = [n for n in flat if n not in order]
    if unknown:
        raise UserError(f"{key}: unknown module names {unknown} (model n_layers = {n_layers})")
    missing = sorted(set(order) - set(flat), key=order.__getitem__)
    dup = sorted({n for n in flat if flat.count(n) > 1}, key=order.__getitem__)
    if missing or dup:
        raise UserError(f"{key} must name every module exactly once: missing {missing}, repeated {dup}")
    # Stages run one after another, so the parts must follow the model's forward order.
    if any(order[a] > order[b] for a, b in zip(flat, flat[1:])):
        raise UserError(f"{key} must list modules in model order ({', '.join(_first_and_last(list(order)))})")
    if any(not part for part in parts):
        raise UserError(f"{key}: every model part needs at least one module")
    return [list(p) for p in parts]


def shared_weights(
    model: nn.Module, parts: list[list[str]], layout: PipelineLayout | None = None
) -> list[dict[int, str]]:
    """The parameters that modules of two or more stages use (an input embedding tied to the output
    layer, a module borrowed by another stage: `layout.shared`): for each, {stage id: the name it has
    on that stage}. Each stage gets its own copy, which distributed.shared_weights keeps equal."""
    stage_of = {name: i for i, part in enumerate(parts) for name in part}
    users: dict[int, dict[int, str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module = name.split(".")[0] if not name.startswith("layers.") else ".".join(name.split(".")[:2])
        users.setdefault(id(param), {}).setdefault(stage_of[module], name)
    for module, reader in layout.shared if layout is not None else ():
        if getattr(model, reader, None) is None or stage_of[reader] == stage_of[module]:
            continue
        for name, param in getattr(model, module).named_parameters(prefix=module):
            users[id(param)].setdefault(stage_of[reader], name)
    return [stages for stages in users.values() if len(stages) > 1]


def _first_and_last(names: list[str]) -> list[str]:
    return names if len(names) <= 6 else [*names[:3], "...", *names[-3:]]


def build_stage_model(
    model_or_factory: nn.Module | Callable[[], nn.Module], layout: PipelineLayout, module_names: list[str]
) -> nn.Module:
    """A copy of the (meta) model that keeps only `module_names`, and copies of the modules those
    borrow (`layout.shared`, named in the copy's `borrowed`); parameter FQNs are unchanged."""
    # Copying a meta model allocates nothing; a factory's fresh model needs no copy.
    if isinstance(model_or_factory, nn.Module):
        model = copy.deepcopy(model_or_factory)
    else:
        model = model_or_factory()
    keep = set(module_names)
    layers = layers_of(model)
    known = {*layout.before, *layout.after} | {f"layers.{k}" for k in layers}
    if keep - known:
        raise UserError(f"model part names unknown modules {sorted(keep - known)}")
    borrowed = {
        module
        for module, reader in layout.shared
        if reader in keep and module not in keep and getattr(model, reader, None) is not None
    }
    for name in (*layout.before, *layout.after):
        if name not in keep and name not in borrowed:
            setattr(model, name, None)
    model.borrowed = frozenset(borrowed)  # pyrefly: ignore[bad-argument-type]  # torch types Module.__setattr__'s value Tensor | Module; it takes any
    for k in list(layers):
        if f"layers.{k}" not in keep:
            del layers[k]
    return model


def stage_ids_for_rank(pp_rank: int, pp_size: int, num_stages: int, style: str = "loop") -> list[int]:
    if num_stages % pp_size != 0:
        raise UserError(
            f"{num_stages} pipeline stages cannot be spread evenly over pipeline_parallel_degree = {pp_size}"
        )
    if style == "loop":
        return list(range(pp_rank, num_stages, pp_size))
    if style == "v":
        if num_stages != 2 * pp_size:
            raise UserError(f"V-shaped schedules need 2 stages per rank: got {num_stages} stages for {pp_size} ranks")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    raise ValueError(f"unknown stage placement style {style!r}")


def stage_rank(stage: int, pp_size: int, style: str = "loop") -> int:
    """The pp-group rank holding `stage` (the inverse of stage_ids_for_rank)."""
    if style == "v":
        return stage if stage < pp_size else 2 * pp_size - 1 - stage
    return stage % pp_size


def last_stage_rank(pp_size: int, num_stages: int, style: str = "loop") -> int:
    """pp-group rank that computes the loss (the rank holding stage num_stages - 1)."""
    return stage_rank(num_stages - 1, pp_size, style)


def num_microbatches(local_batch_size: int, microbatch_size: int) -> int:
    # The config validator explains a microbatch size that does not divide the local batch.
    if microbatch_size < 1 or local_batch_size % microbatch_size != 0:
        raise ValueError(f"microbatch size {microbatch_size} does not divide the local batch {local_batch_size}")
    return local_batch_size // microbatch_size


def build_stages(
    model_parts: list[nn.Module], stage_ids: list[int], num_stages: int, device, pp_group
) -> list[PipelineStage]:
    """Wrap this rank's model parts (same order as stage_ids) as PipelineStages; shapes are inferred
    on the first step, so the stages need no example inputs."""
    return [
        PipelineStage(part, stage_idx, num_stages, torch.device(device), group=pp_group)
        for part, stage_idx in zip(model_parts, stage_ids)
    ]


def build_pipeline_schedule(
    stages: list[PipelineStage],
    schedule_name: str,
    n_microbatches: int,
    loss_fn: Callable,
    csv_path: str | None = None,
) -> PipelineSchedule:
    """A schedule by name (case-insensitive; GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), or the schedule in `csv_path`.

    A CSV schedule lists, one row per pp rank, compute actions such as "0F0", "1B0", "1I0", "1W0"
    (stage, action, microbatch); torch's `_PipelineScheduleRuntime` adds the sends/receives and
    FSDP unshard/reshard/reduce steps, and infers which rank holds which stage.
    """
    if not stages:
        raise ValueError("this rank holds no pipeline stage")
    num_stages = stages[0].num_stages
    if n_microbatches < 1:
        raise UserError(f"the pipeline needs at least 1 microbatch, got {n_microbatches}")
    if csv_path:
        schedule = _PipelineScheduleRuntime(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        schedule._load_csv(csv_path)
        return schedule
    cls = _schedule_class(schedule_name)
    name = schedule_name.lower()
    if name in _NEED_MB_GE_STAGES and n_microbatches < num_stages:
        raise UserError(
            f"parallelism.pipeline_parallel_schedule = {schedule_name!r} needs at least as many microbatches as "
            f"stages: got {n_microbatches} microbatches (local batch / pipeline_parallel_microbatch_size) for "
            f"{num_stages} stages"
        )
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise UserError(f"schedule {schedule_name!r} runs one stage per rank, this rank has {len(stages)}")
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if name in ("interleaved1f1b", "interleavedzerobubble"):
        # Microbatches run in rounds of pp_size; torch rejects a count that is not a whole number of rounds.
        pp = stages[0].group_size
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds != 0:
            raise UserError(
                f"parallelism.pipeline_parallel_schedule = {schedule_name!r}: {n_microbatches} microbatches are not "
                f"a multiple of {rounds} rounds (pipeline_parallel_degree = {pp})"
            )
    return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)


class StepLoss:
    """A schedule's loss_fn: the model's summed token loss times `scale`, which the trainer sets
    before each step (a tensor on the device)."""

    def __init__(self, loss_sum_fn: Callable):
        self.loss_sum_fn = loss_sum_fn
        self.scale: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self.scale is not None, "StepLoss.scale is set before the schedule runs"
        return self.loss_sum_fn(logits, labels) * self.scale


def pipeline_step(
    schedule,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    is_first: bool,
    is_last: bool,
    kwargs: dict | None = None,
    forward_only: bool = False,
):
    """One forward + backward of the local batch (`forward_only`: the forward, on a schedule from
    forward_only_schedule). Only the rank with the first stage needs `inputs` and only the rank with
    the last stage needs `labels` (other ranks may pass anything); every rank passes the keyword
    inputs of forward (`kwargs`: document ids, the family's; batch.BatchPreparation). Returns the sum of the
    microbatch losses on the last-stage rank, None elsewhere."""
    losses: list[torch.Tensor] | None = [] if is_last else None
    target = labels if is_last else None
    args = (inputs,) if is_first else ()
    run = schedule.eval if forward_only else schedule.step
    run(*args, target=target, losses=losses, return_outputs=False, **(kwargs or {}))
    if losses is None:  # not the last stage
        return None
    return torch.stack([loss.detach() for loss in losses]).sum()


def warm_up_schedule(
    pipeline: "Pipeline",
    parts: list[nn.Module],
    step_loss: StepLoss,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    kwargs: dict,
):
    """torch's pipeline schedules infer the stages' tensor shapes with a real forward and backward
    inside their first step. Done once before training (on a batch of zeros), with the model in eval
    mode and the gradients dropped, so that modules that keep training statistics (an MoE's token
    counts) see only the tokens they train on."""
    step_loss.scale = torch.ones((), device=inputs.device)
    for part in parts:
        part.eval()
    pipeline_step(pipeline.schedule, inputs, labels, pipeline.is_first, pipeline.is_last, kwargs)
    for part in parts:
        part.train()
        part.zero_grad(set_to_none=True)


def forward_only_schedule(pipeline: "Pipeline", parts: list[nn.Module], n_microbatches: int, device, loss_fn):
    """A pipeline schedule that runs forwards only (validation): each rank runs its stages in order,
    each on every microbatch in order, and the last stage computes each microbatch's loss. torch's
    own `eval` runs a training schedule with its backward actions skipped, which fails on V-shaped
    placements (two adjacent stages on one rank) and would make the training schedule infer its
    shapes again (a real forward, each time it switches between eval and train)."""
    from torch.distributed.pipelining.schedules import (
        FORWARD,
        _Action,
        _add_send_recv,
        _add_unshard_reshard,
        _PipelineScheduleRuntime,
    )

    pp, num_stages = pipeline.pp_mesh.size(), pipeline.num_stages
    placement = {rank: sorted(stage_ids_for_rank(rank, pp, num_stages, pipeline.style)) for rank in range(pp)}
    owner = {stage: rank for rank, stages in placement.items() for stage in stages}
    stages = build_stages(parts, pipeline.stage_ids, num_stages, device, pipeline.pp_mesh.get_group())
    schedule = _PipelineScheduleRuntime(stages, n_microbatches, loss_fn=loss_fn)
    # What _prepare_schedule_with_comms does, without its check that every forward has a backward.
    schedule.stage_index_to_group_rank = owner
    for stage in stages:
        stage.stage_index_to_group_rank = owner
    compute = {
        rank: _add_unshard_reshard(
            [_Action(stage, FORWARD, mb) for stage in placement[rank] for mb in range(n_microbatches)]
        )
        for rank in range(pp)
    }
    schedule.pipeline_order_with_comms = _add_send_recv(compute, stage_to_rank=owner.__getitem__, num_stages=num_stages)
    return schedule


def broadcast_loss(loss: torch.Tensor | None, pp_group, src_group_rank: int) -> torch.Tensor:
    """Give every pp rank the last stage's loss (for logging)."""
    buf = loss.detach().clone().float() if loss is not None else torch.zeros((), dtype=torch.float32)
    dist.broadcast(buf, group=pp_group, group_src=src_group_rank)
    return buf


def apply_fsdp_to_stage(
    model: nn.Module,
    dp_mesh,
    schedule_name: str,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    reshard_after_forward_policy: str = "default",
    cpu_offload: bool = False,
    csv_path: str | None = None,
    sharded_apart: tuple[nn.Module, ...] = (),
    apart_mesh=None,
) -> nn.Module:
    """FSDP2 for one stage: each block and the stage root, as without PP.

    "default" resharding under PP means never resharding after forward: each microbatch's backward
    would otherwise all-gather the parameters again (torchtitan's choice too).

    Zero-bubble schedules split the backward into an input-grad step and a later weight-grad step,
    both found by walking the autograd graph from `stage.submod.parameters()`. The runtime unshards
    only the stage ROOT's parameter group before each step; a block sharded with its own group is
    resharded after forward, so at that moment `parameters()` yields the block's sharded DTensors,
    which are not in the graph (the forward used the unsharded ones). The block's weights are then
    silently left out of the weight-grad step. So for those schedules blocks must stay unsharded
    between forward and backward ("always" is not honoured for them); `REDUCE_GRAD` reshards them.
    A CSV schedule with split (I/W) backward steps is treated the same way (splits_backward).
    Measured (pp 2 x FSDP 2, ZBVZeroBubble): blocks resharded after forward -> grad norm 0.07 instead
    of 0.54 and loss off by 1e-2 from step 2; blocks kept unsharded, or only the root sharded -> 5e-7.
    """
    from torchtitan.distributed.fsdp import apply_fsdp

    policy = reshard_after_forward_policy
    if policy == "default" or splits_backward(schedule_name, csv_path):
        policy = "never"
    return apply_fsdp(model, dp_mesh, param_dtype, reduce_dtype, policy, cpu_offload, sharded_apart, apart_mesh)


# ---- The trainer's view: this rank's stages and their schedule ----


@dataclass
class Pipeline:
    """This rank's share of a pipelined model; `schedule` is set once the stages are materialized."""

    stage_ids: list[int]
    num_stages: int
    style: str
    pp_mesh: DeviceMesh
    ties: list[dict[int, str]] = field(default_factory=list)  # weights shared across stages (shared_weights)
    schedule: PipelineSchedule | None = None

    @property
    def is_first(self) -> bool:  # holds stage 0: feeds the inputs
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:  # holds the last stage: computes the loss
        return self.num_stages - 1 in self.stage_ids

    @property
    def loss_src(self) -> int:  # pp-group rank of the last stage
        return last_stage_rank(self.pp_mesh.size(), self.num_stages, self.style)

    def rank_of_stage(self, stage: int) -> int:
        return stage_rank(stage, self.pp_mesh.size(), self.style)


def split_for_rank(
    whole: nn.Module, layout: PipelineLayout, parallelism, pp_mesh: DeviceMesh
) -> tuple[list[nn.Module], Pipeline]:
    """This rank's stage models (still on the meta device, full-model FQNs) and their placement."""
    parts = stage_modules(layout, len(layers_of(whole)), pp_mesh.size(), parallelism)
    num_stages = len(parts)
    style = schedule_style(parallelism.pipeline_parallel_schedule)
    stage_ids = stage_ids_for_rank(pp_mesh.get_local_rank(), pp_mesh.size(), num_stages, style)
    stages = [build_stage_model(whole, layout, parts[i]) for i in stage_ids]
    return stages, Pipeline(stage_ids, num_stages, style, pp_mesh, shared_weights(whole, parts, layout))


def attach_schedule(pipeline: Pipeline, model_parts, parallelism, local_batch_size: int, device, loss_fn):
    stages = build_stages(model_parts, pipeline.stage_ids, pipeline.num_stages, device, pipeline.pp_mesh.get_group())
    n_micro = num_microbatches(local_batch_size, parallelism.pipeline_parallel_microbatch_size)
    pipeline.schedule = build_pipeline_schedule(
        stages, parallelism.pipeline_parallel_schedule, n_micro, loss_fn, parallelism.pipeline_parallel_schedule_csv
    )
