"""The training loop: the Trainer and main. The only module that sees the whole JobConfig; each
builder gets its section.

    torchrun --nproc_per_node 2 -m torchtitan.train --job.config_file train_configs/debug_model.toml

Sequence: preflight (torchtitan.preflight: the run's PreflightResult, no collectives) -> process group and mesh
-> model on the meta device -> parallelize -> materialize -> data, optimizer, LR schedule, metrics ->
loop. User mistakes end the run with one message and exit code 2 on every rank. The model is reached
only through its spec (models.common.spec.ModelSpec). `Trainer` runs `setup`, `train_loop` and `finish`,
which call named steps (build_model, build_optimizer, train_step, forward_backward, optimizer_step, log,
checkpoint); a fork overrides any of them in a subclass and runs it with `main(argv, trainer_cls=MyTrainer)`.
What the run builds is in the trainer's `ctx` (RunContext).
"""

import gc
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.components import fault_tolerance, validation, watchdog
from torchtitan.components.batch import BatchPreparation, LossRanks, document_end_of
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.data import build_dataloader
from torchtitan.components.metrics import (
    MetricsLogger,
    MfuPeak,
    left_behind,
    peak_memory_gib,
    rewind_metrics,
    setup_logging,
    slow_cpu_bfloat16,
    startup_line,
    startup_phase,
    write_run_file,
)
from torchtitan.components.optimizer import OptimizerGroup
from torchtitan.components.profiling import maybe_profile
from torchtitan.components.run_lock import take_run_lock
from torchtitan.components.stop_signals import StopSignals
from torchtitan.components.validation import Validator
from torchtitan.config import HelpRequested, JobConfig, UserError, config_to_toml, load_config
from torchtitan.config.rules import validation_seq_len
from torchtitan.distributed.context_parallel import describe_cp, local_positions
from torchtitan.distributed.cross_rank import gather_objects, max_over_ranks
from torchtitan.distributed.determinism import set_determinism
from torchtitan.distributed.dtypes import DTYPES
from torchtitan.distributed.grad_norm import clip_grad_norm_
from torchtitan.distributed.host_memory import release_host_memory
from torchtitan.distributed.parallel_dims import submesh
from torchtitan.distributed.parallelize import parallelize_model
from torchtitan.distributed.pipeline_parallel import (
    Pipeline,
    StepLoss,
    attach_schedule,
    forward_only_schedule,
    pipeline_step,
    split_for_rank,
    warm_up_schedule,
)
from torchtitan.distributed.process_group import (
    destroy_distributed,
    exit_process,
    init_distributed,
    set_collective_timeout,
    stop_with_launcher,
)
from torchtitan.distributed.shared_weights import SharedWeights, build_shared_weights
from torchtitan.distributed.tensor_parallel import loss_parallel_context
from torchtitan.models.common.attention import attention_kernel, set_attention_fn
from torchtitan.models.common.chunked_loss import forward_loss_fn
from torchtitan.models.common.spec import ParallelizeInputs
from torchtitan.preflight import PreflightResult, preflight, vocab_note

logger = logging.getLogger("torchtitan")


@dataclass(frozen=True)
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed micro-batch losses (zero off the last pipeline stage)
    grad_norm: float  # global, before clipping
    lr: float  # the learning rate this step used
    skipped: bool  # non-finite and skipped (training.skip_nonfinite_steps)
    stop_signal: str | None  # a job.stop_signals signal reached some rank: stop after this step


@dataclass
class ModelParts:
    """What build_model gives the trainer: this rank's share of the model and what steps it."""

    parts: list[nn.Module]  # this rank's model: the whole one, or its pipeline stages
    pipeline: Pipeline | None
    shapes: dict[str, tuple]  # the whole model's state, by name (checkpoints record it)
    shared_weights: SharedWeights  # weights tied across pipeline stages, one copy per stage
    parallelize_inputs: ParallelizeInputs  # what the spec's hooks get (meshes, sections of the config)
    step_loss: StepLoss | None  # a pipeline schedule's loss function (its scale set before each step)


@dataclass(eq=False, repr=False)  # no field-by-field repr: it is filled in stages, and holds the whole model
class RunContext:
    """What one run builds and its loop reads and updates: `Trainer.run` and `Trainer.setup` (with the builders
    it calls) set every field before the first step, but the loop's timers and log counters, which
    `Trainer.train_loop` starts; the steps update the counters. A field read before it is set raises
    AttributeError (the class declares it; an instance holds it once set)."""

    # Start-up (Trainer.run, Trainer.setup).
    stop_signals: StopSignals = field(init=False)  # job.stop_signals, installed for the run
    mesh: DeviceMesh | None = field(init=False)  # None: a single process
    startup: dict[str, float] = field(init=False)  # seconds of each start-up phase (startup_line)
    # The data (build_dataloader).
    dataloader: Any = field(init=False)  # the training batches; a fork's own loader may be any iterable
    document_end_id: int | None = field(init=False)  # the token that ends each document (batch.document_end_of)
    data_iter: Iterator = field(init=False)  # over dataloader, read by every step
    # The model and what steps it (build_model, build_optimizer, build_checkpointer, fault_tolerance).
    model: ModelParts = field(init=False)
    parts: list[nn.Module] = field(init=False)  # model.parts: this rank's model, or its pipeline stages
    pipeline: Pipeline | None = field(init=False)  # model.pipeline
    optim: OptimizerGroup = field(init=False)  # the optimizers and their learning-rate schedules
    checkpointer: CheckpointManager = field(init=False)
    replicas: fault_tolerance.ReplicaGroups = field(init=False)  # [fault_tolerance]; inert when it is off
    validator: Validator | None = field(init=False)  # [validation]; None when it is off
    metrics: MetricsLogger = field(init=False)
    # What every step needs (prepare_step_state).
    amp: AbstractContextManager = field(init=False)  # bf16 autocast without FSDP, else nothing
    loss_parallel: bool = field(init=False)  # TP's loss over vocabulary shards
    loss_ranks: LossRanks = field(init=False)  # the ranks a step's loss is spread over
    cp_positions: torch.Tensor | None = field(init=False)  # this rank's positions of each window (CP)
    batch_preparation: BatchPreparation = field(init=False)  # windows -> this rank's model inputs
    precompute_float8: bool = field(init=False)  # float8 scales computed after each optimizer step
    tokens_per_step: int = field(init=False)  # global batch x seq_len
    flops_per_token: float = field(init=False)  # training FLOPs per token of a window without documents
    peak: MfuPeak = field(init=False)  # the device's peak, for MFU
    # The loop: its bounds and counters (setup, train_loop, train_step, log).
    start_step: int = field(init=False)  # the last step done before this launch (0: a fresh run)
    stopped_at: int | None = field(init=False)  # the step after which a stop signal ended the loop
    skipped_in_a_row: int = field(init=False)  # non-finite steps skipped in a row (training.skip_nonfinite_steps)
    start_time: float = field(init=False)  # perf_counter at the loop's start
    last_log_time: float = field(init=False)  # and at the last metrics record
    last_log_step: int = field(init=False)
    tokens_since_log: float = field(init=False)  # this device's share of the tokens since the last record
    flops_since_log: float = field(init=False)  # all devices' training FLOPs since the last record
    data_wait_since_log: float = field(init=False)  # seconds the steps waited for batches since then


def train(cfg: JobConfig, trainer_cls: type["Trainer"] | None = None) -> list[dict]:
    """Runs the job; returns the logged metrics (every rank returns the same global values)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    preflight_result = preflight(cfg, world_size)
    # A caller that set up the process group (a test running several jobs in one launch) keeps it.
    owns_process_group = not torch.distributed.is_initialized()
    device, rank, _ = init_distributed(cfg.comm.init_timeout_seconds, cfg.comm.trace_buf_size)
    lock = None
    try:
        lock = take_run_lock(cfg.job.dump_folder, rank)
        history = (trainer_cls or Trainer)(cfg, preflight_result, device, rank).run()
    except BaseException:
        if lock is not None:
            lock.release()
        if owns_process_group:
            destroy_distributed(wait_for_peers=False)
        raise
    if lock is not None:
        lock.release()
    if owns_process_group:
        destroy_distributed()
    return history


class Trainer:
    """One training job: `_run` calls `setup`, `train_loop` and `finish` in order, and each step of those
    is a method a subclass may replace. What the run builds and the loop updates is in `self.ctx` (a
    RunContext, declared here and filled by `setup`); what preflight decided is in `self.preflight_result`."""

    def __init__(self, cfg: JobConfig, preflight_result: PreflightResult, device: torch.device, rank: int):
        self.cfg, self.preflight_result, self.device, self.rank = cfg, preflight_result, device, rank
        self.spec, self.model_args, self.tokenizer = (
            preflight_result.spec,
            preflight_result.model_args,
            preflight_result.tokenizer,
        )
        self.dims = preflight_result.parallel_dims
        self.history: list[dict] = []
        self.loss_sum_fn = forward_loss_fn(self.spec.loss_sum_fn, preflight_result.loss_chunk_tokens)
        self.ctx = RunContext()

    def run(self) -> list[dict]:
        cfg = self.cfg
        # From here on a scheduler's stop signal ends the run after a step, with a checkpoint.
        self.ctx.stop_signals = StopSignals(cfg.job.stop_signals, cfg.job.stop_grace_seconds)
        try:
            with watchdog.from_config(cfg.comm, cfg.metrics, self.device, self.rank):  # stalls and stragglers
                return self._run()
        finally:
            self.ctx.stop_signals.restore()

    def _run(self) -> list[dict]:
        """`setup`, `train_loop`, `finish`; returns the metrics records (`history`). The garbage collector is
        off during the loop; the metrics logger and the replica groups are closed after it, also when it
        raises. `finish` runs only after a loop that ended without an exception."""
        if not self.setup():
            return []
        gc.disable()
        gc.collect()
        try:
            self.train_loop()
        finally:
            gc.enable()
            self.ctx.metrics.close()
            self.ctx.replicas.close()
        self.finish()
        return self.history

    def setup(self) -> bool:
        """Everything before the first step, filling `self.ctx`: the seed and determinism, the resolved config
        written, the mesh; then, each a timed start-up phase, the data, the model with its optimizer and
        checkpointer, the checkpoint load (with the replica groups), the step's state; then the validator, the
        start lines, the metrics logger, the data iterator and the restored random state. Returns False when
        there is nothing to train: checkpoint.create_seed_checkpoint, the seed checkpoint written.

        A fork overrides it to build or check something more before the first step (call super().setup() and
        return its result), or to run only part of the start-up (scripts/benchmark_hf.py loads and exports);
        to change one piece, override its builder (build_dataloader, build_model, build_optimizer,
        build_checkpointer, build_validator, prepare_step_state) instead."""
        cfg, t, ctx = self.cfg, self.cfg.training, self.ctx
        set_determinism(t.seed, t.deterministic)
        self.write_config()
        ctx.mesh = self.dims.build_mesh(self.device.type)
        ctx.startup = {}
        with self.phase("opening the data"):
            ctx.dataloader = self.build_dataloader()
            ctx.document_end_id = document_end_of(
                ctx.dataloader, self.preflight_result.attention.documents, t.ignore_cross_document_labels
            )
        with self.phase("building the model"):
            ctx.model = self.build_model()
            ctx.parts, ctx.pipeline = ctx.model.parts, ctx.model.pipeline
            ctx.optim = self.build_optimizer()
            ctx.checkpointer = self.build_checkpointer()
        if cfg.checkpoint.create_seed_checkpoint:
            ctx.checkpointer.save_seed()
            return False
        with self.phase("loading the checkpoint"):
            start_step, _ = ctx.checkpointer.load()
            ctx.replicas = fault_tolerance.ReplicaGroups(cfg.fault_tolerance, start_step, self)
            ctx.start_step = ctx.replicas.join(start_step)  # replica groups: wait for them, or heal from one
            if self.device.type == "cpu":
                release_host_memory()
        with self.phase("preparing the step"):
            self.prepare_step_state()
        ctx.validator = self.build_validator()
        self.log_start()
        # A resumed run appends to the metrics of the run it continues.
        metrics_file = os.path.join(cfg.job.dump_folder, "metrics.jsonl")
        if self.rank == 0 and os.path.isfile(metrics_file) and os.path.getsize(metrics_file):
            rewind_metrics(metrics_file, ctx.start_step)
        ctx.metrics = MetricsLogger(
            cfg.metrics,
            cfg.job.dump_folder,
            write=self.rank == 0,
            append=ctx.start_step > 0,
            color=not cfg.metrics.disable_color_printing and sys.stderr.isatty(),
            total_steps=t.steps,
            start_step=ctx.start_step,
            run_config=asdict(cfg),
        )
        ctx.data_iter = iter(ctx.dataloader)
        ctx.stopped_at = None
        ctx.skipped_in_a_row = 0
        ctx.checkpointer.counters.setdefault("skipped_steps", 0)
        ctx.checkpointer.restore_rng()
        return True

    def train_loop(self):
        """The steps from ctx.start_step + 1 to training.steps, or to the one after which a stop signal
        arrived (then ctx.stopped_at): each `train_step`, then `log` (the first step of the launch, every
        metrics.log_freq, the last), `measure_held_out_loss` when due, `checkpoint`; the checkpointer is
        closed after the last step (its background save finished). The profiler wraps the loop.

        A fork overrides it for a loop of its own (steps that change the data or the model between them, an
        extra action every N steps); for what happens within a step, override train_step, log,
        measure_held_out_loss or checkpoint instead."""
        cfg, t, ctx = self.cfg, self.cfg.training, self.ctx
        ctx.start_time = ctx.last_log_time = time.perf_counter()
        ctx.tokens_since_log = ctx.flops_since_log = 0.0
        ctx.data_wait_since_log, ctx.last_log_step = 0.0, ctx.start_step
        start_step = ctx.start_step
        with maybe_profile(cfg.profiling, cfg.job.dump_folder, self.rank, self.device, start_step) as profiler:
            for step in range(start_step + 1, t.steps + 1):
                if step % t.gc_freq == 0:
                    gc.collect(1)
                result = self.train_step(step, ctx.data_iter)
                if step == start_step + 1:  # compiled, loaded and warmed up: the steady-state bound applies
                    set_collective_timeout(cfg.comm.train_timeout_seconds)
                    ctx.startup["first step"] = time.perf_counter() - ctx.start_time
                    logger.info(startup_line(ctx.startup))
                # Tensor-, context- and pipeline-parallel peers share their data-parallel group's
                # batch: count each token once, spread over all devices.
                ctx.tokens_since_log += ctx.tokens_per_step / self.dims.world_size
                # The first step of each launch (a resumed run's too), every log_freq, the last.
                if step == start_step + 1 or step % cfg.metrics.log_freq == 0 or step == t.steps or result.stop_signal:
                    self.log(step, result)
                if ctx.validator is not None and ctx.validator.due(step) and not result.stop_signal:
                    self.measure_held_out_loss(step)
                self.checkpoint(step, stopping=result.stop_signal is not None)
                profiler.step_done()
                if result.stop_signal:
                    ctx.stopped_at = step
                    break
            ctx.checkpointer.close()

    def finish(self):
        """After a loop that ended without an exception: the run's last lines, either stopped by a signal
        (and the checkpoint the same command resumes from) or done (steps, time, and what the run left in
        the dump folder).

        A fork overrides it to report, check or publish its own results at the end of a run (call
        super().finish() for the usual lines)."""
        cfg, t, ctx = self.cfg, self.cfg.training, self.ctx
        start_step, stopped_at = ctx.start_step, ctx.stopped_at
        if stopped_at is not None:
            saved = (
                f"saved checkpoint {ctx.checkpointer.folder.step(stopped_at)} (the same command resumes from it)"
                if cfg.checkpoint.enable_checkpoint
                else "nothing was saved: checkpointing is off (checkpoint.enable_checkpoint)"
            )
            logger.info(f"stopped by {ctx.stop_signals.received} after step {stopped_at} of {t.steps}; {saved}")
        else:
            resumed = f" (steps {start_step + 1}-{t.steps}, resumed from step {start_step})" if start_step else ""
            logger.info(
                f"training done: {t.steps - start_step} steps{resumed} in {time.perf_counter() - ctx.start_time:.1f}s"
            )
            checkpoint = ctx.checkpointer.folder.step(t.steps) if cfg.checkpoint.enable_checkpoint else None
            hf = (
                os.path.join(ctx.checkpointer.folder.path, f"step-{t.steps}-hf")
                if cfg.checkpoint.last_save_in_hf
                else None
            )
            logger.info(left_behind(cfg.job.dump_folder, cfg.metrics, checkpoint, hf))

    def write_config(self):
        if self.rank == 0:
            resolved = config_to_toml(self.cfg)
            path = write_run_file(self.cfg.job.dump_folder, "config.toml", resolved, "config")
            logger.info(
                f"resolved config ({self.cfg.job.config_file or 'defaults'} and the command line) written to "
                f"{path}" + (f":\n{resolved}" if self.cfg.job.print_args else "")
            )

    def build_dataloader(self):
        dp_rank = submesh(self.ctx.mesh, "dp").get_local_rank() if self.ctx.mesh is not None else 0
        # Each replica group reads its own lanes (fault_tolerance.data_lanes).
        lanes = fault_tolerance.data_lanes(
            self.cfg.fault_tolerance, dp_rank, self.dims.dp_degree, self.preflight_result.global_batch_size
        )
        return build_dataloader(
            self.cfg.training,
            self.tokenizer,
            *lanes,
            pin_memory=self.device.type == "cuda",
            gather=gather_objects,
        )

    def build_model(self) -> ModelParts:
        """This rank's model parts (one, or its pipeline stages), parallelized and initialized."""
        cfg, t = self.cfg, self.cfg.training
        logger.info(vocab_note(self.tokenizer, self.model_args.vocab_size, cfg.checkpoint.initial_load_in_hf))
        # Built on the meta device, so even the largest flavor costs nothing until materialized.
        with torch.device("meta"):
            model = self.spec.model_cls(self.model_args)
        if "float8" in cfg.model.converters:
            from torchtitan.components.float8 import convert_to_float8

            # Before parallelizing: FSDP then shards the float8 weights.
            convert_to_float8(model, cfg.float8, self.spec.high_precision)
        if cfg.model.print_after_conversion and self.rank == 0:
            logger.info(f"model after conversion ({', '.join(cfg.model.converters) or 'no converters'}):\n{model}")
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        pipeline, parts = None, [model]
        if self.dims.pp_enabled:
            assert self.ctx.mesh is not None  # pp > 1: more than one process
            parts, pipeline = split_for_rank(model, self.spec.pipeline, cfg.parallelism, self.ctx.mesh["pp"])
        self.set_attention(parts)
        expert_mesh = self.dims.build_expert_mesh(self.device.type) if self.dims.ep_enabled else None
        inputs = ParallelizeInputs(self.dims, self.ctx.mesh, cfg.parallelism, t, cfg.activation_checkpoint, expert_mesh)
        parts = [parallelize_model(part, inputs, self.spec) for part in parts]
        for part in parts:
            # With CPU offload, FSDP keeps the sharded parameters in host memory; buffers live on the device.
            part.to_empty(device="cpu" if t.enable_cpu_offload else self.device)
            part.init_weights(seed=t.seed, buffer_device=self.device)  # pyrefly: ignore[not-callable]  # torch types Module.__getattr__'s result Tensor | Module; a method here
            # With labels, forward computes the loss (chunked_loss).
            part.loss_chunk_tokens = self.preflight_result.loss_chunk_tokens  # pyrefly: ignore[bad-argument-type]  # torch types Module.__setattr__'s value Tensor | Module; it takes any
            part.train()
        if self.device.type == "cpu":
            release_host_memory()  # init drew each parameter whole, then kept its part
        shared_weights, step_loss = SharedWeights(), None
        if pipeline is not None and pipeline.ties:
            shared_weights = build_shared_weights(
                pipeline.ties, parts, pipeline.stage_ids, pipeline.rank_of_stage, self.ctx.mesh
            )
            shared_weights.copy_canonical_values()
            logger.info(
                "weights shared across pipeline stages, one copy per stage kept equal: "
                + "; ".join(" = ".join(tie[s] for s in sorted(tie)) for tie in pipeline.ties)
            )
        if pipeline is not None:
            # Gradient accumulation under a pipeline: one schedule step runs all of an optimizer step's
            # micro-batches as more microbatches (the schedule divides the gradients by their count
            # once; a step per micro-batch would divide the earlier ones again).
            batch = t.local_batch_size * self.preflight_result.grad_accum_steps
            step_loss = StepLoss(self.loss_sum_fn)
            attach_schedule(pipeline, parts, cfg.parallelism, batch, self.device, step_loss)
        return ModelParts(parts, pipeline, shapes, shared_weights, inputs, step_loss)

    def set_attention(self, parts: list[nn.Module]):
        """The attention kernel of every block (preflight's ResolvedAttention), said once; context parallel
        then replaces it with its ring attention, which applies the same mask."""
        attention = self.preflight_result.attention
        if attention.kernel == "own":
            logger.info(f"attention: {attention.describe()}, the model's own kernel")
            return
        fn = attention_kernel(attention.kernel)
        path = self.spec.cp_attention
        assert path is not None  # a spec without it has the "own" kernel (preflight.resolve_attention)
        for part in parts:
            set_attention_fn(part, path, fn, self.spec.blocks(part))
        ring = f"; context parallel: {describe_cp(self.cfg.parallelism)}" if self.dims.cp_enabled else ""
        logger.info(
            f"attention: {attention.describe()}, {attention.kernel} kernel "
            f"(model.attn_backend = {self.cfg.model.attn_backend!r}){ring}"
        )

    def build_optimizer(self) -> OptimizerGroup:
        whole = None
        if self.dims.pp_enabled:
            # The parameter groups are decided on the whole model's names and modules (a stage holds a part).
            with torch.device("meta"):
                whole = self.spec.model_cls(self.model_args)
        optim = OptimizerGroup(
            self.ctx.parts,
            self.cfg.optimizer,
            self.cfg.lr_scheduler,
            self.cfg.training.steps,
            whole_model=whole,
            adamw_params=self.spec.adamw_params or (),
        )
        if self.spec.post_optimizer_build is not None:
            self.spec.post_optimizer_build(self.ctx.parts, optim.optimizers)
        return optim

    def build_checkpointer(self) -> CheckpointManager:
        cfg = self.cfg
        model_record = {
            "name": cfg.model.name,
            "flavor": cfg.model.flavor,
            "args": asdict(self.model_args),
            "pipelined": self.dims.pp_enabled,
            "shapes": self.ctx.model.shapes,
            "hf_adapter": self.spec.hf,
            "hf_args": self.model_args,
            "optimizer_names": self.ctx.model.shared_weights.checkpoint_names(),
        }
        return CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            self.ctx.parts,
            self.ctx.optim.optimizers,
            self.ctx.optim.schedulers,
            self.ctx.dataloader,
            model_record,
            self.device,
        )

    def build_validator(self) -> Validator | None:
        """[validation]: the held-out set (this rank's share of each global batch) and the runner, with
        training's own forward and loss."""
        v, t, ctx = self.cfg.validation, self.cfg.training, self.ctx
        if not v.enabled:
            return None
        dp_rank = submesh(ctx.mesh, "dp").get_local_rank() if ctx.mesh is not None else 0
        batches = validation.ValidationData(
            validation.build_source(v, t, self.tokenizer),
            self.tokenizer,
            validation_seq_len(v, t),
            v.local_batch_size,
            dp_rank,
            self.dims.dp_degree,
            v.steps,
        )
        schedule = None
        if ctx.pipeline is not None:  # microbatches of the training size (the config checks it divides)
            n_micro = v.local_batch_size // self.cfg.parallelism.pipeline_parallel_microbatch_size
            schedule = forward_only_schedule(ctx.pipeline, ctx.parts, n_micro, self.device, self.loss_sum_fn)

        def loss_fn(inputs, labels, kwargs):
            with loss_parallel_context(ctx.loss_parallel):
                return self.forward_loss(inputs, labels, kwargs, schedule)

        return validation.Validator(
            v, t.steps, batches, ctx.parts, loss_fn, ctx.batch_preparation, ctx.loss_ranks.sum, self.device
        )

    def prepare_step_state(self):
        """What every step needs: mixed precision, loss reduction, context-parallel positions, metrics."""
        t, ctx = self.cfg.training, self.ctx
        # Without FSDP there is no mixed-precision policy: autocast gives bf16 compute instead.
        use_autocast = not self.dims.fsdp_enabled and t.mixed_precision_param == "bfloat16"
        ctx.amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if use_autocast else nullcontext()
        ctx.loss_parallel = self.dims.tp_enabled and not self.cfg.parallelism.disable_loss_parallel
        # The data- and context-parallel ranks split a step's tokens: the valid labels are counted over
        # them, and the logged loss is the mean of their shares times their number (`log`).
        ctx.loss_ranks = LossRanks(
            submesh(ctx.mesh, "dp_cp") if ctx.mesh is not None else None,
            ctx.pipeline.pp_mesh.get_group() if ctx.pipeline is not None else None,
            ctx.pipeline.loss_src if ctx.pipeline is not None else 0,
        )
        ctx.cp_positions = None
        if self.dims.cp_enabled:
            assert ctx.mesh is not None  # cp > 1: more than one process
            ctx.cp_positions = local_positions(t.seq_len, self.dims.cp, ctx.mesh["cp"].get_local_rank())
        prepare_window = self.spec.prepare_window
        ctx.batch_preparation = BatchPreparation(
            ctx.document_end_id,
            self.preflight_result.attention.documents,
            t.ignore_cross_document_labels,
            ctx.cp_positions,
            partial(prepare_window, self.model_args) if prepare_window is not None else None,
            labels_to_forward=self.preflight_result.loss_chunk_tokens > 0,
        )
        ctx.precompute_float8 = (
            "float8" in self.cfg.model.converters and self.cfg.float8.precompute_float8_dynamic_scale_for_fsdp
        )
        ctx.tokens_per_step = self.preflight_result.global_batch_size * t.seq_len
        # Training FLOPs per token of a window without document boundaries (block_causal: the actual
        # documents of each step, `step_flops`).
        ctx.flops_per_token = self.spec.flops_per_token(self.model_args, t.seq_len)
        ctx.peak = MfuPeak.for_device(self.device, DTYPES[t.mixed_precision_param], self.cfg.metrics.device_peak_tflops)
        if ctx.pipeline is not None:
            assert ctx.model.step_loss is not None  # built with the pipeline
            zeros = torch.zeros(
                t.local_batch_size * self.preflight_result.grad_accum_steps, t.seq_len, dtype=torch.long
            )
            with loss_parallel_context(ctx.loss_parallel), ctx.amp:
                warm_up_schedule(
                    ctx.pipeline,
                    ctx.parts,
                    ctx.model.step_loss,
                    *ctx.batch_preparation.prepare(zeros, zeros, self.device),
                )

    def phase(self, what: str):  # a start-up phase: said when it begins, timed
        return startup_phase(what, self.ctx.startup)

    def log_start(self):
        cfg, t, decided = self.cfg, self.cfg.training, self.preflight_result
        logger.info(
            f"training {cfg.model.name} {cfg.model.flavor}: {self.spec.size(self.model_args).total:,} parameters, "
            f"vocab {self.model_args.vocab_size}, {self.ctx.flops_per_token / 1e6:.1f} MFLOPs/token, params "
            f"{t.mixed_precision_param}, {t.steps} steps"
        )
        logger.info(f"mesh: {self.dims.describe()} on {self.device.type}")
        logger.info(
            f"batch: global batch {decided.global_batch_size} x seq {t.seq_len} = {self.ctx.tokens_per_step:,} "
            f"tokens/step (local batch {t.local_batch_size}, {decided.grad_accum_steps} accumulation step(s)); loss "
            + (
                f"in chunks of {decided.loss_chunk_tokens} tokens"
                if decided.loss_chunk_tokens
                else "on the whole logits"
            )
        )
        logger.info(f"MFU peak: {self.ctx.peak.tflops:.3f} TFLOP/s {self.ctx.peak.source}")
        uses_bf16 = []
        if t.mixed_precision_param == "bfloat16":
            uses_bf16.append(("the model's matmuls", "--training.mixed_precision_param float32"))
        if cfg.optimizer.name == "Muon" and cfg.optimizer.muon_ns_dtype in (None, "bfloat16"):
            uses_bf16.append(("Muon's Newton-Schulz iterations", "--optimizer.muon_ns_dtype float32"))
        if self.device.type == "cpu" and uses_bf16 and (slow := slow_cpu_bfloat16(uses_bf16)):
            logger.warning(slow)
        if self.preflight_result.memory_estimate:
            logger.info(self.preflight_result.memory_estimate)
        if cfg.lr_scheduler.warmup_steps >= t.steps:
            logger.warning(
                f"lr_scheduler.warmup_steps ({cfg.lr_scheduler.warmup_steps}) is not below training.steps ({t.steps}): "
                f"the learning rate warms up for the whole run and never decays"
            )

    def train_step(self, step: int, data_iter) -> StepResult:
        """One optimizer step over the gradient-accumulation micro-batches. The step is taken only if
        its loss and gradient norm are finite on every rank; otherwise it is skipped
        (training.skip_nonfinite_steps) or the run stops, before the state can reach a checkpoint."""
        ctx = self.ctx
        ctx.optim.zero_grad()
        ctx.replicas.start_step(step)
        loss_sum = torch.zeros((), device=self.device)
        micro_batches, waited = watchdog.read_batches(data_iter, self.preflight_result.grad_accum_steps, step)
        ctx.data_wait_since_log += waited
        if ctx.pipeline is not None:  # the schedule takes them all at once, as microbatches
            micro_batches = [tuple(torch.cat(parts) for parts in zip(*micro_batches))]
        if ctx.batch_preparation.block_causal:
            lengths = [
                n for batch in micro_batches for n in ctx.batch_preparation.document_lengths(batch[0], *batch[2:])
            ]
            ctx.flops_since_log += self.spec.flops_per_token(self.model_args, lengths) * ctx.tokens_per_step
        else:
            ctx.flops_since_log += ctx.flops_per_token * ctx.tokens_per_step
        # (inputs, labels[, doc_ids]) -> this rank's (inputs, labels, forward's keyword inputs) on the
        # device; with context parallel, the tokens at cp_positions of each sequence.
        micro_batches = [
            ctx.batch_preparation.prepare(batch[0], batch[1], self.device, *batch[2:]) for batch in micro_batches
        ]
        scale = ctx.loss_ranks.scale([labels for _, labels, _ in micro_batches])
        for inputs, labels, kwargs in micro_batches:
            loss_sum += self.forward_backward(inputs, labels, kwargs, scale)
        ctx.model.shared_weights.sum_gradients()
        params = [p for part in ctx.parts for p in part.parameters()]
        ctx.replicas.average(params, loss_sum)  # over the live replica groups (fault_tolerance)
        grad_norm = clip_grad_norm_(
            params,
            self.cfg.training.max_norm,
            ctx.loss_ranks.pp_group,
            not_counted=ctx.model.shared_weights.duplicates(),
        )
        # One small all-reduce and one host sync per step: whether any rank's loss is non-finite (with
        # a pipeline only the last stage has one) and whether any rank received a stop signal.
        flags = torch.tensor(
            [0.0 if torch.isfinite(loss_sum) else 1.0, 1.0 if ctx.stop_signals.received else 0.0], device=self.device
        )
        max_over_ranks(flags)
        norm, loss_bad, stop = torch.cat([grad_norm.detach().float().reshape(1), flags]).tolist()
        lr = ctx.optim.lr
        finite = math.isfinite(norm) and not loss_bad
        committed = ctx.replicas.should_commit(step)  # False only when a replica group failed in the step
        if finite and committed:
            ctx.skipped_in_a_row = 0
            self.optimizer_step()
        elif committed:
            self.skip_step(step, "gradient norm" if not math.isfinite(norm) else "loss", norm)
        ctx.replicas.end_step(step)  # diloco: the replica groups' sync every fault_tolerance.sync_every steps
        signal_name = (ctx.stop_signals.received or "a stop signal (on another rank)") if stop else None
        return StepResult(loss_sum, norm, lr, not finite, signal_name)

    def skip_step(self, step: int, what: str, norm: float):
        """A non-finite step: stop the run, or (training.skip_nonfinite_steps) drop its gradients and
        statistics and only advance the learning-rate schedule, so that step N keeps step N's rate."""
        t, ctx = self.cfg.training, self.ctx
        if not t.skip_nonfinite_steps:
            raise UserError(
                f"training stopped at step {step}: the {what} is not finite (gradient norm {norm}: a bad batch, "
                f"too high a learning rate or an overflow); checkpoints hold only earlier steps. "
                f"training.skip_nonfinite_steps skips such steps instead"
            )
        ctx.skipped_in_a_row += 1
        ctx.checkpointer.counters["skipped_steps"] += 1
        if ctx.skipped_in_a_row >= t.max_skipped_steps_in_a_row:
            raise UserError(
                f"training stopped at step {step}: {ctx.skipped_in_a_row} steps in a row had a non-finite loss or "
                f"gradient norm (training.max_skipped_steps_in_a_row); checkpoints hold only earlier steps"
            )
        logger.warning(
            f"step {step}: the {what} is not finite (gradient norm {norm}); skipped the optimizer step "
            f"({ctx.checkpointer.counters['skipped_steps']} skipped so far)"
        )
        ctx.optim.zero_grad()
        ctx.optim.step_schedulers()
        if self.spec.post_skipped_step is not None:
            self.spec.post_skipped_step(ctx.parts, ctx.model.parallelize_inputs)

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict, scale: torch.Tensor
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch (with a pipeline, of all of them at once); returns
        its summed token loss times `scale` (LossRanks.scale), detached: summed over micro-batches and
        averaged over the loss ranks, that is the step's loss. `kwargs`: forward's keyword
        inputs (document ids, the family's own; batch.BatchPreparation)."""
        ctx = self.ctx
        # With loss parallel the logits stay sharded over the vocabulary; the loss and its backward
        # must both run inside the context.
        with loss_parallel_context(ctx.loss_parallel):
            if ctx.pipeline is not None:
                is_first, is_last = ctx.pipeline.is_first, ctx.pipeline.is_last
                assert ctx.model.step_loss is not None  # built with the pipeline
                ctx.model.step_loss.scale = scale
                with ctx.amp:
                    loss = pipeline_step(ctx.pipeline.schedule, inputs, labels, is_first, is_last, kwargs)
                if loss is None:
                    loss = torch.zeros((), device=self.device)
            else:
                loss = self.forward_loss(inputs, labels, kwargs)
                assert loss is not None  # None only from a pipeline schedule
                loss = loss * scale
                loss.backward()
        loss = loss.detach()
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def forward_loss(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict, schedule=None):
        """This rank's summed token loss of a prepared batch: the model's forward in the step's mixed
        precision, then the spec's loss, inside the caller's loss_parallel_context (training keeps it
        open for the backward). Training scales the loss and runs its backward; validation sums it.
        `schedule`: a pipeline's forward-only schedule (forward_only_schedule), whose loss exists on
        the last stage's rank only (None elsewhere)."""
        with self.ctx.amp:
            if schedule is not None:
                assert self.ctx.pipeline is not None  # the schedule runs its stages
                return pipeline_step(
                    schedule,
                    inputs,
                    labels,
                    self.ctx.pipeline.is_first,
                    self.ctx.pipeline.is_last,
                    kwargs,
                    forward_only=True,
                )
            logits = self.ctx.parts[0](inputs, **kwargs)
        return self.loss_sum_fn(logits, labels)

    def optimizer_step(self):
        """Step the optimizers and LR schedules on the clipped gradients, then the model's own updates."""
        self.ctx.optim.step()
        if self.ctx.precompute_float8:
            from torchtitan.components.float8 import precompute_float8_scales

            # One fused amax/scale computation for all float8 weights, used by the next all-gather.
            for part in self.ctx.parts:
                precompute_float8_scales(part)
        if self.spec.post_optimizer_step is not None:
            self.spec.post_optimizer_step(self.ctx.parts, self.ctx.model.parallelize_inputs)

    def log(self, step: int, result: StepResult) -> dict:
        """Reduce the step's loss over ranks and write one metrics record."""
        ctx = self.ctx
        loss_value = ctx.loss_ranks.mean(result.loss_sum)
        now = time.perf_counter()
        tps = ctx.tokens_since_log / (now - ctx.last_log_time)  # tokens per second on this device
        # Each device's share of the step's training FLOPs per second.
        tflops = ctx.flops_since_log / self.dims.world_size / (now - ctx.last_log_time) / 1e12
        record = {
            "step": step,
            "loss": loss_value,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tps": tps,
            "tflops": tflops,
            **ctx.peak.fields(tflops),  # mfu, peak_tflops, and mfu_note when the peak needs one
            "memory_gib": peak_memory_gib(self.device),
            "time": now - ctx.start_time,
            "tokens": step * ctx.tokens_per_step,
            "skipped_steps": ctx.checkpointer.counters["skipped_steps"],
            # Mean time a step waited for its batches since the previous record (data loading off
            # the critical path keeps it near zero).
            "data_wait_s": ctx.data_wait_since_log / max(step - ctx.last_log_step, 1),
            **ctx.replicas.fields(),
            **watchdog.straggler_fields(step),  # straggler_rank (components/watchdog.py)
        }
        if self.spec.metrics is not None:
            record.update(self.spec.metrics(ctx.parts, ctx.model.parallelize_inputs))
        # A mixture's share of each source so far, and the epoch each is in (data_share/I, data_epoch/I);
        # a loader of a fork's own (build_dataloader overridden) may have none.
        mixture_metrics = getattr(getattr(ctx.dataloader, "dataset", None), "mixture_metrics", None)
        if mixture_metrics is not None:
            record.update(mixture_metrics(step * self.preflight_result.global_batch_size))
        ctx.metrics.log(record)
        self.history.append(record)
        ctx.last_log_time, ctx.tokens_since_log, ctx.flops_since_log = now + ctx.peak.probe_s, 0.0, 0.0
        ctx.data_wait_since_log, ctx.last_log_step = 0.0, step
        return record

    def measure_held_out_loss(self, step: int) -> dict:
        """Held-out loss and perplexity (after the step's update, before its checkpoint); one metrics record.
        Its time is left out of the next step line's throughput."""
        assert self.ctx.validator is not None  # called when build_validator made one
        record = self.ctx.validator.run(step)
        self.ctx.metrics.log_validation(record)
        self.history.append(record)
        self.ctx.last_log_time += record["validation_time"]
        return record

    def checkpoint(self, step: int, stopping: bool = False):
        """Publish a finished background save; save when due or when the run stops early; export to
        Hugging Face at the end."""
        t = self.cfg.training
        self.ctx.checkpointer.maybe_publish()
        if self.ctx.checkpointer.should_save(step, t.steps) or (stopping and self.cfg.checkpoint.enable_checkpoint):
            self.ctx.checkpointer.save(step, step * self.ctx.tokens_per_step, last=step == t.steps)
        if step == t.steps and self.cfg.checkpoint.last_save_in_hf:
            self.ctx.checkpointer.export_hf(
                step, self.tokenizer.bos_id, self.tokenizer.eos_id, self.ctx.mesh, self.cfg.model.tokenizer_path
            )


def main(argv: list[str], trainer_cls: type[Trainer] | None = None) -> int:
    setup_logging()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker
        stop_with_launcher()
    try:
        train(load_config(argv), trainer_cls)
    except HelpRequested as h:
        if os.environ.get("RANK", "0") == "0":
            from torchtitan.models.registry import help_with_families

            print(help_with_families(h.text))
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
