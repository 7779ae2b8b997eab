"""The configuration schema: one frozen dataclass per TOML section.

Every field here is read by the code. Its default is defined here and nowhere else, and its
`help` doubles as the `--help` text. Key names follow torchtitan's mid-2025 TOML schema.
Keys of that schema that this version does not implement yet live in `PLANNED_KEYS` below:
they load while they hold a value that asks for nothing, and are rejected with a clear
message otherwise, so a recipe never silently loses an option.
"""

import math
import os
from dataclasses import dataclass, field
from typing import Literal

from torchtitan.config.entries import parse_mix, parse_param_groups
from torchtitan.config.errors import UserError


def opt(default, help: str):
    """A config field with its documentation."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


# Each section's check() returns every problem of its own values, as a message that names the keys and the fix;
# rules that read two sections are in rules.py. Rules are written `ok, message` with ok as a comparison that holds
# for good values, so that NaN fails it too.
def _failed(*rules: tuple[bool, str]) -> list[str]:
    return [message for ok, message in rules if not ok]


def _positive(section: str, values, *names: str) -> list[str]:
    return [
        f"{section}.{name} must be a positive integer, got {getattr(values, name)}; set it to 1 or more"
        for name in names
        if not getattr(values, name) > 0
    ]


# Signals job.stop_signals may name: those schedulers send before a kill, and Ctrl-C's.
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")


@dataclass(frozen=True)
class Job:
    config_file: str | None = opt(None, "Path of the TOML recipe to load.")
    base_config: str | None = opt(
        None,
        "A recipe this one inherits from (path relative to this recipe's folder); "
        "keys set here override the base's.",
    )
    dump_folder: str = opt("./outputs", "Folder for the resolved config, metrics.jsonl and TensorBoard logs.")
    description: str = opt("", "Free text describing the job, printed at start.")
    print_args: bool = opt(True, "Print the resolved config at start (it is always written to {dump_folder}/config.toml).")
    use_for_integration_test: bool = opt(
        False, "A tag for test runners that select recipes (the reference framework's CI reads it); training does not."
    )
    stop_signals: list[str] = opt(
        ["SIGTERM", "SIGUSR1"],
        "Signals (what SLURM and Kubernetes send before a kill) on which every rank finishes the current step, "
        "saves a checkpoint (when checkpointing is on) and exits 0. Empty: the signals' default action.",
    )
    stop_grace_seconds: int = opt(
        120,
        "Time from a stop signal to exit. A step and save still running then are abandoned (exit code 1; the last "
        "complete checkpoint stays). Set it to the warning your scheduler gives (e.g. sbatch --signal=USR1@120).",
    )

    def check(self) -> list[str]:
        return _positive("job", self, "stop_grace_seconds") + [
            f"job.stop_signals: {name!r} is not a signal a run can stop on; use names from {', '.join(STOP_SIGNALS)}"
            for name in self.stop_signals
            if name not in STOP_SIGNALS
        ]


@dataclass(frozen=True)
class Model:
    name: str = opt(
        "llama3",
        "Model family: llama3, qwen3, or one registered by the module named in experimental.custom_import.",
    )
    flavor: str = opt("debugmodel", "Size of the model family (a key of its flavors table).")
    tokenizer_path: str = opt(
        "./assets/tokenizer/python_stdlib_4k.model",
        "A Hugging Face tokenizer folder or tokenizer.json, a tiktoken BPE file or a sentencepiece model (told "
        "apart by content); the model's vocabulary is its size, padded to a multiple of 64.",
    )
    converters: list[str] = opt(
        [], "Model conversions applied before parallelizing: 'float8' (torchao float8 linear layers, see [float8])."
    )
    print_after_conversion: bool = opt(False, "Print the model's modules after the converters ran.")
    hf_assets_path: str | None = opt(
        None,
        "A Hugging Face model folder; read as the weights of checkpoint.initial_load_in_hf when "
        "checkpoint.initial_load_path is unset (the tokenizer comes from model.tokenizer_path).",
    )
    attn_mask_type: Literal["causal", "block_causal"] = opt(
        "causal",
        "causal: a token attends to every earlier token of its training window; block_causal: only to the earlier "
        "tokens of its own document (documents end at the EOS the data pipeline writes after each).",
    )
    attn_backend: Literal["auto", "sdpa", "split", "flex"] = opt(
        "auto",
        "The attention kernel. sdpa: scaled_dot_product_attention (with a boolean mask when the mask is more than "
        "causal); split: one causal SDPA call per document; flex: FlexAttention with a block mask, compiled (CUDA "
        "only: torch has no FlexAttention backward on CPU); auto: flex on CUDA for block_causal or sliding windows, "
        "sdpa otherwise. Context parallel uses its own ring attention, with the same mask.",
    )
    use_flex_attn: bool = opt(False, "The reference schema's spelling of attn_backend = 'flex'.")
    sliding_window: int | None = opt(
        None,
        "Sliding-window attention for families that have it (qwen3): layers max_window_layers and later attend to "
        "the last sliding_window positions only. Unset: the flavor's (none).",
    )
    max_window_layers: int | None = opt(
        None, "The first layer with a sliding window (the layers before it attend fully). Unset: the flavor's (0)."
    )
    mtp_depth: int | None = opt(
        None,
        "Multi-token prediction for families that have it (deepseek_v3): this many modules after the last layer, "
        "module k predicting the token k + 1 positions ahead. 0: off. Unset: the flavor's (0).",
    )
    mtp_loss_weight: float | None = opt(
        None, "The weight of the multi-token-prediction modules' mean loss in the gradient. Unset: the flavor's (0.3)."
    )

    def check(self) -> list[str]:
        return _failed(
            (self.sliding_window is None or self.sliding_window > 0,
             f"model.sliding_window must be a positive number of positions, got {self.sliding_window}; leave it "
             f"unset for attention over every earlier position"),
            (self.max_window_layers is None or self.max_window_layers >= 0,
             f"model.max_window_layers must be 0 or more, got {self.max_window_layers}"),
            (self.mtp_depth is None or self.mtp_depth >= 0,
             f"model.mtp_depth must be 0 (no multi-token prediction) or more, got {self.mtp_depth}"),
            (self.mtp_loss_weight is None or self.mtp_loss_weight >= 0,
             f"model.mtp_loss_weight must be 0 or more, got {self.mtp_loss_weight}"),
            (not self.use_flex_attn or self.attn_backend in ("auto", "flex"),
             f"model.use_flex_attn = true asks for FlexAttention but model.attn_backend = {self.attn_backend!r}; "
             f"keep one"),
        ) + [
            f"model.converters: unknown converter {c!r}; the only one is 'float8'"
            for c in self.converters
            if c != "float8"
        ]


MUON_KEYS = ("muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_adjust_lr")


@dataclass(frozen=True)
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon"] = opt(
        "AdamW",
        "Optimizer: AdamW (decoupled weight decay), Adam, or Muon (momentum orthogonalized by Newton-Schulz "
        "iterations) for the hidden matrices with AdamW for the rest: embeddings, norms, biases, and the "
        "parameters the model family names (the output layer, MoE routers). See docs/optimizers.md.",
    )
    lr: float = opt(8e-4, "Peak learning rate.")
    beta1: float = opt(0.9, "Adam beta1.")
    beta2: float = opt(0.95, "Adam beta2.")
    eps: float = opt(1e-8, "Adam epsilon.")
    weight_decay: float = opt(
        0.1,
        "Weight decay of the weight matrices (and embeddings, see weight_decay_embeddings); norm weights and "
        "biases get none unless weight_decay_norms_and_biases = true.",
    )
    weight_decay_norms_and_biases: bool = opt(
        False,
        "Also decay norm weights (the parameters of normalization modules, and any 1-D or scalar parameter) and "
        "biases. false (the default) leaves them undecayed, as current pre-training recipes do; true decays every "
        "parameter, as this version did before.",
    )
    weight_decay_embeddings: bool = opt(
        True, "Decay the token embeddings (nn.Embedding weights; a tied output layer shares them); false leaves them undecayed."
    )
    param_groups: list[str] = opt(
        [],
        "Groups of parameters with their own learning rate and weight decay: entries "
        "'PATTERN [lr_mult=X] [weight_decay=Y]', e.g. [\"tok_embeddings lr_mult=0.5 weight_decay=0\", "
        "\"layers\\\\.0\\\\. lr_mult=0.1\"] (on the command line comma-separated: a pattern given there cannot "
        "contain a comma). PATTERN is a regular expression searched in each parameter's full name (e.g. "
        "layers.0.attention.wq.weight; anchor it with ^ and $), the same in every parallel layout; a parameter "
        "several patterns match joins the first entry's group. lr_mult (default 1) multiplies the scheduled "
        "learning rate; weight_decay (default: as without the entry) replaces the decay; optimizer=AdamW (with "
        "optimizer.name = 'Muon') trains the matched parameters by AdamW where Muon would take them. Each "
        "pattern must match a parameter of the model (checked before launch).",
    )
    implementation: Literal["fused", "foreach", "for-loop"] = opt(
        "fused", "Kernel implementation of the optimizer step."
    )
    state_dtype: Literal["float32", "bfloat16"] = opt(
        "float32",
        "Dtype of the optimizer state (AdamW's moments, Muon's momentum). bfloat16 halves its memory; the "
        "update is still computed in float32 (AdamW and Muon only).",
    )
    # Muon's keys have no value of their own until set (None): set with another optimizer they are refused, so
    # a recipe never believes it tuned an optimizer it does not run. Unset with Muon: the default named.
    muon_lr: float | None = opt(
        None,
        "Muon's peak learning rate (the hidden matrices), scheduled like optimizer.lr; unset: optimizer.lr "
        "(with muon_adjust_lr = match_rms_adamw the update's RMS is AdamW's, so AdamW's rate serves).",
    )
    muon_momentum: float | None = opt(None, "Muon's momentum, in [0, 1); unset: 0.95.")
    muon_nesterov: bool | None = opt(None, "Muon's Nesterov momentum; unset: true.")
    muon_ns_steps: int | None = opt(None, "Newton-Schulz iterations of Muon's orthogonalization (1 to 99); unset: 5.")
    muon_adjust_lr: Literal["match_rms_adamw", "original", "none"] | None = opt(
        None,
        "Muon's learning rate per A x B matrix: match_rms_adamw (lr x 0.2 x sqrt(max(A, B)), Moonlight: the "
        "update's RMS matches AdamW's), original (lr x sqrt(max(1, A / B)), Keller Jordan's) or none; unset: "
        "match_rms_adamw.",
    )

    def check(self) -> list[str]:
        problems = _failed(
            (self.lr > 0, f"optimizer.lr must be greater than 0, got {self.lr}"),
            (not self.lr > 0 or self.lr < math.inf, f"optimizer.lr must be a finite number, got {self.lr}"),
            (self.eps > 0, f"optimizer.eps must be greater than 0, got {self.eps}"),
            (self.weight_decay >= 0, f"optimizer.weight_decay must be 0 or more, got {self.weight_decay}"),
            (0 <= self.beta1 < 1, f"optimizer.beta1 must be in [0, 1), got {self.beta1}"),
            (0 <= self.beta2 < 1, f"optimizer.beta2 must be in [0, 1), got {self.beta2}"),
            (self.muon_lr is None or 0 < self.muon_lr < math.inf,
             f"optimizer.muon_lr must be a finite number greater than 0, got {self.muon_lr}"),
            (self.muon_momentum is None or 0 <= self.muon_momentum < 1,
             f"optimizer.muon_momentum must be in [0, 1), got {self.muon_momentum}"),
            (self.muon_ns_steps is None or 1 <= self.muon_ns_steps <= 99,
             f"optimizer.muon_ns_steps must be between 1 and 99, got {self.muon_ns_steps}"),
            (self.state_dtype == "float32" or self.name != "Adam",
             "optimizer.state_dtype = 'bfloat16' works with optimizer.name = 'AdamW' or 'Muon', not 'Adam'"),
        )
        muon_keys = [f"optimizer.{k}" for k in MUON_KEYS if getattr(self, k) is not None]
        if muon_keys and self.name != "Muon":
            problems.append(
                f"{', '.join(muon_keys)} {'applies' if len(muon_keys) == 1 else 'apply'} to optimizer.name = 'Muon' "
                f"only, and it is {self.name!r}; remove {'it' if len(muon_keys) == 1 else 'them'} or set "
                f"optimizer.name = 'Muon'"
            )
        try:
            forced = [rule.pattern for rule in parse_param_groups(self.param_groups) if rule.adamw]
        except UserError as e:
            problems.append(str(e))
            forced = []
        if forced and self.name != "Muon":
            problems.append(f"optimizer.param_groups: optimizer=AdamW ({', '.join(map(repr, forced))}) chooses between "
                            f"Muon and AdamW, and optimizer.name is {self.name!r}; remove it or set optimizer.name = "
                            f"'Muon'")
        return problems


@dataclass(frozen=True)
class LRScheduler:
    warmup_steps: int = opt(200, "Steps of linear warmup from near zero to the peak learning rate.")
    decay_ratio: float | None = opt(
        None,
        "Fraction of the steps (after warmup) spent decaying; the steps between warmup and decay "
        "hold the peak (warmup-stable-decay). Unset: decay over all steps after warmup.",
    )
    decay_type: Literal["linear", "sqrt", "cosine"] = opt("linear", "Shape of the decay.")
    min_lr_factor: float = opt(0.0, "Final learning rate as a fraction of the peak.")

    def check(self) -> list[str]:
        return _failed(
            (self.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be 0 or more, got {self.warmup_steps}"),
            (self.decay_ratio is None or 0 <= self.decay_ratio <= 1,
             f"lr_scheduler.decay_ratio must be in [0, 1] (or unset to decay over all steps after warmup), got "
             f"{self.decay_ratio}"),
            (0 <= self.min_lr_factor <= 1, f"lr_scheduler.min_lr_factor must be in [0, 1], got {self.min_lr_factor}"),
        )


PATH_DATASETS = {
    "local": "data file or folder (.jsonl, .json, .txt, their .gz/.zst, .parquet, Arrow)",
    "huggingface": "dataset name or path",
    "tokens": "folder scripts/pretokenize.py wrote",
}


def _data_rules(section: str, values: "Training | Validation") -> list[str]:
    """The rules [training] and [validation] share: batch size, and one source given one way (dataset_mix, or
    dataset with dataset_path where it reads one). The rules that also read [parallelism] are in rules.py."""
    problems = _positive(section, values, "local_batch_size")
    dataset, path = values.dataset, values.dataset_path
    if values.dataset_mix:
        try:
            parse_mix(values.dataset_mix, f"{section}.dataset_mix")
        except UserError as e:
            problems.append(str(e))
        if dataset != type(values)().dataset or path is not None:
            problems.append(
                f"{section}.dataset_mix is set, so {section}.dataset ({dataset!r}) and {section}.dataset_path "
                f"({path!r}) are not used; remove them (a mixture names every source itself)"
            )
    elif dataset in PATH_DATASETS and not path:
        problems.append(
            f'{section}.dataset = "{dataset}" needs {section}.dataset_path; set it to the {PATH_DATASETS[dataset]}'
        )
    elif dataset in ("python_stdlib", "python_stdlib_test") and path is not None:
        problems.append(
            f'{section}.dataset_path = {path!r} is set but {section}.dataset = "{dataset}" does not read it; set '
            f'{section}.dataset = "local" (or "huggingface") to read it, or remove dataset_path'
        )
    return problems


@dataclass(frozen=True)
class Training:
    dataset: Literal["python_stdlib", "local", "huggingface", "c4", "c4_test", "tokens"] = opt(
        "python_stdlib",
        "python_stdlib: the .py files of this interpreter's standard library (embedded, offline); "
        "local: the file or folder at dataset_path (.jsonl/.json/.txt, also .gz/.zst compressed, .parquet, .arrow, "
        "datasets save_to_disk folders); huggingface: datasets.load_dataset(dataset_path, split='train', "
        "streaming=True) (needs the datasets package); c4: allenai/c4 'en' streamed through datasets (needs it and "
        "the network); c4_test: the reference torchtitan's local C4 sample, tests/assets/c4_test; tokens: the "
        "token folder at dataset_path written by scripts/pretokenize.py (the same samples as its source, memory-mapped).",
    )
    dataset_path: str | None = opt(
        None,
        "File or folder (local), dataset name or path (huggingface); for c4 another hub name or a local copy "
        "(a clone's en/c4-train.*.json.gz shards are read), for c4_test where the sample is. Relative paths are "
        "relative to the working directory.",
    )
    dataset_mix: list[str] = opt(
        [],
        "A mixture of sources instead of dataset and dataset_path: WEIGHT:SOURCE entries, e.g. "
        "[\"0.6:data/web\", \"0.4:python_stdlib\"] (on the command line 0.6:data/web,0.4:python_stdlib). A weight is "
        "the share of training sequences (hence tokens) its source supplies; weights are normalized. SOURCE: a path (a "
        "data file or folder of any supported format, or a token folder), python_stdlib, c4, c4_test, or hf:NAME (a "
        "Hugging Face dataset streamed through datasets). Each source is shuffled, repeats and resumes on its own, "
        "as training.dataset would; metrics.jsonl logs data_share/I and data_epoch/I per source.",
    )
    dataset_text_field: str = opt(
        "text",
        "The field of each JSON record, or the column of a parquet/Arrow/huggingface dataset, that holds the "
        "document text (.txt files are whole documents; python_stdlib ignores it).",
    )
    shuffle_documents: bool | None = opt(
        None,
        "Shuffle the data each epoch, seeded by training.seed: the same on every rank and layout, restored exactly "
        "on resume. Each sample position of the global batch is a lane that reads its own share of every source "
        "(components/data/lanes.py); shuffled, the units (files, pieces of files, ranges of documents) are dealt "
        "to the lanes in a new order each epoch, and each lane reads its documents in a seeded order (with random "
        "access: a permutation; read as a stream: within blocks of shuffle_buffer; a datasets stream's units are "
        "its shards). Unset: shuffle, except datasets streams (huggingface, c4 from the Hub), read in the order "
        "datasets gives. false: stored order.",
    )
    shuffle_buffer: int = opt(
        10_000,
        "Shuffled sources read as streams (JSON lines, parquet, datasets streams): each lane shuffles its "
        "documents within consecutive blocks of this many, held in memory per lane and source (read again on "
        "resume).",
    )
    skip_corrupt_files: bool = opt(
        False,
        "Local files: a file that fails to read past its start (corrupt compression, an invalid JSON line, a "
        "failing parquet row group) is read no further, and a document read by index from it is taken as empty, "
        "each with a warning naming the file and a running count, instead of stopping the run. The same on every "
        "rank and layout, and on resume. A file unreadable from its start is still refused before launch.",
    )
    data_workers: int = opt(
        0,
        "Processes per rank that read, tokenize and pack this rank's lanes ahead of training (each worker some of "
        "the lanes; at most one per lane). The samples, their order and the resumable state are the same for "
        "every count. 0: in the trainer process. A token folder alone (tokens) has nothing to tokenize and is "
        "read in the trainer process (memory-mapped).",
    )
    local_batch_size: int = opt(8, "Sequences per data-parallel rank per micro-batch.")
    global_batch_size: int = opt(
        -1,
        "Sequences per optimizer step over all ranks; a multiple of local_batch_size x data-parallel "
        "degree, the quotient being the gradient-accumulation steps. -1: local_batch_size x dp degree.",
    )
    seq_len: int = opt(2048, "Tokens per training sequence.")
    ignore_cross_document_labels: bool = opt(
        False,
        "Leave out of the loss the prediction of each document's first token from the previous document's last "
        "(label -100). The loss is the sum over the labels that count divided by their number in the whole "
        "optimizer step, over all ranks and micro-batches.",
    )
    max_norm: float = opt(1.0, "Clip the global gradient norm to this value (0 disables clipping).")
    steps: int = opt(10000, "Optimizer steps to train.")
    mixed_precision_param: Literal["bfloat16", "float32"] = opt(
        "bfloat16", "Dtype of parameters in forward/backward (FSDP mixed precision, or autocast without FSDP)."
    )
    mixed_precision_reduce: Literal["float32", "bfloat16"] = opt(
        "float32", "Dtype of the FSDP gradient reduction."
    )
    compile: bool = opt(
        False, "torch.compile each transformer block (after activation checkpointing, before FSDP)."
    )
    enable_cpu_offload: bool = opt(
        False,
        "Keep parameters, gradients and optimizer state in host memory between uses (FSDP2 offload; "
        "CUDA only: on a CPU device everything already lives in host memory).",
    )
    gc_freq: int = opt(50, "Run Python's garbage collector every this many steps (automatic GC is off).")
    seed: int = opt(0, "Seed for weight init and every random number generator.")
    deterministic: bool = opt(False, "Use deterministic algorithms only (slower; bitwise-repeatable runs).")
    skip_nonfinite_steps: bool = opt(
        False,
        "On a non-finite loss or gradient norm, skip that optimizer step (weights, optimizer and expert "
        "statistics unchanged; counted as skipped_steps) instead of stopping the run.",
    )
    max_skipped_steps_in_a_row: int = opt(
        10, "With skip_nonfinite_steps: stop the run when this many steps in a row are non-finite."
    )

    def check(self) -> list[str]:
        return _data_rules("training", self) + _positive(
            "training", self, "seq_len", "steps", "gc_freq", "max_skipped_steps_in_a_row"
        ) + _failed(
            (self.global_batch_size == -1 or self.global_batch_size > 0,
             f"training.global_batch_size must be -1 (local_batch_size x data-parallel degree) or a positive "
             f"integer, got {self.global_batch_size}"),
            (self.max_norm >= 0, f"training.max_norm must be 0 (no clipping) or more, got {self.max_norm}"),
            (self.shuffle_buffer >= 1,
             f"training.shuffle_buffer must be 1 or more documents, got {self.shuffle_buffer}"),
            (self.data_workers >= 0,
             f"training.data_workers must be 0 (read in the trainer) or more, got {self.data_workers}"),
            (self.dataset != "tokens" or self.data_workers == 0,
             f'training.data_workers = {self.data_workers} with training.dataset = "tokens": a token folder has '
             "nothing to tokenize and is read memory-mapped in the trainer; set data_workers = 0"),
            (bool(self.dataset_text_field),
             "training.dataset_text_field is empty; set it to the field or column holding the text (default 'text')"),
        )


# Pipeline schedules (lower case) that split the backward into input-grad (B) and weight-grad (W)
# steps; FSDP must keep their blocks gathered between forward and backward.
ZERO_BUBBLE_SCHEDULES = frozenset({"interleavedzerobubble", "zbvzerobubble", "dualpipev"})


@dataclass(frozen=True)
class Parallelism:
    data_parallel_replicate_degree: int = opt(
        1, "Replicas (DDP, or HSDP's replicate dimension when data_parallel_shard_degree > 1)."
    )
    data_parallel_shard_degree: int = opt(
        -1, "FSDP shard degree; -1 fills the ranks left over by the other degrees."
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = opt(
        "default",
        "Free gathered parameters after forward (always), keep them until backward (never), "
        "or default (always, except for the root module whose parameters backward needs first).",
    )
    tensor_parallel_degree: int = opt(
        1, "Tensor + sequence parallel degree (innermost mesh dimension; divides heads, KV heads and seq_len)."
    )
    disable_loss_parallel: bool = opt(
        False, "With tensor parallel: gather the logits instead of computing the loss on vocabulary shards."
    )
    enable_async_tensor_parallel: bool = opt(
        False, "Overlap tensor-parallel communication with matmuls (CUDA with training.compile only)."
    )
    context_parallel_degree: int = opt(
        1,
        "Context parallel degree: each sequence is split over this many ranks (load-balanced chunks, ring "
        "attention); seq_len must be divisible by 2 x context_parallel_degree x tensor_parallel_degree.",
    )
    expert_parallel_degree: int = opt(
        1,
        "Expert parallel degree (models with a mixture of experts): the experts are split over this many ranks "
        "taken from data_parallel_shard_degree x context_parallel_degree, tokens travel to their experts by "
        "all-to-all; FSDP shards the experts over the ranks that remain. Must divide the number of experts.",
    )
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = opt(
        "allgather",
        "How context-parallel attention sees the other ranks' keys and values: allgather (gather them all at "
        "once) or alltoall (pass them around the ring one block per step, merging partial softmaxes).",
    )
    pipeline_parallel_degree: int = opt(1, "Pipeline stages' ranks (outermost mesh dimension).")
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "GPipe, 1F1B (one stage per rank), Interleaved1F1B, LoopedBFS, InterleavedZeroBubble (several stages "
        "per rank), ZBVZeroBubble, DualPipeV (two stages per rank in a V).",
    )
    pipeline_parallel_schedule_csv: str | None = opt(
        None, "A custom schedule: a CSV file with one row of compute actions (e.g. 0F0,0B0) per pipeline rank."
    )
    pipeline_parallel_microbatch_size: int = opt(1, "Sequences per pipeline microbatch (divides local_batch_size).")
    pipeline_parallel_layers_per_stage: int | None = opt(
        None, "Transformer layers per stage (unset: one stage per rank, or two for multi-stage schedules)."
    )
    module_fqns_per_model_part: list[list[str]] = opt(
        [],
        "An explicit pipeline split: the module names of each stage in model order, e.g. [['tok_embeddings', "
        "'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'norm', 'output']] (on the command line: "
        "'tok_embeddings,layers.0,layers.1;layers.2,layers.3,norm,output'); replaces the split by layers.",
    )
    pipeline_parallel_split_points: list[str] = opt(
        [],
        "The older form of an explicit split: the modules at which a new stage begins, e.g. ['layers.2'].",
    )
    pipeline_parallel_first_stage_less_layers: int = opt(
        1, "The first stage holds this many fewer layers (it also holds the embedding)."
    )
    pipeline_parallel_last_stage_less_layers: int = opt(
        1, "The last stage holds this many fewer layers (it also holds the output layer and the loss)."
    )

    def check(self) -> list[str]:
        degrees = ("data_parallel_replicate_degree", "pipeline_parallel_degree", "pipeline_parallel_microbatch_size",
                   "tensor_parallel_degree", "expert_parallel_degree", "context_parallel_degree")
        fewer = ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers")
        splits = ("module_fqns_per_model_part", "pipeline_parallel_split_points")
        pp = self.pipeline_parallel_degree
        problems = [f"parallelism.{k} must be 1 or more, got {getattr(self, k)}" for k in degrees
                    if not getattr(self, k) >= 1]
        problems += [f"parallelism.{k} must be 0 or more, got {getattr(self, k)}" for k in fewer
                     if not getattr(self, k) >= 0]
        problems += [
            f"parallelism.{k} splits the model into pipeline stages, but pipeline_parallel_degree is {pp}; set "
            f"pipeline_parallel_degree > 1 or remove it" for k in splits if getattr(self, k) and not pp > 1
        ]
        problems += _failed((
            self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
            f"parallelism.data_parallel_shard_degree must be -1 (use the ranks left over) or 1 or more, "
            f"got {self.data_parallel_shard_degree}",
        ))
        if pp > 1:
            explicit = [k for k in splits if getattr(self, k)]
            schedule, csv = self.pipeline_parallel_schedule, self.pipeline_parallel_schedule_csv
            problems += _failed(
                (not (schedule.lower() in ZERO_BUBBLE_SCHEDULES and self.fsdp_reshard_after_forward == "always"),
                 f"parallelism.fsdp_reshard_after_forward = 'always' cannot be used with pipeline_parallel_schedule "
                 f"= {schedule!r}: its split weight-gradient step needs the gathered block weights (resharding "
                 "silently drops their gradients); use 'default'"),
                (len(explicit) < 2,
                 "parallelism.module_fqns_per_model_part and parallelism.pipeline_parallel_split_points both split "
                 "the pipeline; set one of them"),
                (not (explicit and self.pipeline_parallel_layers_per_stage is not None),
                 f"parallelism.{explicit[0] if explicit else ''} and parallelism.pipeline_parallel_layers_per_stage "
                 "both split the pipeline; set one of them"),
                (not csv or os.path.isfile(csv), f"parallelism.pipeline_parallel_schedule_csv: {csv} does not exist"),
            )
        return problems


@dataclass(frozen=True)
class Metrics:
    log_freq: int = opt(10, "Log metrics every this many steps (and at the first and last step).")
    enable_tensorboard: bool = opt(False, "Write TensorBoard scalars to {dump_folder}/{save_tb_folder}.")
    save_tb_folder: str = opt("tb", "TensorBoard folder under dump_folder.")
    device_peak_tflops: float = opt(
        0.0,
        "Peak TFLOP/s of one device for MFU. 0: from a table of known GPUs, or on CPU measured at "
        "start with a short matmul in the training dtype.",
    )
    disable_color_printing: bool = opt(
        False, "Plain console lines; otherwise the step line is colored when the console is a terminal."
    )
    enable_wandb: bool = opt(
        False,
        "Log metrics and the resolved config to Weights & Biases too (the wandb package; project WANDB_PROJECT, "
        "default torchtitan). Offline, into {dump_folder}/wandb, unless an API key is set and the service answers "
        "(or as WANDB_MODE says); a resumed run continues the same wandb run.",
    )

    def check(self) -> list[str]:
        return _positive("metrics", self, "log_freq") + _failed((
            self.device_peak_tflops >= 0,
            f"metrics.device_peak_tflops must be 0 (auto) or more, got {self.device_peak_tflops}",
        ))


@dataclass(frozen=True)
class Comm:
    init_timeout_seconds: int = opt(
        300, "Timeout of process-group initialization and of every collective until the first step is done."
    )
    train_timeout_seconds: int = opt(
        100, "Timeout of every collective after the first step (which may compile, load and warm up)."
    )
    trace_buf_size: int = opt(
        20000,
        "Entries of the collectives' flight recorder (TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE, "
        "unless set in the environment); 0 turns it off.",
    )

    def check(self) -> list[str]:
        # A collective's time limit: 0 would time out every collective at once, a negative one is refused by
        # the process group on every rank (gloo: "Invalid timeout") once the job has started.
        problems = [
            f"comm.{key} must be a positive number of seconds, got {getattr(self, key)}; set it to 1 or more "
            f"(default {getattr(Comm(), key)})"
            for key in ("init_timeout_seconds", "train_timeout_seconds")
            if not getattr(self, key) > 0
        ]
        return problems + _failed((
            self.trace_buf_size >= 0,
            f"comm.trace_buf_size must be 0 (flight recorder off) or more entries, got {self.trace_buf_size}",
        ))


@dataclass(frozen=True)
class ActivationCheckpoint:
    mode: Literal["none", "selective", "full"] = opt(
        "none",
        "Recompute activations in backward instead of keeping them: none, full (every block), or "
        "selective (see selective_ac_option).",
    )
    selective_ac_option: str = opt(
        "2",
        "With mode = selective: a positive integer N checkpoints every N-th block; 'op' keeps the outputs "
        "of attention and of every other matmul in each block and recomputes the rest.",
    )

    def check(self) -> list[str]:
        option = self.selective_ac_option
        return _failed((
            self.mode != "selective" or option == "op" or (option.isdigit() and int(option) > 0),
            f"activation_checkpoint.selective_ac_option must be a positive integer (checkpoint every N-th block) "
            f"or 'op' (operator-level policy), got {option!r}",
        ))


@dataclass(frozen=True)
class Float8:
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = opt(
        "tensorwise", "torchao float8 recipe: one scale per tensor, or per row (rowwise needs CUDA kernels for speed)."
    )
    enable_fsdp_float8_all_gather: bool = opt(
        False, "All-gather FSDP parameters in float8 (tensorwise recipe only): half the bytes of bf16."
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "Compute all float8 weight scales in one fused step after the optimizer (with float8 all-gather)."
    )
    filter_fqns: list[str] = opt(
        ["output"], "Linear layers whose name contains any of these stay in high precision."
    )
    emulate: bool = opt(False, "Emulate float8 matmuls in high precision (for testing on hardware without float8).")

    def check(self) -> list[str]:
        return _failed((
            not self.precompute_float8_dynamic_scale_for_fsdp or self.enable_fsdp_float8_all_gather,
            "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather = true",
        ))


@dataclass(frozen=True)
class Profiling:
    enable_profiling: bool = opt(False, "Record torch profiler traces every profile_freq steps.")
    save_traces_folder: str = opt("profile_traces", "Trace folder under dump_folder (one file per rank and step).")
    profile_freq: int = opt(10, "Profile one step out of every this many.")
    enable_memory_snapshot: bool = opt(
        False,
        "Record memory: CUDA allocator snapshots (and a dump on out-of-memory); on CPU a profiler memory timeline.",
    )
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Memory snapshot folder under dump_folder.")

    def check(self) -> list[str]:
        return _failed(
            (self.profile_freq > 0, f"profiling.profile_freq must be a positive integer, got {self.profile_freq}")
        )


@dataclass(frozen=True)
class Checkpoint:
    enable_checkpoint: bool = opt(
        False,
        "Save checkpoints to {dump_folder}/{folder}/step-N and, at start, resume from the newest complete one.",
    )
    folder: str = opt("checkpoint", "Checkpoint folder under dump_folder.")
    interval: int = opt(500, "Save every this many steps (and at the last step).")
    keep_latest_k: int = opt(
        10, "Keep this many newest complete checkpoints, deleting older ones after a save (0: keep all)."
    )
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = opt(
        "disabled",
        "disabled: training waits for each save; async: files are written in a background thread while "
        "training goes on; async_with_pinned_mem: as async, staging through pinned host memory (CUDA only).",
    )
    load_step: int = opt(-1, "Resume from this step's checkpoint instead of the newest (-1: newest).")
    exclude_from_loading: list[str] = opt(
        [], "Parts of a checkpoint not to restore on resume: any of model, optimizer, lr_scheduler, dataloader, train_state."
    )
    initial_load_path: str | None = opt(
        None,
        "When the checkpoint folder holds no checkpoint: start from this checkpoint folder (a step-N folder, "
        "or a Hugging Face folder with initial_load_in_hf).",
    )
    initial_load_model_only: bool = opt(True, "Load only the model weights from initial_load_path.")
    initial_load_in_hf: bool = opt(
        False, "initial_load_path is a Hugging Face folder (config.json + *.safetensors)."
    )
    last_save_model_only: bool = opt(
        True, "The save at the last step holds the model weights only (in export_dtype), for inference."
    )
    last_save_in_hf: bool = opt(
        False, "Also export the last step's weights as a Hugging Face folder {folder}/step-N-hf."
    )
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32", "Dtype of model-only saves and Hugging Face exports."
    )
    hf_max_shard_mb: int = opt(
        5120,
        "The largest safetensors file of a Hugging Face export, in MiB (a larger tensor gets a file of its own). "
        "Each file's writer holds its tensors until the file is written.",
    )
    enable_first_step_checkpoint: bool = opt(False, "Also save right after the first step.")
    create_seed_checkpoint: bool = opt(
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
        return problems + _failed(
            (self.hf_max_shard_mb >= 1, f"checkpoint.hf_max_shard_mb must be 1 or more, got {self.hf_max_shard_mb}"),
            (self.interval > 0, f"checkpoint.interval must be a positive integer, got {self.interval}"),
            (self.keep_latest_k >= 0,
             f"checkpoint.keep_latest_k must be 0 (keep all) or more, got {self.keep_latest_k}"),
            (self.load_step >= -1, f"checkpoint.load_step must be -1 (newest) or a step number, got {self.load_step}"),
            (not (self.initial_load_in_hf and not self.initial_load_model_only),
             "checkpoint.initial_load_in_hf loads weights only; set checkpoint.initial_load_model_only = true"),
            (not (self.create_seed_checkpoint and not self.enable_checkpoint),
             "checkpoint.create_seed_checkpoint writes into the checkpoint folder; also set "
             "checkpoint.enable_checkpoint = true"),
        )


@dataclass(frozen=True)
class MoE:
    top_k: int | None = opt(None, "Experts per token (unset: the flavor's); changes the model's compute, not its weights.")
    load_balance_coeff: float | None = opt(
        None,
        "Update rate of the auxiliary-loss-free expert bias (moved after every step toward equal expert loads); "
        "0 turns the bias off. Unset: the flavor's (1e-3 for Qwen3-MoE).",
    )
    seq_aux_loss_coeff: float | None = opt(
        None, "Coefficient of the sequence-wise load-balancing auxiliary loss (0: off). Unset: the flavor's (0)."
    )
    z_loss_coeff: float | None = opt(None, "Coefficient of the router z-loss (0: off). Unset: the flavor's (0).")
    capacity_factor: float | None = opt(
        None,
        "Each expert keeps at most capacity_factor x tokens x top_k / experts assignments per micro-batch, the "
        "highest-scored; the rest are dropped (their share is reported). 0: no limit. Unset: the flavor's (no limit).",
    )

    def check(self) -> list[str]:
        problems = [
            f"moe.{key} must be 0 (off) or more, got {getattr(self, key)}"
            for key in ("load_balance_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "capacity_factor")
            if not (getattr(self, key) is None or getattr(self, key) >= 0)
        ]
        return problems + _failed(
            (self.top_k is None or self.top_k >= 1, f"moe.top_k must be 1 or more, got {self.top_k}")
        )


VALIDATION_DATASETS = ("python_stdlib_test", "python_stdlib", "local", "huggingface", "c4_test")


@dataclass(frozen=True)
class Validation:
    enabled: bool = opt(
        False,
        "Compute the loss and perplexity on held-out data every freq steps and at the last step (logged as "
        "validation_loss and validation_perplexity).",
    )
    # A string, not a Literal: reference recipes name their own sets (c4_validation) while disabled.
    dataset: str = opt(
        "python_stdlib_test",
        "python_stdlib_test: the test files of this interpreter's standard library, which the python_stdlib "
        "training corpus leaves out (embedded, offline); python_stdlib, local, huggingface: as training.dataset.",
    )
    dataset_path: str | None = opt(None, "File or folder (local) or dataset name/path (huggingface).")
    dataset_mix: list[str] = opt(
        [],
        "A validation mixture instead of dataset and dataset_path: WEIGHT:SOURCE entries as training.dataset_mix "
        "takes them (paths, token folders, python_stdlib, python_stdlib_test, c4_test, hf:NAME). Each source is read "
        "in stored order from its first document; the set ends where the schedule first asks a source past its end.",
    )
    local_batch_size: int = opt(8, "Validation sequences per data-parallel rank per batch.")
    seq_len: int = opt(
        -1,
        "Tokens per validation sequence; at most training.seq_len (the model's positions), equal to it with "
        "context parallel. -1: training.seq_len.",
    )
    freq: int = opt(500, "Validate every this many steps (and at the last step).")
    steps: int = opt(
        -1,
        "Global validation batches per run, always from the start of the set and never past its end; -1: every "
        "complete batch of one pass over the set.",
    )

    def check(self) -> list[str]:
        if not self.enabled:
            return []  # a disabled section loads with any values (reference recipes name their own sets)
        return _data_rules("validation", self) + _positive("validation", self, "freq") + _failed(
            (self.steps == -1 or self.steps > 0,
             f"validation.steps must be -1 (one pass over the validation set) or a positive integer, got {self.steps}"),
            (self.dataset in VALIDATION_DATASETS,
             f"validation.dataset = {self.dataset!r} is not available here; choose one of "
             f"{', '.join(VALIDATION_DATASETS)} (local and huggingface read validation.dataset_path)"),
            (self.seq_len == -1 or self.seq_len > 0,
             f"validation.seq_len must be -1 (training.seq_len) or a positive integer, got {self.seq_len}"),
        )


@dataclass(frozen=True)
class MemoryEstimation:
    enabled: bool = opt(
        False,
        "Before launch, print the estimated memory per rank of this recipe's layout (parameters, gradients, "
        "optimizer state, activations, logits, communication buffers: torchtitan.planner) and refuse a layout that "
        "cannot fit the device memory (on CPU: the host memory per process of this node). scripts/plan.py compares "
        "every layout.",
    )


@dataclass(frozen=True)
class Experimental:
    custom_import: str = opt(
        "",
        "A module to import before the model is looked up, e.g. one that registers a model family defined "
        "outside torchtitan with torchtitan.models.registry.register_model: a dotted name importable from the "
        "working directory or PYTHONPATH, or the path of a .py file. Empty: none.",
    )


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

PLANNED_KEYS: dict[str, dict[str, object]] = {
    "training": {"gc_debug": False},
    "float8": {"moe_fqns_prototype": []},
    "parallelism": {
        "enable_compiled_autograd": False,
    },
    "metrics": {"save_for_all_ranks": False},
    "memory_estimation": {"disable_fake_mode": False},
    "experimental": {"custom_args_module": ""},
}

# What a user reads when a planned key asks for something.
PLANNED_WHY: dict[str, str] = {
    "parallelism": "this parallelism option is not implemented",
    "metrics": "this metrics backend is not implemented",
    "memory_estimation": "the estimate is computed from the model spec and never runs the model in fake mode",
    "experimental": "custom config sections are not supported; a custom model registers through experimental.custom_import",
}
PLANNED_WHY["parallelism.enable_compiled_autograd"] = "compiled autograd is not supported (it broke FSDP2 parity)"
PLANNED_WHY["training.gc_debug"] = "gc_debug is not implemented"
PLANNED_WHY["float8.moe_fqns_prototype"] = (
    "float8 for the MoE experts' weights (their grouped matmuls) needs torchao's prototype scaled grouped GEMM, "
    "which runs on CUDA SM90+ only and is not wired here; the float8 converter keeps experts and routers in high "
    "precision"
)
