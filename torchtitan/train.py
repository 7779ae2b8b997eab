"""The training loop. The only module that sees the whole JobConfig: each builder gets its section.

    torchrun --nproc_per_node 2 -m torchtitan.train --job.config_file train_configs/debug_model.toml

Build sequence: config -> preflight checks (no collectives) -> process group and mesh -> model on the
meta device -> parallelize -> materialize (to_empty + init_weights) -> tokenizer, data, optimizer,
LR schedule, metrics -> loop. User mistakes end the run with one message and exit code 2 on every
rank; nothing else is printed as a traceback unless it is a bug.
"""

import gc
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpoint import CheckpointManager, check_writable, preflight_checkpoint
from torchtitan.components.data import build_dataloader
from torchtitan.components.metrics import MetricsLogger, device_peak_tflops, peak_memory_gib
from torchtitan.components.optimizer import OptimizerGroup
from torchtitan.components.profiling import maybe_profile
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config import HelpRequested, JobConfig, UserError, config_to_toml, load_config
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.context_parallel import local_positions, shard_sequence
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    Pipeline,
    attach_schedule,
    broadcast_loss,
    pipeline_step,
    plan_split,
    pp_clip_grad_norm_,
    split_for_rank,
)
from torchtitan.distributed.tensor_parallel import check_tp_divisibility, loss_parallel_context
from torchtitan.models.llama3.model import count_params, flops_per_token
from torchtitan.models.registry import get_model_args, get_model_spec

logger = logging.getLogger("torchtitan")


@dataclass(frozen=True)
class Plan:
    """Everything decided before any process group exists."""

    parallel_dims: ParallelDims
    global_batch_size: int
    grad_accum_steps: int


def preflight(cfg: JobConfig, world_size: int) -> Plan:
    """Checks that need no collectives: degrees against the world size, batch arithmetic, the model
    name and flavor, the tokenizer file. Raises UserError; run identically on every rank."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    t = cfg.training
    per_step = t.local_batch_size * dims.dp_degree
    global_batch = per_step if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_step:
        raise UserError(
            f"training.global_batch_size = {global_batch} is not a multiple of local_batch_size x "
            f"data-parallel degree = {t.local_batch_size} x {dims.dp_degree} = {per_step}; use a multiple "
            f"of {per_step} (the quotient is the number of gradient-accumulation steps)."
        )
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
    model_args = get_model_args(cfg.model.name, cfg.model.flavor)
    if not os.path.isfile(cfg.model.tokenizer_path):
        raise UserError(
            f"tokenizer model not found at '{cfg.model.tokenizer_path}' (model.tokenizer_path); point it at a "
            f"sentencepiece .model file, e.g. ./assets/tokenizer/python_stdlib_4k.model (made by "
            f"scripts/train_tokenizer.py). Relative paths are relative to the working directory {os.getcwd()}."
        )
    if dims.tp_enabled:
        if cfg.parallelism.enable_async_tensor_parallel and dist_utils.device_type() != "cuda":
            raise UserError(
                "parallelism.enable_async_tensor_parallel uses CUDA symmetric memory; this job runs on the CPU: "
                "turn it off"
            )
        vocab = Tokenizer(cfg.model.tokenizer_path).vocab_size
        check_tp_divisibility(model_args.with_vocab_and_seq(vocab, t.seq_len), dims.tp, t.seq_len)
    if dims.pp_enabled:
        plan_split(model_args.n_layers, dims.pp, cfg.parallelism)
    check_writable(cfg.job.dump_folder, "the config and metrics")
    preflight_checkpoint(
        cfg.checkpoint, cfg.job.dump_folder, world_size, dist_utils.device_type(), t.seq_len, global_batch
    )
    return Plan(dims, global_batch, global_batch // per_step)


def set_determinism(seed: int, deterministic: bool):
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def train_step(parts, optim: OptimizerGroup, data_iter, grad_accum_steps: int, amp, max_norm: float, device,
               loss_parallel: bool, pipeline: Pipeline | None, cp_positions: torch.Tensor | None = None):
    """One optimizer step over `grad_accum_steps` micro-batches; returns (summed loss, grad norm, lr
    used). With a pipeline the loss exists on the last stage's rank only (zero elsewhere). With
    context parallel, this rank trains on the tokens at `cp_positions` of each sequence."""
    optim.zero_grad()
    loss_sum = torch.zeros((), device=device)
    for _ in range(grad_accum_steps):
        inputs, labels = next(data_iter)
        inputs, labels = shard_sequence(inputs, cp_positions), shard_sequence(labels, cp_positions)
        inputs, labels = inputs.to(device), labels.to(device)
        # With loss parallel the logits stay sharded over the vocabulary; the loss and its backward
        # must both run inside the context.
        with loss_parallel_context(loss_parallel):
            if pipeline is not None:
                with amp:
                    loss = pipeline_step(pipeline.schedule, inputs, labels, pipeline.is_first, pipeline.is_last)
                loss = loss / grad_accum_steps if loss is not None else torch.zeros((), device=device)
            else:
                with amp:
                    logits = parts[0](inputs)
                # Equal token counts in every micro-batch: the mean of micro-batch means is the batch mean.
                loss = cross_entropy(logits, labels) / grad_accum_steps
                loss.backward()
        loss = loss.detach()
        loss_sum += loss.to_local() if isinstance(loss, DTensor) else loss
    params = [p for part in parts for p in part.parameters()]
    if pipeline is not None:
        grad_norm = pp_clip_grad_norm_(params, max_norm, pipeline.pp_mesh.get_group())
    else:
        grad_norm = dist_utils.clip_grad_norm_(params, max_norm)
    lr = optim.lr
    optim.step()
    return loss_sum, grad_norm, lr


def train(cfg: JobConfig) -> list[dict]:
    """Runs the job; returns the logged metrics (every rank returns the same global values)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    plan = preflight(cfg, world_size)
    # A caller that set up the process group (a test running several jobs in one launch) keeps it.
    owns_process_group = not torch.distributed.is_initialized()
    device, rank, _ = dist_utils.init_distributed(cfg.comm.init_timeout_seconds)
    try:
        history = _train(cfg, plan, device, rank)
    except BaseException:
        if owns_process_group:
            dist_utils.destroy_distributed(wait_for_peers=False)
        raise
    if owns_process_group:
        dist_utils.destroy_distributed()
    return history


def _train(cfg: JobConfig, plan: Plan, device: torch.device, rank: int) -> list[dict]:
    t = cfg.training
    dims = plan.parallel_dims
    set_determinism(t.seed, t.deterministic)
    if rank == 0:
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        resolved = config_to_toml(cfg)
        with open(os.path.join(cfg.job.dump_folder, "config.toml"), "w") as f:
            f.write(resolved)
        logger.info(f"resolved config ({cfg.job.config_file or 'defaults'}):\n{resolved}")
    mesh = dims.build_mesh(device.type)

    tokenizer = Tokenizer(cfg.model.tokenizer_path)
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    dataloader = build_dataloader(t, tokenizer, dp_rank, dims.dp_degree, plan.global_batch_size)

    # The model is built on the meta device, so even the largest flavor costs nothing until materialized.
    spec = get_model_spec(cfg.model.name)
    model_args = spec.flavors[cfg.model.flavor].with_vocab_and_seq(tokenizer.vocab_size, t.seq_len)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    if "float8" in cfg.model.converters:
        from torchtitan.components.float8 import convert_to_float8

        convert_to_float8(model, cfg.float8)  # before parallelizing: FSDP then shards the float8 weights
    n_params = count_params(model)
    flops_tok = flops_per_token(model_args, count_params(model, exclude_embedding=True), t.seq_len)
    pipeline = None
    parts = [model]
    if dims.pp_enabled:
        parts, pipeline = split_for_rank(model, cfg.parallelism, mesh["pp"])
    parts = [spec.parallelize(part, dims, mesh, cfg.parallelism, t, cfg.activation_checkpoint) for part in parts]
    for part in parts:
        # With CPU offload, FSDP keeps the sharded parameters in host memory; buffers live on the device.
        part.to_empty(device="cpu" if t.enable_cpu_offload else device)
        part.init_weights(seed=t.seed, buffer_device=device)
        part.train()
    if pipeline is not None:
        def pipeline_loss(logits, labels):
            return cross_entropy(logits, labels) / plan.grad_accum_steps

        attach_schedule(pipeline, parts, cfg.parallelism, t.local_batch_size, device, pipeline_loss)

    optim = OptimizerGroup(parts, cfg.optimizer, cfg.lr_scheduler, t.steps)
    model_info = {"name": cfg.model.name, "flavor": cfg.model.flavor, "model_args": model_args, "pipelined": dims.pp_enabled}
    checkpointer = CheckpointManager(
        cfg.checkpoint, cfg.job.dump_folder, parts, optim.optimizers, optim.schedulers, dataloader, model_info, device
    )
    if cfg.checkpoint.create_seed_checkpoint:
        checkpointer.save_seed()
        return []
    start_step, _ = checkpointer.load()
    # Without FSDP there is no mixed-precision policy: autocast gives bf16 compute instead.
    use_autocast = not dims.fsdp_enabled and t.mixed_precision_param == "bfloat16"
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if use_autocast else nullcontext()
    compute_dtype = torch.bfloat16 if t.mixed_precision_param == "bfloat16" else torch.float32
    peak_tflops, peak_source = device_peak_tflops(device, compute_dtype, cfg.metrics.device_peak_tflops)

    tokens_per_step = plan.global_batch_size * t.seq_len
    logger.info(
        f"training {cfg.model.name} {cfg.model.flavor}: {n_params:,} parameters, vocab {model_args.vocab_size}, "
        f"{flops_tok / 1e6:.1f} MFLOPs/token | {dims.describe()} on {device.type} | global batch "
        f"{plan.global_batch_size} x seq {t.seq_len} = {tokens_per_step:,} tokens/step "
        f"(local batch {t.local_batch_size}, {plan.grad_accum_steps} accumulation step(s)) | "
        f"params {t.mixed_precision_param} | peak {peak_tflops:.3f} TFLOP/s {peak_source} | {t.steps} steps"
    )
    if cfg.lr_scheduler.warmup_steps > t.steps:
        logger.warning(
            f"lr_scheduler.warmup_steps ({cfg.lr_scheduler.warmup_steps}) exceeds training.steps ({t.steps}): "
            f"the peak learning rate is reached on the last step"
        )

    # A resumed run appends to the metrics of the run it continues.
    metrics = MetricsLogger(cfg.metrics, cfg.job.dump_folder, write=rank == 0, append=start_step > 0)
    # Every data- and context-parallel rank holds an equal share of the tokens: the mean of their
    # losses is the loss of the global batch.
    loss_mesh = mesh["dp_cp"] if mesh is not None else None
    cp_positions = None
    if dims.cp_enabled:
        cp_positions = local_positions(t.seq_len, dims.cp, mesh["cp"].get_local_rank())
    history: list[dict] = []
    data_iter = iter(dataloader)
    gc.disable()
    gc.collect()
    start = last_log_time = time.perf_counter()
    tokens_since_log = 0
    precompute_float8 = "float8" in cfg.model.converters and cfg.float8.precompute_float8_dynamic_scale_for_fsdp
    if precompute_float8:
        from torchtitan.components.float8 import precompute_float8_scales
    try:
        with maybe_profile(cfg.profiling, cfg.job.dump_folder, rank, device, start_step) as profiler:
            for step in range(start_step + 1, t.steps + 1):
                if step % t.gc_freq == 0:
                    gc.collect(1)
                loss_sum, grad_norm, lr = train_step(
                    parts, optim, data_iter, plan.grad_accum_steps, amp, t.max_norm, device,
                    loss_parallel=dims.tp_enabled and not cfg.parallelism.disable_loss_parallel,
                    pipeline=pipeline, cp_positions=cp_positions,
                )
                if precompute_float8:
                    # One fused amax/scale computation for all float8 weights, used by the next all-gather.
                    for part in parts:
                        precompute_float8_scales(part)
                # Tensor-, context- and pipeline-parallel peers share their data-parallel group's batch:
                # count each token once, spread over all devices.
                tokens_since_log += tokens_per_step / dims.world_size

                if step == 1 or step % cfg.metrics.log_freq == 0 or step == t.steps:
                    if pipeline is not None:
                        loss_sum = broadcast_loss(loss_sum, pipeline.pp_mesh.get_group(), pipeline.loss_src)
                    loss_value = dist_utils.dist_mean(loss_sum, loss_mesh)
                    if not math.isfinite(loss_value):
                        raise FloatingPointError(f"loss is {loss_value} at step {step}")
                    now = time.perf_counter()
                    tps = tokens_since_log / (now - last_log_time)  # tokens per second on this device
                    tflops = flops_tok * tps / 1e12
                    record = {
                        "step": step,
                        "loss": loss_value,
                        "grad_norm": grad_norm.item(),
                        "lr": lr,
                        "tps": tps,
                        "tflops": tflops,
                        "mfu": 100 * tflops / peak_tflops,
                        "memory_gib": peak_memory_gib(device),
                        "time": now - start,
                        "tokens": step * tokens_per_step,
                    }
                    metrics.log(record)
                    history.append(record)
                    last_log_time, tokens_since_log = now, 0

                checkpointer.maybe_publish()
                if checkpointer.should_save(step, t.steps):
                    checkpointer.save(step, step * tokens_per_step, last=step == t.steps)
                if step == t.steps and cfg.checkpoint.last_save_in_hf:
                    checkpointer.export_hf(step, tokenizer.bos_id, tokenizer.eos_id)
                profiler.step_done()
            checkpointer.close()
    finally:
        gc.enable()
        metrics.close()
    logger.info(f"training done: {t.steps} steps in {time.perf_counter() - start:.1f}s")
    return history


def setup_logging():
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def main(argv: list[str]) -> int:
    setup_logging()
    try:
        train(load_config(argv))
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
