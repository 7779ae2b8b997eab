"""The layout planner: every layout of a recipe at a world size, its memory per rank and step time,
ranked (scripts/plan.py is its command line).

Searched: tensor parallel within a node (powers of two whose splits divide the model's sizes),
pipeline parallel (degrees that give every stage a layer; the recipe's schedule), context parallel
(powers of two up to 8 dividing the sequence; the gathered and the rotating ring, and Ulysses where the
degree divides the query heads per TP rank; only the recipe's method where it sets Ulysses or the
rotating ring), data parallel sharding and HSDP replicas (one replica per node group when FSDP
would span more than a node), expert parallel for MoE flavors (powers of two dividing the experts
and the shard ranks), activation checkpointing (none, op, full) and the
micro-batch size. A degree the recipe (or the command line) sets to anything but its default is kept
fixed. The global batch in sequences is the recipe's training.global_batch_size, or local_batch_size
x the data-parallel degree of the recipe's own layout at this world size.

A layout is shown, explained or written only if the trainer would start it: its config passes the
rules load_config applies and torchtitan.preflight (refusal()). The estimates are cheap and
ranked first; preflight then runs on the fastest, in order, until enough are accepted (rank_layouts()'s
`keep`), since it reads files and builds the meta model, and a large MoE flavor has thousands of
layouts. The validation set (when enabled) is read for the best layout only.
"""

import itertools
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

from torchtitan.config import UserError
from torchtitan.config.parallelism_sections import (
    CONTEXT_PARALLEL_KEYS,
    PIPELINE_KEYS,
    TENSOR_PARALLEL_KEYS,
    Parallelism,
)
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.spec import meta_model
from torchtitan.planner.estimate import FIXES, Estimate, RecipeFacts, default_hardware, estimate_layout
from torchtitan.planner.memory import GiB, param_shards, replace
from torchtitan.planner.timing import Hardware
from torchtitan.preflight import check_attention, load_tokenizer, model_args_for_run, preflight

AC_MODES = (("none", "2"), ("selective", "op"), ("full", "2"))


def check_model_options(spec, cfg) -> None:
    """The [model] options that preflight checks before it builds the model args (an unknown flavor, a
    field the family lacks), checked before the planner builds them: UserError, not a traceback."""
    from torchtitan.config.parallelism_sections import Parallelism
    from torchtitan.models.registry import get_model_args

    get_model_args(cfg.model.name, cfg.model.flavor)
    # Any layout will do: what depends on the layout is preflight's to say, for each candidate.
    check_attention(cfg, spec, ParallelDims.from_config(Parallelism(), 1))


def recipe_model_args(spec, cfg):
    """The model args the job would build: the tokenizer's vocabulary when its file is there (as the
    trainer does), else the flavor's."""
    path = cfg.model.tokenizer_path
    if path and os.path.exists(path):
        return model_args_for_run(spec, cfg, load_tokenizer(path).vocab_size)
    flavor = spec.flavors[cfg.model.flavor]
    return spec.args_for_training(cfg.model.flavor, flavor.vocab_size, cfg.training.seq_len)


def recipe_facts(cfg) -> RecipeFacts:
    """What every layout of `cfg`'s recipe shares, with the model args the trainer would build."""
    from torchtitan.models.registry import get_model_spec, import_custom_module

    import_custom_module(cfg.experimental.custom_import)
    spec = get_model_spec(cfg.model.name)
    check_model_options(spec, cfg)
    return RecipeFacts.build(spec, recipe_model_args(spec, cfg), cfg)


def estimate_config(
    cfg, world_size: int, device_type: str, hw: Hardware | None = None, facts: RecipeFacts | None = None
) -> Estimate:
    """Memory and step time of `cfg`'s own layout on `world_size` ranks."""
    return estimate_layout(cfg, world_size, device_type, facts or recipe_facts(cfg), hw)


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def _fixed(cfg) -> dict[str, int]:
    """Degrees the recipe sets to something other than their defaults: kept as they are."""
    p = cfg.parallelism
    fixed = {}
    for key, default in (
        ("tensor_parallel_degree", 1),
        ("pipeline_parallel_degree", 1),
        ("context_parallel_degree", 1),
        ("expert_parallel_degree", 1),
        ("data_parallel_replicate_degree", 1),
        ("data_parallel_shard_degree", -1),
    ):
        if getattr(p, key) != default:
            fixed[key] = getattr(p, key)
    return fixed


def cp_methods(cfg, args, cp: int, tp: int) -> list[dict]:
    """The context-parallel methods searched at degree `cp` (as parallelism settings): the gathered ring,
    the rotating ring (the same communication, a different memory: no mask of the whole sequence, its
    blocks' outputs in float32; memory.cp_attention_bytes) and Ulysses where cp divides the query heads
    of a TP rank; only the recipe's method where it sets one other than the default gathered ring."""
    p = cfg.parallelism
    gathered = {
        "context_parallel_method": "ring",
        "context_parallel_rotate_method": "allgather",
        "context_parallel_ring_overlap": True,
    }
    rotating = {
        "context_parallel_method": "ring",
        "context_parallel_rotate_method": "alltoall",
        "context_parallel_ring_overlap": p.context_parallel_ring_overlap,
    }
    ulysses = {
        "context_parallel_method": "ulysses",
        "context_parallel_rotate_method": "allgather",
        "context_parallel_ring_overlap": True,
    }
    if cp == 1:
        return [{}]
    if p.context_parallel_method == "ulysses":
        return [ulysses]
    if p.context_parallel_rotate_method == "alltoall":
        return [rotating]
    heads = getattr(args, "n_heads", None)
    return [gathered, rotating] + ([ulysses] if heads is not None and (heads // tp) % cp == 0 else [])


def unused_keys_reset(tp: int, pp: int, cp: int) -> dict:
    """The recipe's settings of the parallelisms a layout does not use (degree 1) put back to their defaults: they
    are its preference for the layouts that use them, and the trainer refuses them where nothing reads them
    (Parallelism.unread_keys)."""
    defaults = Parallelism()
    keys = [
        *(TENSOR_PARALLEL_KEYS if tp == 1 else ()),
        *(PIPELINE_KEYS if pp == 1 else ()),
        *(CONTEXT_PARALLEL_KEYS if cp == 1 else ()),
    ]
    return {key: getattr(defaults, key) for key in keys}


def _global_batch(cfg, world_size: int) -> int:
    """The global batch in sequences the planner keeps (module docstring)."""
    t = cfg.training
    if t.global_batch_size != -1:
        return t.global_batch_size
    try:
        own = ParallelDims.from_config(cfg.parallelism, world_size)
    except UserError as e:
        raise UserError(
            f"training.global_batch_size is unset, so the global batch is local_batch_size x the data-parallel degree "
            f"of the recipe's own layout, and that layout does not fit {world_size} ranks: {e}; set "
            "training.global_batch_size (in sequences) for the planner to keep, or fix the recipe's degrees"
        ) from None
    return t.local_batch_size * own.dp_degree


def candidates(cfg, world_size: int, gpus_per_node: int, spec, args):
    """Every layout config of the search (see the module docstring)."""
    from torchtitan.distributed.pipeline_parallel import stage_modules
    from torchtitan.distributed.tensor_parallel import check_tp_divisibility

    fixed = _fixed(cfg)
    product = 1
    for key in (
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
        "data_parallel_replicate_degree",
    ):
        product *= fixed.get(key, 1)
    product *= fixed.get("data_parallel_shard_degree", 1)
    if world_size % product:
        raise UserError(
            f"the recipe fixes parallel degrees ({', '.join(f'{k} = {v}' for k, v in fixed.items())}) whose product "
            f"{product} does not divide the world size {world_size}; choose a world size that is a multiple of "
            f"{product}, or leave those degrees to the planner (remove them from the recipe)"
        )
    t = cfg.training
    has_experts = spec.has_experts(args)
    num_experts = args.moe.num_experts if has_experts else 1
    global_batch = _global_batch(cfg, world_size)

    def options(key, values):
        return [fixed[key]] if key in fixed else values

    for tp in options("tensor_parallel_degree", _powers_of_two(min(gpus_per_node, world_size))):
        if tp > 1:
            if spec.tp_plan is None:
                continue
            try:
                check_tp_divisibility(spec.tp_sizes(args), tp, t.seq_len)
            except UserError as e:
                if "tensor_parallel_degree" in fixed:  # the recipe's own degree: no layout has another
                    raise UserError(f"the recipe fixes tensor_parallel_degree = {tp}: {e}") from None
                continue
        for pp in options(
            "pipeline_parallel_degree", [p for p in range(1, args.n_layers + 1) if world_size % (tp * p) == 0]
        ):
            if pp > 1:
                try:
                    stage_modules(spec.pipeline, args.n_layers, pp, cfg.parallelism)
                except UserError as e:
                    if "pipeline_parallel_degree" in fixed:
                        raise UserError(f"the recipe fixes pipeline_parallel_degree = {pp}: {e}") from None
                    continue
            cps = [c for c in _powers_of_two(8) if c == 1 or t.seq_len % (2 * c) == 0]  # CP 1: any seq_len
            for cp in options("context_parallel_degree", cps):
                if cp > 1 and spec.cp_attention is None or world_size % (tp * pp * cp):
                    continue
                dp = world_size // (tp * pp * cp)
                if global_batch % dp:
                    continue
                replicas = (
                    [fixed["data_parallel_replicate_degree"]]
                    if "data_parallel_replicate_degree" in fixed
                    else sorted({1, max(1, dp * tp * cp // gpus_per_node) if dp * tp * cp > gpus_per_node else 1})
                )
                for rep in replicas:
                    if dp % rep:
                        continue
                    shard = dp // rep
                    eps = [1]
                    if has_experts:
                        eps = options(
                            "expert_parallel_degree",
                            [e for e in _powers_of_two(num_experts) if num_experts % e == 0 and (shard * cp) % e == 0],
                        )
                    for ep, (mode, option), method in itertools.product(eps, AC_MODES, cp_methods(cfg, args, cp, tp)):
                        local = global_batch // dp
                        micros = [m for m in (1, 2, 4, 8) if local % m == 0 and (pp == 1 or local // m >= pp)]
                        for micro in micros if pp > 1 else [local]:
                            yield replace(
                                cfg,
                                parallelism={
                                    **unused_keys_reset(tp, pp, cp),
                                    "tensor_parallel_degree": tp,
                                    "pipeline_parallel_degree": pp,
                                    "context_parallel_degree": cp,
                                    "data_parallel_replicate_degree": rep,
                                    "data_parallel_shard_degree": shard,
                                    "expert_parallel_degree": ep,
                                    **({"pipeline_parallel_microbatch_size": micro} if pp > 1 else {}),
                                    **method,
                                },
                                training={"local_batch_size": local, "global_batch_size": global_batch},
                                activation_checkpoint={"mode": mode, "selective_ac_option": option},
                            )


@dataclass
class Ranking:
    """What rank_layouts() found. Only layouts the trainer accepts are in `fits` and `smallest`."""

    fits: list[Estimate]  # layouts that fit the memory and that the trainer accepts, fastest first
    smallest: Estimate | None  # the smallest layout the trainer accepts among those that do not fit
    searched: int  # layouts estimated
    fitting: int  # of which fit the memory by the estimate (before the trainer's checks)
    refused: dict[str, list[str]]  # the trainer's refusals of the layouts checked: message -> layouts


def check_world(world_size: int, gpus_per_node: int) -> None:
    """The world size fills whole nodes (one node may be filled only in part)."""
    if world_size < 1 or gpus_per_node < 1:
        raise UserError(f"the world size ({world_size}) and the devices per node ({gpus_per_node}) must be 1 or more")
    if world_size > gpus_per_node and world_size % gpus_per_node:
        raise UserError(
            f"a world size of {world_size} devices is not a whole number of nodes of {gpus_per_node}; use a multiple "
            f"of {gpus_per_node} (e.g. {world_size - world_size % gpus_per_node} or "
            f"{world_size + gpus_per_node - world_size % gpus_per_node}), or give the node size (--gpus_per_node)"
        )


def rank_layouts(
    cfg,
    world_size: int,
    gpus_per_node: int,
    memory_bytes: float,
    device_type: str = "cuda",
    hw: Hardware | None = None,
    keep: int = 20,
) -> Ranking:
    """Every layout estimated and ranked; then, fastest first, each checked as the trainer checks a job
    (refusal()) until `keep` accepted layouts fit `memory_bytes` per rank, and the smallest accepted
    one that does not fit is found. Checking stops there: preflight reads files and builds the model,
    and a large MoE flavor has thousands of layouts."""
    from torchtitan.planner.memory import missing_counts

    check_world(world_size, gpus_per_node)
    with _judged_on(device_type):
        p = recipe_facts(cfg)
    missing_counts(p.spec)
    hw = hw or default_hardware(device_type, gpus_per_node, cfg)
    fits, too_big, impossible = [], [], {}
    for candidate in candidates(cfg, world_size, gpus_per_node, p.spec, p.args):
        try:
            est = estimate_config(candidate, world_size, device_type, hw, p)
        except UserError as e:  # a combination of degrees that cannot be formed
            impossible[str(e)] = impossible.get(str(e), 0) + 1
            continue
        (fits if est.memory.total <= memory_bytes else too_big).append(est)
    if not fits and not too_big:
        why = (
            max(impossible, key=impossible.__getitem__)
            if impossible
            else (
                "no data-parallel degree that the other degrees leave divides the global batch of "
                f"{_global_batch(cfg, world_size)} sequences; "
                "set training.global_batch_size to a multiple of more of them"
            )
        )
        raise UserError(
            f"no layout of {cfg.model.name} {cfg.model.flavor} can be formed on {world_size} ranks with "
            f"this recipe: {why}"
        )
    fits.sort(key=lambda e: e.step_time)
    too_big.sort(key=lambda e: e.memory.total)
    refused: dict[str, list[str]] = {}
    accepted_fits = _accepted(fits, world_size, device_type, keep, refused)
    smallest = _accepted(too_big, world_size, device_type, 1, refused)
    if accepted_fits and cfg.validation.enabled:
        best = accepted_fits[0]
        why = refusal(best.cfg, world_size, device_type, read_data=True)
        if why is not None:
            raise UserError(f"the trainer refuses the best layout, {best.layout()} with AC {best.ac()}: {why}")
    return Ranking(accepted_fits, smallest[0] if smallest else None, len(fits) + len(too_big), len(fits), refused)


def refusal(cfg, world_size: int, device_type: str, read_data: bool = True) -> str | None:
    """Why the trainer would refuse to start `cfg` on `world_size` ranks of `device_type`, or None: the
    config rules load_config applies to a recipe, then the trainer's own preflight (no process group).
    [memory_estimation] is left out: the planner's fit against the memory it was given replaces it.
    Without `read_data`, the validation set is not read: that check tokenizes it (seconds to minutes)
    and depends on the layout only through the data-parallel degree; rank_layouts() runs it on the best."""
    from torchtitan.config.manager import validate

    checked = replace(cfg, memory_estimation={"enabled": False})
    if not read_data:
        checked = replace(checked, validation={"enabled": False})
    try:
        validate(cfg)
        with _judged_on(device_type):
            preflight(checked, world_size, services=False)
    except UserError as e:
        return str(e)
    return None


def _accepted(
    estimates: list[Estimate], world_size: int, device_type: str, count: int, refused: dict[str, list[str]]
) -> list[Estimate]:
    """The first `count` of `estimates` (in their order) that the trainer accepts; those it refuses on
    the way are added to `refused`."""
    out = []
    for e in estimates:
        if len(out) == count:
            break
        why = refusal(e.cfg, world_size, device_type, read_data=False)
        if why is None:
            out.append(e)
        else:
            refused.setdefault(why, []).append(f"{e.layout()} with AC {e.ac()}")
    return out


@contextmanager
def _judged_on(device_type: str):
    """Preflight asks torchtitan.distributed.process_group.device_type() where the job runs (CPU offload, FlexAttention,
    async TP and pinned-memory checkpoints need CUDA); the planner judges a layout for the device it
    plans for, whatever this host has."""
    from torchtitan.distributed import process_group

    real = process_group.device_type
    process_group.device_type = lambda: device_type
    try:
        yield
    finally:
        process_group.device_type = real


def refusals(refused: dict[str, list[str]]) -> str:
    """The trainer's refusals as lines: each reason once, with the layouts it refused."""
    lines = []
    for why, layouts in sorted(refused.items(), key=lambda item: -len(item[1])):
        distinct = list(dict.fromkeys(layouts))  # micro-batch sizes of one layout share a name
        shown = ", ".join(distinct[:3]) + (f" and {len(distinct) - 3} more" if len(distinct) > 3 else "")
        lines.append(f"  {len(layouts)} refused ({shown}): {why}")
    return "\n".join(lines)


def table(estimates: list[Estimate], limit: int = 20) -> str:
    rows = [
        "rank  layout                  AC           micro  params  grads  optim  activ  logits  buffers  total GiB"
        "  step s  tokens/s/dev   MFU"
    ]
    for i, e in enumerate(estimates[:limit], 1):
        m = e.memory
        micro = (
            e.cfg.parallelism.pipeline_parallel_microbatch_size if e.dims.pp > 1 else e.cfg.training.local_batch_size
        )
        rows.append(
            f"{i:>4}  {e.layout():<22}  {e.ac():<11}  {micro:>5}  {m.params / GiB:6.2f}  {m.grads / GiB:5.2f}  "
            f"{m.optimizer / GiB:5.2f}  {m.activations / GiB:5.2f}  {m.logits / GiB:6.2f}  {m.buffers / GiB:7.2f}  "
            f"{m.total / GiB:9.2f}  {e.step_time:6.2f}  {e.tokens_per_s:12,.0f}  {e.mfu:5.1%}"
        )
    return "\n".join(rows)


def explain(e: Estimate, memory_bytes: float) -> str:
    """What does not fit, for the best layout that does not."""
    terms = e.memory.terms()
    largest = e.memory.largest()
    return (
        f"the best layout that does not fit, {e.layout()} with AC {e.ac()}, needs {e.memory.total / GiB:.2f} GiB "
        f"per rank of {memory_bytes / GiB:.2f}; its largest term is {largest} ({terms[largest] / GiB:.2f} GiB): "
        f"{FIXES[largest]}"
    )


def write_recipe(e: Estimate, path: str, device_type: str = "cuda") -> None:
    """The layout as a TOML recipe run_train.sh takes as it is (every key resolved). It is loaded back
    and checked as the trainer would check it before it takes `path`: a recipe the trainer refuses is
    never left there."""
    from torchtitan.config import load_config
    from torchtitan.config.manager import config_to_toml

    header = (
        f"# Written by scripts/plan.py: {e.layout()} with AC {e.ac()} on {e.dims.world_size} ranks; estimated "
        f"{e.memory.total / GiB:.2f} GiB per rank, {e.step_time:.3f} s per step.\n"
    )
    folder, name = os.path.split(os.path.abspath(path))
    partial = os.path.join(folder, f".{name}.partial-{os.getpid()}")
    try:
        with open(partial, "w") as f:
            f.write(header + config_to_toml(e.cfg))
        why = refusal(load_config(["--job.config_file", partial]), e.dims.world_size, device_type)
        if why is not None:
            raise RuntimeError(
                f"the recipe written for {e.layout()} does not load back as the layout the planner "
                f"checked; the trainer refuses it: {why}"
            )
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def check_by_simulation(e: Estimate) -> tuple[float, int]:
    """Apply `e`'s layout for real over a fake process group (torchtitan.planner.simulate) and check
    that every rank's parameter shards are the estimate's, for one pipeline rank per distinct stage
    shape; returns (the seconds it took, the pipeline ranks simulated)."""
    import time

    from torchtitan.models.registry import get_model_spec
    from torchtitan.planner.simulate import simulate

    start = time.perf_counter()
    spec = get_model_spec(e.cfg.model.name)
    args = recipe_model_args(spec, e.cfg)
    cfg = replace(e.cfg, training={"compile": False})
    expected = param_shards(spec, meta_model(spec, args), e.dims, cfg.parallelism)
    # One rank per distinct stage shape: pipeline ranks whose blocks differ only in their layer ids hold
    # the same shards.
    shapes: dict[tuple, int] = {}
    for pp_rank, held in expected.items():
        shape = tuple(sorted((re.sub(r"^layers\.\d+\.", "layers.*.", n), s.local) for n, s in held.items()))
        shapes.setdefault(shape, pp_rank)
    for pp_rank, held in simulate(spec, args, e.dims, cfg, sorted(shapes.values())).items():
        want = {name: s.local for name, s in expected[pp_rank].items()}
        if held != want:
            wrong = sorted(set(held) ^ set(want)) or [n for n in held if held[n] != want[n]]
            raise RuntimeError(
                f"the simulation of {e.layout()} disagrees with the estimate at pipeline rank {pp_rank}: "
                f"{wrong[:5]} (simulated {[held.get(n) for n in wrong[:5]]}, estimated "
                f"{[want.get(n) for n in wrong[:5]]})"
            )
    return time.perf_counter() - start, len(shapes)
