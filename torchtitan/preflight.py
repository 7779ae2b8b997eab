"""Preflight: everything decided about a job before any process group exists, and every check that
needs no collective. `preflight(cfg, world_size)` returns the run's `PreflightResult` (parallel degrees, batch
arithmetic, the model spec and args, the tokenizer, the attention mask and kernel) or raises
UserError. The trainer runs it on every rank; the launcher (torchtitan/launch.py, which run_train.sh
runs) calls `check` in its own process before starting any worker, so that a mistake is reported in
about a second, once, instead of by every rank after the workers have started; the layout planner
runs it on the layouts it shows.

    WORLD_SIZE=4 python -m torchtitan.preflight --job.config_file train_configs/debug_model.toml

Exit status: 0 the job can start, 2 a user mistake (one line on stderr), 3 --help was printed.
"""

import dataclasses
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtitan.components import fault_tolerance, validation
from torchtitan.components.checkpoint import check_writable, preflight_checkpoint
from torchtitan.components.optimizer import check_muon_supported, check_param_groups
from torchtitan.components.tokenizer import Tokenizer, detect as detect_tokenizer
from torchtitan.config import HelpRequested, JobConfig, UserError, load_config
from torchtitan.config.errors import run_main
from torchtitan.distributed import process_group
from torchtitan.distributed.context_parallel import check_ulysses_degree
from torchtitan.distributed.dtypes import DTYPES
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import splits_backward, stage_modules
from torchtitan.distributed.tensor_parallel import check_tp_divisibility
from torchtitan.models.common.attention import choose_attention_kernel
from torchtitan.models.common.chunked_loss import resolve_chunk_tokens
from torchtitan.models.common.moe import check_expert_layer, overrides_from_config as moe_overrides
from torchtitan.models.common.spec import VOCAB_MULTIPLE, ModelSpec, meta_model
from torchtitan.models.registry import get_model_args, get_model_spec, import_custom_module

logger = logging.getLogger("torchtitan")


@dataclass(frozen=True)
class ResolvedAttention:
    """The run's attention, resolved once from [model]: what the mask lets through and the kernel that
    computes it. The trainer sets the kernel, the batch preparation and the FLOPs count read `documents`."""

    documents: bool  # block-causal: no query attends across a document boundary
    window: int | None  # the model's sliding window (on the layers that have one); None: unlimited
    kernel: str  # "sdpa", "split" or "flex"; "own": the model's own (its spec names no attention module)

    def describe(self) -> str:
        mask = "block_causal" if self.documents else "causal"
        return mask + (f" with sliding windows of {self.window}" if self.window else "")


@dataclass(frozen=True)
class PreflightResult:
    """Everything decided before any process group exists."""

    parallel_dims: ParallelDims
    global_batch_size: int
    grad_accum_steps: int
    spec: ModelSpec
    model_args: Any  # the args of the model this run builds (model_args_for_run), typed Any as in ModelSpec
    tokenizer: Tokenizer
    attention: ResolvedAttention
    loss_chunk_tokens: int  # training.loss_chunk_tokens as a number: "auto" resolved (0: the whole logits)
    memory_estimate: str | None = None  # [memory_estimation]: the estimate of this layout, one line


# Model args that shape no tensor, taken from the initial Hugging Face folder's config.json when the
# family has them.
HF_ADOPTED_FIELDS = (
    "rope_theta",
    "rope_scaling",
    "norm_eps",
    "tie_word_embeddings",
    "sliding_window",
    "max_window_layers",
)


def model_args_for_run(spec, cfg: JobConfig, tokenizer_vocab: int):
    """The args of the model this job builds. Its vocabulary is the tokenizer's, padded
    (spec.args_for_training); where the initial weights come from a Hugging Face folder, that folder's
    vocab_size (checkpoints pad as they like: Qwen3 has 151,936 rows for 151,669 tokens) and the
    settings of HF_ADOPTED_FIELDS."""
    args = spec.args_for_training(
        cfg.model.flavor, tokenizer_vocab, cfg.training.seq_len, moe_overrides(cfg.moe), attention_overrides(cfg.model)
    )
    if not cfg.checkpoint.initial_load_in_hf:
        return args
    from torchtitan.components.checkpoint import HF_CONFIG, read_hf_config

    folder = cfg.checkpoint.initial_load_path
    assert folder is not None  # the config's rules require it with initial_load_in_hf
    where = os.path.join(folder, HF_CONFIG)
    config = read_hf_config(folder)
    # The language model's settings (a multimodal folder's text_config, a vision tower alone refused), as
    # check_hf_folder and the scripts read them: its vocabulary and the adopted fields below come from there.
    from torchtitan.models.common.hf_conversion import hf_text_config

    config = hf_text_config(config, where)
    hf_vocab = config.get("vocab_size")
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
    hf_args = spec.hf.args_from_config(config)
    adopted = {
        name: getattr(hf_args, name)
        for name in HF_ADOPTED_FIELDS
        if not spec.missing_fields([name]) and getattr(cfg.model, name, None) is None
    }
    changed = {name: value for name, value in adopted.items() if getattr(args, name) != value}
    if changed:
        logger.info(
            f"from {where}, in place of flavor {cfg.model.flavor}'s: "
            + ", ".join(f"{name} = {value}" for name, value in changed.items())
        )
    return dataclasses.replace(args, vocab_size=hf_vocab, **adopted)


def vocab_note(tokenizer: Tokenizer, vocab: int, from_hf: bool) -> str:
    """Where the model's vocabulary size comes from (model_args_for_run), for the log."""
    tokens = tokenizer.vocab_size
    if vocab == tokens:
        return f"vocab {vocab:,} from the {tokenizer.kind} tokenizer ({tokens:,} tokens)"
    to = "the initial Hugging Face weights' vocab_size" if from_hf else f"a multiple of {VOCAB_MULTIPLE}"
    return (
        f"vocab {vocab:,}: the {tokenizer.kind} tokenizer's {tokens:,} tokens padded to {to} "
        f"(ids {tokens:,}-{vocab - 1:,} are never produced)"
    )


# Model args that [model] may set, and what a family without that field lacks.
MODEL_OVERRIDES = {
    "sliding_window": "sliding-window attention",
    "max_window_layers": "sliding-window attention",
    "mtp_depth": "multi-token prediction",
    "mtp_loss_weight": "multi-token prediction",
    "delta_rule_kernel": "gated delta rule",
}


def attention_overrides(model) -> dict:
    """The model args that [model] sets (sliding windows, multi-token prediction), where set."""
    return {name: getattr(model, name) for name in MODEL_OVERRIDES if getattr(model, name) is not None}


def check_attention(cfg: JobConfig, spec: ModelSpec, dims: ParallelDims) -> None:
    """[model] attention options against the device and the family (before any model is built)."""
    m = cfg.model
    backend = "flex" if m.use_flex_attn else m.attn_backend
    if backend == "flex" and process_group.device_type() != "cuda":
        raise UserError(
            f"model.{'use_flex_attn = true' if m.use_flex_attn else 'attn_backend = flex'} asks for FlexAttention, "
            f"which cannot train on {process_group.device_type()}: FlexAttention does not support backward on CPU "
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
        where = (
            f"model.mtp_depth = {depth}"
            if cfg.model.mtp_depth is not None
            else f"model {spec.name} {cfg.model.flavor} has mtp_depth = {depth}, which"
        )
        raise UserError(
            f"{where} is more than training.seq_len = {seq}: depth k predicts the token k positions ahead of each "
            f"position, which a {seq}-token window does not hold for k > {seq}; set model.mtp_depth to {seq} or "
            "less, or raise training.seq_len"
        )


def check_delta_rule_kernel(model_args) -> None:
    """flash-linear-attention's gated delta rule (delta_rule_kernel = "fla") is a Triton kernel for CUDA, from an
    optional package."""
    if getattr(model_args, "delta_rule_kernel", "torch") != "fla":
        return
    from torchtitan.models.common.delta_rule import FLA_INSTALL

    if process_group.device_type() != "cuda":
        raise UserError(
            f"model.delta_rule_kernel = 'fla' runs flash-linear-attention's Triton kernel, which needs "
            f"CUDA (this is {process_group.device_type()}); use model.delta_rule_kernel = 'torch'"
        )
    if importlib.util.find_spec("fla") is None:
        raise UserError(
            f"model.delta_rule_kernel = 'fla' needs the flash-linear-attention package: {FLA_INSTALL} "
            "(or model.delta_rule_kernel = 'torch')"
        )


def check_hf_export(cfg: JobConfig, spec: ModelSpec, model_args, tokenizer: Tokenizer) -> None:
    """checkpoint.last_save_in_hf writes the model as a Hugging Face folder after the last step: what the format
    cannot express is refused now (the family's config.json of these args), not once the run is over, when the
    weights would be lost with checkpointing off. Where it goes is checked with the checkpoint folder
    (resume.preflight_checkpoint)."""
    assert spec.hf is not None  # called for a family with a Hugging Face adapter only
    try:
        spec.hf.config(model_args, DTYPES[cfg.checkpoint.export_dtype], tokenizer.bos_id, tokenizer.eos_id)
    except UserError as e:
        raise UserError(
            f"checkpoint.last_save_in_hf exports the model as a Hugging Face folder after the last step, "
            f"and this one cannot be: {e}; or turn checkpoint.last_save_in_hf off"
        ) from None


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
    if dims.tp_enabled and process_group.device_type() == "cpu":
        # DTensor's redistribute backward fails inside compiled blocks ("'Tensor' object has no attribute
        # '_local_tensor'"), for every family; on CUDA, where async TP needs both, it is untested here.
        raise UserError(
            f"training.compile with parallelism.tensor_parallel_degree = {dims.tp} fails on the CPU in the "
            "backward of tensor-parallel blocks; turn training.compile off, or use FSDP (or PP) instead of TP"
        )


def preflight(cfg: JobConfig, world_size: int, services: bool = True) -> PreflightResult:
    """Checks that need no collectives: degrees against the world size, batch arithmetic, the model
    name and flavor against the parallelisms, the tokenizer file, the dump and checkpoint folders.
    Raises UserError; run identically on every rank (and once by run_train.sh before launch).
    `services`: also ask the services the job meets over the network (the replica groups' lighthouse)
    whether they answer; the layout planner does not (a layout's fit does not depend on them), nor the
    launcher, which may start the lighthouse itself once the rest is checked."""
    import_custom_module(cfg.experimental.custom_import)
    unread = cfg.parallelism.unread_keys()
    if unread:
        raise UserError(unread[0])
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    t = cfg.training
    global_batch, accum = dims.batch(t.local_batch_size, t.global_batch_size)
    if t.enable_cpu_offload:
        if process_group.device_type() != "cuda":
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
    model_args = spec.args_for_training(
        cfg.model.flavor, flavor_args.vocab_size, t.seq_len, overrides, attention_overrides(cfg.model)
    )
    check_mtp_window(cfg, spec, model_args)
    check_delta_rule_kernel(model_args)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    # The model as built: the tokenizer's vocabulary, padded (TP splits it; Hugging Face weights must
    # have a row for every token), and the settings an initial Hugging Face folder brings.
    model_args = model_args_for_run(spec, cfg, tokenizer.vocab_size)
    p = cfg.parallelism
    split_backward = dims.pp_enabled and splits_backward(p.pipeline_parallel_schedule, p.pipeline_parallel_schedule_csv)
    loss_chunk_tokens = resolve_chunk_tokens(
        cfg, spec, dims.tp, dims.cp, dims.pp, model_args.vocab_size, split_backward
    )
    if dims.tp_enabled:
        if spec.tp_plan is None:
            raise UserError(
                f"model '{spec.name}' has no tensor-parallel plan in its spec; "
                "set parallelism.tensor_parallel_degree = 1"
            )
        if cfg.parallelism.enable_async_tensor_parallel and process_group.device_type() != "cuda":
            raise UserError(
                "parallelism.enable_async_tensor_parallel uses CUDA symmetric memory; this job runs on the CPU: "
                "turn it off"
            )
        check_tp_divisibility(spec.tp_sizes(model_args), dims.tp, t.seq_len)
    if dims.cp_enabled and spec.cp_attention is None:
        raise UserError(
            f"model '{spec.name}' does not support context parallel (its spec names no attention to replace); "
            f"set parallelism.context_parallel_degree = 1"
        )
    heads = getattr(model_args, "n_heads", None)
    if dims.cp_enabled and cfg.parallelism.context_parallel_method == "ulysses" and heads is not None:
        check_ulysses_degree(heads, dims.tp, dims.cp)
    if dims.pp_enabled:
        stage_modules(spec.pipeline, model_args.n_layers, dims.pp, cfg.parallelism)
        schedule = (
            f"pipeline_parallel_schedule_csv {p.pipeline_parallel_schedule_csv} (its I and W actions)"
            if p.pipeline_parallel_schedule_csv
            else f"pipeline_parallel_schedule = {p.pipeline_parallel_schedule}"
        )
        if split_backward and spec.extra_blocks is not None:
            extra = len(spec.extra_blocks(meta_model(spec, model_args)))
            if extra:
                # Measured: their second backward pass (the weights') finds the graph already freed.
                raise UserError(
                    f"parallelism.{schedule} splits each backward into an input and a weight pass, which model "
                    f"{spec.name}'s {extra} block(s) after its layers (e.g. multi-token prediction) do not support; "
                    f"choose 1F1B or Interleaved1F1B, or remove those blocks (for deepseek_v3: model.mtp_depth = 0)"
                )
        if split_backward and p.fsdp_reshard_after_forward == "always" and dims.fsdp_enabled:
            raise UserError(
                f"parallelism.fsdp_reshard_after_forward = 'always' cannot be used with parallelism.{schedule}: its "
                "split weight-gradient step needs the gathered block weights (resharding silently drops their "
                "gradients); use 'default'"
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
    if cfg.checkpoint.last_save_in_hf and spec.hf is not None:
        check_hf_export(cfg, spec, model_args, tokenizer)
    if cfg.checkpoint.initial_load_in_hf and spec.hf is not None:
        from torchtitan.components.checkpoint import check_hf_folder, meta_shapes

        folder = cfg.checkpoint.initial_load_path
        assert folder is not None  # the config's rules require it with initial_load_in_hf
        # From the files' headers: the family, missing files or tensors, dtypes, shapes.
        check_hf_folder(folder, spec.hf, meta_shapes(spec, model_args), model_args)
    if spec.validate is not None:
        spec.validate(model_args, dims)
    check_muon_supported(cfg.optimizer, spec.name, spec.adamw_params)
    if cfg.optimizer.param_groups:  # every pattern matches a parameter of the whole model
        check_param_groups(meta_model(spec, model_args), cfg.optimizer)
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise UserError("metrics.enable_wandb needs the wandb package: pip install wandb (or turn it off)")
    fault_tolerance.check(cfg.fault_tolerance, probe=services)  # torchft installed, the lighthouse answers
    check_writable(cfg.job.dump_folder, "the config and metrics")
    preflight_checkpoint(  # a replica group's data state spans all groups' lanes (fault_tolerance.data_lanes)
        cfg.checkpoint,
        cfg.job.dump_folder,
        world_size,
        process_group.device_type(),
        t.seq_len,
        fault_tolerance.data_lanes(cfg.fault_tolerance, 0, 1, global_batch)[2],
        t.steps,
    )
    # The validation set holds a global batch.
    validation.preflight_validation(cfg.validation, t, tokenizer, dims.dp_degree)
    attention = resolve_attention(cfg, spec, model_args)
    memory = None
    if cfg.memory_estimation.enabled:
        from torchtitan.planner.estimate import RecipeFacts, check_memory

        memory = check_memory(
            cfg,
            world_size,
            process_group.device_type(),
            int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
            RecipeFacts.build(spec, model_args, cfg),
        )
    return PreflightResult(dims, global_batch, accum, spec, model_args, tokenizer, attention, loss_chunk_tokens, memory)


def resolve_attention(cfg: JobConfig, spec: ModelSpec, model_args) -> ResolvedAttention:
    """model.attn_mask_type and model.attn_backend (checked by check_attention) with the model's
    window, as one value, with the kernel chosen for this device."""
    m = cfg.model
    documents = m.attn_mask_type == "block_causal"
    window = getattr(model_args, "sliding_window", None)
    if spec.cp_attention is None:
        return ResolvedAttention(documents, window, "own")
    kernel = choose_attention_kernel(
        "flex" if m.use_flex_attn else m.attn_backend,
        process_group.device_type(),
        documents or window is not None,
        documents,
        cfg.training.seq_len,
    )
    return ResolvedAttention(documents, window, kernel)


def warn_tokenizerless_export(tokenizer_path: str) -> None:
    """The Hugging Face export after the last step writes the weights even where the tokenizer cannot be written in
    Hugging Face form (it says so then): said before launch too, by writing it once into a scratch folder (checked
    once, by the launcher, rather than on every rank: a large vocabulary takes seconds)."""
    import tempfile

    from torchtitan.components.tokenizer_export import export_tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        try:
            export_tokenizer(tokenizer_path, scratch)
        except UserError as e:
            print(
                f"warning: the Hugging Face export after the last step (checkpoint.last_save_in_hf) will hold the "
                f"weights but no tokenizer: {e}",
                file=sys.stderr,
                flush=True,
            )


_TOKENIZER: dict = {}


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at `path`, loaded once per process while its file is unchanged: the layout
    planner runs preflight on many layouts of one recipe, and a large vocabulary takes a while to load."""
    kind, file = detect_tokenizer(path)
    stat = Path(file).stat()
    key = (str(Path(file).resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _TOKENIZER:
        _TOKENIZER.clear()
        _TOKENIZER[key] = Tokenizer(path)
    return _TOKENIZER[key]


def check(argv: list[str], world_size: int, check_lock: bool = True, services: bool = True) -> JobConfig:
    """The resolved config of a job that can start on `world_size` processes. Raises UserError (a
    mistake) or HelpRequested. `check_lock`: refuse a dump folder that a live run holds; only where
    no worker of this job can hold it yet (one node, or node rank 0 of several: the others may start
    after this job's rank 0 took the lock). `services`: as preflight's."""
    try:
        cfg = load_config(argv)
    except HelpRequested as h:
        from torchtitan.models.registry import help_with_families

        raise HelpRequested(help_with_families(h.text)) from None
    from torchtitan.components.data import build_dataloader
    from torchtitan.components.run_lock import refuse_if_locked

    result = preflight(cfg, world_size, services)
    if result.memory_estimate:
        print(result.memory_estimate, flush=True)
    if cfg.checkpoint.last_save_in_hf:
        warn_tokenizerless_export(cfg.model.tokenizer_path)
    if check_lock:
        refuse_if_locked(cfg.job.dump_folder)
    # Opening the data source as rank 0 finds a missing path or an empty dataset.
    build_dataloader(cfg.training, result.tokenizer, 0, result.parallel_dims.dp_degree, result.global_batch_size)
    return cfg


def main(argv: list[str]) -> int:
    def run() -> None:
        text = os.environ.get("WORLD_SIZE", "1")
        if not text.isdigit() or int(text) < 1:
            raise UserError(f"WORLD_SIZE={text!r} must be the number of processes of the job, 1 or more")
        check(argv, int(text))

    return run_main(run, help_status=3)  # --help is not an error, but there is nothing to launch


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
