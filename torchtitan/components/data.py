"""Pre-training data: documents -> one packed token stream -> each rank's share of every step.

What is unusual here:

- The default corpus, `python_stdlib`, is embedded: it is the `.py` files of the running
  interpreter's standard library (`sysconfig.get_paths()["stdlib"]`), minus `site-packages`,
  `dist-packages` and test folders (any path component named `test` or `tests`, and
  `idlelib/idle_test`), sorted by relative POSIX path, one file per document, read as UTF-8
  with errors="replace". It is real text nobody here wrote, it exists offline on every machine,
  and it is deterministic for a given interpreter (~730 files, ~12 MB on CPython 3.11).

- Packing: each document is tokenized as [BOS] + text + [EOS], the documents are concatenated
  into one global token stream, and the stream is cut into consecutive non-overlapping windows
  of seq_len + 1 tokens. Window k is global sample k (inputs = w[:-1], labels = w[1:]). At the
  end of the source the stream goes on with the first document again (a new epoch), without
  dropping the tokens carried over the boundary.

- Ownership: optimizer step s consumes global samples [s*G, (s+1)*G), G = global batch size.
  Data-parallel rank r of D owns the contiguous block [s*G + r*G/D, s*G + (r+1)*G/D), read in
  order and cut into micro-batches of local_batch_size. The samples of a step are thus the same
  for every D and every gradient-accumulation split, so runs of different layouts compare step
  by step. Every rank tokenizes the whole stream and skips the windows it does not own: simple
  and deterministic, and cheap at this scale (sentencepiece encodes ~1.5M tokens/s per rank). At
  thousands of ranks a pre-tokenized, indexable source would be needed instead.

- Resumable state, independent of the layout: the dataset's state names a position in the
  global stream (the next global sample, the document index, the token offset in that
  document and any carried tokens), not a rank's progress. At the end of its block in a step,
  a rank's state_dict() first reads ahead to the step boundary, so at step boundaries every
  rank holds the same state, and it can be loaded under another data-parallel degree: each
  rank then skips to its own block of the next step. A state saved mid-step resumes exactly,
  for the layout it was saved under. seq_len and the global batch size define what a global
  sample is, so a state only loads with the values it was saved with.

- Empty documents are skipped (no BOS/EOS pair for them), but they keep their document index.
"""

import functools
import itertools
import json
import logging
import os
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError
from torchtitan.config.job_config import Training

logger = logging.getLogger(__name__)

STATE_VERSION = 1
LOCAL_EXTENSIONS = (".jsonl", ".txt")


# ---------------------------------------------------------------------------------------------
# Sources: documents by index. `documents(start)` yields the texts of documents start, start+1,
# ... to the end of the source; resuming calls it with the saved index.


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded_stdlib_dir(rel_dir: str) -> bool:
    parts = rel_dir.split("/")
    if parts[-1] in ("site-packages", "dist-packages", "test", "tests"):
        return True
    return rel_dir == "idlelib/idle_test"


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    root = _stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        # Prune in place so os.walk never descends into excluded folders.
        dirnames[:] = [
            d for d in dirnames
            if not _is_excluded_stdlib_dir(d if rel_dir == "." else f"{rel_dir}/{d}")
        ]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return tuple(sorted(found, key=lambda p: p.relative_to(root).as_posix()))


def stdlib_files() -> list[Path]:
    """The documents of the python_stdlib corpus, in corpus order (computed once)."""
    return list(_stdlib_files())


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


class _StdlibSource:
    name = "python_stdlib"

    def __init__(self):
        self.files = _stdlib_files()
        if not self.files:
            raise UserError(
                f"dataset python_stdlib is empty: no .py files under {_stdlib_root()}; "
                "set training.dataset = 'local' and training.dataset_path to your own data"
            )

    def documents(self, start: int) -> Iterator[str]:
        for path in self.files[start:]:
            yield _read_text(path)


def _parse_jsonl_line(line: str, path: Path, lineno: int) -> str:
    fix = "each line must be a JSON object with a 'text' string field"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {lineno}: invalid JSON ({e.msg}); {fix}") from None
    if not isinstance(obj, dict) or "text" not in obj:
        raise UserError(f"{path} line {lineno}: no 'text' field; {fix}")
    if not isinstance(obj["text"], str):
        raise UserError(f"{path} line {lineno}: 'text' is a {type(obj['text']).__name__}; {fix}")
    return obj["text"]


class _LocalSource:
    """A .jsonl file (one document per non-blank line), a .txt file (one document), or a
    folder of both (recursively, sorted by relative path)."""

    name = "local"

    def __init__(self, path: str):
        root = Path(path)
        if not root.exists():
            raise UserError(
                f"dataset_path {root} does not exist; set training.dataset_path to a .jsonl or .txt "
                "file or a folder of them"
            )
        if root.is_dir():
            files = []
            for dirpath, _, filenames in os.walk(root):
                files.extend(Path(dirpath) / f for f in filenames if f.lower().endswith(LOCAL_EXTENSIONS))
            self.files = sorted(files, key=lambda p: p.relative_to(root).as_posix())
            if not self.files:
                raise UserError(
                    f"dataset folder {root} is empty: it holds no .jsonl or .txt files "
                    "(other files are ignored)"
                )
        elif root.suffix.lower() in LOCAL_EXTENSIONS:
            self.files = [root]
        else:
            raise UserError(
                f"dataset_path {root} has unsupported extension {root.suffix!r}; supported: "
                ".jsonl (one JSON object with a 'text' field per line), .txt (one document), "
                "or a folder of such files"
            )
        self.root = root

    def documents(self, start: int) -> Iterator[str]:
        to_skip = start
        for path in self.files:
            if path.suffix.lower() == ".txt":
                if to_skip:
                    to_skip -= 1
                    continue
                yield _read_text(path)
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    # Skipped lines are counted, not parsed: resuming deep into a file stays cheap.
                    if to_skip:
                        to_skip -= 1
                        continue
                    yield _parse_jsonl_line(line, path, lineno)


class _HuggingFaceSource:
    name = "huggingface"

    def __init__(self, path: str):
        try:
            import datasets
        except ImportError:
            raise UserError(
                "training.dataset = 'huggingface' needs the datasets package: pip install datasets, "
                "or use dataset = 'local' with .jsonl/.txt files"
            ) from None
        self.path = path
        try:
            self.dataset = datasets.load_dataset(path, split="train", streaming=True)
        except Exception as e:  # the library raises many types for a bad name, path or split
            raise UserError(
                f"could not load huggingface dataset {path!r} (split 'train'): {type(e).__name__}: {e}; "
                "check training.dataset_path"
            ) from None

    def documents(self, start: int) -> Iterator[str]:
        # Streaming datasets cannot seek: resuming skips the documents before `start`.
        for index, row in enumerate(itertools.islice(self.dataset, start, None), start=start):
            if "text" not in row:
                raise UserError(
                    f"huggingface dataset {self.path!r} row {index} has no 'text' column "
                    f"(columns: {sorted(row)}); use a dataset with a 'text' column"
                )
            text = row["text"]
            if text is not None and not isinstance(text, str):
                raise UserError(
                    f"huggingface dataset {self.path!r} row {index}: 'text' is a {type(text).__name__}, "
                    "not a string"
                )
            yield text or ""


def _build_source(cfg: Training):
    """The source named by the config, checked now: every rank fails the same way at start. Which
    dataset names take a dataset_path is the config validator's rule (torchtitan/config/manager.py)."""
    if cfg.dataset == "python_stdlib":
        source = _StdlibSource()
    elif cfg.dataset in ("local", "huggingface") and cfg.dataset_path:
        source = _LocalSource(cfg.dataset_path) if cfg.dataset == "local" else _HuggingFaceSource(cfg.dataset_path)
    else:
        raise ValueError(f"unvalidated data config: dataset {cfg.dataset!r}, dataset_path {cfg.dataset_path!r}")
    # Finding one non-empty document is enough: a source too small for one sequence is caught
    # when its first epoch ends.
    if not any(text for text in source.documents(0)):
        where = f" at {cfg.dataset_path}" if cfg.dataset_path else ""
        raise UserError(f"dataset {cfg.dataset}{where} is empty: it has no non-empty document")
    return source


# ---------------------------------------------------------------------------------------------
# The packed token stream and each rank's view of it.


class _TokenStream:
    """Windows of window_len tokens cut from the global token stream, one after another.

    The position is (doc_index, offset): the next token is `offset` into the token list of
    document `doc_index`. `carry` holds tokens read but not yet part of an emitted window; it is
    always empty between reads, as the position is exact, but a saved carry is honoured.
    """

    def __init__(self, source, tokenizer, window_len: int):
        self.source = source
        self.tokenizer = tokenizer
        self.window_len = window_len
        self.next_sample = 0  # global index of the window read next
        self.epoch = 0
        self.doc_index = 0
        self.offset = 0
        self.carry: list[int] = []
        self._docs: Iterator[str] | None = None  # yields document doc_index next, when _tokens is None
        self._tokens: list[int] | None = None  # token list of document doc_index

    def seek(self, next_sample: int, epoch: int, doc_index: int, offset: int, carry: list[int]):
        self._close_documents()
        self.next_sample, self.epoch, self.doc_index, self.offset = next_sample, epoch, doc_index, offset
        self.carry = list(carry)

    def _close_documents(self):
        if self._docs is not None and hasattr(self._docs, "close"):
            self._docs.close()  # releases an open jsonl file
        self._docs = None
        self._tokens = None

    def _document_tokens(self) -> list[int] | None:
        """The token list of document doc_index; None past the last document."""
        if self._tokens is None:
            if self._docs is None:
                self._docs = self.source.documents(self.doc_index)
            text = next(self._docs, None)
            if text is None:
                return None
            # An empty document carries no text: it adds no BOS/EOS pair either.
            self._tokens = self.tokenizer.encode(text, bos=True, eos=True) if text else []
        return self._tokens

    def _start_epoch(self, tokens_read: int):
        if self.epoch == 0 and self.next_sample == 0:
            raise UserError(
                f"dataset {self.source.name} is too small: all of it tokenizes to {tokens_read} tokens, "
                f"fewer than one sequence of seq_len + 1 = {self.window_len}; add data or lower "
                "training.seq_len"
            )
        documents = self.doc_index
        if documents == 0:  # a whole pass without a document: wrapping again would spin forever
            raise UserError(f"dataset {self.source.name} is empty: it has no document")
        self._close_documents()
        self.epoch += 1
        self.doc_index = 0
        self.offset = 0
        logger.warning(
            "dataset %s exhausted after %d documents: starting epoch %d (the data repeats)",
            self.source.name, documents, self.epoch,
        )

    def read(self) -> list[int]:
        window, self.carry = self.carry, []
        while len(window) < self.window_len:
            tokens = self._document_tokens()
            if tokens is None:
                self._start_epoch(len(window))
                continue
            taken = tokens[self.offset : self.offset + self.window_len - len(window)]
            window += taken
            self.offset += len(taken)
            if self.offset >= len(tokens):
                self.doc_index += 1
                self.offset = 0
                self._tokens = None
        self.next_sample += 1
        return window


class PackedDataset(IterableDataset):
    """This rank's samples of the packed stream, as tensors of seq_len + 1 token ids."""

    def __init__(self, source, tokenizer, seq_len: int, dp_rank: int, dp_degree: int, global_batch_size: int,
                 dataset_name: str = "", dataset_path: str = ""):
        if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"bad data-parallel rank {dp_rank} of {dp_degree}")
        if global_batch_size < 1 or global_batch_size % dp_degree:
            raise ValueError(f"global batch size {global_batch_size} is not a positive multiple of {dp_degree}")
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        block = global_batch_size // dp_degree
        self._block_start = dp_rank * block  # this rank's block, as offsets inside a step
        self._block_end = (dp_rank + 1) * block
        self.dataset_name = dataset_name or source.name
        self.dataset_path = dataset_path
        self._stream = _TokenStream(source, tokenizer, seq_len + 1)

    def owns(self, sample: int) -> bool:
        return self._block_start <= sample % self.global_batch_size < self._block_end

    def _next_owned(self, sample: int) -> int:
        """The first global sample >= `sample` that this rank owns."""
        step, pos = divmod(sample, self.global_batch_size)
        if pos < self._block_start:
            return step * self.global_batch_size + self._block_start
        if pos < self._block_end:
            return sample
        return (step + 1) * self.global_batch_size + self._block_start

    def _skip_to(self, sample: int):
        while self._stream.next_sample < sample:
            self._stream.read()

    def __iter__(self) -> Iterator[torch.Tensor]:
        # All progress lives in self._stream, so an abandoned iterator costs nothing and a state
        # loaded (or advanced by state_dict) between two samples is picked up here.
        while True:
            self._skip_to(self._next_owned(self._stream.next_sample))
            yield torch.tensor(self._stream.read(), dtype=torch.long)

    def state_dict(self) -> dict:
        stream = self._stream
        # Past the end of this rank's block: read ahead to the step boundary, so that the state is
        # the same on every rank and loads under any data-parallel layout.
        if stream.next_sample % self.global_batch_size >= self._block_end:
            self._skip_to((stream.next_sample // self.global_batch_size + 1) * self.global_batch_size)
        return {
            "version": STATE_VERSION,
            "dataset": self.dataset_name,
            "dataset_path": self.dataset_path,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "next_sample": stream.next_sample,
            "epoch": stream.epoch,
            "doc_index": stream.doc_index,
            "token_offset": stream.offset,
            "carry": list(stream.carry),
        }

    def load_state_dict(self, state: dict):
        if state.get("version") != STATE_VERSION:
            raise UserError(f"data loader state has version {state.get('version')}; expected {STATE_VERSION}")
        if state["dataset"] != self.dataset_name:
            raise UserError(
                f"the checkpoint's data state is for dataset {state['dataset']!r}, but training.dataset "
                f"is {self.dataset_name!r}; resume with the same dataset"
            )
        if state["dataset_path"] != self.dataset_path:
            logger.warning(
                "resuming data of %s from a state saved for %s: document positions are only "
                "meaningful if the data is the same", self.dataset_path, state["dataset_path"],
            )
        for key in ("seq_len", "global_batch_size"):
            # Explained to the user before launch (checkpoint.preflight_checkpoint).
            if state[key] != getattr(self, key):
                raise ValueError(f"data state saved with {key} = {state[key]}, loaded with {getattr(self, key)}")
        next_sample = state["next_sample"]
        if next_sample % self.global_batch_size and not self.owns(next_sample):
            raise UserError(
                f"the data state was saved in the middle of a step (at global sample {next_sample}) by "
                "another data-parallel rank or layout; only states saved at step boundaries load "
                "under a different layout"
            )
        if len(state["carry"]) > self.seq_len:
            raise ValueError(f"corrupt data state: {len(state['carry'])} carried tokens")
        self._stream.seek(next_sample, state["epoch"], state["doc_index"], state["token_offset"], state["carry"])


def _collate(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.stack(windows)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def build_dataloader(
    cfg: Training, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, global_batch_size: int
) -> StatefulDataLoader:
    """Batches (inputs, labels), each int64 [local_batch_size, seq_len], of this rank's samples.

    `global_batch_size` is resolved: a positive multiple of local_batch_size x dp_degree.
    The loader never ends (the data loops). To resume, call loader.load_state_dict(state) and
    then iter(loader): the state is applied when the next iterator is created.
    """
    if global_batch_size % (cfg.local_batch_size * dp_degree):
        raise ValueError(
            f"global batch size {global_batch_size} is not a multiple of local_batch_size "
            f"{cfg.local_batch_size} x dp degree {dp_degree}"
        )
    source = _build_source(cfg)
    dataset = PackedDataset(
        source, tokenizer, cfg.seq_len, dp_rank, dp_degree, global_batch_size,
        dataset_name=cfg.dataset, dataset_path=cfg.dataset_path or "",
    )
    with warnings.catch_warnings():
        # torchdata 0.11 calls a torch API that torch now deprecates; nothing for users to act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, batch_size=cfg.local_batch_size, num_workers=0, collate_fn=_collate)
