"""Job configuration: schema, loading (defaults < TOML recipe < command line) and validation.

Importing this package must not import torch: it validates a job before launch.
"""

from torchtitan.config.errors import HelpRequested, UserError
from torchtitan.config.job_config import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Experimental,
    Float8,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    MoE,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
)
from torchtitan.config.manager import (
    config_to_dict,
    config_to_toml,
    help_text,
    load_config,
    validate,
)

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Experimental",
    "Float8",
    "HelpRequested",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "MoE",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "UserError",
    "config_to_dict",
    "config_to_toml",
    "help_text",
    "load_config",
    "validate",
]
