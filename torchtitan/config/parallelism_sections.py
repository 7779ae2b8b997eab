"""The sections of how a job spreads over its ranks: the parallel layout and the collectives' communication."""

import os
import urllib.parse
from dataclasses import dataclass
from typing import Literal

from torchtitan.config.fields import broken_rules, changed_keys, option

# Pipeline schedules (lower case) that split the backward into input-grad (B) and weight-grad (W)
# steps; FSDP must keep their blocks gathered between forward and backward.
ZERO_BUBBLE_SCHEDULES = frozenset({"interleavedzerobubble", "zbvzerobubble", "dualpipev"})


# The keys that say how a parallelism splits the work (the splits themselves excepted), read only when its degree is
# more than 1 (Parallelism.unread_keys).
TENSOR_PARALLEL_KEYS = ("disable_loss_parallel",)
CONTEXT_PARALLEL_KEYS = ("context_parallel_method", "context_parallel_rotate_method", "context_parallel_ring_overlap")
PIPELINE_KEYS = (
    "pipeline_parallel_schedule",
    "pipeline_parallel_schedule_csv",
    "pipeline_parallel_microbatch_size",
    "pipeline_parallel_layers_per_stage",
    "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers",
)


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Parallelism:
    data_parallel_replicate_degree: int = option(
        1, "Replicas (DDP, or HSDP's replicate dimension when data_parallel_shard_degree > 1)."
    )
    data_parallel_shard_degree: int = option(
        -1, "FSDP shard degree; -1 fills the ranks left over by the other degrees."
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = option(
        "default",
        "Free gathered parameters after forward (always), keep them until backward (never), "
        "or default (always, except for the root module whose parameters backward needs first).",
    )
    tensor_parallel_degree: int = option(
        1, "Tensor + sequence parallel degree (innermost mesh dimension; divides heads, KV heads and seq_len)."
    )
    disable_loss_parallel: bool = option(
        False, "With tensor parallel: gather the logits instead of computing the loss on vocabulary shards."
    )
    enable_async_tensor_parallel: bool = option(
        False, "Overlap tensor-parallel communication with matmuls (CUDA with training.compile only)."
    )
    context_parallel_degree: int = option(
        1,
        "Context parallel degree: each sequence is split over this many ranks (load-balanced chunks, ring "
        "attention); seq_len must be divisible by 2 x context_parallel_degree x tensor_parallel_degree.",
    )
    expert_parallel_degree: int = option(
        1,
        "Expert parallel degree (models with a mixture of experts): the experts are split over this many ranks "
        "taken from data_parallel_shard_degree x context_parallel_degree, tokens travel to their experts by "
        "all-to-all; FSDP shards the experts over the ranks that remain. Must divide the number of experts.",
    )
    context_parallel_method: Literal["ring", "ulysses"] = option(
        "ring",
        "How context-parallel attention sees the whole sequence: ring (each rank keeps its queries and sees the "
        "other ranks' keys and values, as context_parallel_rotate_method says) or ulysses (an all-to-all gives "
        "each rank the whole sequence for heads / context_parallel_degree of the heads, the run's attention "
        "kernel runs unchanged on it, a second all-to-all brings the outputs back; the degree must divide the "
        "query heads per tensor-parallel rank).",
    )
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = option(
        "allgather",
        "How the ring (context_parallel_method = 'ring') sees the other ranks' keys and values: allgather (gather "
        "them all at once) or alltoall (pass them around the ring one block per step, merging partial softmaxes).",
    )
    context_parallel_ring_overlap: bool = option(
        True,
        "The rotating ring (context_parallel_rotate_method = 'alltoall'): post the transfer of the next block of "
        "keys and values (in backward, of their gradient) before computing on the current one, so that the "
        "transfer overlaps the attention; off, each transfer is waited for at once. Results are bitwise the same.",
    )
    pipeline_parallel_degree: int = option(1, "Pipeline stages' ranks (outermost mesh dimension).")
    pipeline_parallel_schedule: str = option(
        "1F1B",
        "GPipe, 1F1B (one stage per rank), Interleaved1F1B, LoopedBFS, InterleavedZeroBubble (several stages "
        "per rank), ZBVZeroBubble, DualPipeV (two stages per rank in a V).",
    )
    pipeline_parallel_schedule_csv: str | None = option(
        None, "A custom schedule: a CSV file with one row of compute actions (e.g. 0F0,0B0) per pipeline rank."
    )
    pipeline_parallel_microbatch_size: int = option(1, "Sequences per pipeline microbatch (divides local_batch_size).")
    pipeline_parallel_layers_per_stage: int | None = option(
        None, "Transformer layers per stage (unset: one stage per rank, or two for multi-stage schedules)."
    )
    module_fqns_per_model_part: list[list[str]] = option(
        [],
        "An explicit pipeline split: the module names of each stage in model order, e.g. [['tok_embeddings', "
        "'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'norm', 'output']] (on the command line: "
        "'tok_embeddings,layers.0,layers.1;layers.2,layers.3,norm,output'); replaces the split by layers.",
    )
    pipeline_parallel_split_points: list[str] = option(
        [],
        "The older form of an explicit split: the modules at which a new stage begins, e.g. ['layers.2'].",
    )
    pipeline_parallel_first_stage_less_layers: int = option(
        1, "The first stage holds this many fewer layers (it also holds the embedding)."
    )
    pipeline_parallel_last_stage_less_layers: int = option(
        1, "The last stage holds this many fewer layers (it also holds the output layer and the loss)."
    )

    def unread_keys(self) -> list[str]:
        """The keys that say how a parallelism splits the work, set while its degree is 1, as messages: a job
        would silently train without what they ask for. The trainer refuses them (preflight); the layout planner
        reads them as the recipe's preference for the layouts that use that parallelism."""
        problems = []
        for keys, degree, what in (
            (CONTEXT_PARALLEL_KEYS, "context_parallel_degree", "context parallel"),
            (PIPELINE_KEYS, "pipeline_parallel_degree", "pipeline parallel"),
            (TENSOR_PARALLEL_KEYS, "tensor_parallel_degree", "tensor parallel"),
        ):
            if getattr(self, degree) == 1:
                problems += [
                    f"parallelism.{k} = {_show(getattr(self, k))} is only read with {what}, and {degree} is 1; set "
                    f"parallelism.{degree} > 1 or remove it"
                    for k in changed_keys(self, *keys)
                ]
        return problems

    def check(self) -> list[str]:
        degrees = (
            "data_parallel_replicate_degree",
            "pipeline_parallel_degree",
            "pipeline_parallel_microbatch_size",
            "tensor_parallel_degree",
            "expert_parallel_degree",
            "context_parallel_degree",
        )
        fewer = ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers")
        splits = ("module_fqns_per_model_part", "pipeline_parallel_split_points")
        pp = self.pipeline_parallel_degree
        problems = [
            f"parallelism.{k} must be 1 or more, got {getattr(self, k)}" for k in degrees if not getattr(self, k) >= 1
        ]
        problems += [
            f"parallelism.{k} must be 0 or more, got {getattr(self, k)}" for k in fewer if not getattr(self, k) >= 0
        ]
        problems += [
            f"parallelism.{k} splits the model into pipeline stages, but pipeline_parallel_degree is {pp}; set "
            f"pipeline_parallel_degree > 1 or remove it"
            for k in splits
            if getattr(self, k) and not pp > 1
        ]
        problems += broken_rules(
            (
                self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
                f"parallelism.data_parallel_shard_degree must be -1 (use the ranks left over) or 1 or more, "
                f"got {self.data_parallel_shard_degree}",
            )
        )
        problems += broken_rules(
            (
                self.context_parallel_ring_overlap
                or (self.context_parallel_method == "ring" and self.context_parallel_rotate_method == "alltoall"),
                "parallelism.context_parallel_ring_overlap = false: only the rotating ring (context_parallel_method = "
                "'ring', context_parallel_rotate_method = 'alltoall') has transfers to overlap; remove it or choose "
                "the rotating ring",
            ),
            (
                not (self.context_parallel_method == "ulysses" and self.context_parallel_rotate_method != "allgather"),
                f"parallelism.context_parallel_rotate_method = {self.context_parallel_rotate_method!r} chooses how the "
                "ring passes keys and values, but context_parallel_method = 'ulysses' has no ring; remove it or set "
                "context_parallel_method = 'ring'",
            ),
        )
        if pp > 1:
            explicit = [k for k in splits if getattr(self, k)]
            csv = self.pipeline_parallel_schedule_csv
            problems += broken_rules(
                (
                    len(explicit) < 2,
                    "parallelism.module_fqns_per_model_part and parallelism.pipeline_parallel_split_points both split "
                    "the pipeline; set one of them",
                ),
                (
                    not (explicit and self.pipeline_parallel_layers_per_stage is not None),
                    f"parallelism.{explicit[0] if explicit else ''} and parallelism.pipeline_parallel_layers_per_stage "
                    "both split the pipeline; set one of them",
                ),
                (not csv or os.path.isfile(csv), f"parallelism.pipeline_parallel_schedule_csv: {csv} does not exist"),
            )
        return problems


@dataclass(frozen=True)
class Comm:
    init_timeout_seconds: int = option(
        300, "Timeout of process-group initialization and of every collective until the first step is done."
    )
    train_timeout_seconds: int = option(
        100, "Timeout of every collective after the first step (which may compile, load and warm up)."
    )
    trace_buf_size: int = option(
        20000,
        "Entries of the collectives' flight recorder (sets TORCH_FR_BUFFER_SIZE unless it or the older "
        "TORCH_NCCL_TRACE_BUFFER_SIZE is set in the environment); 0 turns it off.",
    )
    data_timeout_seconds: int = option(
        600,
        "Longest a step may wait for its batches (a read that blocks: a network file system, a "
        "named pipe with no writer, a data worker that stopped); past it the rank ends the run with a line naming the "
        "step (exit 1) and the launcher stops the others (torchtitan/components/watchdog.py). 0: no limit.",
    )
    checkpoint_timeout_seconds: int = option(
        1800,
        "Longest a checkpoint save may take after start-up: its writes, and with checkpoint.async_mode its background "
        "writes; past it the rank ends the run with a line naming the checkpoint (exit 1), leaving the checkpoints "
        "already published complete. 0: no limit.",
    )

    def check(self) -> list[str]:
        # A collective's time limit: 0 would time out every collective at once, a negative one is refused by
        # the process group on every rank (gloo: "Invalid timeout") once the job has started.
        problems = [
            f"comm.{key} must be a positive number of seconds, got {getattr(self, key)}; set it to 1 or more "
            f"(default {getattr(Comm(), key)})"
            for key in ("init_timeout_seconds", "train_timeout_seconds")
            if not getattr(self, key) > 0
        ]
        problems += [
            f"comm.{key} must be 0 (no limit) or a positive number of seconds, got {getattr(self, key)}"
            for key in ("data_timeout_seconds", "checkpoint_timeout_seconds")
            if not getattr(self, key) >= 0
        ]
        return problems + broken_rules(
            (
                self.trace_buf_size >= 0,
                f"comm.trace_buf_size must be 0 (flight recorder off) or more entries, got {self.trace_buf_size}",
            )
        )


@dataclass(frozen=True)
class FaultTolerance:
    """Replica groups on torchft (torchtitan/components/fault_tolerance.py, docs/launching.md): each group is an
    ordinary run; across groups each rank's gradients are averaged over the groups alive at that step."""

    enabled: bool = option(
        False,
        "Train as one replica group of several (needs the torchft package: pip install torchft==0.2.0). Each group "
        "is an ordinary run with its own dump folder; a group that dies leaves the others training.",
    )
    group_count: int = option(1, "Replica groups of the job (the same in every group); each reads its own data lanes.")
    group_id: int = option(0, "This group's id, 0..group_count-1.")
    min_groups: int = option(
        1,
        "Groups that must take part in a step for it to be committed; with fewer alive, a step waits up to "
        "quorum_timeout_seconds for more, then the run stops.",
    )
    lighthouse: str = option(
        "",
        "Address of the torchft lighthouse that forms the groups' quorum, http://HOST:PORT (start one with "
        "torchft_lighthouse --min_replicas 1 --bind HOST:PORT, or run_train.sh with LIGHTHOUSE_PORT).",
    )
    timeout_seconds: int = option(
        30,
        "Timeout of the groups' gradient average and commit vote, and of the lighthouse's first answer "
        "(checked before launch). A group that stops answering is dropped after it.",
    )
    quorum_timeout_seconds: int = option(
        120,
        "How long a step waits for a quorum of at least min_groups groups (a fresh run's first step: of all "
        "group_count groups, then it starts with those present).",
    )
    sync: Literal["every_step", "diloco"] = option(
        "every_step",
        "How the groups train as one: every_step averages the gradients over the live groups at every step; diloco "
        "(semi-synchronous) trains each group alone for sync_every steps, then averages the groups' weight deltas "
        "and applies them with an outer SGD optimizer (outer_lr, outer_momentum, outer_nesterov).",
    )
    sync_every: int = option(
        100,
        "diloco: local steps between two averages of the weight deltas (H); only read under "
        "sync = 'diloco' (another value is refused under every_step).",
    )
    outer_lr: float = option(
        0.7,
        "diloco: the outer SGD's learning rate on the averaged weight delta (1 with no "
        "momentum: the groups' average weights); only read under sync = 'diloco'.",
    )
    outer_momentum: float = option(
        0.9, "diloco: the outer SGD's momentum, 0 <= m < 1; only read under sync = 'diloco'."
    )
    outer_nesterov: bool = option(
        True, "diloco: Nesterov momentum in the outer SGD (needs outer_momentum > 0); only read under sync = 'diloco'."
    )

    def check(self) -> list[str]:
        if not self.enabled:
            # Each key says which job this is (a group of several, its data lanes, how it syncs): set without
            # replica groups, the run would train as a plain run instead, and exit 0.
            return [
                f"fault_tolerance.{key} = {getattr(self, key)!r} is only read with fault_tolerance.enabled; "
                f"enable fault tolerance (--fault_tolerance.enabled) or remove it"
                for key in changed_keys(self)
                if key != "enabled"
            ]
        problems = [
            f"fault_tolerance.{key} must be a positive integer, got {getattr(self, key)}; set it to 1 or more"
            for key in ("group_count", "min_groups", "timeout_seconds", "quorum_timeout_seconds", "sync_every")
            if not getattr(self, key) > 0
        ]
        if self.sync == "every_step":
            problems += [
                f"fault_tolerance.{key} = {getattr(self, key)} is only read under fault_tolerance.sync = 'diloco' "
                f"(sync is 'every_step'); remove it or set sync = 'diloco'"
                for key in changed_keys(self, "sync_every", "outer_lr", "outer_momentum", "outer_nesterov")
            ]
        else:
            problems += broken_rules(
                (
                    0 < self.outer_lr < float("inf"),
                    f"fault_tolerance.outer_lr must be a positive number, got {self.outer_lr}",
                ),
                (
                    0 <= self.outer_momentum < 1,
                    f"fault_tolerance.outer_momentum must be in [0, 1), got {self.outer_momentum}",
                ),
                (
                    self.outer_momentum > 0 or not self.outer_nesterov,
                    "fault_tolerance.outer_nesterov needs fault_tolerance.outer_momentum > 0; set "
                    "--fault_tolerance.no-outer_nesterov for an outer SGD without momentum",
                ),
            )
        return (
            problems
            + broken_rules(
                (
                    0 <= self.group_id < self.group_count,
                    f"fault_tolerance.group_id = {self.group_id} is outside 0..group_count-1 "
                    f"(fault_tolerance.group_count = {self.group_count})",
                ),
                (
                    self.min_groups <= self.group_count,
                    f"fault_tolerance.min_groups = {self.min_groups} is above fault_tolerance.group_count = "
                    f"{self.group_count}: no step could ever be committed",
                ),
            )
            + lighthouse_address_problems(self.lighthouse)
        )


def lighthouse_address_problems(address: str) -> list[str]:
    """What is wrong with a lighthouse address (it must be http://HOST:PORT), as messages; [] if nothing."""
    fix = f"fault_tolerance.lighthouse = {address!r} must be the lighthouse's http://HOST:PORT"
    try:
        parts = urllib.parse.urlsplit(address)
        port = parts.port  # ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        return [f"{fix} ({e})"]
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return [fix]
    if parts.path.strip("/") or parts.query or parts.fragment:
        return [f"{fix}, with nothing after the port (got {parts.path + parts.query + parts.fragment!r})"]
    return []
