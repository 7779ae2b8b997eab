"""The cross-field rules of a loaded config: each returns every problem it finds, as a message that
names the keys and the fix (manager.validate raises them together before any process starts)."""

import os

from torchtitan.config.errors import UserError
from torchtitan.config.job_config import ZERO_BUBBLE_SCHEDULES, Comm, JobConfig, parse_mix

# Signals job.stop_signals may name: those schedulers send before a kill, and Ctrl-C's.
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")


def check_rules(cfg: JobConfig) -> list[str]:
    t, o, s, p, m = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.parallelism, cfg.metrics
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    for name, value in [
        ("training.local_batch_size", t.local_batch_size),
        ("training.seq_len", t.seq_len),
        ("training.steps", t.steps),
        ("training.gc_freq", t.gc_freq),
        ("metrics.log_freq", m.log_freq),
        ("job.stop_grace_seconds", cfg.job.stop_grace_seconds),
        ("training.max_skipped_steps_in_a_row", t.max_skipped_steps_in_a_row),
    ]:
        need(value > 0, f"{name} must be a positive integer, got {value}; set it to 1 or more")
    # A collective's time limit: 0 would time out every collective at once, a negative one is refused by
    # the process group on every rank (gloo: "Invalid timeout") once the job has started.
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        value = getattr(cfg.comm, key)
        need(
            value > 0,
            f"comm.{key} must be a positive number of seconds, got {value}; set it to 1 or more "
            f"(default {getattr(Comm(), key)})",
        )
    need(
        cfg.comm.trace_buf_size >= 0,
        f"comm.trace_buf_size must be 0 (flight recorder off) or more entries, got {cfg.comm.trace_buf_size}",
    )
    mdl = cfg.model
    need(
        mdl.sliding_window is None or mdl.sliding_window > 0,
        f"model.sliding_window must be a positive number of positions, got {mdl.sliding_window}; leave it unset "
        f"for attention over every earlier position",
    )
    need(
        mdl.max_window_layers is None or mdl.max_window_layers >= 0,
        f"model.max_window_layers must be 0 or more, got {mdl.max_window_layers}",
    )
    need(
        not mdl.use_flex_attn or mdl.attn_backend in ("auto", "flex"),
        f"model.use_flex_attn = true asks for FlexAttention but model.attn_backend = {mdl.attn_backend!r}; keep one",
    )
    need(cfg.checkpoint.hf_max_shard_mb >= 1,
         f"checkpoint.hf_max_shard_mb must be 1 or more, got {cfg.checkpoint.hf_max_shard_mb}")
    for name in cfg.job.stop_signals:
        need(
            name in STOP_SIGNALS,
            f"job.stop_signals: {name!r} is not a signal a run can stop on; use names from {', '.join(STOP_SIGNALS)}",
        )
    need(
        t.global_batch_size == -1 or t.global_batch_size > 0,
        f"training.global_batch_size must be -1 (local_batch_size x data-parallel degree) or a "
        f"positive integer, got {t.global_batch_size}",
    )
    need(
        p.data_parallel_replicate_degree >= 1,
        f"parallelism.data_parallel_replicate_degree must be 1 or more, got {p.data_parallel_replicate_degree}",
    )
    need(p.pipeline_parallel_degree >= 1, f"parallelism.pipeline_parallel_degree must be 1 or more, got {p.pipeline_parallel_degree}")
    need(
        p.pipeline_parallel_microbatch_size >= 1,
        f"parallelism.pipeline_parallel_microbatch_size must be 1 or more, got {p.pipeline_parallel_microbatch_size}",
    )
    for name in ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers"):
        need(getattr(p, name) >= 0, f"parallelism.{name} must be 0 or more, got {getattr(p, name)}")
    for name in ("module_fqns_per_model_part", "pipeline_parallel_split_points"):
        need(
            not getattr(p, name) or p.pipeline_parallel_degree > 1,
            f"parallelism.{name} splits the model into pipeline stages, but pipeline_parallel_degree is "
            f"{p.pipeline_parallel_degree}; set pipeline_parallel_degree > 1 or remove it",
        )
    if p.pipeline_parallel_degree > 1:
        need(
            t.local_batch_size % p.pipeline_parallel_microbatch_size == 0,
            f"training.local_batch_size = {t.local_batch_size} is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size = {p.pipeline_parallel_microbatch_size}",
        )
        zero_bubble = p.pipeline_parallel_schedule.lower() in ZERO_BUBBLE_SCHEDULES
        need(
            not (zero_bubble and p.fsdp_reshard_after_forward == "always"),
            f"parallelism.fsdp_reshard_after_forward = 'always' cannot be used with pipeline_parallel_schedule = "
            f"{p.pipeline_parallel_schedule!r}: its split weight-gradient step needs the gathered block weights "
            "(resharding silently drops their gradients); use 'default'",
        )
        explicit = [k for k in ("module_fqns_per_model_part", "pipeline_parallel_split_points") if getattr(p, k)]
        need(
            len(explicit) < 2,
            "parallelism.module_fqns_per_model_part and parallelism.pipeline_parallel_split_points both split the "
            "pipeline; set one of them",
        )
        need(
            not (explicit and p.pipeline_parallel_layers_per_stage is not None),
            f"parallelism.{explicit[0] if explicit else ''} and parallelism.pipeline_parallel_layers_per_stage both "
            "split the pipeline; set one of them",
        )
        need(
            not p.pipeline_parallel_schedule_csv or os.path.isfile(p.pipeline_parallel_schedule_csv),
            f"parallelism.pipeline_parallel_schedule_csv: {p.pipeline_parallel_schedule_csv} does not exist",
        )
    need(p.tensor_parallel_degree >= 1, f"parallelism.tensor_parallel_degree must be 1 or more, got {p.tensor_parallel_degree}")
    for key in ("load_balance_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "capacity_factor"):
        value = getattr(cfg.moe, key)
        need(value is None or value >= 0, f"moe.{key} must be 0 (off) or more, got {value}")
    need(cfg.moe.top_k is None or cfg.moe.top_k >= 1, f"moe.top_k must be 1 or more, got {cfg.moe.top_k}")
    need(p.expert_parallel_degree >= 1, f"parallelism.expert_parallel_degree must be 1 or more, got {p.expert_parallel_degree}")
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    need(cp >= 1, f"parallelism.context_parallel_degree must be 1 or more, got {cp}")
    if cp > 1:
        need(
            t.seq_len % (2 * cp * max(tp, 1)) == 0,
            f"training.seq_len = {t.seq_len} must be divisible by 2 x context_parallel_degree x "
            f"tensor_parallel_degree = 2 x {cp} x {tp} = {2 * cp * max(tp, 1)} (each context-parallel rank "
            f"holds two sequence chunks, each split over the tensor-parallel ranks); choose a multiple",
        )
    if p.enable_async_tensor_parallel:
        need(
            t.compile and p.tensor_parallel_degree > 1,
            "parallelism.enable_async_tensor_parallel needs parallelism.tensor_parallel_degree > 1 and "
            "training.compile = true (the overlap is done by the compiler); turn it off or enable both",
        )
    need(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        f"parallelism.data_parallel_shard_degree must be -1 (use the ranks left over) or 1 or more, "
        f"got {p.data_parallel_shard_degree}",
    )
    # Written as `not (ok)` comparisons so that NaN fails them too.
    need(o.lr > 0, f"optimizer.lr must be greater than 0, got {o.lr}")
    need(o.eps > 0, f"optimizer.eps must be greater than 0, got {o.eps}")
    need(o.weight_decay >= 0, f"optimizer.weight_decay must be 0 or more, got {o.weight_decay}")
    for name, value in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)]:
        need(0 <= value < 1, f"{name} must be in [0, 1), got {value}")
    need(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be 0 or more, got {s.warmup_steps}")
    need(
        s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
        f"lr_scheduler.decay_ratio must be in [0, 1] (or unset to decay over all steps after "
        f"warmup), got {s.decay_ratio}",
    )
    need(0 <= s.min_lr_factor <= 1, f"lr_scheduler.min_lr_factor must be in [0, 1], got {s.min_lr_factor}")
    need(t.max_norm >= 0, f"training.max_norm must be 0 (no clipping) or more, got {t.max_norm}")
    need(
        m.device_peak_tflops >= 0,
        f"metrics.device_peak_tflops must be 0 (auto) or more, got {m.device_peak_tflops}",
    )
    if t.dataset_mix:
        problems += _mix_problems("training", t.dataset_mix, t.dataset, "python_stdlib", t.dataset_path)
    elif t.dataset in ("local", "huggingface", "tokens"):
        need(
            bool(t.dataset_path),
            f'training.dataset = "{t.dataset}" needs training.dataset_path; set it to the '
            + {"local": "data file or folder (.jsonl, .json, .txt, their .gz/.zst, .parquet, Arrow)",
               "huggingface": "dataset name or path",
               "tokens": "folder scripts/pretokenize.py wrote"}[t.dataset],
        )
    need(t.shuffle_buffer >= 1, f"training.shuffle_buffer must be 1 or more documents, got {t.shuffle_buffer}")
    need(t.data_workers >= 0, f"training.data_workers must be 0 (read in the trainer) or more, got {t.data_workers}")
    need(
        t.dataset != "tokens" or t.data_workers == 0,
        f'training.data_workers = {t.data_workers} with training.dataset = "tokens": a token folder has nothing to '
        "tokenize and is read memory-mapped in the trainer; set data_workers = 0",
    )
    need(
        bool(t.dataset_text_field),
        "training.dataset_text_field is empty; set it to the field or column holding the text (default 'text')",
    )
    if t.dataset == "python_stdlib":
        need(
            t.dataset_path is None,
            f'training.dataset_path = {t.dataset_path!r} is set but training.dataset = "python_stdlib" '
            'does not read it; set training.dataset = "local" (or "huggingface") to train on it, '
            "or remove dataset_path",
        )
    for converter in cfg.model.converters:
        need(converter == "float8", f"model.converters: unknown converter {converter!r}; the only one is 'float8'")
    f8 = cfg.float8
    if "float8" in cfg.model.converters and f8.enable_fsdp_float8_all_gather:
        need(
            f8.recipe_name == "tensorwise",
            f"float8.enable_fsdp_float8_all_gather works with float8.recipe_name = 'tensorwise' only, got "
            f"{f8.recipe_name!r}; turn one of them off",
        )
    need(
        not f8.precompute_float8_dynamic_scale_for_fsdp or f8.enable_fsdp_float8_all_gather,
        "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather = true",
    )
    need(cfg.profiling.profile_freq > 0, f"profiling.profile_freq must be a positive integer, got {cfg.profiling.profile_freq}")
    ac = cfg.activation_checkpoint
    if ac.mode == "selective":
        option = ac.selective_ac_option
        need(
            option == "op" or (option.isdigit() and int(option) > 0),
            f"activation_checkpoint.selective_ac_option must be a positive integer (checkpoint every N-th block) "
            f"or 'op' (operator-level policy), got {option!r}",
        )
    c = cfg.checkpoint
    need(c.interval > 0, f"checkpoint.interval must be a positive integer, got {c.interval}")
    need(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k must be 0 (keep all) or more, got {c.keep_latest_k}")
    need(c.load_step >= -1, f"checkpoint.load_step must be -1 (newest) or a step number, got {c.load_step}")
    parts = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
    for part in c.exclude_from_loading:
        need(part in parts, f"checkpoint.exclude_from_loading: unknown part {part!r}; choose from {', '.join(parts)}")
    need(
        not (c.initial_load_in_hf and not c.initial_load_path and not cfg.model.hf_assets_path),
        "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (or model.hf_assets_path): the Hugging Face folder",
    )
    need(
        not (c.initial_load_in_hf and not c.initial_load_model_only),
        "checkpoint.initial_load_in_hf loads weights only; set checkpoint.initial_load_model_only = true",
    )
    need(
        not (c.create_seed_checkpoint and not c.enable_checkpoint),
        "checkpoint.create_seed_checkpoint writes into the checkpoint folder; also set checkpoint.enable_checkpoint = true",
    )
    if cfg.validation.enabled:
        problems += _validation_problems(cfg)
    return problems


VALIDATION_DATASETS = ("python_stdlib_test", "python_stdlib", "local", "huggingface", "c4_test")


def _mix_problems(section: str, mix: list[str], dataset: str, default: str, dataset_path: str | None) -> list[str]:
    """A [training] or [validation] dataset_mix: its syntax, and no dataset or dataset_path beside it."""
    problems = []
    try:
        parse_mix(mix, f"{section}.dataset_mix")
    except UserError as e:
        problems.append(str(e))
    if dataset != default or dataset_path is not None:
        problems.append(
            f"{section}.dataset_mix is set, so {section}.dataset ({dataset!r}) and {section}.dataset_path "
            f"({dataset_path!r}) are not used; remove them (a mixture names every source itself)"
        )
    return problems


def _validation_problems(cfg: JobConfig) -> list[str]:
    """[validation] is checked only when enabled: a disabled section loads with any values."""
    v, t, p = cfg.validation, cfg.training, cfg.parallelism
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    for name in ("local_batch_size", "freq"):
        value = getattr(v, name)
        need(value > 0, f"validation.{name} must be a positive integer, got {value}; set it to 1 or more")
    need(
        v.steps == -1 or v.steps > 0,
        f"validation.steps must be -1 (one pass over the validation set) or a positive integer, got {v.steps}",
    )
    if v.dataset_mix:
        problems += _mix_problems("validation", v.dataset_mix, v.dataset, "python_stdlib_test", v.dataset_path)
    need(
        v.dataset in VALIDATION_DATASETS,
        f"validation.dataset = {v.dataset!r} is not available here; choose one of "
        f"{', '.join(VALIDATION_DATASETS)} (local and huggingface read validation.dataset_path)",
    )
    if v.dataset in ("local", "huggingface"):
        need(bool(v.dataset_path), f'validation.dataset = "{v.dataset}" needs validation.dataset_path')
    elif v.dataset in ("python_stdlib_test", "python_stdlib"):
        need(
            v.dataset_path is None,
            f"validation.dataset_path = {v.dataset_path!r} is set but validation.dataset = {v.dataset!r} does not "
            'read it; set validation.dataset = "local" (or "huggingface"), or remove dataset_path',
        )
    seq_len = t.seq_len if v.seq_len == -1 else v.seq_len
    need(
        v.seq_len == -1 or v.seq_len > 0,
        f"validation.seq_len must be -1 (training.seq_len) or a positive integer, got {v.seq_len}",
    )
    need(
        seq_len <= t.seq_len,
        f"validation.seq_len = {seq_len} exceeds training.seq_len = {t.seq_len}: the model holds positions for "
        "training.seq_len tokens; lower it (or -1 for training.seq_len)",
    )
    if p.context_parallel_degree > 1:
        need(
            seq_len == t.seq_len,
            f"validation.seq_len = {seq_len} must equal training.seq_len = {t.seq_len} with context parallel (each "
            "rank holds fixed positions of the sequence); set it to -1",
        )
    if p.tensor_parallel_degree > 1:
        need(
            seq_len % p.tensor_parallel_degree == 0,
            f"validation.seq_len = {seq_len} must be divisible by parallelism.tensor_parallel_degree = "
            f"{p.tensor_parallel_degree} (sequence parallel splits it)",
        )
    if p.pipeline_parallel_degree > 1:
        need(
            v.local_batch_size % p.pipeline_parallel_microbatch_size == 0,
            f"validation.local_batch_size = {v.local_batch_size} is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size = {p.pipeline_parallel_microbatch_size}",
        )
    return problems
