"""Tokenize a corpus once into a token folder that training reads memory-mapped.

    python scripts/pretokenize.py SOURCE OUTPUT --tokenizer PATH [--workers N] [--text-field text]

SOURCE: a local corpus as training.dataset = "local" reads it (a .jsonl/.json/.txt file, also .gz/.zst,
.parquet, .arrow, a datasets save_to_disk folder, or a folder of such files), or the name
python_stdlib or c4_test. OUTPUT: a new folder (see torchtitan/components/token_file.py for the
format). Train on it with

    --training.dataset tokens --training.dataset_path OUTPUT

with the same tokenizer (model.tokenizer_path): the samples, their order and the resumable state
are those of the text pipeline on SOURCE. Encoding uses all cores (--workers); the documents are
written in order, chunk by chunk. If interrupted, run the same command again: it continues after
the last complete chunk (a folder without meta.json is refused by training as incomplete).
"""

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.components import data  # noqa: E402
from torchtitan.components.token_file import pretokenize  # noqa: E402
from torchtitan.components.tokenizer import Tokenizer  # noqa: E402
from torchtitan.config.errors import UserError  # noqa: E402
from torchtitan.config.job_config import Training  # noqa: E402


def open_source(spec: str, text_field: str = "text"):
    """The text source named by SOURCE (as the text pipeline builds it) and its description: what it
    is plus a fingerprint of its files (path, size, mtime), so a resumed run checks it is the same data."""
    if spec in ("python_stdlib", "c4_test") and not os.path.exists(spec):
        cfg = Training(dataset=spec, shuffle_documents=False, dataset_text_field=text_field)
    else:
        cfg = Training(dataset="local", dataset_path=spec, shuffle_documents=False, dataset_text_field=text_field)
    source, _ = data.build_source(cfg)
    files = getattr(source, "paths", None) or list(getattr(source, "files", []))
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{Path(f).resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    description = {
        "dataset": cfg.dataset,
        "path": None if cfg.dataset_path is None else str(Path(cfg.dataset_path).resolve()),
        "text_field": text_field,
        "description": f"{cfg.dataset}" + (f" {cfg.dataset_path}" if cfg.dataset_path else ""),
        "files": len(files),
        "files_sha256": h.hexdigest(),
    }
    return source, description


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a data file or folder (as training.dataset = local), python_stdlib or c4_test")
    parser.add_argument("output", help="the token folder to write (new, or an interrupted one to finish)")
    parser.add_argument("--tokenizer", required=True, help="the tokenizer (as model.tokenizer_path)")
    parser.add_argument("--text-field", default="text", help="the JSON field / column holding the text")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="encoding processes (default: all cores)")
    parser.add_argument("--chunk-docs", type=int, default=4096, help="documents per resumable chunk")
    parser.add_argument("--max-chunks", type=int, default=None, help=argparse.SUPPRESS)  # tests: stop early
    args = parser.parse_args(argv)
    try:
        tokenizer = Tokenizer(args.tokenizer)
        source, description = open_source(args.source, args.text_field)
        start = time.perf_counter()
        meta = pretokenize(source, tokenizer, args.output, source_description=description,
                           tokenizer_spec=str(tokenizer.path), workers=args.workers, chunk_docs=args.chunk_docs,
                           max_chunks=args.max_chunks)
    except UserError as e:
        # The source's messages name the training key; here the source is the SOURCE argument.
        print("error: " + str(e).replace("set training.dataset_path to", "give SOURCE as")
              .replace("training.dataset_path", "SOURCE"), file=sys.stderr)
        return 2
    if meta is None:
        print(f"stopped after {args.max_chunks} chunks: run again to finish {args.output}")
        return 3
    seconds = time.perf_counter() - start
    print(f"wrote {args.output}: {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens ({meta['dtype']}) "
          f"in {seconds:.1f} s; train on it with --training.dataset tokens --training.dataset_path {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
