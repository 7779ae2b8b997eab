"""Tokenize a corpus once into a token folder that training reads memory-mapped.

    python scripts/pretokenize.py SOURCE OUTPUT --tokenizer PATH [--dataset NAME] [--workers N] [--text-field text]

SOURCE is what training reads, as training.dataset = --dataset and training.dataset_path = SOURCE:

    (no --dataset)          SOURCE is a local corpus, as training.dataset = "local" reads it (a .jsonl/.json/.txt
                            file, also .gz/.zst, .parquet, .arrow, a datasets save_to_disk folder, or a folder
                            of such files), or one of the names python_stdlib, c4_test, c4 (when no file or
                            folder of that name is here)
    --dataset huggingface   SOURCE is a dataset streamed through the datasets package,
                            datasets.load_dataset(SOURCE, split="train", streaming=True): a Hugging Face Hub
                            name (org/name) or a local folder of data files
    --dataset c4            SOURCE is c4 (allenai/c4, config en, streamed from the Hub) or a local clone of
                            allenai/c4 (its en/c4-train.* shards)
    --dataset c4_test       SOURCE is c4_test (tests/assets/c4_test) or the folder of that sample
    --dataset local, python_stdlib: as without --dataset

e.g. python scripts/pretokenize.py --dataset huggingface HuggingFaceFW/fineweb-edu tokens/ --tokenizer tok.model

OUTPUT: a new folder (see torchtitan/components/data/token_folder.py for the format); one that cannot be created
or written is refused before anything is read. Train on it with

    --training.dataset tokens --training.dataset_path OUTPUT

with the same tokenizer (model.tokenizer_path): the samples, their order and the resumable state
are those of the text pipeline on SOURCE. Encoding uses all cores (--workers); the documents are
written in order, chunk by chunk. If interrupted (or stopped by an error such as a full disk), run
the same command again: it continues after the last complete chunk (a folder without meta.json is
refused by training as incomplete). A rerun checks that the source is the same: for files their
paths, sizes and modification times; for a Hub dataset its name, config, text field and data files
(whose URLs name the dataset's revision).
"""

import argparse
import errno
import hashlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.components import data  # noqa: E402
from torchtitan.components.data.token_folder import META, pretokenize  # noqa: E402
from torchtitan.components.tokenizer import Tokenizer  # noqa: E402
from torchtitan.config.errors import ArgumentParser, UserError, positive_int, run_main  # noqa: E402
from torchtitan.config.training_sections import Training  # noqa: E402

DATASETS = ("local", "huggingface", "c4", "c4_test", "python_stdlib")
NAMED = ("python_stdlib", "c4_test", "c4")  # datasets a bare SOURCE may name (they need no path)


def source_config(spec: str, dataset: str | None = None, text_field: str = "text") -> Training:
    """The training config whose text pipeline reads SOURCE (--dataset is training.dataset)."""
    if dataset is None:
        # A bare name selects that dataset, unless a file or folder of that name is here: then it is data.
        dataset = spec if spec in NAMED and not os.path.exists(spec) else "local"
    # For c4 and c4_test, SOURCE = their own name means their default place (the Hub, the test sample).
    path = None if dataset in NAMED and spec == dataset and not os.path.exists(spec) else spec
    if dataset == "python_stdlib" and path is not None:
        raise UserError(
            f"--dataset python_stdlib is the embedded corpus and takes no path: give SOURCE as "
            f"python_stdlib, not {spec!r}"
        )
    return Training(dataset=dataset, dataset_path=path, shuffle_documents=False, dataset_text_field=text_field)


def _streamed_files(source) -> list[str] | None:
    """The data files a `datasets` stream reads: local paths, or hf://datasets/NAME@COMMIT/... URLs that
    name the revision. The library keeps them only in its private example iterable (the builders' gen
    kwargs: original_files for JSON/CSV/text, files for parquet/Arrow); None where a version keeps them
    elsewhere, and the fingerprint is then the name and config alone."""
    stream = getattr(getattr(source, "dataset", None), "_ex_iterable", None)
    kwargs = getattr(stream, "kwargs", None) or {}
    for key in ("original_files", "files", "base_files"):
        files = kwargs.get(key)
        if isinstance(files, (list, tuple)) and files and all(isinstance(f, str) for f in files):
            return list(dict.fromkeys(files))  # parquet lists a file once per row group
    return None


def _files_sha256(files) -> str:
    h = hashlib.sha256()
    for f in files:
        if "://" in str(f):  # a remote file: its URL (with the commit) is what identifies it
            h.update(f"{f}\n".encode())
        else:
            st = os.stat(f)
            h.update(f"{Path(f).resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def describe_source(cfg: Training, source) -> dict:
    """What the source is and a fingerprint of its data, recorded in the token folder so that a rerun
    continues only on the same data. Files: path, size, mtime. A `datasets` stream (huggingface, c4 from
    the Hub) has no files of its own: its name, config and the data files it streams."""
    path = cfg.dataset_path
    description = {
        "dataset": cfg.dataset,
        # Only a local path resolves; a Hub name (org/name) is kept as written.
        "path": None if path is None else str(Path(path).resolve()) if os.path.exists(path) else path,
        "text_field": cfg.dataset_text_field,
        "description": f"{cfg.dataset}" + (f" {path}" if path else ""),
    }
    if hasattr(source, "dataset"):  # streamed through datasets
        files = _streamed_files(source)
        info = getattr(source.dataset, "info", None)
        description.update(
            {
                "stream": getattr(source, "path", path),
                "config": getattr(info, "config_name", None),
                "files": None if files is None else len(files),
                "files_sha256": None if files is None else _files_sha256(files),
            }
        )
        return description
    files = getattr(source, "paths", None) or list(getattr(source, "files", []))
    description.update({"files": len(files), "files_sha256": _files_sha256(files)})
    return description


def open_source(spec: str, text_field: str = "text", dataset: str | None = None):
    """The text source named by SOURCE (as the text pipeline builds it) and its description."""
    cfg = source_config(spec, dataset, text_field)
    source, _ = data.build_source(cfg)
    return source, describe_source(cfg, source)


# --- OUTPUT ---------------------------------------------------------------------------------------


def _output_error(out: Path, e: OSError) -> UserError:
    """One line: the folder, why it cannot be made or written, and what to do."""
    full = out.absolute()
    blocker = next((p for p in reversed([full, *full.parents]) if p.exists() and not p.is_dir()), None)
    if blocker == full:
        reason = "it is a file, not a folder"
    elif blocker is not None:
        reason = f"{blocker} is a file, not a folder"
    elif e.errno == errno.ENOENT and e.filename and Path(e.filename).parent.is_dir():
        # /proc and the like answer "no such file" to mkdir in an existing folder.
        reason = f"{Path(e.filename).parent} does not accept new folders ({e.strerror})"
    else:
        reason = e.strerror or str(e)
        if e.filename and Path(e.filename).absolute() != full:
            reason += f" ({e.filename})"
    return UserError(
        f"cannot create the output folder {out}: {reason}; give OUTPUT as a new folder in a place "
        "you can write to (or the folder of an interrupted run, to finish it)"
    )


def prepare_output(output: str) -> Path | None:
    """Create OUTPUT (and missing parents) now, before the tokenizer and the source are opened, so a
    folder that cannot be made or written fails at once. Returns the topmost folder it created (None if
    OUTPUT existed), for remove_if_unused."""
    out = Path(output)
    full = out.absolute()
    missing = [p for p in [full, *full.parents] if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _output_error(out, e) from None
    # An existing folder may still refuse files (permissions, a read-only mount; root passes the first).
    # A complete token folder is not written again, so it may be read-only.
    if not (out / META).is_file() and not os.access(out, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only_mount(out) else "permission denied"
        raise _output_error(out, OSError(errno.EACCES, reason))
    return missing[-1] if missing else None


def _read_only_mount(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def remove_if_unused(output: str, created: Path | None):
    """After a failure before anything was written: remove the empty folders prepare_output made."""
    if created is None:
        return
    folder = Path(output).absolute()
    while True:
        try:
            folder.rmdir()  # only if empty: a folder holding a partial run stays, to resume
        except OSError:
            return
        if folder == created:
            return
        folder = folder.parent


def _main(argv: list[str]) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "source",
        help="what to read: a data file or folder, python_stdlib, c4_test or c4; with "
        "--dataset, training.dataset_path of that dataset (for huggingface: a Hub "
        "name or a local folder)",
    )
    parser.add_argument("output", help="the token folder to write (new, or an interrupted one to finish)")
    parser.add_argument("--tokenizer", required=True, help="the tokenizer (as model.tokenizer_path)")
    parser.add_argument(
        "--dataset",
        choices=DATASETS,
        default=None,
        help="read SOURCE as training.dataset = DATASET reads training.dataset_path (default: local "
        "files, or the dataset SOURCE names)",
    )
    parser.add_argument("--text-field", default="text", help="the JSON field / column holding the text")
    parser.add_argument(
        "--workers", type=positive_int, default=os.cpu_count(), help="encoding processes (default: all cores)"
    )
    parser.add_argument("--chunk-docs", type=positive_int, default=4096, help="documents per resumable chunk")
    parser.add_argument("--max-chunks", type=int, default=None, help=argparse.SUPPRESS)  # tests: stop early
    args = parser.parse_args(argv)
    created = None
    try:
        created = prepare_output(args.output)
        tokenizer = Tokenizer(args.tokenizer)
        source, description = open_source(args.source, args.text_field, args.dataset)
        start = time.perf_counter()
        meta = pretokenize(
            source,
            tokenizer,
            args.output,
            source_description=description,
            tokenizer_spec=str(tokenizer.path),
            workers=args.workers,
            chunk_docs=args.chunk_docs,
            max_chunks=args.max_chunks,
        )
    except UserError as e:
        remove_if_unused(args.output, created)
        # The source's messages name the training key; here the source is the SOURCE argument.
        raise UserError(
            str(e).replace("set training.dataset_path to", "give SOURCE as").replace("training.dataset_path", "SOURCE")
        ) from None
    if meta is None:
        print(f"stopped after {args.max_chunks} chunks: run again to finish {args.output}")
        return 3
    seconds = time.perf_counter() - start
    print(
        f"wrote {args.output}: {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens ({meta['dtype']}) "
        f"in {seconds:.1f} s; train on it with --training.dataset tokens --training.dataset_path {args.output}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """The exit status: 0 written, 3 stopped early (--max-chunks), 2 a mistake (one line on stderr)."""
    return run_main(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
