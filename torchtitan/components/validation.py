"""Validation: the held-out loss and perplexity of the model being trained, every `validation.freq`
steps and at the last step.

What it computes:

- The validation set is packed exactly like the training data (torchtitan/components/data.py): each
  document as [BOS] + text + [EOS], concatenated, cut into consecutive windows of seq_len + 1 tokens;
  window k is global validation sample k. Global validation batch b holds samples [b*G, (b+1)*G),
  G = validation.local_batch_size x data-parallel degree, and data-parallel rank r of D reads the
  contiguous block [b*G + r*G/D, b*G + (r+1)*G/D) of it, as the training loader splits a global
  batch. So the set of sequences does not depend on the layout.
- Every run starts from the first document again and never wraps around: it reads validation.steps
  global batches, or with steps = -1 every complete global batch of one pass over the set (the
  trailing samples that do not fill a global batch are left out). A set that does not hold one global
  batch is refused before launch (`preflight_validation`). Each rank caches its batches after the
  first run (up to CACHE_TOKENS tokens), so later runs skip the tokenizer.
- The loss is the mean over every validation label that counts: training's summed token loss (the
  model spec's `loss_sum_fn`) over this rank's share of the tokens of every batch, summed over the
  data- and context-parallel ranks (the same mesh as the training loss), over the number of labels
  that count on all of them. Batches are prepared as in training (batch.BatchPreparation: the same
  attention mask, the same ignored labels, the same context-parallel positions). Perplexity =
  exp(loss).
- The model runs in eval mode under no_grad, with the training step's mixed precision and loss-parallel
  context; with context parallel each rank takes the same sequence positions as in training; with a
  pipeline, a second, forward-only schedule over the same stage modules (each rank runs its stages in
  order on every microbatch of pipeline_parallel_microbatch_size sequences, torch's runtime adding the
  sends, receives and FSDP gathers) runs the validation batch through `eval`, and the last stage's loss
  is broadcast over the pipeline ranks. The training schedule is not used: torch re-infers a
  schedule's shapes, with a real forward, each time it switches between eval and train, and its eval of
  the V-shaped schedules (ZBVZeroBubble, DualPipeV) fails on their split backward steps.

What it leaves unchanged: the training random number generators (the run is inside fork_rng), the
modules' train mode (restored), a mixture of experts' token counts and expert bias (counted only in a
training forward: train mode with gradients on), and FSDP's sharding (every FSDP module is resharded
after the run). Training losses with validation on are bitwise those with it off
(tests/distributed/test_data_parallel_parity.py).
"""

import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.components.batch import valid_labels
from torchtitan.components.data import sources
from torchtitan.components.data.mixing import integer_weights, next_source, source_kind
from torchtitan.components.data.packing import encode_document
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.entries import parse_mix, split_text_field
from torchtitan.config.errors import UserError
from torchtitan.config.rules import validation_seq_len
from torchtitan.config.training_sections import Training, TrainingDataset, Validation

# Tokens of validation batches a rank keeps in memory (int32) between runs: 256 MiB.
CACHE_TOKENS = 2**26


# ---------------------------------------------------------------------------------------------
# The validation set


def _is_stdlib_test_dir(rel_dir: str) -> bool:
    parts = rel_dir.split("/")
    return (
        any(p in ("test", "tests") for p in parts)
        or rel_dir == "idlelib/idle_test"
        or rel_dir.startswith("idlelib/idle_test/")
    )


@functools.lru_cache(maxsize=1)
def _stdlib_test_files() -> tuple[Path, ...]:
    """The .py files the python_stdlib training corpus leaves out as tests: those under a folder named
    test or tests, or under idlelib/idle_test (site-packages and dist-packages excluded as there)."""
    root = sources.stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        if rel_dir != "." and _is_stdlib_test_dir(rel_dir):
            found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return tuple(sorted(found, key=lambda p: p.relative_to(root).as_posix()))


class _StdlibTestSource:
    name = "python_stdlib_test"

    def __init__(self):
        self.files = _stdlib_test_files()
        if not self.files:
            raise UserError(
                f"validation.dataset python_stdlib_test is empty: this interpreter ships no test files under "
                f"{sources.stdlib_root()} (some Linux distributions package them apart); set "
                "validation.dataset = 'local' and validation.dataset_path to held-out .jsonl/.txt data"
            )

    def documents(self, start: int) -> Iterator[str]:
        for path in self.files[start:]:
            yield sources.read_text(path)


class Mixture:
    """validation.dataset_mix: sources (text, or token folders) with integer weights (mixing.integer_weights),
    and the entries (SOURCE) that name them."""

    def __init__(self, sources: list, weights: list[int], specs: list[str] | None = None):
        self.sources, self.weights = sources, weights
        self.specs = specs if specs is not None else [f"source {i}" for i in range(len(sources))]

    def documents(self, start: int):
        # Only asked whether the set holds any document at all (preflight's message).
        for source in self.sources:
            yield from source.documents(start)


def build_source(cfg: Validation, training: Training | None = None, tokenizer: Tokenizer | None = None):
    """The documents of the validation set named by the config (its names are checked by the config
    validator: a path exactly for local and huggingface). Files are read as training reads them, with
    training.dataset_text_field, in stored order. A mixture's token folders are checked against
    `tokenizer`."""
    if cfg.dataset_mix:
        fractions, specs = parse_mix(cfg.dataset_mix, "validation.dataset_mix")
        mixed = [_mix_source(cfg, training, tokenizer, spec) for spec in specs]
        return Mixture(mixed, integer_weights(fractions), specs)
    if cfg.dataset == "python_stdlib_test":
        return _StdlibTestSource()
    if cfg.dataset == "python_stdlib":
        return sources.StdlibSource()
    if cfg.dataset == "local" and (cfg.dataset_path is None or not os.path.exists(cfg.dataset_path)):
        raise UserError(
            f"validation.dataset_path {cfg.dataset_path} does not exist; set it to a data file or a folder of them "
            "(.jsonl, .json, .txt, optionally .gz/.zst; .parquet; .arrow)"
        )
    # The config validator allows only VALIDATION_DATASETS, and python_stdlib_test is not read as training's.
    dataset = cast(TrainingDataset, cfg.dataset)
    as_training = dataclasses.replace(
        training or Training(), dataset=dataset, dataset_path=cfg.dataset_path, shuffle_documents=False
    )
    try:
        return sources.build_source(as_training)[0]
    except UserError as e:  # the training loader's messages name the training keys
        message = str(e).replace("training.dataset_text_field", "training.dataset_text_field (read for validation too)")
        raise UserError(
            "validation: " + re.sub(r"training\.(dataset_path|dataset|shuffle_documents)", r"validation.\1", message)
        ) from None


def _mix_source(cfg: Validation, training: Training | None, tokenizer: Tokenizer | None, spec: str):
    """One source of validation.dataset_mix, opened as validation.dataset would open it."""
    if spec == "python_stdlib_test":
        return _StdlibTestSource()
    spec, field = split_text_field(spec)  # SOURCE#FIELD: the source's own text field
    if field:
        training = dataclasses.replace(training or Training(), dataset_text_field=field)
    try:
        dataset, path = source_kind(spec)
    except UserError as e:
        raise UserError(f"validation.dataset_mix: {e}") from None
    if dataset == "tokens":
        from torchtitan.components.data.token_folder import open_token_source

        try:
            return open_token_source(path, tokenizer)
        except UserError as e:
            raise UserError(f"validation.dataset_mix source {spec!r}: {e}") from None
    single = dataclasses.replace(cfg, dataset=dataset, dataset_path=path, dataset_mix=[])
    try:
        return build_source(single, training)
    except UserError as e:
        raise UserError(f"validation.dataset_mix source {spec!r}: {e}") from None


def _token_list(tokens) -> list[int]:
    return tokens.tolist()  # a token folder's memory-mapped slice, as Python ints


def _windows(source, tokenizer: Tokenizer, length: int) -> Generator[list[int], None, None]:
    """The packed stream's windows of `length` tokens, from the first document to the end (no wrap). A
    mixture's window k is the next window of the source its schedule picks; the set ends where the
    schedule first asks a source past its end."""
    if isinstance(source, Mixture):
        streams = [_windows(s, tokenizer, length) for s in source.sources]
        counts = [0] * len(streams)
        while (window := next(streams[i := next_source(source.weights, counts)], None)) is not None:
            counts[i] += 1
            yield window
        return
    # A token folder's documents are framed already; a text source's are framed as training frames them.
    encode = _token_list if hasattr(source, "document_length") else functools.partial(encode_document, tokenizer)
    buffer: list[int] = []
    for doc in source.documents(0):
        buffer.extend(encode(doc))
        start = 0
        while len(buffer) - start >= length:
            yield buffer[start : start + length]
            start += length
        del buffer[:start]


class ValidationData:
    """This rank's share of each global validation batch, from the start of the set on every call."""

    def __init__(
        self,
        source,
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        max_batches: int,
    ):
        self.source, self.tokenizer = source, tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.global_batch_size = local_batch_size * dp_degree
        self.first = dp_rank * local_batch_size  # this rank's block, as offsets inside a global batch
        self.max_batches = max_batches  # -1: every complete global batch
        self._cache: list[torch.Tensor] | None = None

    def _read(self) -> Iterator[torch.Tensor]:
        mine, done = [], 0
        for k, window in enumerate(_windows(self.source, self.tokenizer, self.seq_len + 1)):
            pos = k % self.global_batch_size
            if self.first <= pos < self.first + self.local_batch_size:
                mine.append(window)
            if pos == self.global_batch_size - 1:
                yield torch.tensor(mine, dtype=torch.long)
                mine, done = [], done + 1
                if done == self.max_batches:
                    return

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, labels), each int64 [local_batch_size, seq_len]; the same sequence every call."""
        if self._cache is not None:
            for batch in self._cache:
                batch = batch.long()
                yield batch[:, :-1], batch[:, 1:]
            return
        cache, tokens = [], 0
        for batch in self._read():
            if cache is not None:
                cache.append(batch.to(torch.int32))
                tokens += batch.numel()
                if tokens > CACHE_TOKENS:
                    cache = None
            yield batch[:, :-1], batch[:, 1:]
        self._cache = cache


def preflight_validation(v: Validation, training: Training, tokenizer: Tokenizer, dp_degree: int) -> None:
    """Before launch: the validation set exists and holds at least one global validation batch.
    Reads only as much of it as that needs."""
    if not v.enabled:
        return
    source = build_source(v, training, tokenizer)
    need = v.local_batch_size * dp_degree
    seq_len = validation_seq_len(v, training)
    if isinstance(source, Mixture):
        # The set ends where the schedule first asks a source past its end (_windows): a source without one
        # window would end it at that source's first turn, measuring none of it (and the set would hold a
        # batch or two, or none, depending on where the schedule puts that turn). Named here, by its entry.
        for spec, part in zip(source.specs, source.sources):
            first = _windows(part, tokenizer, seq_len + 1)
            if next(first, None) is None:
                raise UserError(
                    f"validation.dataset_mix source {spec!r} is too small: its documents tokenize to fewer than one "
                    f"sequence of validation.seq_len + 1 = {seq_len + 1} tokens, so the validation set would end at "
                    "its first turn without a sample of it; add data to it, remove it from validation.dataset_mix, "
                    "or lower validation.seq_len"
                )
            first.close()
    windows = _windows(source, tokenizer, seq_len + 1)
    found = sum(1 for _ in zip(range(need), windows))
    if found < need:
        where = f" at {v.dataset_path}" if v.dataset_path else ""
        name = f"validation.dataset_mix {v.dataset_mix}" if v.dataset_mix else f"validation set {v.dataset}{where}"
        what = (
            "is empty: it holds no text"
            if found == 0 and not any(source.documents(0))
            else (f"is too small: it holds {found} sequence(s) of validation.seq_len + 1 = {seq_len + 1} tokens")
        )
        raise UserError(
            f"{name} {what}, fewer than one global validation batch of "
            f"validation.local_batch_size x data-parallel degree = {v.local_batch_size} x {dp_degree} = {need} "
            f"sequences; add data, or lower validation.local_batch_size or validation.seq_len"
        )


# ---------------------------------------------------------------------------------------------
# The validation run


def _reshard_fsdp(parts: list[nn.Module]):
    """Free parameters an eval forward left gathered (FSDP keeps them after forward where backward
    would have resharded them)."""
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


class Validator:
    """Runs validation for a Trainer; `due(step)` says when, `run(step)` returns the metrics record.

    `loss_fn(inputs, labels, kwargs)`: this rank's summed token loss of a prepared batch, forward
    only, as training computes it (None on pipeline ranks without the last stage).
    `sum_over_ranks(sums)`: the tensor summed over the ranks that split a batch's tokens, taken from
    the rank that holds the loss."""

    def __init__(
        self,
        cfg: Validation,
        training_steps: int,
        data: ValidationData,
        parts: list[nn.Module],
        loss_fn,
        batch_preparation,
        sum_over_ranks,
        device: torch.device,
    ):
        self.cfg, self.training_steps, self.data, self.parts = cfg, training_steps, data, parts
        self.loss_fn, self.batch_preparation = loss_fn, batch_preparation
        self.sum_over_ranks, self.device = sum_over_ranks, device

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0 or step == self.training_steps

    def _batch_loss(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> torch.Tensor:
        loss = self.loss_fn(inputs, labels, kwargs)
        if loss is None:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        return loss.detach().double()

    def run(self, step: int) -> dict:
        start = time.perf_counter()
        modes = [part.training for part in self.parts]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = 0
        rng_devices = [self.device] if self.device.type == "cuda" else []
        try:
            for part in self.parts:
                part.eval()
            with torch.no_grad(), torch.random.fork_rng(devices=rng_devices, device_type=self.device.type):
                for inputs, labels in self.data.batches():
                    # With context parallel, this rank's positions of each sequence (as in training).
                    inputs, labels, kwargs = self.batch_preparation.prepare(inputs, labels, self.device)
                    total += self._batch_loss(inputs, labels, kwargs)
                    count += valid_labels(labels)
                    batches += 1
        finally:
            for part, mode in zip(self.parts, modes):
                part.train(mode)
            _reshard_fsdp(self.parts)
        if batches == 0:  # preflight_validation makes sure there is a batch
            raise ValueError("the validation set yielded no batch")
        sums = self.sum_over_ranks(torch.stack([total, count]))
        loss = (sums[0] / sums[1].clamp(min=1)).item()  # float64 all the way
        return {
            "step": step,
            "validation_loss": loss,
            "validation_perplexity": math.exp(loss) if loss < 700 else math.inf,
            "validation_batches": batches,
            "validation_tokens": batches * self.data.global_batch_size * self.data.seq_len,
            "validation_time": time.perf_counter() - start,
        }
