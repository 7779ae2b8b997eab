"""Small tokenizers built offline (tests/components/test_tokenizer.py, test_tokenizer_export.py): a byte-level
BPE trained on standard library files, written as a Hugging Face folder and as a tiktoken ranks file."""

import base64
import json
from pathlib import Path

# ---- small tokenizers built offline (tests/components/test_tokenizer.py, test_tokenizer_export.py) ----

BPE_SIZE = 650  # trained pieces (the 256 byte symbols included); ids 650-652 are special, 653 added by the config
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def stdlib_texts(count: int) -> list[str]:
    """`count` source files of the standard library, spread over its sorted list."""
    from torchtitan.components.data import stdlib_files

    files = stdlib_files()
    return [p.read_text(encoding="utf-8", errors="replace") for p in files[:: len(files) // count][:count]]


def byte_symbols() -> dict[str, int]:
    """The byte-level BPE alphabet: each byte's printable stand-in character -> the byte. Bytes that
    print as themselves (visible Latin-1) keep their character; the others, in order, take
    characters from U+0100 on."""
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, extra = {chr(b): b for b in visible}, 0
    for b in range(256):
        if b not in visible:
            symbols[chr(256 + extra)] = b
            extra += 1
    return symbols


def write_ranks(path: Path, tokens: list[bytes]) -> Path:
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))
    return path


def write_hf_folder(folder: Path) -> Path:
    """A Llama-3-like Hugging Face folder in `folder`: a byte-level BPE trained on stdlib files, its special
    tokens in tokenizer.json, a post-processor that prepends BOS, and tokenizer_config.json naming BOS/EOS
    and declaring one more special token that tokenizer.json lacks."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(stdlib_texts(12), trainer)
    assert tok.get_vocab_size() == BPE_SIZE
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BPE_SIZE)]
    )
    tok.save(str(folder / "tokenizer.json"))
    added = {str(BPE_SIZE + i): {"content": t, "special": True} for i, t in enumerate(SPECIALS + ["<|extra|>"])}
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "added_tokens_decoder": added,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|begin_of_text|>", "lstrip": False},
                "eos_token": {"content": "<|end_of_text|>"},
            }
        )
    )
    return folder


def write_tiktoken_file(hf_folder: Path, path: Path) -> Path:
    """A tiktoken ranks file at `path` of the BPE in `hf_folder`: each piece as raw bytes, ranked by its id
    (the merge order); no sidecar, so Llama 3's special tokens follow the ranks."""
    vocab = json.loads((hf_folder / "tokenizer.json").read_text())["model"]["vocab"]
    symbols = byte_symbols()
    tokens = [b""] * len(vocab)
    for piece, rank in vocab.items():
        tokens[rank] = bytes(symbols[c] for c in piece)
    return write_ranks(path, tokens)
