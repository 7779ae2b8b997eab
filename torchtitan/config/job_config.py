"""The configuration schema: `JobConfig`, one frozen dataclass per TOML section.

Every field of a section is read by the code. Its default is defined in its section's module and nowhere else,
and its `help` doubles as the `--help` text: job_sections.py (job, metrics, profiling, checkpoint,
memory_estimation, experimental), model_sections.py (model, activation_checkpoint, float8, moe),
training_sections.py (optimizer, lr_scheduler, training, validation) and parallelism_sections.py (parallelism,
comm, fault_tolerance). Key names follow torchtitan's mid-2025 TOML schema. Keys of that schema that this version
does not implement yet live in `NOT_IMPLEMENTED_KEYS` below: they load while they hold a value that asks for nothing,
and are rejected with a clear message otherwise, so a recipe never silently loses an option.
"""

from dataclasses import dataclass, field

from torchtitan.config.job_sections import Checkpoint, Experimental, Job, MemoryEstimation, Metrics, Profiling
from torchtitan.config.model_sections import ActivationCheckpoint, Float8, Model, MoE
from torchtitan.config.parallelism_sections import Comm, FaultTolerance, Parallelism
from torchtitan.config.training_sections import LRScheduler, Optimizer, Training, Validation


@dataclass(frozen=True)
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    float8: Float8 = field(default_factory=Float8)
    profiling: Profiling = field(default_factory=Profiling)
    moe: MoE = field(default_factory=MoE)
    validation: Validation = field(default_factory=Validation)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    experimental: Experimental = field(default_factory=Experimental)


# Keys of the reference schema that are not implemented yet. Each maps to the value that asks
# for nothing (ANY: the key only matters once its feature is switched on, so any value loads).
# A recipe may carry these keys; a value other than the inert one is rejected with `why`.
ANY = object()

NOT_IMPLEMENTED_KEYS: dict[str, dict[str, object]] = {
    "training": {"gc_debug": False},
    "float8": {"moe_fqns_prototype": []},
    "parallelism": {
        "enable_compiled_autograd": False,
    },
    "metrics": {"save_for_all_ranks": False},
    "memory_estimation": {"disable_fake_mode": False},
    "experimental": {"custom_args_module": ""},
}

# What a user reads when a not-implemented key asks for something.
NOT_IMPLEMENTED_WHY: dict[str, str] = {
    "parallelism": "this parallelism option is not implemented",
    "metrics": "this metrics backend is not implemented",
    "memory_estimation": "the estimate is computed from the model spec and never runs the model in fake mode",
    "experimental": (
        "custom config sections are not supported; a custom model registers through experimental.custom_import"
    ),
}
NOT_IMPLEMENTED_WHY["parallelism.enable_compiled_autograd"] = (
    "compiled autograd is not supported (it broke FSDP2 parity)"
)
NOT_IMPLEMENTED_WHY["training.gc_debug"] = "gc_debug is not implemented"
NOT_IMPLEMENTED_WHY["float8.moe_fqns_prototype"] = (
    "float8 for the MoE experts' weights (their grouped matmuls) needs torchao's prototype scaled grouped GEMM, "
    "which runs on CUDA SM90+ only and is not wired here; the float8 converter keeps experts and routers in high "
    "precision"
)
