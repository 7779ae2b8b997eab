"""Pre-tokenized corpora: a folder written by scripts/pretokenize.py, read by training.dataset = "tokens".

The folder:

- `tokens.bin`: the tokens of every document, as the text pipeline frames them
  (data.encode_document: [BOS] + text + [EOS], an empty document is no tokens), concatenated in
  stored document order; little-endian uint16 when the vocabulary fits (vocab_size <= 65536),
  else uint32.
- `docs.idx`: little-endian uint64 offsets (in tokens) of each document, num_docs + 1 of them:
  document i is tokens[idx[i]:idx[i + 1]]. Every document of the source has an entry (empty ones
  too), so the document indices, the shuffle permutation over them and the packing are those of the
  text pipeline: the samples are identical.
- `meta.json`, written last: format version, dtype, vocab_size, bos/eos ids, the tokenizer's
  fingerprint (kind, vocab size, sha256 of its files), num_docs, num_tokens, max_id, the source's
  description and fingerprint, and whether the text pipeline shuffles that source by default. A
  folder without it is incomplete (an interrupted pretokenize): refused, "run pretokenize again".
- `progress.json`, while writing: the documents and tokens of the complete chunks. A rerun cuts
  tokens.bin and docs.idx back to it and continues from there.

Reading memory-maps both arrays: start-up and memory do not depend on the corpus size. Checks at
open (O(1)): meta.json present, file sizes, the tokenizer (vocab size, BOS/EOS, file hash), a
uint16 file with a vocabulary over 65536, the recorded max id; and per window read, that its ids are
below the vocabulary (a file changed after it was written).
"""

import contextlib
import errno
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from torchtitan.config.errors import UserError

logger = logging.getLogger(__name__)

FORMAT = "torchtitan-tokens"
FORMAT_VERSION = 1
TOKENS, INDEX, META, PROGRESS = "tokens.bin", "docs.idx", "meta.json", "progress.json"
UINT16_LIMIT = 1 << 16
PRETOKENIZE = "python scripts/pretokenize.py SOURCE OUTPUT --tokenizer PATH"


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= UINT16_LIMIT else "uint32"


_TOKENIZER_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_fingerprint(tokenizer) -> dict:
    """What identifies a tokenizer: its kind, vocabulary size, BOS/EOS ids and the sha256 of its file(s)
    (the model file, and the Hugging Face config files beside it). A tokenizer without a path (a test's)
    has no hash."""
    digest = None
    path = getattr(tokenizer, "path", None)
    if path is not None:
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        files = [] if path.is_dir() else [path]
        files += [folder / n for n in _TOKENIZER_SIDE_FILES if (folder / n).is_file() and folder / n != path]
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        digest = h.hexdigest()
    return {
        "kind": getattr(tokenizer, "kind", type(tokenizer).__name__),
        "path": None if path is None else str(path),
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "sha256": digest,
    }


def _same_tokenizer(a: dict, b: dict) -> bool:
    keys = ("kind", "vocab_size", "bos_id", "eos_id", "sha256")
    return all(a.get(k) == b.get(k) for k in keys)


def _describe_tokenizer(fp: dict) -> str:
    sha = fp.get("sha256")
    return (
        f"{fp.get('kind')} tokenizer {fp.get('path') or '(no file)'} (vocab_size {fp.get('vocab_size')}, "
        f"bos {fp.get('bos_id')}, eos {fp.get('eos_id')}" + (f", sha256 {sha[:12]}" if sha else "") + ")"
    )


def read_meta(folder: Path) -> dict:
    meta_file = folder / META
    if not folder.is_dir():
        raise UserError(f"token folder {folder} does not exist (training.dataset_path); write it with {PRETOKENIZE}")
    if not meta_file.is_file():
        if (folder / PROGRESS).is_file() or (folder / TOKENS).is_file():
            raise UserError(
                f"token folder {folder} is incomplete (no {META}: its pretokenize was interrupted); run pretokenize "
                f"again with the same arguments to finish it ({PRETOKENIZE})"
            )
        raise UserError(f"{folder} is not a token folder (no {META}); write one with {PRETOKENIZE}")
    try:
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}")
    except ValueError as e:
        raise UserError(
            f"{meta_file} is not a token folder's metadata ({e}); write the folder again with {PRETOKENIZE}"
        ) from None
    if meta.get("version") != FORMAT_VERSION:
        raise UserError(
            f"{meta_file} has format version {meta.get('version')}; this torchtitan reads version "
            f"{FORMAT_VERSION}: write the folder again with {PRETOKENIZE}"
        )
    return meta


class TokenFile:
    """A token folder, memory-mapped: documents of tokens by index (a source for data._TokenStream)."""

    random_access = True
    name = "tokens"

    def __init__(self, path: str | os.PathLike, vocab_size: int | None = None):
        folder = Path(path)
        self.folder = folder
        meta = read_meta(folder)
        self.meta = meta
        dtype = meta["dtype"]
        if dtype not in ("uint16", "uint32"):
            raise UserError(f"{folder / META}: unknown dtype {dtype!r}; write the folder again with {PRETOKENIZE}")
        file_vocab = int(meta["vocab_size"])
        for what, vocab in (("the vocabulary it was written with", file_vocab), ("the job's tokenizer", vocab_size)):
            if dtype == "uint16" and vocab is not None and vocab > UINT16_LIMIT:
                raise UserError(
                    f"{folder / TOKENS} holds uint16 ids, but {what} has {vocab} tokens (over 65536): ids above "
                    f"65535 cannot be stored in it; pretokenize again with that tokenizer (it writes uint32)"
                )
        self.num_docs, self.num_tokens = int(meta["num_docs"]), int(meta["num_tokens"])
        itemsize = np.dtype(dtype).itemsize
        for name, expected in ((TOKENS, self.num_tokens * itemsize), (INDEX, (self.num_docs + 1) * 8)):
            f = folder / name
            size = f.stat().st_size if f.is_file() else None
            if size != expected:
                got = "missing" if size is None else f"{size:,} bytes"
                raise UserError(
                    f"{f} is {got}, but {META} says it holds {expected:,} bytes: it is truncated or damaged (a copy "
                    f"cut short?); copy it again, or write the folder again with {PRETOKENIZE}"
                )
        limit = file_vocab if vocab_size is None else vocab_size
        self.vocab_limit = limit
        if int(meta["max_id"]) >= limit:
            raise UserError(
                f"{folder / TOKENS} holds token id {meta['max_id']}, not below the vocabulary size {limit}: it was "
                f"written with another tokenizer; pretokenize again with this job's tokenizer, or set "
                f"model.tokenizer_path to the one it was written with"
            )
        le = "<" + ("u2" if dtype == "uint16" else "u4")
        self.tokens = np.memmap(folder / TOKENS, dtype=le, mode="r", shape=(self.num_tokens,))
        self.offsets = np.memmap(folder / INDEX, dtype="<u8", mode="r", shape=(self.num_docs + 1,))
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.num_tokens:
            raise UserError(
                f"{folder / INDEX} does not match {TOKENS} (offsets {int(self.offsets[0])}.."
                f"{int(self.offsets[-1])} for {self.num_tokens} tokens); write the folder again with "
                f"{PRETOKENIZE}"
            )

    def num_documents(self) -> int:
        return self.num_docs

    def document_length(self, index: int) -> int:
        return int(self.offsets[index + 1]) - int(self.offsets[index])

    def document(self, index: int):
        return self.tokens[int(self.offsets[index]) : int(self.offsets[index + 1])]

    def documents(self, start: int):
        for i in range(start, self.num_docs):
            yield self.document(i)

    def check_window(self, window):
        """Every id of a window read is below the vocabulary (O(window), so cheap; the whole file was
        checked when written, this catches a file changed since)."""
        top = int(window.max())
        if top >= self.vocab_limit:
            raise UserError(
                f"{self.folder / TOKENS} holds token id {top}, not below the vocabulary size {self.vocab_limit} "
                f"(the file changed after it was written, or was written with another tokenizer); write the folder "
                f"again with {PRETOKENIZE} and this job's tokenizer"
            )


def open_token_source(path: str | None, tokenizer) -> TokenFile:
    """The token folder of training.dataset = "tokens", checked against the job's tokenizer."""
    if not path:
        raise UserError(f'training.dataset = "tokens" needs training.dataset_path: the folder written by {PRETOKENIZE}')
    vocab = getattr(tokenizer, "vocab_size", None)
    source = TokenFile(path, vocab)
    recorded = source.meta["tokenizer"]
    if tokenizer is not None:
        current = tokenizer_fingerprint(tokenizer)
        if not _same_tokenizer(recorded, current):
            raise UserError(
                f"token folder {path} was written with the {_describe_tokenizer(recorded)}, but this job's "
                f"model.tokenizer_path is the {_describe_tokenizer(current)}; set model.tokenizer_path to the "
                f"tokenizer it was written with, or pretokenize again with this one"
            )
    return source


# ---------------------------------------------------------------------------------------------
# Writing: pretokenize.


def _atomic_write_json(path: Path, value: dict):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_worker_tokenizer = None


def _init_worker(tokenizer_or_path):
    global _worker_tokenizer
    if isinstance(tokenizer_or_path, (str, Path)):
        from torchtitan.components.tokenizer import Tokenizer

        _worker_tokenizer = Tokenizer(tokenizer_or_path)
    else:
        _worker_tokenizer = tokenizer_or_path


def _encode_batch(texts: list) -> list:
    from torchtitan.components.data.packing import encode_document

    return [encode_document(_worker_tokenizer, t) for t in texts]


def _batches(iterator, size: int):
    batch = []
    for item in iterator:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_error(out: Path, e: OSError) -> UserError:
    """A failed write into the token folder (a full disk, a quota, permissions) as one line: what failed,
    and that the same command continues after the last complete chunk once it is fixed."""
    where = f" ({e.filename})" if e.filename else ""
    fix = "free space on it" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "fix that"
    return UserError(
        f"could not write the token folder {out}: {e.strerror or e}{where}; {fix} and run the same "
        "command again (it continues after the last complete chunk), or choose another OUTPUT"
    )


@contextlib.contextmanager
def _writing(out: Path):
    try:
        yield
    except OSError as e:
        raise _write_error(out, e) from None


def _read_chunk(docs, count: int, description, done: int) -> list:
    """The next `count` texts of the source. An OSError here is the source's (a file, the network of a
    streamed dataset), not the token folder's."""
    try:
        return [t for _, t in zip(range(count), docs)]
    except OSError as e:
        raise UserError(
            f"could not read the source {description} after {done:,} documents: {type(e).__name__}: "
            f"{e}; run the same command again: it continues after the last complete chunk"
        ) from None


def _difference(recorded: dict, current: dict) -> str | None:
    """How a token folder's recorded source and tokenizer differ from this run's (None: the same). The
    tokenizer is compared by content (kind, vocabulary, BOS/EOS, file hash), not by where it lies."""
    old, new = recorded.get("source") or {}, current["source"]
    if old != new:
        if old.get("description") == new.get("description") and old.get("text_field") == new.get("text_field"):
            return (
                f"the source {new.get('description')} has changed since (its files' paths, sizes or modification "
                "times, or the dataset's data files or revision)"
            )
        return (
            f"it is of the source {old.get('description')} (text field {old.get('text_field')!r}), not "
            f"{new.get('description')} (text field {new.get('text_field')!r})"
        )
    if not _same_tokenizer(recorded.get("tokenizer") or {}, current["tokenizer"]):
        return (
            f"it is of the {_describe_tokenizer(recorded.get('tokenizer') or {})}, not the "
            f"{_describe_tokenizer(current['tokenizer'])}"
        )
    if recorded.get("dtype") != current["dtype"]:
        return f"it holds {recorded.get('dtype')} ids, this run writes {current['dtype']}"
    return None


def pretokenize(
    source,
    tokenizer,
    output: str | os.PathLike,
    *,
    source_description: dict,
    tokenizer_spec=None,
    workers: int | None = None,
    chunk_docs: int = 4096,
    batch_docs: int = 64,
    max_chunks: int | None = None,
    log=print,
) -> dict | None:
    """Write the token folder of a text source (data.py's sources: `documents(start)` in stored order).

    `tokenizer_spec`: what each worker builds its tokenizer from (a path; default: the tokenizer itself,
    pickled). Resumable: each chunk of `chunk_docs` documents is appended, then progress.json records it;
    a rerun continues after the last complete chunk (if the source and tokenizer are the same). meta.json
    is written last. `max_chunks`: stop after that many chunks without finishing (for tests); returns
    the meta dict when finished, else None. An OSError writing the folder (a full disk) or reading the
    source is a UserError of one line: the same call then continues after the last complete chunk.
    """
    out = Path(output)
    fingerprint = tokenizer_fingerprint(tokenizer)
    vocab = fingerprint["vocab_size"]
    dtype = dtype_for(vocab)
    identity = {"source": source_description, "tokenizer": fingerprint, "dtype": dtype}
    np_dtype = np.dtype("<u2" if dtype == "uint16" else "<u4")
    docs_done, tokens_done, max_id = 0, 0, -1
    # Every OSError of the token folder (mkdir, a full disk, permissions) is one line with its fix: the
    # writes are in _writing blocks; reading the source is not (its errors are its own).
    with _writing(out):
        out.mkdir(parents=True, exist_ok=True)
        if (out / META).is_file():
            meta = read_meta(out)
            difference = _difference(meta, identity)
            if difference:
                raise UserError(
                    f"{out} already holds a complete token folder of another source or tokenizer: "
                    f"{difference}; choose another OUTPUT, or remove it"
                )
            log(f"{out} is already complete: {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens")
            return meta
        if (out / PROGRESS).is_file():
            progress = json.loads((out / PROGRESS).read_text())
            difference = _difference(progress, identity)
            if difference:
                raise UserError(
                    f"{out} holds an interrupted pretokenize of another source or tokenizer: {difference}; rerun it "
                    "with the same SOURCE and --tokenizer, or choose another OUTPUT (or remove it)"
                )
            docs_done, tokens_done, max_id = progress["docs_done"], progress["tokens_done"], progress["max_id"]
            log(f"resuming {out}: {docs_done:,} documents, {tokens_done:,} tokens already written")
        elif any(out.iterdir()):
            raise UserError(f"OUTPUT {out} is not empty and is not a token folder; choose an empty or new folder")
        # Cut back to the last complete chunk (a killed or failed run may have appended part of the next one).
        with open(out / TOKENS, "ab") as f:
            f.truncate(tokens_done * np_dtype.itemsize)
        with open(out / INDEX, "ab") as f:
            f.truncate((docs_done + 1) * 8 if docs_done else 0)
            if docs_done == 0:
                f.write(np.zeros(1, dtype="<u8").tobytes())

    workers = workers or os.cpu_count() or 1
    pool = None
    if workers > 1:
        import multiprocessing

        pool = multiprocessing.get_context("fork" if os.name == "posix" else "spawn").Pool(
            workers, initializer=_init_worker, initargs=(tokenizer_spec or tokenizer,)
        )
        encode = lambda batches: pool.imap(_encode_batch, batches)  # noqa: E731 (in order)
    else:
        _init_worker(tokenizer_spec or tokenizer)
        encode = lambda batches: map(_encode_batch, batches)  # noqa: E731
    chunks = 0
    description = source_description.get("description")
    try:
        docs = source.documents(docs_done)
        while True:
            texts = _read_chunk(docs, chunk_docs, description, docs_done)
            if not texts:
                break
            lengths, pieces = [], []
            for encoded in encode(_batches(texts, batch_docs)):
                for ids in encoded:
                    arr = np.asarray(ids, dtype=np.int64)
                    if arr.size:
                        max_id = max(max_id, int(arr.max()))
                        if arr.min() < 0 or max_id >= vocab:
                            raise UserError(f"the tokenizer produced id {max_id} outside its vocabulary of {vocab}")
                    pieces.append(arr.astype(np_dtype))
                    lengths.append(arr.size)
            ends = tokens_done + np.cumsum(np.asarray(lengths, dtype=np.uint64), dtype=np.uint64)
            # Opened per chunk (cheap next to encoding it), so that each write is inside _writing.
            with _writing(out), open(out / TOKENS, "ab") as tokens_f, open(out / INDEX, "ab") as index_f:
                tokens_f.write(np.concatenate(pieces).tobytes() if pieces else b"")
                index_f.write(ends.astype("<u8").tobytes())
                tokens_f.flush()
                index_f.flush()
                os.fsync(tokens_f.fileno())
                os.fsync(index_f.fileno())
            docs_done += len(texts)
            tokens_done = int(ends[-1]) if len(ends) else tokens_done
            with _writing(out):
                _atomic_write_json(
                    out / PROGRESS, {**identity, "docs_done": docs_done, "tokens_done": tokens_done, "max_id": max_id}
                )
            chunks += 1
            log(f"{docs_done:,} documents, {tokens_done:,} tokens")
            if max_chunks is not None and chunks >= max_chunks:
                return None
        if hasattr(docs, "close"):
            docs.close()
    finally:
        if pool is not None:
            pool.terminate()
    if tokens_done == 0:
        raise UserError(f"the source {description} has no non-empty document: nothing to train on")
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        **identity,
        "vocab_size": vocab,
        "bos_id": fingerprint["bos_id"],
        "eos_id": fingerprint["eos_id"],
        "num_docs": docs_done,
        "num_tokens": tokens_done,
        "max_id": max_id,
        "source_random_access": bool(source.random_access),
    }
    with _writing(out):
        _atomic_write_json(out / META, meta)
        (out / PROGRESS).unlink()
    return meta
