"""Write a jsonl corpus of short documents: runs of consecutive non-blank lines of the standard
library's sources (the embedded corpus), `lines` or `lines + 1` lines each, alternately. Many
documents then share one training window, which is what block-causal attention is about.

    python scripts/short_documents.py OUT.jsonl [--count N] [--lines L]

`--lines 1` (the default) gives documents of about 20 tokens of the default tokenizer; 20 about 200.
OUT.jsonl is replaced if it exists; a path that cannot be written, or a count below 1, is reported in
one line on stderr with exit status 2.
"""

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from a checkout

from torchtitan.config.errors import ArgumentParser, check_output_path, positive_int, run_main  # noqa: E402


def short_documents_corpus(path: Path, count: int = 3000, lines: int = 1) -> Path:
    from torchtitan.components.data import stdlib_files

    docs = []
    for f in stdlib_files():
        text = [line for line in f.read_text(errors="replace").splitlines() if line.strip()]
        i = 0
        while i < len(text) and len(docs) < count:
            n = lines + len(docs) % 2
            docs.append("\n".join(text[i : i + n]))
            i += n
        if len(docs) >= count:
            break
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return Path(path)


def main(argv: list[str]) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--count", type=positive_int, default=3000)
    parser.add_argument("--lines", type=positive_int, default=1)
    a = parser.parse_args(argv)
    check_output_path(a.out, "OUT", existing="replace_file")
    path = short_documents_corpus(Path(a.out), a.count, a.lines)
    with open(path) as f:
        written = sum(1 for _ in f)
    print(f"wrote {written} documents to {a.out}")


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
