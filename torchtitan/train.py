"""The training loop: the Trainer and main. The only module that sees the whole JobConfig; each
builder gets its section.

    torchrun --nproc_per_node 2 -m torchtitan.train --job.config_file train_configs/debug_model.toml

Sequence: preflight (torchtitan.preflight: the run's Plan, no collectives) -> process group and mesh
-> model on the meta device -> parallelize -> materialize -> data, optimizer, LR schedule, metrics ->
loop. User mistakes end the run with one message and exit code 2 on every rank. The model is reached
only through its spec (models.common.spec.ModelSpec). `Trainer`'s loop calls named steps
(build_model, build_optimizer, forward_backward, optimizer_step, log, checkpoint) that a fork can
override in a subclass and run with `main(argv, trainer_cls=MyTrainer)`.
"""

import gc
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.components import fault_tolerance, validate, watchdog
from torchtitan.components.batch import BatchRule, LossRanks, document_end_of
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
from torchtitan.components.validate import Validator
from torchtitan.config import HelpRequested, JobConfig, UserError, config_to_toml, load_config
from torchtitan.config.rules import validation_seq_len
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.context_parallel import describe_cp, local_positions
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
from torchtitan.distributed.shared_weights import SharedWeights, build_shared_weights
from torchtitan.distributed.tensor_parallel import loss_parallel_context
from torchtitan.models.common.attention import attention_kernel, set_attention_fn
from torchtitan.models.common.chunked_loss import forward_loss_fn
from torchtitan.models.common.spec import ParallelizeInputs
from torchtitan.preflight import Plan, preflight, vocab_note

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


def train(cfg: JobConfig, trainer_cls: type["Trainer"] | None = None) -> list[dict]:
    """Runs the job; returns the logged metrics (every rank returns the same global values)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    plan = preflight(cfg, world_size)
    # A caller that set up the process group (a test running several jobs in one launch) keeps it.
    owns_process_group = not torch.distributed.is_initialized()
    device, rank, _ = dist_utils.init_distributed(cfg.comm.init_timeout_seconds, cfg.comm.trace_buf_size)
    lock = None
    try:
        lock = take_run_lock(cfg.job.dump_folder, rank)
        history = (trainer_cls or Trainer)(cfg, plan, device, rank).run()
    except BaseException:
        if lock is not None:
            lock.release()
        if owns_process_group:
            dist_utils.destroy_distributed(wait_for_peers=False)
        raise
    if lock is not None:
        lock.release()
    if owns_process_group:
        dist_utils.destroy_distributed()
    return history


class Trainer:
    """One training job, read top to bottom in `run`. Each step is a method a subclass may replace."""

    def __init__(self, cfg: JobConfig, plan: Plan, device: torch.device, rank: int):
        self.cfg, self.plan, self.device, self.rank = cfg, plan, device, rank
        self.spec, self.model_args, self.tokenizer = plan.spec, plan.model_args, plan.tokenizer
        self.dims = plan.parallel_dims
        self.history: list[dict] = []
        self.loss_sum_fn = forward_loss_fn(self.spec.loss_sum_fn, plan.loss_chunk_tokens)

    def run(self) -> list[dict]:
        cfg = self.cfg
        # From here on a scheduler's stop signal ends the run after a step, with a checkpoint.
        self.stop_signals = StopSignals(cfg.job.stop_signals, cfg.job.stop_grace_seconds)
        try:
            with watchdog.from_config(cfg.comm, cfg.metrics, self.device, self.rank):  # stalls and stragglers
                return self._run()
        finally:
            self.stop_signals.restore()

    def _run(self) -> list[dict]:
        cfg, t = self.cfg, self.cfg.training
        dist_utils.set_determinism(t.seed, t.deterministic)
        self.write_config()
        self.mesh = self.dims.build_mesh(self.device.type)
        self.startup: dict[str, float] = {}
        with self.phase("opening the data"):
            self.dataloader = self.build_dataloader()
            self.document_end_id = document_end_of(
                self.dataloader, self.plan.attention.documents, t.ignore_cross_document_labels
            )
        with self.phase("building the model"):
            self.model = self.build_model()
            self.parts, self.pipeline = self.model.parts, self.model.pipeline
            self.optim = self.build_optimizer()
            self.checkpointer = self.build_checkpointer()
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed()
            return []
        with self.phase("loading the checkpoint"):
            start_step, _ = self.checkpointer.load()
            self.replicas = fault_tolerance.ReplicaGroups(cfg.fault_tolerance, start_step, self)
            start_step = self.replicas.join(start_step)  # replica groups: wait for them, or heal from one
            if self.device.type == "cpu":
                dist_utils.release_host_memory()
        with self.phase("preparing the step"):
            self.prepare_step_state()
        self.validator = self.build_validator()
        self.log_start()
        # A resumed run appends to the metrics of the run it continues.
        metrics_file = os.path.join(cfg.job.dump_folder, "metrics.jsonl")
        if self.rank == 0 and os.path.isfile(metrics_file) and os.path.getsize(metrics_file):
            rewind_metrics(metrics_file, start_step)
        self.metrics = MetricsLogger(
            cfg.metrics,
            cfg.job.dump_folder,
            write=self.rank == 0,
            append=start_step > 0,
            color=not cfg.metrics.disable_color_printing and sys.stderr.isatty(),
            total_steps=t.steps,
            start_step=start_step,
            run_config=asdict(cfg),
        )
        data_iter = iter(self.dataloader)
        stopped_at = None
        self.skipped_in_a_row = 0
        self.checkpointer.counters.setdefault("skipped_steps", 0)
        self.checkpointer.restore_rng()
        gc.disable()
        gc.collect()
        self.start_time = self.last_log_time = time.perf_counter()
        self.tokens_since_log = self.flops_since_log = 0.0
        self.data_wait_since_log, self.last_log_step = 0.0, start_step
        try:
            with maybe_profile(cfg.profiling, cfg.job.dump_folder, self.rank, self.device, start_step) as profiler:
                for step in range(start_step + 1, t.steps + 1):
                    if step % t.gc_freq == 0:
                        gc.collect(1)
                    result = self.train_step(step, data_iter)
                    if step == start_step + 1:  # compiled, loaded and warmed up: the steady-state bound applies
                        dist_utils.set_collective_timeout(cfg.comm.train_timeout_seconds)
                        self.startup["first step"] = time.perf_counter() - self.start_time
                        logger.info(startup_line(self.startup))
                    # Tensor-, context- and pipeline-parallel peers share their data-parallel group's
                    # batch: count each token once, spread over all devices.
                    self.tokens_since_log += self.tokens_per_step / self.dims.world_size
                    # The first step of each launch (a resumed run's too), every log_freq, the last.
                    if (
                        step == start_step + 1
                        or step % cfg.metrics.log_freq == 0
                        or step == t.steps
                        or result.stop_signal
                    ):
                        self.log(step, result)
                    if self.validator is not None and self.validator.due(step) and not result.stop_signal:
                        self.validate(step)
                    self.checkpoint(step, stopping=result.stop_signal is not None)
                    profiler.step_done()
                    if result.stop_signal:
                        stopped_at = step
                        break
                self.checkpointer.close()
        finally:
            gc.enable()
            self.metrics.close()
            self.replicas.close()
        if stopped_at is not None:
            saved = (
                f"saved checkpoint {self.checkpointer.folder.step(stopped_at)} (the same command resumes from it)"
                if cfg.checkpoint.enable_checkpoint
                else "nothing was saved: checkpointing is off (checkpoint.enable_checkpoint)"
            )
            logger.info(f"stopped by {self.stop_signals.received} after step {stopped_at} of {t.steps}; {saved}")
        else:
            resumed = f" (steps {start_step + 1}-{t.steps}, resumed from step {start_step})" if start_step else ""
            logger.info(
                f"training done: {t.steps - start_step} steps{resumed} in {time.perf_counter() - self.start_time:.1f}s"
            )
            checkpoint = self.checkpointer.folder.step(t.steps) if cfg.checkpoint.enable_checkpoint else None
            hf = (
                os.path.join(self.checkpointer.folder.path, f"step-{t.steps}-hf")
                if cfg.checkpoint.last_save_in_hf
                else None
            )
            logger.info(left_behind(cfg.job.dump_folder, cfg.metrics, checkpoint, hf))
        return self.history

    def write_config(self):
        if self.rank == 0:
            resolved = config_to_toml(self.cfg)
            path = write_run_file(self.cfg.job.dump_folder, "config.toml", resolved, "config")
            logger.info(
                f"resolved config ({self.cfg.job.config_file or 'defaults'} and the command line) written to "
                f"{path}" + (f":\n{resolved}" if self.cfg.job.print_args else "")
            )

    def build_dataloader(self):
        dp_rank = submesh(self.mesh, "dp").get_local_rank() if self.mesh is not None else 0
        # Each replica group reads its own lanes (fault_tolerance.data_lanes).
        lanes = fault_tolerance.data_lanes(
            self.cfg.fault_tolerance, dp_rank, self.dims.dp_degree, self.plan.global_batch_size
        )
        return build_dataloader(
            self.cfg.training,
            self.tokenizer,
            *lanes,
            pin_memory=self.device.type == "cuda",
            gather=dist_utils.gather_objects,
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
            assert self.mesh is not None  # pp > 1: more than one process
            parts, pipeline = split_for_rank(model, self.spec.pipeline, cfg.parallelism, self.mesh["pp"])
        self.set_attention(parts)
        expert_mesh = self.dims.build_expert_mesh(self.device.type) if self.dims.ep_enabled else None
        inputs = ParallelizeInputs(self.dims, self.mesh, cfg.parallelism, t, cfg.activation_checkpoint, expert_mesh)
        parts = [parallelize_model(part, inputs, self.spec) for part in parts]
        for part in parts:
            # With CPU offload, FSDP keeps the sharded parameters in host memory; buffers live on the device.
            part.to_empty(device="cpu" if t.enable_cpu_offload else self.device)
            part.init_weights(seed=t.seed, buffer_device=self.device)  # pyrefly: ignore[not-callable]  # torch types Module.__getattr__'s result Tensor | Module; a method here
            # With labels, forward computes the loss (chunked_loss).
            part.loss_chunk_tokens = self.plan.loss_chunk_tokens  # pyrefly: ignore[bad-argument-type]  # torch types Module.__setattr__'s value Tensor | Module; it takes any
            part.train()
        if self.device.type == "cpu":
            dist_utils.release_host_memory()  # init drew each parameter whole, then kept its part
        shared_weights, step_loss = SharedWeights(), None
        if pipeline is not None and pipeline.ties:
            shared_weights = build_shared_weights(
                pipeline.ties, parts, pipeline.stage_ids, pipeline.rank_of_stage, self.mesh
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
            batch = t.local_batch_size * self.plan.grad_accum_steps
            step_loss = StepLoss(self.loss_sum_fn)
            attach_schedule(pipeline, parts, cfg.parallelism, batch, self.device, step_loss)
        return ModelParts(parts, pipeline, shapes, shared_weights, inputs, step_loss)

    def set_attention(self, parts: list[nn.Module]):
        """The attention kernel of every block (preflight's AttentionPlan), said once; context parallel
        then replaces it with its ring attention, which applies the same mask."""
        attention = self.plan.attention
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
            self.parts,
            self.cfg.optimizer,
            self.cfg.lr_scheduler,
            self.cfg.training.steps,
            whole_model=whole,
            adamw_params=self.spec.adamw_params or (),
        )
        if self.spec.post_optimizer_build is not None:
            self.spec.post_optimizer_build(self.parts, optim.optimizers)
        return optim

    def build_checkpointer(self) -> CheckpointManager:
        cfg = self.cfg
        model_record = {
            "name": cfg.model.name,
            "flavor": cfg.model.flavor,
            "args": asdict(self.model_args),
            "pipelined": self.dims.pp_enabled,
            "shapes": self.model.shapes,
            "hf_adapter": self.spec.hf,
            "hf_args": self.model_args,
            "optimizer_names": self.model.shared_weights.checkpoint_names(),
        }
        return CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            self.parts,
            self.optim.optimizers,
            self.optim.schedulers,
            self.dataloader,
            model_record,
            self.device,
        )

    def build_validator(self) -> Validator | None:
        """[validation]: the held-out set (this rank's share of each global batch) and the runner, with
        training's own forward and loss."""
        v, t = self.cfg.validation, self.cfg.training
        if not v.enabled:
            return None
        dp_rank = submesh(self.mesh, "dp").get_local_rank() if self.mesh is not None else 0
        batches = validate.ValidationData(
            validate.build_source(v, t, self.tokenizer),
            self.tokenizer,
            validation_seq_len(v, t),
            v.local_batch_size,
            dp_rank,
            self.dims.dp_degree,
            v.steps,
        )
        schedule = None
        if self.pipeline is not None:  # microbatches of the training size (the config checks it divides)
            n_micro = v.local_batch_size // self.cfg.parallelism.pipeline_parallel_microbatch_size
            schedule = forward_only_schedule(self.pipeline, self.parts, n_micro, self.device, self.loss_sum_fn)

        def loss_fn(inputs, labels, kwargs):
            with loss_parallel_context(self.loss_parallel):
                return self.forward_loss(inputs, labels, kwargs, schedule)

        return validate.Validator(
            v, t.steps, batches, self.parts, loss_fn, self.batch_rule, self.loss_ranks.sum, self.device
        )

    def prepare_step_state(self):
        """What every step needs: mixed precision, loss reduction, context-parallel positions, metrics."""
        t = self.cfg.training
        # Without FSDP there is no mixed-precision policy: autocast gives bf16 compute instead.
        use_autocast = not self.dims.fsdp_enabled and t.mixed_precision_param == "bfloat16"
        self.amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if use_autocast else nullcontext()
        self.loss_parallel = self.dims.tp_enabled and not self.cfg.parallelism.disable_loss_parallel
        # The data- and context-parallel ranks split a step's tokens: the valid labels are counted over
        # them, and the logged loss is the mean of their shares times their number (`log`).
        self.loss_ranks = LossRanks(
            submesh(self.mesh, "dp_cp") if self.mesh is not None else None,
            self.pipeline.pp_mesh.get_group() if self.pipeline is not None else None,
            self.pipeline.loss_src if self.pipeline is not None else 0,
        )
        self.cp_positions = None
        if self.dims.cp_enabled:
            assert self.mesh is not None  # cp > 1: more than one process
            self.cp_positions = local_positions(t.seq_len, self.dims.cp, self.mesh["cp"].get_local_rank())
        prepare_window = self.spec.prepare_window
        self.batch_rule = BatchRule(
            self.document_end_id,
            self.plan.attention.documents,
            t.ignore_cross_document_labels,
            self.cp_positions,
            partial(prepare_window, self.model_args) if prepare_window is not None else None,
            labels_to_forward=self.plan.loss_chunk_tokens > 0,
        )
        self.precompute_float8 = (
            "float8" in self.cfg.model.converters and self.cfg.float8.precompute_float8_dynamic_scale_for_fsdp
        )
        self.tokens_per_step = self.plan.global_batch_size * t.seq_len
        # Training FLOPs per token of a window without document boundaries (block_causal: the actual
        # documents of each step, `step_flops`).
        self.flops_per_token = self.spec.flops_per_token(self.model_args, t.seq_len)
        self.peak = MfuPeak.for_device(
            self.device, dist_utils.DTYPES[t.mixed_precision_param], self.cfg.metrics.device_peak_tflops
        )
        if self.pipeline is not None:
            assert self.model.step_loss is not None  # built with the pipeline
            zeros = torch.zeros(t.local_batch_size * self.plan.grad_accum_steps, t.seq_len, dtype=torch.long)
            with loss_parallel_context(self.loss_parallel), self.amp:
                warm_up_schedule(
                    self.pipeline, self.parts, self.model.step_loss, *self.batch_rule.prepare(zeros, zeros, self.device)
                )

    def phase(self, what: str):  # a start-up phase: said when it begins, timed
        return startup_phase(what, self.startup)

    def log_start(self):
        cfg, t = self.cfg, self.cfg.training
        logger.info(
            f"training {cfg.model.name} {cfg.model.flavor}: {self.spec.size(self.model_args).total:,} parameters, "
            f"vocab {self.model_args.vocab_size}, {self.flops_per_token / 1e6:.1f} MFLOPs/token, params "
            f"{t.mixed_precision_param}, {t.steps} steps"
        )
        logger.info(f"mesh: {self.dims.describe()} on {self.device.type}")
        logger.info(
            f"batch: global batch {self.plan.global_batch_size} x seq {t.seq_len} = {self.tokens_per_step:,} "
            f"tokens/step (local batch {t.local_batch_size}, {self.plan.grad_accum_steps} accumulation step(s)); loss "
            + (
                f"in chunks of {self.plan.loss_chunk_tokens} tokens"
                if self.plan.loss_chunk_tokens
                else "on the whole logits"
            )
        )
        logger.info(f"MFU peak: {self.peak.tflops:.3f} TFLOP/s {self.peak.source}")
        uses_bf16 = []
        if t.mixed_precision_param == "bfloat16":
            uses_bf16.append(("the model's matmuls", "--training.mixed_precision_param float32"))
        if cfg.optimizer.name == "Muon" and cfg.optimizer.muon_ns_dtype in (None, "bfloat16"):
            uses_bf16.append(("Muon's Newton-Schulz iterations", "--optimizer.muon_ns_dtype float32"))
        if self.device.type == "cpu" and uses_bf16 and (slow := slow_cpu_bfloat16(uses_bf16)):
            logger.warning(slow)
        if self.plan.memory_estimate:
            logger.info(self.plan.memory_estimate)
        if cfg.lr_scheduler.warmup_steps >= t.steps:
            logger.warning(
                f"lr_scheduler.warmup_steps ({cfg.lr_scheduler.warmup_steps}) is not below training.steps ({t.steps}): "
                f"the learning rate warms up for the whole run and never decays"
            )

    def train_step(self, step: int, data_iter) -> StepResult:
        """One optimizer step over the gradient-accumulation micro-batches. The step is taken only if
        its loss and gradient norm are finite on every rank; otherwise it is skipped
        (training.skip_nonfinite_steps) or the run stops, before the state can reach a checkpoint."""
        self.optim.zero_grad()
        self.replicas.start_step(step)
        loss_sum = torch.zeros((), device=self.device)
        micro_batches, waited = watchdog.read_batches(data_iter, self.plan.grad_accum_steps, step)
        self.data_wait_since_log += waited
        if self.pipeline is not None:  # the schedule takes them all at once, as microbatches
            micro_batches = [tuple(torch.cat(parts) for parts in zip(*micro_batches))]
        if self.batch_rule.block_causal:
            lengths = [n for batch in micro_batches for n in self.batch_rule.document_lengths(batch[0], *batch[2:])]
            self.flops_since_log += self.spec.flops_per_token(self.model_args, lengths) * self.tokens_per_step
        else:
            self.flops_since_log += self.flops_per_token * self.tokens_per_step
        # (inputs, labels[, doc_ids]) -> this rank's (inputs, labels, forward's keyword inputs) on the
        # device; with context parallel, the tokens at cp_positions of each sequence.
        micro_batches = [
            self.batch_rule.prepare(batch[0], batch[1], self.device, *batch[2:]) for batch in micro_batches
        ]
        scale = self.loss_ranks.scale([labels for _, labels, _ in micro_batches])
        for inputs, labels, kwargs in micro_batches:
            loss_sum += self.forward_backward(inputs, labels, kwargs, scale)
        self.model.shared_weights.sum_gradients()
        params = [p for part in self.parts for p in part.parameters()]
        self.replicas.average(params, loss_sum)  # over the live replica groups (fault_tolerance)
        grad_norm = dist_utils.clip_grad_norm_(
            params,
            self.cfg.training.max_norm,
            self.loss_ranks.pp_group,
            not_counted=self.model.shared_weights.duplicates(),
        )
        # One small all-reduce and one host sync per step: whether any rank's loss is non-finite (with
        # a pipeline only the last stage has one) and whether any rank received a stop signal.
        flags = torch.tensor(
            [0.0 if torch.isfinite(loss_sum) else 1.0, 1.0 if self.stop_signals.received else 0.0], device=self.device
        )
        dist_utils.max_over_ranks(flags)
        norm, loss_bad, stop = torch.cat([grad_norm.detach().float().reshape(1), flags]).tolist()
        lr = self.optim.lr
        finite = math.isfinite(norm) and not loss_bad
        committed = self.replicas.should_commit(step)  # False only when a replica group failed in the step
        if finite and committed:
            self.skipped_in_a_row = 0
            self.optimizer_step()
        elif committed:
            self.skip_step(step, "gradient norm" if not math.isfinite(norm) else "loss", norm)
        self.replicas.end_step(step)  # diloco: the replica groups' sync every fault_tolerance.sync_every steps
        signal_name = (self.stop_signals.received or "a stop signal (on another rank)") if stop else None
        return StepResult(loss_sum, norm, lr, not finite, signal_name)

    def skip_step(self, step: int, what: str, norm: float):
        """A non-finite step: stop the run, or (training.skip_nonfinite_steps) drop its gradients and
        statistics and only advance the learning-rate schedule, so that step N keeps step N's rate."""
        t = self.cfg.training
        if not t.skip_nonfinite_steps:
            raise UserError(
                f"training stopped at step {step}: the {what} is not finite (gradient norm {norm}: a bad batch, "
                f"too high a learning rate or an overflow); checkpoints hold only earlier steps. "
                f"training.skip_nonfinite_steps skips such steps instead"
            )
        self.skipped_in_a_row += 1
        self.checkpointer.counters["skipped_steps"] += 1
        if self.skipped_in_a_row >= t.max_skipped_steps_in_a_row:
            raise UserError(
                f"training stopped at step {step}: {self.skipped_in_a_row} steps in a row had a non-finite loss or "
                f"gradient norm (training.max_skipped_steps_in_a_row); checkpoints hold only earlier steps"
            )
        logger.warning(
            f"step {step}: the {what} is not finite (gradient norm {norm}); skipped the optimizer step "
            f"({self.checkpointer.counters['skipped_steps']} skipped so far)"
        )
        self.optim.zero_grad()
        self.optim.step_schedulers()
        if self.spec.post_skipped_step is not None:
            self.spec.post_skipped_step(self.parts, self.model.parallelize_inputs)

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict, scale: torch.Tensor
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch (with a pipeline, of all of them at once); returns
        its summed token loss times `scale` (LossRanks.scale), detached: summed over micro-batches and
        averaged over the loss ranks, that is the step's loss. `kwargs`: forward's keyword
        inputs (document ids, the family's own; batch.BatchRule)."""
        # With loss parallel the logits stay sharded over the vocabulary; the loss and its backward
        # must both run inside the context.
        with loss_parallel_context(self.loss_parallel):
            if self.pipeline is not None:
                is_first, is_last = self.pipeline.is_first, self.pipeline.is_last
                assert self.model.step_loss is not None  # built with the pipeline
                self.model.step_loss.scale = scale
                with self.amp:
                    loss = pipeline_step(self.pipeline.schedule, inputs, labels, is_first, is_last, kwargs)
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
        with self.amp:
            if schedule is not None:
                assert self.pipeline is not None  # the schedule runs its stages
                return pipeline_step(
                    schedule, inputs, labels, self.pipeline.is_first, self.pipeline.is_last, kwargs, forward_only=True
                )
            logits = self.parts[0](inputs, **kwargs)
        return self.loss_sum_fn(logits, labels)

    def optimizer_step(self):
        """Step the optimizers and LR schedules on the clipped gradients, then the model's own updates."""
        self.optim.step()
        if self.precompute_float8:
            from torchtitan.components.float8 import precompute_float8_scales

            # One fused amax/scale computation for all float8 weights, used by the next all-gather.
            for part in self.parts:
                precompute_float8_scales(part)
        if self.spec.post_optimizer_step is not None:
            self.spec.post_optimizer_step(self.parts, self.model.parallelize_inputs)

    def log(self, step: int, result: StepResult) -> dict:
        """Reduce the step's loss over ranks and write one metrics record."""
        loss_value = self.loss_ranks.mean(result.loss_sum)
        now = time.perf_counter()
        tps = self.tokens_since_log / (now - self.last_log_time)  # tokens per second on this device
        # Each device's share of the step's training FLOPs per second.
        tflops = self.flops_since_log / self.dims.world_size / (now - self.last_log_time) / 1e12
        record = {
            "step": step,
            "loss": loss_value,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tps": tps,
            "tflops": tflops,
            **self.peak.fields(tflops),  # mfu, peak_tflops, and mfu_note when the peak needs one
            "memory_gib": peak_memory_gib(self.device),
            "time": now - self.start_time,
            "tokens": step * self.tokens_per_step,
            "skipped_steps": self.checkpointer.counters["skipped_steps"],
            # Mean time a step waited for its batches since the previous record (data loading off
            # the critical path keeps it near zero).
            "data_wait_s": self.data_wait_since_log / max(step - self.last_log_step, 1),
            **self.replicas.fields(),
            **watchdog.straggler_fields(step),  # straggler_rank (components/watchdog.py)
        }
        if self.spec.metrics is not None:
            record.update(self.spec.metrics(self.parts, self.model.parallelize_inputs))
        # A mixture's share of each source so far, and the epoch each is in (data_share/I, data_epoch/I);
        # a loader of a fork's own (build_dataloader overridden) may have none.
        mixture_metrics = getattr(getattr(self.dataloader, "dataset", None), "mixture_metrics", None)
        if mixture_metrics is not None:
            record.update(mixture_metrics(step * self.plan.global_batch_size))
        self.metrics.log(record)
        self.history.append(record)
        self.last_log_time, self.tokens_since_log, self.flops_since_log = now + self.peak.probe_s, 0.0, 0.0
        self.data_wait_since_log, self.last_log_step = 0.0, step
        return record

    def validate(self, step: int) -> dict:
        """Held-out loss and perplexity (after the step's update, before its checkpoint); one metrics record.
        Its time is left out of the next step line's throughput."""
        assert self.validator is not None  # called when build_validator made one
        record = self.validator.run(step)
        self.metrics.log_validation(record)
        self.history.append(record)
        self.last_log_time += record["validation_time"]
        return record

    def checkpoint(self, step: int, stopping: bool = False):
        """Publish a finished background save; save when due or when the run stops early; export to
        Hugging Face at the end."""
        t = self.cfg.training
        self.checkpointer.maybe_publish()
        if self.checkpointer.should_save(step, t.steps) or (stopping and self.cfg.checkpoint.enable_checkpoint):
            self.checkpointer.save(step, step * self.tokens_per_step, last=step == t.steps)
        if step == t.steps and self.cfg.checkpoint.last_save_in_hf:
            self.checkpointer.export_hf(
                step, self.tokenizer.bos_id, self.tokenizer.eos_id, self.mesh, self.cfg.model.tokenizer_path
            )


def main(argv: list[str], trainer_cls: type[Trainer] | None = None) -> int:
    setup_logging()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker
        dist_utils.stop_with_launcher()
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
    dist_utils.exit_process(main(sys.argv[1:]))
