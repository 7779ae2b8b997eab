"""Write a jsonl corpus of short documents: runs of consecutive non-blank lines of the standard
library's sources (the embedded corpus), `lines` or `lines + 1` lines each, alternately. Many
documents then share one training window, which is what block-causal attention is about.

    python scripts/short_documents.py OUT.jsonl [--count N] [--lines L]

`--lines 1` (the default) gives documents of about 20 tokens of the default tokenizer; 20 about 200.
"""

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from a checkout


def short_documents_corpus(path: Path, count: int = 3000, lines: int = 1) -> Path:
    from torchtitan.components.data import stdlib_files

    docs = []
    for f in stdlib_files():
        text = [line for line in f.read_text(errors="replace").splitlines() if line.strip()]
        i = 0
        while i < len(text) and len(docs) < count:
            n = lines + len(docs) % 2
            docs.append("\n".join(text[i:i + n]))
            i += n
        if len(docs) >= count:
            break
    Path(path).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return Path(path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--lines", type=int, default=1)
    a = parser.parse_args()
    short_documents_corpus(Path(a.out), a.count, a.lines)
    print(f"wrote {a.count} documents to {a.out}")
