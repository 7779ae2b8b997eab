"""Train the shipped tokenizer: a 4k-piece sentencepiece BPE model of Python source code.

Usage: python scripts/train_tokenizer.py [--output PATH] [--vocab-size N]

Mistakes (an --output that cannot be written, checked before training; a --vocab-size the corpus
cannot have) are reported in one line on stderr with exit status 2.

The training text is the embedded python_stdlib corpus (torchtitan.components.data), taken in
corpus order and capped at ~8 MB, one sentence per non-blank line. Everything that could vary
between runs is pinned (one thread, no sampling, no shuffling), so the same interpreter always
produces the same model bytes.

The options make the model lossless on code: no normalization, whitespace kept as written
(runs of spaces become pieces, so indentation is cheap), digits split, and byte fallback so
that any text, even characters never seen in training, encodes and decodes back exactly.
"""

import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from a checkout

from torchtitan.components.data import stdlib_files  # noqa: E402
from torchtitan.config.errors import ArgumentParser, UserError, check_output_path, positive_int, run_main  # noqa: E402

DEFAULT_OUTPUT = REPO_ROOT / "assets" / "tokenizer" / "python_stdlib_4k.model"
TRAINING_BYTES = 8_000_000
# Longest line the trainer keeps; stdlib lines are far shorter, data tables included.
MAX_SENTENCE_BYTES = 1 << 16


def training_lines(max_bytes: int = TRAINING_BYTES) -> Iterator[str]:
    """Non-blank lines of the stdlib corpus in corpus order, until max_bytes have been used."""
    used = 0
    for path in stdlib_files():
        for line in path.read_text(encoding="utf-8", errors="replace").split("\n"):
            used += len(line.encode("utf-8")) + 1
            if used > max_bytes:
                return
            if line.strip():
                yield line


def train(output: Path, vocab_size: int) -> bytes:
    model = io.BytesIO()
    try:
        _train(model, vocab_size)
    except RuntimeError as e:
        # sentencepiece checks the size against the corpus: at least its characters, the 256 byte
        # pieces and the control pieces; at most what BPE can merge.
        if "Vocabulary size" not in str(e):
            raise
        small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
        if small:
            raise UserError(
                f"--vocab-size {vocab_size} is less than the {small[1]} pieces this corpus needs (its "
                f"characters, 256 byte pieces and the control pieces); give {small[1]} or more"
            ) from None
        raise UserError(
            f"--vocab-size {vocab_size}: sentencepiece refuses it for this corpus: {str(e).split('] ')[-1].strip()}"
        ) from None
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(model.getvalue())
    return model.getvalue()


def _train(model: io.BytesIO, vocab_size: int) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=training_lines(),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        max_sentence_length=MAX_SENTENCE_BYTES,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=1,
        minloglevel=1,
    )


def check_round_trip(model_path: Path, n_files: int = 20) -> None:
    """decode(encode(x)) == x on stdlib files spread over the corpus, training-held-out tail included."""
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    files = stdlib_files()
    for path in files[:: max(1, len(files) // n_files)] + files[-1:]:
        text = path.read_text(encoding="utf-8", errors="replace")
        if sp.decode(sp.encode(text)) != text:
            raise SystemExit(f"round trip failed on {path}")


def main(argv: list[str]) -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the .model file")
    parser.add_argument("--vocab-size", type=positive_int, default=4096, help="number of pieces")
    args = parser.parse_args(argv)
    check_output_path(args.output, "--output", existing="replace_file")  # before minutes of training
    model = train(args.output, args.vocab_size)
    check_round_trip(args.output)
    print(f"wrote {args.output} ({len(model)} bytes, vocab {args.vocab_size}); round trip checked")


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
