"""The rules of a loaded config: each section's own check() (job_config.py), then the rules below, which read two
or more sections. Each returns every problem it finds, as a message that names the keys and the fix
(manager.validate raises them together before any process starts)."""

import dataclasses

from torchtitan.config.job_config import JobConfig
from torchtitan.config.parallelism_sections import Parallelism

# The largest integer any key may hold: a 64-bit signed integer, what TOML can write and what the libraries the
# values reach (deque lengths, tensor sizes, seeds, C timeouts) take without overflowing.
MAX_INT = 2**63 - 1
# The longest duration a `*_seconds` key may hold: a year. Longer ones overflow later, after launch (Python's
# timedelta and socket timeouts, the lighthouse client), and are no limit in practice.
MAX_SECONDS = 365 * 24 * 3600


def check_rules(cfg: JobConfig) -> list[str]:
    problems = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        problems += _range_rules(f.name, section)
        # A section with no rule of its own (experimental) has no check().
        problems += getattr(section, "check", list)()
    for rule in (_batch_rules, _sequence_rules, _parallelism_rules, _float8_rules, _checkpoint_rules):
        problems += rule(cfg)
    return problems


def _range_rules(name: str, section) -> list[str]:
    """Every integer key within MAX_INT, every duration within MAX_SECONDS: a value past them would pass the
    section's own rules and overflow once the job has started."""
    problems = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, int) and abs(value) > MAX_INT:
            problems.append(f"{name}.{f.name} = {value} does not fit a 64-bit integer (at most {MAX_INT:,} in size)")
        elif f.name.endswith("_seconds") and value > MAX_SECONDS:
            problems.append(
                f"{name}.{f.name} = {value} is more than a year ({MAX_SECONDS:,} seconds), the longest "
                f"duration a run takes; set a shorter one"
            )
    return problems


def _microbatch_rule(section: str, local_batch_size: int, p: Parallelism) -> list[str]:
    """[training] and [validation] alike: a pipeline splits each local batch into whole microbatches."""
    if p.pipeline_parallel_degree > 1 and local_batch_size % p.pipeline_parallel_microbatch_size:
        return [
            f"{section}.local_batch_size = {local_batch_size} is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size = {p.pipeline_parallel_microbatch_size}"
        ]
    return []


def _batch_rules(cfg: JobConfig) -> list[str]:
    # A zero microbatch size is Parallelism.check()'s to report, not a division to attempt here.
    if not cfg.parallelism.pipeline_parallel_microbatch_size >= 1:
        return []
    problems = _microbatch_rule("training", cfg.training.local_batch_size, cfg.parallelism)
    if cfg.validation.enabled:
        problems += _microbatch_rule("validation", cfg.validation.local_batch_size, cfg.parallelism)
    return problems


def _sequence_rules(cfg: JobConfig) -> list[str]:
    t, v, p = cfg.training, cfg.validation, cfg.parallelism
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    problems = []
    if cp > 1 and t.seq_len % (2 * cp * max(tp, 1)):
        problems.append(
            f"training.seq_len = {t.seq_len} must be divisible by 2 x context_parallel_degree x "
            f"tensor_parallel_degree = 2 x {cp} x {tp} = {2 * cp * max(tp, 1)} (each context-parallel rank "
            f"holds two sequence chunks, each split over the tensor-parallel ranks); choose a multiple"
        )
    # training.seq_len % tensor_parallel_degree is checked with the model's sizes (check_tp_divisibility).
    if not v.enabled:
        return problems
    seq_len = validation_seq_len(v, t)
    if seq_len > t.seq_len:
        problems.append(
            f"validation.seq_len = {seq_len} exceeds training.seq_len = {t.seq_len}: the model holds positions for "
            "training.seq_len tokens; lower it (or -1 for training.seq_len)"
        )
    if cp > 1 and seq_len != t.seq_len:
        problems.append(
            f"validation.seq_len = {seq_len} must equal training.seq_len = {t.seq_len} with context parallel (each "
            "rank holds fixed positions of the sequence); set it to -1"
        )
    if tp > 1 and seq_len % tp:
        problems.append(
            f"validation.seq_len = {seq_len} must be divisible by parallelism.tensor_parallel_degree = {tp} "
            "(sequence parallel splits it)"
        )
    return problems


def _parallelism_rules(cfg: JobConfig) -> list[str]:
    p = cfg.parallelism
    if p.enable_async_tensor_parallel and not (cfg.training.compile and p.tensor_parallel_degree > 1):
        return [
            "parallelism.enable_async_tensor_parallel needs parallelism.tensor_parallel_degree > 1 and "
            "training.compile = true (the overlap is done by the compiler); turn it off or enable both"
        ]
    return []


def _float8_rules(cfg: JobConfig) -> list[str]:
    f8 = cfg.float8
    if "float8" in cfg.model.converters and f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        return [
            f"float8.enable_fsdp_float8_all_gather works with float8.recipe_name = 'tensorwise' only, got "
            f"{f8.recipe_name!r}; turn one of them off"
        ]
    return []


def _checkpoint_rules(cfg: JobConfig) -> list[str]:
    c = cfg.checkpoint
    if c.initial_load_in_hf and not c.initial_load_path and not cfg.model.hf_assets_path:
        return [
            "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (or model.hf_assets_path): the Hugging "
            "Face folder"
        ]
    return []


def validation_seq_len(v, t) -> int:
    """The validation window: validation.seq_len, or training.seq_len where it is -1."""
    return t.seq_len if v.seq_len == -1 else v.seq_len
