"""The sections around the training itself: the job, its metrics and profiling, its checkpoints, the memory
estimate before launch, and the experimental hooks."""

from dataclasses import dataclass
from typing import Literal

from torchtitan.config.fields import broken_rules, option, positive

# Signals job.stop_signals may name: those schedulers send before a kill, and Ctrl-C's.
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")


@dataclass(frozen=True)
class Job:
    config_file: str | None = option(None, "Path of the TOML recipe to load.")
    base_config: str | None = option(
        None,
        "A recipe this one inherits from (path relative to this recipe's folder); keys set here override the base's.",
    )
    dump_folder: str = option("./outputs", "Folder for the resolved config, metrics.jsonl and TensorBoard logs.")
    description: str = option("", "Free text describing the job, printed at start.")
    print_args: bool = option(
        False,
        "Print the resolved config at start (it is always written to {dump_folder}/config.toml, and the "
        "start-up says where).",
    )
    use_for_integration_test: bool = option(
        False, "A tag for test runners that select recipes (the reference framework's CI reads it); training does not."
    )
    stop_signals: list[str] = option(
        ["SIGTERM", "SIGUSR1", "SIGINT"],
        "Signals (what SLURM and Kubernetes send before a kill; SIGINT is Ctrl-C) on which every rank finishes the "
        "current step, saves a checkpoint (when checkpointing is on) and names it; the run exits 0 (SIGINT: 130, "
        "as shells expect of an interrupted command; a second Ctrl-C ends it at once without saving). "
        "Empty: the signals' default action.",
    )
    stop_grace_seconds: int = option(
        120,
        "Time from a stop signal to exit. A step and save still running then are abandoned (exit code 1; the last "
        "complete checkpoint stays). Set it to the warning your scheduler gives (e.g. sbatch --signal=USR1@120).",
    )

    def check(self) -> list[str]:
        return positive("job", self, "stop_grace_seconds") + [
            f"job.stop_signals: {name!r} is not a signal a run can stop on; use names from {', '.join(STOP_SIGNALS)}"
            for name in self.stop_signals
            if name not in STOP_SIGNALS
        ]


@dataclass(frozen=True)
class Metrics:
    log_freq: int = option(10, "Log metrics every this many steps (and at the first and last step).")
    enable_tensorboard: bool = option(False, "Write TensorBoard scalars to {dump_folder}/{save_tb_folder}.")
    save_tb_folder: str = option("tb", "TensorBoard folder under dump_folder.")
    device_peak_tflops: float = option(
        0.0,
        "Peak TFLOP/s of one device for MFU. 0: from a table of known GPUs, or on CPU measured at "
        "start with a short matmul in the training dtype.",
    )
    disable_color_printing: bool = option(
        False, "Plain console lines; otherwise the step line is colored when the console is a terminal."
    )
    enable_wandb: bool = option(
        False,
        "Log metrics and the resolved config to Weights & Biases too (the wandb package; project WANDB_PROJECT, "
        "default torchtitan). Offline, into {dump_folder}/wandb, unless an API key is set and the service answers "
        "(or as WANDB_MODE says); a resumed run continues the same wandb run.",
    )
    straggler_factor: float = option(
        1.5,
        "At each log step (after a launch's first) the ranks compare their own time per step: the time each spent "
        "computing or reading data rather than waiting for its peers (metrics.jsonl: step_time_max_over_median). A "
        "rank slower than this factor times the median of the other ranks in straggler_windows log windows in a row "
        "is named in the log and in metrics.jsonl (straggler_rank). 0: off. torchtitan/components/watchdog.py.",
    )
    straggler_windows: int = option(
        3, "Log windows in a row (of log_freq steps each) a rank must be slower than straggler_factor to be named."
    )

    def check(self) -> list[str]:
        return positive("metrics", self, "log_freq", "straggler_windows") + broken_rules(
            (
                self.device_peak_tflops >= 0,
                f"metrics.device_peak_tflops must be 0 (auto) or more, got {self.device_peak_tflops}",
            ),
            (
                self.straggler_factor == 0 or self.straggler_factor > 1,
                f"metrics.straggler_factor must be 0 (off) or more than 1 (a rank slower than the others' median by "
                f"that factor), got {self.straggler_factor}",
            ),
        )


@dataclass(frozen=True)
class Profiling:
    enable_profiling: bool = option(False, "Record torch profiler traces every profile_freq steps.")
    save_traces_folder: str = option("profile_traces", "Trace folder under dump_folder (one file per rank and step).")
    profile_freq: int = option(10, "Profile one step out of every this many.")
    enable_memory_snapshot: bool = option(
        False,
        "Record memory: CUDA allocator snapshots (and a dump on out-of-memory); on CPU a profiler memory timeline.",
    )
    save_memory_snapshot_folder: str = option("memory_snapshot", "Memory snapshot folder under dump_folder.")

    def check(self) -> list[str]:
        return broken_rules(
            (self.profile_freq > 0, f"profiling.profile_freq must be a positive integer, got {self.profile_freq}")
        )


@dataclass(frozen=True)
class Checkpoint:
    enable_checkpoint: bool = option(
        False,
        "Save checkpoints to {dump_folder}/{folder}/step-N and, at start, resume from the newest complete one.",
    )
    folder: str = option("checkpoint", "Checkpoint folder under dump_folder.")
    interval: int = option(500, "Save every this many steps (and at the last step).")
    keep_latest_k: int = option(
        10, "Keep this many newest complete checkpoints, deleting older ones after a save (0: keep all)."
    )
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = option(
        "disabled",
        "disabled: training waits for each save; async: files are written in a background thread while "
        "training goes on; async_with_pinned_mem: as async, staging through pinned host memory (CUDA only).",
    )
    load_step: int = option(-1, "Resume from this step's checkpoint instead of the newest (-1: newest).")
    exclude_from_loading: list[str] = option(
        [],
        "Parts of a checkpoint not to restore on resume: "
        "any of model, optimizer, lr_scheduler, dataloader, train_state.",
    )
    initial_load_path: str | None = option(
        None,
        "When the checkpoint folder holds no checkpoint: start from this checkpoint folder (a step-N folder, "
        "or a Hugging Face folder with initial_load_in_hf).",
    )
    initial_load_model_only: bool = option(True, "Load only the model weights from initial_load_path.")
    initial_load_in_hf: bool = option(
        False, "initial_load_path is a Hugging Face folder (config.json + *.safetensors)."
    )
    last_save_model_only: bool = option(
        True, "The save at the last step holds the model weights only (in export_dtype), for inference."
    )
    last_save_in_hf: bool = option(
        False, "Also export the last step's weights as a Hugging Face folder {folder}/step-N-hf."
    )
    export_dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32", "Dtype of model-only saves and Hugging Face exports."
    )
    hf_max_shard_mb: int = option(
        5120,
        "The largest safetensors file of a Hugging Face export, in MiB (a larger tensor gets a file of its own). "
        "Each file's writer holds its tensors until the file is written.",
    )
    enable_first_step_checkpoint: bool = option(False, "Also save right after the first step.")
    create_seed_checkpoint: bool = option(
        False,
        "Write the initial weights to {folder}/step-0 and exit (one process). Later runs of any layout "
        "start from these weights.",
    )

    def check(self) -> list[str]:
        parts = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
        problems = [
            f"checkpoint.exclude_from_loading: unknown part {part!r}; choose from {', '.join(parts)}"
            for part in self.exclude_from_loading
            if part not in parts
        ]
        return problems + broken_rules(
            (self.hf_max_shard_mb >= 1, f"checkpoint.hf_max_shard_mb must be 1 or more, got {self.hf_max_shard_mb}"),
            (self.interval > 0, f"checkpoint.interval must be a positive integer, got {self.interval}"),
            (
                self.keep_latest_k >= 0,
                f"checkpoint.keep_latest_k must be 0 (keep all) or more, got {self.keep_latest_k}",
            ),
            (self.load_step >= -1, f"checkpoint.load_step must be -1 (newest) or a step number, got {self.load_step}"),
            (
                not (self.initial_load_in_hf and not self.initial_load_model_only),
                "checkpoint.initial_load_in_hf loads weights only; set checkpoint.initial_load_model_only = true",
            ),
            (
                not (self.create_seed_checkpoint and not self.enable_checkpoint),
                "checkpoint.create_seed_checkpoint writes into the checkpoint folder; also set "
                "checkpoint.enable_checkpoint = true",
            ),
        )


@dataclass(frozen=True)
class MemoryEstimation:
    enabled: bool = option(
        False,
        "Before launch, print the estimated memory per rank of this recipe's layout (parameters, gradients, "
        "optimizer state, activations, logits, communication buffers: torchtitan.planner) and refuse a layout that "
        "cannot fit the device memory (on CPU: the host memory per process of this node). scripts/plan.py compares "
        "every layout.",
    )


@dataclass(frozen=True)
class Experimental:
    custom_import: str = option(
        "",
        "A module to import before the model is looked up, e.g. one that registers a model family defined "
        "outside torchtitan with torchtitan.models.registry.register_model: a dotted name importable from the "
        "working directory or PYTHONPATH, or the path of a .py file. Empty: none.",
    )
