"""The sections of the training itself: the optimizer, its learning-rate schedule, the training data and
loop, and validation (which shares training's data rules)."""

import math
from dataclasses import dataclass
from typing import Literal

from torchtitan.config.entries import parse_mix, parse_param_groups
from torchtitan.config.errors import UserError
from torchtitan.config.fields import broken_rules, option, positive

# The sources training.dataset names (a mixture's SOURCE and validation.dataset name them too).
TrainingDataset = Literal["python_stdlib", "local", "huggingface", "c4", "c4_test", "tokens"]

MUON_KEYS = ("muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_ns_dtype", "muon_adjust_lr")


@dataclass(frozen=True)
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon"] = option(
        "AdamW",
        "Optimizer: AdamW (decoupled weight decay), Adam, or Muon (momentum orthogonalized by Newton-Schulz "
        "iterations) for the hidden matrices with AdamW for the rest: embeddings, norms, biases, and the "
        "parameters the model family names (the output layer, MoE routers). See docs/optimizers.md.",
    )
    lr: float = option(8e-4, "Peak learning rate.")
    beta1: float = option(0.9, "Adam beta1.")
    beta2: float = option(0.95, "Adam beta2.")
    eps: float = option(1e-8, "Adam epsilon.")
    weight_decay: float = option(
        0.1,
        "Weight decay of the weight matrices (and embeddings, see weight_decay_embeddings); norm weights and "
        "biases get none unless weight_decay_norms_and_biases = true.",
    )
    weight_decay_norms_and_biases: bool = option(
        False,
        "Also decay norm weights (the parameters of normalization modules, and any 1-D or scalar parameter) and "
        "biases. false (the default) leaves them undecayed, as current pre-training recipes do; true decays every "
        "parameter, as this version did before.",
    )
    weight_decay_embeddings: bool = option(
        True,
        "Decay the token embeddings (nn.Embedding weights; a tied output layer shares them); "
        "false leaves them undecayed.",
    )
    param_groups: list[str] = option(
        [],
        "Groups of parameters with their own learning rate and weight decay: entries "
        "'PATTERN [lr_mult=X] [weight_decay=Y]', e.g. [\"tok_embeddings lr_mult=0.5 weight_decay=0\", "
        '"layers\\\\.0\\\\. lr_mult=0.1"] (on the command line comma-separated: a pattern given there cannot '
        "contain a comma). PATTERN is a regular expression searched in each parameter's full name (e.g. "
        "layers.0.attention.wq.weight; anchor it with ^ and $), the same in every parallel layout; a parameter "
        "several patterns match joins the first entry's group. lr_mult (default 1) multiplies the scheduled "
        "learning rate; weight_decay (default: as without the entry) replaces the decay; optimizer=AdamW (with "
        "optimizer.name = 'Muon') trains the matched parameters by AdamW where Muon would take them. Each "
        "pattern must match a parameter of the model (checked before launch).",
    )
    implementation: Literal["fused", "foreach", "for-loop"] = option(
        "fused", "Kernel implementation of the optimizer step."
    )
    state_dtype: Literal["float32", "bfloat16"] = option(
        "float32",
        "Dtype of the optimizer state (AdamW's moments, Muon's momentum). bfloat16 halves its memory; the "
        "update is still computed in float32 (AdamW and Muon only).",
    )
    # Muon's keys have no value of their own until set (None): set with another optimizer they are refused, so
    # a recipe never believes it tuned an optimizer it does not run. Unset with Muon: the default named.
    muon_lr: float | None = option(
        None,
        "Muon's peak learning rate (the hidden matrices), scheduled like optimizer.lr; unset: optimizer.lr "
        "(with muon_adjust_lr = match_rms_adamw the update's RMS is AdamW's, so AdamW's rate serves).",
    )
    muon_momentum: float | None = option(None, "Muon's momentum, in [0, 1); unset: 0.95.")
    muon_nesterov: bool | None = option(None, "Muon's Nesterov momentum; unset: true.")
    muon_ns_steps: int | None = option(
        None, "Newton-Schulz iterations of Muon's orthogonalization (1 to 99); unset: 5."
    )
    muon_ns_dtype: Literal["bfloat16", "float32"] | None = option(
        None,
        "Dtype of Muon's Newton-Schulz iterations; unset: bfloat16 (as torch.optim.Muon). float32 on a CPU without "
        "native bf16 arithmetic, where bf16 matmuls run tens of times slower.",
    )
    muon_adjust_lr: Literal["match_rms_adamw", "original", "none"] | None = option(
        None,
        "Muon's learning rate per A x B matrix: match_rms_adamw (lr x 0.2 x sqrt(max(A, B)), Moonlight: the "
        "update's RMS matches AdamW's), original (lr x sqrt(max(1, A / B)), Keller Jordan's) or none; unset: "
        "match_rms_adamw.",
    )

    def check(self) -> list[str]:
        problems = broken_rules(
            (self.lr > 0, f"optimizer.lr must be greater than 0, got {self.lr}"),
            (not self.lr > 0 or self.lr < math.inf, f"optimizer.lr must be a finite number, got {self.lr}"),
            (self.eps > 0, f"optimizer.eps must be greater than 0, got {self.eps}"),
            (self.weight_decay >= 0, f"optimizer.weight_decay must be 0 or more, got {self.weight_decay}"),
            (0 <= self.beta1 < 1, f"optimizer.beta1 must be in [0, 1), got {self.beta1}"),
            (0 <= self.beta2 < 1, f"optimizer.beta2 must be in [0, 1), got {self.beta2}"),
            (
                self.muon_lr is None or 0 < self.muon_lr < math.inf,
                f"optimizer.muon_lr must be a finite number greater than 0, got {self.muon_lr}",
            ),
            (
                self.muon_momentum is None or 0 <= self.muon_momentum < 1,
                f"optimizer.muon_momentum must be in [0, 1), got {self.muon_momentum}",
            ),
            (
                self.muon_ns_steps is None or 1 <= self.muon_ns_steps <= 99,
                f"optimizer.muon_ns_steps must be between 1 and 99, got {self.muon_ns_steps}",
            ),
            (
                self.state_dtype == "float32" or self.name != "Adam",
                "optimizer.state_dtype = 'bfloat16' works with optimizer.name = 'AdamW' or 'Muon', not 'Adam'",
            ),
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
            problems.append(
                f"optimizer.param_groups: optimizer=AdamW ({', '.join(map(repr, forced))}) chooses between "
                f"Muon and AdamW, and optimizer.name is {self.name!r}; remove it or set optimizer.name = "
                f"'Muon'"
            )
        return problems


@dataclass(frozen=True)
class LRScheduler:
    warmup_steps: int = option(200, "Steps of linear warmup from near zero to the peak learning rate.")
    decay_ratio: float | None = option(
        None,
        "Fraction of the steps (after warmup) spent decaying; the steps between warmup and decay "
        "hold the peak (warmup-stable-decay). Unset: decay over all steps after warmup.",
    )
    decay_type: Literal["linear", "sqrt", "cosine"] = option("linear", "Shape of the decay.")
    min_lr_factor: float = option(0.0, "Final learning rate as a fraction of the peak.")

    def check(self) -> list[str]:
        return broken_rules(
            (self.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be 0 or more, got {self.warmup_steps}"),
            (
                self.decay_ratio is None or 0 <= self.decay_ratio <= 1,
                f"lr_scheduler.decay_ratio must be in [0, 1] (or unset to decay over all steps after warmup), got "
                f"{self.decay_ratio}",
            ),
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
    problems = positive(section, values, "local_batch_size")
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
    dataset: TrainingDataset = option(
        "python_stdlib",
        "python_stdlib: the .py files of this interpreter's standard library (embedded, offline); "
        "local: the file or folder at dataset_path (.jsonl/.json/.txt, also .gz/.zst compressed, .parquet, .arrow, "
        "datasets save_to_disk folders); huggingface: datasets.load_dataset(dataset_path, split='train', "
        "streaming=True) (needs the datasets package); c4: allenai/c4 'en' streamed through datasets (needs it and "
        "the network); c4_test: the reference torchtitan's local C4 sample, tests/assets/c4_test; tokens: the "
        "token folder at dataset_path written by scripts/pretokenize.py "
        "(the same samples as its source, memory-mapped).",
    )
    dataset_path: str | None = option(
        None,
        "File or folder (local), dataset name or path (huggingface); for c4 another hub name or a local copy "
        "(a clone's en/c4-train.*.json.gz shards are read), for c4_test where the sample is. Relative paths are "
        "relative to the working directory.",
    )
    dataset_mix: list[str] = option(
        [],
        "A mixture of sources instead of dataset and dataset_path: WEIGHT:SOURCE entries, e.g. "
        '["0.6:data/web", "0.4:python_stdlib"] (on the command line 0.6:data/web,0.4:python_stdlib). A weight is '
        "the share of training sequences (hence tokens) its source supplies; weights are normalized. SOURCE: a path (a "
        "data file or folder of any supported format, or a token folder), python_stdlib, c4, c4_test, or hf:NAME (a "
        "Hugging Face dataset streamed through datasets); SOURCE#FIELD reads the text from that source's own field or "
        "column (default: dataset_text_field). Each source is shuffled, repeats and resumes on its own, "
        "as training.dataset would; metrics.jsonl logs data_share/I and data_epoch/I per source.",
    )
    dataset_text_field: str = option(
        "text",
        "The field of each JSON record, or the column of a parquet/Arrow/huggingface dataset, that holds the "
        "document text (.txt files are whole documents; python_stdlib ignores it).",
    )
    shuffle_documents: bool | None = option(
        None,
        "Shuffle the data each epoch, seeded by training.seed: the same on every rank and layout, restored exactly "
        "on resume. Each sample position of the global batch is a lane that reads its own share of every source "
        "(components/data/lanes.py); shuffled, the units (files, pieces of files, ranges of documents) are dealt "
        "to the lanes in a new order each epoch, and each lane reads its documents in a seeded order (with random "
        "access: a permutation; read as a stream: within blocks of shuffle_buffer; a datasets stream's units are "
        "its shards). Unset: shuffle, except datasets streams (huggingface, c4 from the Hub), read in the order "
        "datasets gives. false: stored order.",
    )
    shuffle_buffer: int = option(
        10_000,
        "Shuffled sources read as streams (JSON lines, parquet, datasets streams): each lane shuffles its "
        "documents within consecutive blocks of this many, held in memory per lane and source (read again on "
        "resume).",
    )
    skip_corrupt_files: bool = option(
        False,
        "Local files: a file that fails to read past its start (corrupt compression, an invalid JSON line, a "
        "failing parquet row group) is read no further, and a document read by index from it is taken as empty, "
        "each with a warning naming the file and a running count, instead of stopping the run. The same on every "
        "rank and layout, and on resume. A file unreadable from its start is still refused before launch.",
    )
    data_workers: int = option(
        0,
        "Processes per rank that read, tokenize and pack this rank's lanes ahead of training (each worker some of "
        "the lanes; at most one per lane). The samples, their order and the resumable state are the same for "
        "every count. 0: in the trainer process. A token folder alone (tokens) has nothing to tokenize and is "
        "read in the trainer process (memory-mapped).",
    )
    local_batch_size: int = option(8, "Sequences per data-parallel rank per micro-batch.")
    global_batch_size: int = option(
        -1,
        "Sequences per optimizer step over all ranks; a multiple of local_batch_size x data-parallel "
        "degree, the quotient being the gradient-accumulation steps. -1: local_batch_size x dp degree.",
    )
    seq_len: int = option(2048, "Tokens per training sequence.")
    ignore_cross_document_labels: bool = option(
        False,
        "Leave out of the loss the prediction of each document's first token from the previous document's last "
        "(label -100). The loss is the sum over the labels that count divided by their number in the whole "
        "optimizer step, over all ranks and micro-batches.",
    )
    loss_chunk_tokens: int | Literal["auto"] = option(
        "auto",
        "Compute the output layer and the loss this many tokens at a time, in forward and backward, so that the "
        "[tokens, vocabulary] logits never exist whole: only one chunk's logits, each token's log-sum-exp and "
        "label logit, and the gradients. The same loss and gradients (to round-off) on every layout; the output "
        "layer's activation memory falls from tokens x vocabulary to loss_chunk_tokens x vocabulary (see "
        'docs/performance.md for when it pays). 0: the whole logits at once. "auto": chunks of 1,024 tokens '
        "where a micro-batch on one rank has 2,048 tokens or more and its float32 logits "
        "(tokens x vocabulary shard x 4 bytes) would take 256 MiB or more, and where the model and layout can "
        "chunk; the whole logits otherwise.",
    )
    max_norm: float = option(1.0, "Clip the global gradient norm to this value (0 disables clipping).")
    steps: int = option(10000, "Optimizer steps to train.")
    mixed_precision_param: Literal["bfloat16", "float32"] = option(
        "bfloat16", "Dtype of parameters in forward/backward (FSDP mixed precision, or autocast without FSDP)."
    )
    mixed_precision_reduce: Literal["float32", "bfloat16"] = option("float32", "Dtype of the FSDP gradient reduction.")
    compile: bool = option(False, "torch.compile each transformer block (after activation checkpointing, before FSDP).")
    enable_cpu_offload: bool = option(
        False,
        "Keep parameters, gradients and optimizer state in host memory between uses (FSDP2 offload; "
        "CUDA only: on a CPU device everything already lives in host memory).",
    )
    gc_freq: int = option(50, "Run Python's garbage collector every this many steps (automatic GC is off).")
    seed: int = option(0, "Seed for weight init and every random number generator.")
    deterministic: bool = option(False, "Use deterministic algorithms only (slower; bitwise-repeatable runs).")
    skip_nonfinite_steps: bool = option(
        False,
        "On a non-finite loss or gradient norm, skip that optimizer step (weights, optimizer and expert "
        "statistics unchanged; counted as skipped_steps) instead of stopping the run.",
    )
    max_skipped_steps_in_a_row: int = option(
        10, "With skip_nonfinite_steps: stop the run when this many steps in a row are non-finite."
    )

    def check(self) -> list[str]:
        return (
            _data_rules("training", self)
            + positive("training", self, "seq_len", "steps", "gc_freq", "max_skipped_steps_in_a_row")
            + broken_rules(
                (
                    self.global_batch_size == -1 or self.global_batch_size > 0,
                    f"training.global_batch_size must be -1 (local_batch_size x data-parallel degree) or a positive "
                    f"integer, got {self.global_batch_size}",
                ),
                (self.max_norm >= 0, f"training.max_norm must be 0 (no clipping) or more, got {self.max_norm}"),
                (
                    self.loss_chunk_tokens == "auto" or self.loss_chunk_tokens >= 0,
                    'training.loss_chunk_tokens must be "auto", 0 (the whole logits at once) '
                    f"or a positive number of tokens, got {self.loss_chunk_tokens}",
                ),
                (
                    self.shuffle_buffer >= 1,
                    f"training.shuffle_buffer must be 1 or more documents, got {self.shuffle_buffer}",
                ),
                (
                    self.data_workers >= 0,
                    f"training.data_workers must be 0 (read in the trainer) or more, got {self.data_workers}",
                ),
                (
                    self.dataset != "tokens" or self.data_workers == 0,
                    f'training.data_workers = {self.data_workers} with training.dataset = "tokens": a token folder has '
                    "nothing to tokenize and is read memory-mapped in the trainer; set data_workers = 0",
                ),
                (
                    bool(self.dataset_text_field),
                    "training.dataset_text_field is empty; "
                    "set it to the field or column holding the text (default 'text')",
                ),
            )
        )


VALIDATION_DATASETS = ("python_stdlib_test", "python_stdlib", "local", "huggingface", "c4_test")


@dataclass(frozen=True)
class Validation:
    enabled: bool = option(
        False,
        "Compute the loss and perplexity on held-out data every freq steps and at the last step (logged as "
        "validation_loss and validation_perplexity).",
    )
    # A string, not a Literal: reference recipes name their own sets (c4_validation) while disabled.
    dataset: str = option(
        "python_stdlib_test",
        "python_stdlib_test: the test files of this interpreter's standard library, which the python_stdlib "
        "training corpus leaves out (embedded, offline); python_stdlib, local, huggingface: as training.dataset.",
    )
    dataset_path: str | None = option(None, "File or folder (local) or dataset name/path (huggingface).")
    dataset_mix: list[str] = option(
        [],
        "A validation mixture instead of dataset and dataset_path: WEIGHT:SOURCE entries as training.dataset_mix "
        "takes them (paths, token folders, python_stdlib, python_stdlib_test, c4_test, hf:NAME). Each source is read "
        "in stored order from its first document; the set ends where the schedule first asks a source past its end.",
    )
    local_batch_size: int = option(8, "Validation sequences per data-parallel rank per batch.")
    seq_len: int = option(
        -1,
        "Tokens per validation sequence; at most training.seq_len (the model's positions), equal to it with "
        "context parallel. -1: training.seq_len.",
    )
    freq: int = option(500, "Validate every this many steps (and at the last step).")
    steps: int = option(
        -1,
        "Global validation batches per run, always from the start of the set and never past its end; -1: every "
        "complete batch of one pass over the set.",
    )

    def check(self) -> list[str]:
        if not self.enabled:
            return []  # a disabled section loads with any values (reference recipes name their own sets)
        return (
            _data_rules("validation", self)
            + positive("validation", self, "freq")
            + broken_rules(
                (
                    self.steps == -1 or self.steps > 0,
                    "validation.steps must be -1 (one pass over the validation set) "
                    f"or a positive integer, got {self.steps}",
                ),
                (
                    self.dataset in VALIDATION_DATASETS,
                    f"validation.dataset = {self.dataset!r} is not available here; choose one of "
                    f"{', '.join(VALIDATION_DATASETS)} (local and huggingface read validation.dataset_path)",
                ),
                (
                    self.seq_len == -1 or self.seq_len > 0,
                    f"validation.seq_len must be -1 (training.seq_len) or a positive integer, got {self.seq_len}",
                ),
            )
        )
