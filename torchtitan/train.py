"""The training loop. The only module that sees the whole JobConfig: each builder gets its section.

    torchrun --nproc_per_node 2 -m torchtitan.train --job.config_file train_configs/debug_model.toml

Build sequence: config -> preflight checks (no collectives) -> process group and mesh -> model on the
meta device -> parallelize -> materialize (to_empty + init_weights) -> tokenizer, data, optimizer,
LR schedule, metrics -> loop. User mistakes end the run with one message and exit code 2 on every
rank; nothing else is printed as a traceback unless it is a bug.

The model is reached only through its spec (torchtitan.models.common.spec.ModelSpec, from the registry).
`Trainer` runs one job; its loop calls named steps (build_model, build_optimizer, forward_backward,
optimizer_step, log, checkpoint) that a fork can override one at a time in a subclass and run with
`main(argv, trainer_cls=MyTrainer)`.
"""

import dataclasses
import gc
import importlib.util
import json
import logging
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.components.batch import BatchRule, valid_labels
from torchtitan.components.checkpoint import CheckpointManager, check_writable, preflight_checkpoint
from torchtitan.components.data import build_dataloader
from torchtitan.components.metrics import MetricsLogger, MfuPeak, peak_memory_gib
from torchtitan.components.optimizer import OptimizerGroup, check_muon_supported, check_param_groups
from torchtitan.components.profiling import maybe_profile
from torchtitan.components.run_lock import RunLock
from torchtitan.components.stop_signals import StopSignals
from torchtitan.components.tokenizer import Tokenizer, detect as detect_tokenizer
from torchtitan.components import validate
from torchtitan.config import HelpRequested, JobConfig, UserError, config_to_toml, load_config
from torchtitan.config.parallelism_sections import ZERO_BUBBLE_SCHEDULES
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.context_parallel import local_positions
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    Pipeline,
    attach_schedule,
    broadcast_loss,
    StepLoss,
    pipeline_step,
    plan_split,
    split_for_rank,
)
from torchtitan.distributed.parallelize import parallelize_model
from torchtitan.distributed.shared_weights import SharedWeights, build_shared_weights
from torchtitan.distributed.tensor_parallel import check_tp_divisibility, loss_parallel_context
from torchtitan.models.common.attention import attention_backend, set_attention_fn
from torchtitan.models.common.moe import check_expert_layer
from torchtitan.models.common.moe import overrides_from_config as moe_overrides
from torchtitan.models.registry import get_model_args, get_model_spec, import_custom_module
from torchtitan.models.common.spec import VOCAB_MULTIPLE, ModelSpec, ParallelizeInputs

logger = logging.getLogger("torchtitan")


@dataclass(frozen=True)
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed micro-batch losses (zero off the last pipeline stage)
    grad_norm: float  # global, before clipping
    lr: float  # the learning rate this step used
    skipped: bool  # non-finite and skipped (training.skip_nonfinite_steps)
    stop_signal: str | None  # a job.stop_signals signal reached some rank: stop after this step


@dataclass(frozen=True)
class Plan:
    """Everything decided before any process group exists."""

    parallel_dims: ParallelDims
    global_batch_size: int
    grad_accum_steps: int
    spec: ModelSpec
    memory_estimate: str | None = None  # [memory_estimation]: the estimate of this layout, one line


# Model args that shape no tensor, taken from the initial Hugging Face folder's config.json when the
# family has them.
HF_ADOPTED_FIELDS = ("rope_theta", "rope_scaling", "norm_eps", "tie_word_embeddings", "sliding_window",
                     "max_window_layers")


def model_args_for_run(spec, cfg: JobConfig, tokenizer_vocab: int):
    """The args of the model this job builds. Its vocabulary is the tokenizer's, padded
    (spec.args_for_training); where the initial weights come from a Hugging Face folder, that folder's
    vocab_size (checkpoints pad as they like: Qwen3 has 151,936 rows for 151,669 tokens) and the
    settings of HF_ADOPTED_FIELDS."""
    args = spec.args_for_training(cfg.model.flavor, tokenizer_vocab, cfg.training.seq_len, moe_overrides(cfg.moe),
                                  attention_overrides(cfg.model))
    if not cfg.checkpoint.initial_load_in_hf:
        return args
    from torchtitan.components.hf_checkpoint import HF_CONFIG, read_hf_config

    where = os.path.join(cfg.checkpoint.initial_load_path, HF_CONFIG)
    hf_vocab = read_hf_config(cfg.checkpoint.initial_load_path).get("vocab_size")
    if not isinstance(hf_vocab, int) or isinstance(hf_vocab, bool) or hf_vocab < 1:
        raise UserError(f"{where} has no positive integer vocab_size (got {hf_vocab!r}); is it a model's config.json?")
    if hf_vocab < tokenizer_vocab:
        raise UserError(
            f"{where} has vocab_size {hf_vocab:,}, fewer than the {tokenizer_vocab:,} tokens of model.tokenizer_path "
            f"{cfg.model.tokenizer_path}: the tokenizer would produce ids the weights have no row for; use the "
            "tokenizer that was published with these weights"
        )
    # The folder's settings that shape no tensor too: its rotary theta and scaling (Llama 3.1 and 3.2
    # scale theirs), norm epsilon, tied embeddings, and attention windows (unless [model] sets them),
    # so that the model computes what the weights were trained for. Shapes are checked against the
    # flavor's (check_hf_folder).
    hf_args = spec.hf.args_from_config(read_hf_config(cfg.checkpoint.initial_load_path))
    adopted = {name: getattr(hf_args, name) for name in HF_ADOPTED_FIELDS
               if not spec.missing_fields([name]) and getattr(cfg.model, name, None) is None}
    changed = {name: value for name, value in adopted.items() if getattr(args, name) != value}
    if changed:
        logger.info(f"from {where}, in place of flavor {cfg.model.flavor}'s: "
                    + ", ".join(f"{name} = {value}" for name, value in changed.items()))
    return dataclasses.replace(args, vocab_size=hf_vocab, **adopted)


# Model args that [model] may set, and what a family without that field lacks.
MODEL_OVERRIDES = {"sliding_window": "sliding-window attention", "max_window_layers": "sliding-window attention",
                   "mtp_depth": "multi-token prediction", "mtp_loss_weight": "multi-token prediction"}


def attention_overrides(model) -> dict:
    """The model args that [model] sets (sliding windows, multi-token prediction), where set."""
    return {name: getattr(model, name) for name in MODEL_OVERRIDES if getattr(model, name) is not None}


def check_attention(cfg: JobConfig, spec: ModelSpec, dims: ParallelDims) -> None:
    """[model] attention options against the device and the family (before any model is built)."""
    m = cfg.model
    backend = "flex" if m.use_flex_attn else m.attn_backend
    if backend == "flex" and dist_utils.device_type() != "cuda":
        raise UserError(
            f"model.{'use_flex_attn = true' if m.use_flex_attn else 'attn_backend = flex'} asks for FlexAttention, "
            f"which cannot train on {dist_utils.device_type()}: FlexAttention does not support backward on CPU "
            f"(torch {torch.__version__.split('+')[0]}); use model.attn_backend = 'sdpa' or 'split' (or 'auto')"
        )
    if backend != "auto" and spec.cp_attention is None:
        raise UserError(
            f"model.attn_backend = {backend!r}: model '{spec.name}' names no attention module in its spec "
            f"(cp_attention), so its kernel cannot be chosen; leave model.attn_backend = 'auto'"
        )
    if m.attn_mask_type == "block_causal" and not spec.document_masks:
        raise UserError(
            f"model.attn_mask_type = 'block_causal': model '{spec.name}' cannot mask attention at document "
            f"boundaries (its spec does not set document_masks); use 'causal'"
        )
    overrides = attention_overrides(m)
    missing = spec.missing_fields(overrides)
    if missing:
        raise UserError(
            f"model.{missing[0]} is set, but model '{spec.name}' has no {MODEL_OVERRIDES[missing[0]]} (its args have "
            f"no {missing[0]} field); remove it"
        )
    if "max_window_layers" in overrides:
        args = spec.args_for_training(m.flavor, 1, cfg.training.seq_len, None, overrides)
        if args.sliding_window is None:
            raise UserError(
                f"model.max_window_layers = {m.max_window_layers} has no effect: model {spec.name} {m.flavor} has no "
                f"sliding window; set model.sliding_window too, or remove it"
            )
        if args.max_window_layers >= args.n_layers:
            raise UserError(
                f"model.max_window_layers = {m.max_window_layers}: the model has {args.n_layers} layers, so none "
                f"would have the sliding window; set it below {args.n_layers}"
            )


def check_mtp_window(cfg: JobConfig, spec: ModelSpec, model_args) -> None:
    """Multi-token prediction against the training window: depth k predicts, at each position, the
    token k positions further on, built from the whole window (spec.prepare_window, before context
    parallel cuts it, so the bound is training.seq_len for any CP degree). A depth past the window
    has no target at any position (and its label shift no longer fits the window). Validation
    windows may be shorter: there only the next-token labels count."""
    depth, seq = getattr(model_args, "mtp_depth", 0) or 0, cfg.training.seq_len
    if depth > seq:
        where = (f"model.mtp_depth = {depth}" if cfg.model.mtp_depth is not None
                 else f"model {spec.name} {cfg.model.flavor} has mtp_depth = {depth}, which")
        raise UserError(
            f"{where} is more than training.seq_len = {seq}: depth k predicts the token k positions ahead of each "
            f"position, which a {seq}-token window does not hold for k > {seq}; set model.mtp_depth to {seq} or "
            "less, or raise training.seq_len"
        )


_META_MODEL: dict = {}


def meta_model(spec: ModelSpec, model_args) -> nn.Module:
    """The model of `model_args` on the meta device, for checks that read its structure (blocks,
    experts, parameter names) and change nothing. The last one is kept: a large model takes about a
    second to build even on meta, and the layout planner runs preflight on many layouts of one model."""
    try:
        key = (spec.name, spec.model_cls, model_args)
        hash(key)
    except TypeError:  # args with a list or dict field: built each time
        key = None
    if key is None or key not in _META_MODEL:
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        if key is None:
            return model
        _META_MODEL.clear()
        _META_MODEL[key] = model
    return _META_MODEL[key]


def check_compile(cfg: JobConfig, spec: ModelSpec, model_args, dims: ParallelDims) -> None:
    """training.compile with what torch 2.13 cannot compile here (measured: each crashed at step 1)."""
    if spec.expert_layers is not None and spec.expert_layers(meta_model(spec, model_args)):
        # Dynamo cannot trace the experts' per-forward token bookkeeping (torch._C._current_graph_task_id),
        # and the compiled torch._grouped_mm takes bf16 only.
        raise UserError(
            f"training.compile does not support the mixture-of-experts blocks of model {spec.name} "
            f"{cfg.model.flavor} yet (they fail to trace at the first step); turn training.compile off, or "
            "choose a dense flavor"
        )
    if dims.tp_enabled and dist_utils.device_type() == "cpu":
        # DTensor's redistribute backward fails inside compiled blocks ("'Tensor' object has no attribute
        # '_local_tensor'"), for every family; on CUDA, where async TP needs both, it is untested here.
        raise UserError(
            f"training.compile with parallelism.tensor_parallel_degree = {dims.tp} fails on the CPU in the "
            "backward of tensor-parallel blocks; turn training.compile off, or use FSDP (or PP) instead of TP"
        )


def preflight(cfg: JobConfig, world_size: int) -> Plan:
    """Checks that need no collectives: degrees against the world size, batch arithmetic, the model
    name and flavor against the parallelisms, the tokenizer file, the dump and checkpoint folders.
    Raises UserError; run identically on every rank (and once by run_train.sh before launch)."""
    import_custom_module(cfg.experimental.custom_import)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    t = cfg.training
    global_batch, accum = dims.batch(t.local_batch_size, t.global_batch_size)
    if t.enable_cpu_offload:
        if dist_utils.device_type() != "cuda":
            raise UserError(
                "training.enable_cpu_offload moves parameters, gradients and optimizer state from GPU memory to "
                "host memory; this job runs on the CPU, where they already are: remove the option"
            )
        if not dims.fsdp_enabled:
            raise UserError(
                "training.enable_cpu_offload works through FSDP, but parallelism.data_parallel_shard_degree is "
                f"{dims.dp_shard}; shard over 2 or more ranks, or turn offload off"
            )
    spec = get_model_spec(cfg.model.name)
    flavor_args = get_model_args(cfg.model.name, cfg.model.flavor)
    overrides = moe_overrides(cfg.moe)
    if overrides and getattr(flavor_args, "moe", None) is None:
        raise UserError(
            f"[moe] sets {', '.join(overrides)}, but model {spec.name} {cfg.model.flavor} has no mixture of experts; "
            f"remove them or choose an MoE flavor"
        )
    check_attention(cfg, spec, dims)
    model_args = spec.args_for_training(cfg.model.flavor, flavor_args.vocab_size, t.seq_len, overrides,
                                        attention_overrides(cfg.model))
    check_mtp_window(cfg, spec, model_args)
    # A missing path, a folder without tokenizer.json (cheap; Tokenizer reads the content, which
    # torchtitan.preflight does before launch).
    detect_tokenizer(cfg.model.tokenizer_path)
    # The model as built, where its vocabulary matters before launch: TP splits it, and Hugging Face
    # weights must have a row for every token.
    run_args = (model_args_for_run(spec, cfg, Tokenizer(cfg.model.tokenizer_path).vocab_size)
                if dims.tp_enabled or cfg.checkpoint.initial_load_in_hf else None)
    if dims.tp_enabled:
        if spec.tp_plan is None:
            raise UserError(
                f"model '{spec.name}' has no tensor-parallel plan in its spec; set parallelism.tensor_parallel_degree = 1"
            )
        if cfg.parallelism.enable_async_tensor_parallel and dist_utils.device_type() != "cuda":
            raise UserError(
                "parallelism.enable_async_tensor_parallel uses CUDA symmetric memory; this job runs on the CPU: "
                "turn it off"
            )
        check_tp_divisibility(spec.tp_sizes(run_args), dims.tp, t.seq_len)
    if dims.cp_enabled and spec.cp_attention is None:
        raise UserError(
            f"model '{spec.name}' does not support context parallel (its spec names no attention to replace); "
            f"set parallelism.context_parallel_degree = 1"
        )
    if dims.pp_enabled:
        plan_split(spec.pipeline, model_args.n_layers, dims.pp, cfg.parallelism)
        schedule = cfg.parallelism.pipeline_parallel_schedule
        if schedule.lower() in ZERO_BUBBLE_SCHEDULES and spec.extra_blocks is not None:
            extra = len(spec.extra_blocks(meta_model(spec, model_args)))
            if extra:
                # Measured: their second backward pass (the weights') finds the graph already freed.
                raise UserError(
                    f"parallelism.pipeline_parallel_schedule = {schedule} splits each backward into an input and a "
                    f"weight pass, which model {spec.name}'s {extra} block(s) after its layers (e.g. multi-token "
                    f"prediction) do not support; choose 1F1B or Interleaved1F1B, or remove those blocks "
                    f"(for deepseek_v3: model.mtp_depth = 0)"
                )
    if dims.ep_enabled:
        expert_layers = spec.expert_layers(meta_model(spec, model_args)) if spec.expert_layers is not None else []
        if not expert_layers:
            raise UserError(
                f"parallelism.expert_parallel_degree = {dims.ep} splits the experts of a mixture-of-experts model, "
                f"but model {spec.name} {cfg.model.flavor} has none; set it to 1 (or choose an MoE flavor)"
            )
        for layer in expert_layers:
            try:
                check_expert_layer(layer)
            except TypeError as e:
                raise UserError(f"model {spec.name} cannot run expert parallel: {e}") from None
    if t.compile:
        check_compile(cfg, spec, model_args, dims)
    if spec.hf is None and (cfg.checkpoint.last_save_in_hf or cfg.checkpoint.initial_load_in_hf):
        raise UserError(
            f"model '{spec.name}' has no Hugging Face adapter in its spec, so checkpoint.last_save_in_hf and "
            "checkpoint.initial_load_in_hf cannot be used; turn them off"
        )
    if cfg.checkpoint.initial_load_in_hf and spec.hf is not None:
        from torchtitan.components.hf_checkpoint import check_hf_folder, meta_shapes

        # From the files' headers: the family, missing files or tensors, dtypes, shapes.
        check_hf_folder(cfg.checkpoint.initial_load_path, spec.hf, meta_shapes(spec, run_args), run_args)
    if spec.validate is not None:
        spec.validate(model_args, dims)
    check_muon_supported(cfg.optimizer, spec.name, spec.adamw_params)
    if cfg.optimizer.param_groups:  # every pattern matches a parameter of the whole model
        check_param_groups(meta_model(spec, model_args), cfg.optimizer)
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise UserError("metrics.enable_wandb needs the wandb package: pip install wandb (or turn it off)")
    check_writable(cfg.job.dump_folder, "the config and metrics")
    preflight_checkpoint(
        cfg.checkpoint, cfg.job.dump_folder, world_size, dist_utils.device_type(), t.seq_len, global_batch
    )
    validate.preflight_validation(cfg, dims.dp_degree)  # the validation set holds a global batch
    memory = None
    if cfg.memory_estimation.enabled:
        from torchtitan.planner.plan import check_memory

        memory = check_memory(cfg, world_size, dist_utils.device_type(),
                              int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    return Plan(dims, global_batch, accum, spec, memory)


def set_determinism(seed: int, deterministic: bool):
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


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


def take_run_lock(dump_folder: str, rank: int) -> RunLock | None:
    """Rank 0 locks the dump folder for the run; every rank stops with the reason if it cannot."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = RunLock(dump_folder)
        except UserError as e:
            error = str(e)
    if torch.distributed.is_initialized():
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise UserError(error)
    return lock


class Trainer:
    """One training job, read top to bottom in `run`. Each step is a method a subclass may replace."""

    def __init__(self, cfg: JobConfig, plan: Plan, device: torch.device, rank: int):
        self.cfg, self.plan, self.device, self.rank = cfg, plan, device, rank
        self.spec = plan.spec
        self.dims = plan.parallel_dims
        self.history: list[dict] = []

    # ---- the job, top to bottom -------------------------------------------------------------

    def run(self) -> list[dict]:
        cfg, t = self.cfg, self.cfg.training
        # From here on a scheduler's stop signal ends the run after a step, with a checkpoint.
        self.stop_signals = StopSignals(cfg.job.stop_signals, cfg.job.stop_grace_seconds)
        try:
            return self._run()
        finally:
            self.stop_signals.restore()

    def _run(self) -> list[dict]:
        cfg, t = self.cfg, self.cfg.training
        set_determinism(t.seed, t.deterministic)
        self.write_config()
        self.mesh = self.dims.build_mesh(self.device.type)
        self.startup: dict[str, float] = {}
        with self.phase("opening the data"):
            self.tokenizer = Tokenizer(cfg.model.tokenizer_path)
            self.dataloader = self.build_dataloader()
            self.document_end_id = self.data_document_end()
        with self.phase("building the model"):
            self.parts, self.pipeline = self.build_model()
            self.optim = self.build_optimizer()
            self.checkpointer = self.build_checkpointer()
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed()
            return []
        with self.phase("loading the checkpoint"):
            start_step, _ = self.checkpointer.load()
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
            cfg.metrics, cfg.job.dump_folder, write=self.rank == 0, append=start_step > 0,
            color=not cfg.metrics.disable_color_printing and sys.stderr.isatty(), total_steps=t.steps,
            start_step=start_step, run_config=asdict(cfg),
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
                        self.log_startup()
                    # Tensor-, context- and pipeline-parallel peers share their data-parallel group's
                    # batch: count each token once, spread over all devices.
                    self.tokens_since_log += self.tokens_per_step / self.dims.world_size
                    if step == 1 or step % cfg.metrics.log_freq == 0 or step == t.steps or result.stop_signal:
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
        if stopped_at is not None:
            saved = "its checkpoint is saved" if cfg.checkpoint.enable_checkpoint else "checkpointing is off: nothing saved"
            logger.info(f"stopped by {self.stop_signals.received} after step {stopped_at} of {t.steps}; {saved}")
        else:
            logger.info(f"training done: {t.steps} steps in {time.perf_counter() - self.start_time:.1f}s")
        return self.history

    # ---- building ---------------------------------------------------------------------------

    def write_config(self):
        if self.rank == 0:
            os.makedirs(self.cfg.job.dump_folder, exist_ok=True)
            resolved = config_to_toml(self.cfg)
            path = os.path.join(self.cfg.job.dump_folder, "config.toml")
            if os.path.isfile(path) and open(path).read() != resolved:
                keep_earlier(path, "config")
            with open(path, "w") as f:
                f.write(resolved)
            if self.cfg.job.print_args:
                logger.info(f"resolved config ({self.cfg.job.config_file or 'defaults'}):\n{resolved}")

    def build_dataloader(self):
        dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None else 0
        return build_dataloader(self.cfg.training, self.tokenizer, dp_rank, self.dims.dp_degree,
                                self.plan.global_batch_size, pin_memory=self.device.type == "cuda",
                                gather=dist_utils.gather_objects)

    def data_document_end(self) -> int | None:
        """The token that ends each document in the training data, where the run needs document
        boundaries (block_causal attention, ignore_cross_document_labels). A loader whose dataset
        sets `yields_document_ids` gives (inputs, labels, doc_ids) batches instead (batch.BatchRule)."""
        dataset = getattr(self.dataloader, "dataset", None)
        end = getattr(dataset, "document_end_id", None)
        if getattr(dataset, "yields_document_ids", False):
            return end
        needs = [what for what, on in (("model.attn_mask_type = 'block_causal'",
                                        self.cfg.model.attn_mask_type == "block_causal"),
                                       ("training.ignore_cross_document_labels",
                                        self.cfg.training.ignore_cross_document_labels)) if on]
        if needs and end is None:
            raise UserError(
                f"{' and '.join(needs)} needs the document boundaries of the training data, but its loader "
                f"({type(self.dataloader).__name__}) carries no document boundaries: its dataset has no "
                f"document_end_id (the token that ends every document) and does not set yields_document_ids "
                f"(batches of inputs, labels and document ids); give it one, or use 'causal' attention and "
                f"count every label"
            )
        return end

    def build_model(self) -> tuple[list[nn.Module], Pipeline | None]:
        """This rank's model parts (one, or its pipeline stages), parallelized and initialized."""
        cfg, t = self.cfg, self.cfg.training
        self.model_args = model_args_for_run(self.spec, cfg, self.tokenizer.vocab_size)
        tokens, vocab = self.tokenizer.vocab_size, self.model_args.vocab_size
        logger.info(
            f"vocab {vocab:,} from the {self.tokenizer.kind} tokenizer ({tokens:,} tokens)" if vocab == tokens else
            f"vocab {vocab:,}: the {self.tokenizer.kind} tokenizer's {tokens:,} tokens padded to "
            + ("the initial Hugging Face weights' vocab_size" if cfg.checkpoint.initial_load_in_hf
               else f"a multiple of {VOCAB_MULTIPLE}")
            + f" (ids {tokens:,}-{vocab - 1:,} are never produced)"
        )
        # Built on the meta device, so even the largest flavor costs nothing until materialized.
        with torch.device("meta"):
            model = self.spec.model_cls(self.model_args)
        if "float8" in cfg.model.converters:
            from torchtitan.components.float8 import convert_to_float8

            # Before parallelizing: FSDP then shards the float8 weights.
            convert_to_float8(model, cfg.float8, self.spec.high_precision)
        if cfg.model.print_after_conversion and self.rank == 0:
            logger.info(f"model after conversion ({', '.join(cfg.model.converters) or 'no converters'}):\n{model}")
        self.model_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        pipeline, parts = None, [model]
        if self.dims.pp_enabled:
            parts, pipeline = split_for_rank(model, self.spec.pipeline, cfg.parallelism, self.mesh["pp"])
        self.set_attention(parts)
        expert_mesh = self.dims.build_expert_mesh(self.device.type) if self.dims.ep_enabled else None
        self.parallelize_inputs = inputs = ParallelizeInputs(
            self.dims, self.mesh, cfg.parallelism, t, cfg.activation_checkpoint, expert_mesh
        )
        parts = [parallelize_model(part, inputs, self.spec) for part in parts]
        for part in parts:
            # With CPU offload, FSDP keeps the sharded parameters in host memory; buffers live on the device.
            part.to_empty(device="cpu" if t.enable_cpu_offload else self.device)
            part.init_weights(seed=t.seed, buffer_device=self.device)
            part.train()
        if self.device.type == "cpu":
            dist_utils.release_host_memory()  # init drew each parameter whole, then kept its part
        self.shared_weights = SharedWeights()
        if pipeline is not None and pipeline.ties:
            self.shared_weights = build_shared_weights(pipeline.ties, parts, pipeline.stage_ids,
                                                       pipeline.rank_of_stage, self.mesh)
            self.shared_weights.copy_canonical_values()
            logger.info("weights shared across pipeline stages, one copy per stage kept equal: "
                        + "; ".join(" = ".join(tie[s] for s in sorted(tie)) for tie in pipeline.ties))
        if pipeline is not None:
            # Gradient accumulation under a pipeline: one schedule step runs all of an optimizer step's
            # micro-batches as more microbatches (the schedule divides the gradients by their count
            # once; a step per micro-batch would divide the earlier ones again).
            batch = t.local_batch_size * self.plan.grad_accum_steps
            self.step_loss = StepLoss(self.spec.loss_sum_fn)
            attach_schedule(pipeline, parts, cfg.parallelism, batch, self.device, self.step_loss)
        return parts, pipeline

    def set_attention(self, parts: list[nn.Module]):
        """The attention kernel of every block (model.attn_backend), said once; context parallel then
        replaces it with its ring attention, which applies the same mask."""
        m = self.cfg.model
        masked = m.attn_mask_type == "block_causal" or getattr(self.model_args, "sliding_window", None) is not None
        mask = m.attn_mask_type + (f" with sliding windows of {self.model_args.sliding_window}"
                                   if getattr(self.model_args, "sliding_window", None) else "")
        if self.spec.cp_attention is None:
            logger.info(f"attention: {mask}, the model's own kernel")
            return
        name, fn = attention_backend("flex" if m.use_flex_attn else m.attn_backend, self.device.type, masked,
                                     m.attn_mask_type == "block_causal", self.cfg.training.seq_len)
        for part in parts:
            set_attention_fn(part, self.spec.cp_attention, fn, self.spec.blocks(part))
        ring = f"; context parallel's ring attention ({self.cfg.parallelism.context_parallel_rotate_method})" \
            if self.dims.cp_enabled else ""
        logger.info(f"attention: {mask}, {name} kernel (model.attn_backend = {m.attn_backend!r}){ring}")

    def build_optimizer(self) -> OptimizerGroup:
        whole = None
        if self.dims.pp_enabled:
            # The parameter groups are decided on the whole model's names and modules (a stage holds a part).
            with torch.device("meta"):
                whole = self.spec.model_cls(self.model_args)
        optim = OptimizerGroup(self.parts, self.cfg.optimizer, self.cfg.lr_scheduler, self.cfg.training.steps,
                               whole_model=whole, adamw_params=self.spec.adamw_params or ())
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
            "shapes": self.model_shapes,
            "hf_adapter": self.spec.hf,
            "hf_args": self.model_args,
            "optimizer_names": self.shared_weights.checkpoint_names(),
        }
        return CheckpointManager(
            cfg.checkpoint, cfg.job.dump_folder, self.parts, self.optim.optimizers, self.optim.schedulers,
            self.dataloader, model_record, self.device,
        )

    def build_validator(self) -> "validate.Validator | None":
        """[validation]: the held-out set (this rank's share of each global batch) and the runner."""
        v, t = self.cfg.validation, self.cfg.training
        if not v.enabled:
            return None
        dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None else 0
        seq_len = t.seq_len if v.seq_len == -1 else v.seq_len
        batches = validate.ValidationData(
            validate.build_source(v, t, self.tokenizer), self.tokenizer, seq_len, v.local_batch_size, dp_rank, self.dims.dp_degree, v.steps
        )
        return validate.Validator(
            v, t.steps, batches, self.parts, self.spec.loss_sum_fn, self.device, self.amp, self.loss_parallel,
            self.batch_rule, self.loss_mesh, self.pipeline, self.cfg.parallelism,
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
        self.loss_mesh = self.mesh["dp_cp"] if self.mesh is not None else None
        self.cp_positions = None
        if self.dims.cp_enabled:
            self.cp_positions = local_positions(t.seq_len, self.dims.cp, self.mesh["cp"].get_local_rank())
        prepare_window = self.spec.prepare_window
        self.batch_rule = BatchRule(
            self.document_end_id, self.cfg.model.attn_mask_type == "block_causal", t.ignore_cross_document_labels,
            self.cp_positions, partial(prepare_window, self.model_args) if prepare_window is not None else None,
        )
        self.pp_group = self.pipeline.pp_mesh.get_group() if self.pipeline is not None else None
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
            self.warm_up_pipeline()

    def warm_up_pipeline(self):
        """torch's pipeline schedules infer the stages' tensor shapes with a real forward and backward
        inside their first step. Done here once, on a batch of zeros with the model in eval mode and
        the gradients dropped, so that modules that keep training statistics (an MoE's token counts)
        see only the tokens they train on."""
        t = self.cfg.training
        zeros = torch.zeros(t.local_batch_size * self.plan.grad_accum_steps, t.seq_len, dtype=torch.long)
        zeros, labels, kwargs = self.batch_rule.prepare(zeros, zeros, self.device)
        self.step_loss.scale = torch.ones((), device=self.device)
        for part in self.parts:
            part.eval()
        with loss_parallel_context(self.loss_parallel), self.amp:
            pipeline_step(self.pipeline.schedule, zeros, labels, self.pipeline.is_first, self.pipeline.is_last,
                          kwargs)
        for part in self.parts:
            part.train()
            part.zero_grad(set_to_none=True)

    @contextmanager
    def phase(self, what: str):
        """A start-up phase: said when it begins (a large model or checkpoint takes minutes), timed."""
        logger.info(f"{what}...")
        start = time.perf_counter()
        yield
        self.startup[what] = time.perf_counter() - start

    def log_startup(self):
        phases = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.startup.items())
        since = process_age()
        logger.info(f"start-up: {phases}" + (f"; first step done {since:.1f}s after the process started" if since else ""))

    def log_start(self):
        cfg, t = self.cfg, self.cfg.training
        logger.info(
            f"training {cfg.model.name} {cfg.model.flavor}: {self.spec.size(self.model_args).total:,} parameters, "
            f"vocab {self.model_args.vocab_size}, {self.flops_per_token / 1e6:.1f} MFLOPs/token | "
            f"{self.dims.describe()} on {self.device.type} | global batch {self.plan.global_batch_size} x seq "
            f"{t.seq_len} = {self.tokens_per_step:,} tokens/step (local batch {t.local_batch_size}, "
            f"{self.plan.grad_accum_steps} accumulation step(s)) | params {t.mixed_precision_param} | peak "
            f"{self.peak.tflops:.3f} TFLOP/s {self.peak.source} | {t.steps} steps"
        )
        if self.plan.memory_estimate:
            logger.info(self.plan.memory_estimate)
        if cfg.lr_scheduler.warmup_steps > t.steps:
            logger.warning(
                f"lr_scheduler.warmup_steps ({cfg.lr_scheduler.warmup_steps}) exceeds training.steps ({t.steps}): "
                f"the peak learning rate is reached on the last step"
            )

    # ---- one step -----------------------------------------------------------------------------

    def train_step(self, step: int, data_iter) -> StepResult:
        """One optimizer step over the gradient-accumulation micro-batches. The step is taken only if
        its loss and gradient norm are finite on every rank; otherwise it is skipped
        (training.skip_nonfinite_steps) or the run stops, before the state can reach a checkpoint."""
        self.optim.zero_grad()
        loss_sum = torch.zeros((), device=self.device)
        waited = time.perf_counter()
        micro_batches = [next(data_iter) for _ in range(self.plan.grad_accum_steps)]
        self.data_wait_since_log += time.perf_counter() - waited
        if self.pipeline is not None:  # the schedule takes them all at once, as microbatches
            micro_batches = [tuple(torch.cat(parts) for parts in zip(*micro_batches))]
        if self.batch_rule.block_causal:
            lengths = [n for batch in micro_batches for n in self.batch_rule.document_lengths(batch[0], *batch[2:])]
            self.flops_since_log += self.spec.flops_per_token(self.model_args, lengths) * self.tokens_per_step
        else:
            self.flops_since_log += self.flops_per_token * self.tokens_per_step
        # (inputs, labels[, doc_ids]) -> this rank's (inputs, labels, forward's keyword inputs) on the
        # device; with context parallel, the tokens at cp_positions of each sequence.
        micro_batches = [self.batch_rule.prepare(batch[0], batch[1], self.device, *batch[2:]) for batch in micro_batches]
        scale = self.loss_scale([labels for _, labels, _ in micro_batches])
        for inputs, labels, kwargs in micro_batches:
            loss_sum += self.forward_backward(inputs, labels, kwargs, scale)
        self.shared_weights.sum_gradients()
        params = [p for part in self.parts for p in part.parameters()]
        grad_norm = dist_utils.clip_grad_norm_(params, self.cfg.training.max_norm, self.pp_group,
                                               not_counted=self.shared_weights.duplicates())
        # One small all-reduce and one host sync per step: whether any rank's loss is non-finite (with
        # a pipeline only the last stage has one) and whether any rank received a stop signal.
        flags = torch.tensor(
            [0.0 if torch.isfinite(loss_sum) else 1.0, 1.0 if self.stop_signals.received else 0.0], device=self.device
        )
        dist_utils.max_over_ranks(flags)
        norm, loss_bad, stop = torch.cat([grad_norm.detach().float().reshape(1), flags]).tolist()
        lr = self.optim.lr
        finite = math.isfinite(norm) and not loss_bad
        if finite:
            self.skipped_in_a_row = 0
            self.optimizer_step()
        else:
            self.skip_step(step, "gradient norm" if not math.isfinite(norm) else "loss", norm)
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
            self.spec.post_skipped_step(self.parts, self.parallelize_inputs)

    def loss_scale(self, labels: list[torch.Tensor]) -> torch.Tensor:
        """What a micro-batch's summed token loss is multiplied by: the number of data- and
        context-parallel ranks over the step's count of valid labels on all of them. Their gradients
        are averaged (FSDP/DDP), so the step's gradient is that of the sum of all token losses over
        that count. One scalar all-reduce; no host sync."""
        count = sum(valid_labels(x) for x in labels)
        ranks = 1
        if self.loss_mesh is not None:
            torch.distributed.all_reduce(count, group=self.loss_mesh.get_group())
            ranks = self.loss_mesh.size()
        return (ranks / count.clamp(min=1)).float()

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict,
                         scale: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch (with a pipeline, of all of them at once); returns
        its summed token loss times `scale` (loss_scale), detached: summed over micro-batches and
        averaged over the ranks of loss_mesh, that is the step's loss. `kwargs`: forward's keyword
        inputs (document ids, the family's own; batch.BatchRule)."""
        # With loss parallel the logits stay sharded over the vocabulary; the loss and its backward
        # must both run inside the context.
        with loss_parallel_context(self.loss_parallel):
            if self.pipeline is not None:
                is_first, is_last = self.pipeline.is_first, self.pipeline.is_last
                self.step_loss.scale = scale
                with self.amp:
                    loss = pipeline_step(self.pipeline.schedule, inputs, labels, is_first, is_last, kwargs)
                if loss is None:
                    loss = torch.zeros((), device=self.device)
            else:
                with self.amp:
                    logits = self.parts[0](inputs, **kwargs)
                loss = self.spec.loss_sum_fn(logits, labels) * scale
                loss.backward()
        loss = loss.detach()
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def optimizer_step(self):
        """Step the optimizers and LR schedules on the clipped gradients, then the model's own updates."""
        self.optim.step()
        if self.precompute_float8:
            from torchtitan.components.float8 import precompute_float8_scales

            # One fused amax/scale computation for all float8 weights, used by the next all-gather.
            for part in self.parts:
                precompute_float8_scales(part)
        if self.spec.post_optimizer_step is not None:
            self.spec.post_optimizer_step(self.parts, self.parallelize_inputs)

    # ---- after a step -------------------------------------------------------------------------

    def log(self, step: int, result: StepResult) -> dict:
        """Reduce the step's loss over ranks and write one metrics record."""
        loss_sum = result.loss_sum
        if self.pipeline is not None:
            loss_sum = broadcast_loss(loss_sum, self.pp_group, self.pipeline.loss_src)
        loss_value = dist_utils.dist_mean(loss_sum, self.loss_mesh)
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
        }
        if self.spec.metrics is not None:
            record.update(self.spec.metrics(self.parts, self.parallelize_inputs))
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
            self.checkpointer.export_hf(step, self.tokenizer.bos_id, self.tokenizer.eos_id, self.mesh,
                                        self.cfg.model.tokenizer_path)


def keep_earlier(path: str, what: str):
    """Rename an earlier run's file to {path}.N (the first free N) instead of overwriting it."""
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.rename(path, f"{path}.{n}")
    logger.warning(f"{path} holds an earlier run's {what}; kept it as {path}.{n}")


def rewind_metrics(path: str, start_step: int):
    """Before a run writes metrics.jsonl: a fresh start keeps the earlier file as metrics.jsonl.N; a
    resume from step S keeps the records up to S, and the whole earlier file as .N when it also holds
    later steps (a restart redoes them), so the file reads as one run."""
    if start_step == 0:
        keep_earlier(path, "metrics")
        return
    with open(path) as f:
        lines = f.read().splitlines()
    def before_resume(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= start_step
        except ValueError:  # a line cut short by a kill
            return False

    kept = [line for line in lines if before_resume(line)]
    if len(kept) == len(lines):
        return
    keep_earlier(path, "metrics")
    with open(path, "w") as f:
        f.writelines(line + "\n" for line in kept)


def process_age() -> float | None:
    """Seconds since this process started (Linux; None elsewhere): start-up including imports."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started_ticks / os.sysconf("SC_CLK_TCK")


def setup_logging():
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def main(argv: list[str], trainer_cls: type[Trainer] | None = None) -> int:
    setup_logging()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker
        dist_utils.stop_with_launcher()
    try:
        train(load_config(argv), trainer_cls)
    except HelpRequested as h:
        if os.environ.get("RANK", "0") == "0":
            print(h.text)
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    dist_utils.exit_process(main(sys.argv[1:]))
