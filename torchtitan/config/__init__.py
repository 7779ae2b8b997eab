"""Job configuration: schema, loading (defaults < TOML recipe < command line) and validation.

Importing this package must not import torch: it validates a job before launch.
"""

from torchtitan.config.errors import HelpRequested, UserError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.job_sections import Checkpoint, Experimental, Job, MemoryEstimation, Metrics, Profiling
from torchtitan.config.manager import (
    config_to_dict,
    config_to_toml,
    help_text,
    load_config,
    validate,
)
from torchtitan.config.model_sections import ActivationCheckpoint, Float8, Model, MoE
from torchtitan.config.parallelism_sections import Comm, Parallelism
from torchtitan.config.training_sections import LRScheduler, Optimizer, Training, Validation

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
    "MemoryEstimation",
    "Metrics",
    "MoE",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "UserError",
    "Validation",
    "config_to_dict",
    "config_to_toml",
    "help_text",
    "load_config",
    "validate",
]
