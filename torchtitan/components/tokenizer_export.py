"""The run's tokenizer in Hugging Face form, for an export folder that `AutoTokenizer` loads.

- A Hugging Face tokenizer folder: its files are copied.
- A sentencepiece BPE model (the shipped python_stdlib_4k.model): written as a `tokenizers` BPE with
  the model's pieces and byte fallback. Its merges are every split of a piece into two pieces,
  ranked by the merged piece's id (sentencepiece merges the adjacent pair whose piece scores
  highest, and its scores fall with the id). Words split as sentencepiece splits them without a
  dummy prefix: a run of spaces (U+2581 after normalization) starts a word and stays with it.
- A tiktoken BPE file: written as a byte-level BPE with Llama 3's split pattern; each token's merge
  is the last step of tiktoken's own merging of that token's bytes.

Either way `tokenizer(text)` in transformers gives BOS (where the tokenizer has one) followed by the
ids `Tokenizer.encode(text)` gives, and decodes back to the text (tests/components/
test_tokenizer_export.py). What it cannot carry: special-token strings inside a text are special
tokens to transformers, while the trainer encodes them as ordinary text; a sentencepiece model of
another kind (unigram) or with other normalization is refused with the reason.
"""

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from torchtitan.components.tokenizer import HF, LLAMA3_PATTERN, SENTENCEPIECE, Tokenizer, read_tiktoken_ranks
from torchtitan.config.errors import UserError

# The files of a Hugging Face tokenizer folder, copied when present.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


# Model types whose folders transformers (5.x) tokenizes with a class of its own whatever tokenizer_config.json names
# (its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS): Qwen3.5-MoE's Qwen3_5Tokenizer rebuilds the tokenizer from
# tokenizer.json's vocabulary and merges with Qwen's own normalizer and pre-tokenizer, so any other tokenizer (the
# shipped sentencepiece one: `def main` to other ids, `import os\n` decoded as `importos`) comes out wrong. An
# `auto_map` entry in tokenizer_config.json is what makes AutoTokenizer skip that substitution and load the named
# class with tokenizer.json as written. It names no code: for these model types transformers ignores an auto_map's
# remote code unless asked with trust_remote_code=True, which then fails (there is no code in the folder to run).
FIXED_TOKENIZER_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text")


def export_tokenizer(tokenizer_path: str | Path, folder: str | Path) -> list[str]:
    """Write the tokenizer at `tokenizer_path` into `folder` in Hugging Face form; the files written. Where `folder`
    already holds the model's config.json, the tokenizer is written so that transformers loads it for that model."""
    tok = Tokenizer(tokenizer_path)
    folder = Path(folder)
    if tok.kind == HF:
        source = Path(tokenizer_path) if Path(tokenizer_path).is_dir() else tok.path.parent
        names = [n for n in HF_TOKENIZER_FILES if (source / n).is_file()]
        if tok.path.name != "tokenizer.json":  # a lone tokenizer file of another name
            shutil.copy2(tok.path, folder / "tokenizer.json")
            names = [n for n in names if n != "tokenizer.json"] + ["tokenizer.json"]
        for name in names:
            if (source / name) != (folder / name):
                shutil.copy2(source / name, folder / name)
        return sorted(set(names) | _load_as_written(folder))
    if importlib.util.find_spec("tokenizers") is None:
        raise UserError(
            "writing the tokenizer in Hugging Face form needs the tokenizers package: pip install "
            "tokenizers (or pip install 'torchtitan[tokenizers]')"
        )
    backend = _sentencepiece_bpe(tok) if tok.kind == SENTENCEPIECE else _tiktoken_bpe(tok)
    _add_specials(backend, tok)
    backend.save(str(folder / "tokenizer.json"))
    names = {v: k for k, v in tok.special_tokens.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": names[tok.eos_id],
        "bos_token": names.get(tok.bos_id) if tok.bos_id is not None else None,
        "clean_up_tokenization_spaces": False,
    }
    unk = getattr(backend.model, "unk_token", None)
    if unk:
        config["unk_token"] = unk
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    _load_as_written(folder)
    return ["tokenizer.json", "tokenizer_config.json"]


def _load_as_written(folder: Path) -> set[str]:
    """For a model type in FIXED_TOKENIZER_MODEL_TYPES (folder/config.json), tokenizer_config.json names the class
    that reads tokenizer.json as it is, with the auto_map that keeps transformers from replacing it; the files
    changed."""
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return set()
    if model_type not in FIXED_TOKENIZER_MODEL_TYPES:
        return set()
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.update(
        tokenizer_class="PreTrainedTokenizerFast", auto_map={"AutoTokenizer": [None, "PreTrainedTokenizerFast"]}
    )
    path.write_text(json.dumps(config, indent=2) + "\n")
    return {"tokenizer_config.json"}


def _add_specials(backend, tok: Tokenizer) -> None:
    """The special tokens at their ids, and BOS put in front of every text (as the data pipeline frames
    each document)."""
    from tokenizers import AddedToken, processors

    specials = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, _ in specials])
    for text, token_id in specials:
        if backend.token_to_id(text) != token_id:
            raise UserError(
                f"{tok.path}: special token {text!r} would get id {backend.token_to_id(text)} in "
                f"tokenizer.json instead of {token_id}; this tokenizer cannot be written in Hugging "
                "Face form"
            )
    if tok.bos_id is not None:
        bos = tok.decode([tok.bos_id], skip_special_tokens=False)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)]
        )


def _sentencepiece_bpe(tok: Tokenizer):
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

    # Generated by protobuf: its message classes are made when it is imported, so no type checker sees them.
    pb2: Any = sentencepiece_model_pb2

    proto = pb2.ModelProto()
    proto.ParseFromString(tok.path.read_bytes())
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    kind = pb2.TrainerSpec.ModelType.Name(trainer.model_type)
    unsupported = [
        what
        for what, bad in [
            (f"model type {kind} (only BPE is written)", kind != "BPE"),
            (f"normalization rule {norm.name!r} (only 'identity')", norm.name != "identity"),
            ("add_dummy_prefix", norm.add_dummy_prefix),
            ("remove_extra_whitespaces", norm.remove_extra_whitespaces),
            ("treat_whitespace_as_suffix", trainer.treat_whitespace_as_suffix),
            ("split_by_whitespace off", not trainer.split_by_whitespace),
        ]
        if bad
    ]
    if unsupported:
        raise UserError(
            f"sentencepiece model {tok.path} cannot be written as a Hugging Face tokenizer that encodes "
            f"alike: {', '.join(unsupported)}; export without it (the weights are unaffected) and "
            "tokenize with torchtitan.components.tokenizer.Tokenizer"
        )
    normal = pb2.ModelProto.SentencePiece.Type.Value("NORMAL")
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    plain = {p.piece for p in proto.pieces if p.type == normal}
    merges = sorted(
        (i, vocab[piece[:k]], vocab[piece[k:]], piece[:k], piece[k:])
        for piece, i in vocab.items()
        if piece in plain
        for k in range(1, len(piece))
        if piece[:k] in plain and piece[k:] in plain
    )
    unk = proto.pieces[trainer.unk_id].piece
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for *_, a, b in merges],
            unk_token=unk,
            byte_fallback=trainer.byte_fallback,
            fuse_unk=True,
        )
    )
    space = "\u2581"
    backend.normalizer = normalizers.Replace(" ", space)
    # A word: a run of spaces with the non-spaces after it, or non-spaces at the start, or trailing spaces.
    word = (
        f"{space}+[^{space}]+|[^{space}]+|{space}+"
        if trainer.allow_whitespace_only_pieces
        else f"{space}?[^{space}]+|{space}"
    )
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(word), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _tiktoken_bpe(tok: Tokenizer):
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    ranks = read_tiktoken_ranks(tok.path)
    char = _byte_chars()
    text = lambda token: "".join(char[b] for b in token)  # noqa: E731
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            left, right = _last_merge(token, ranks, rank)
            merges.append((text(left), text(right)))
    backend = HFTokenizer(models.BPE(vocab={text(t): r for t, r in ranks.items()}, merges=merges, ignore_merges=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _last_merge(token: bytes, ranks: dict[bytes, int], rank: int) -> tuple[bytes, bytes]:
    """The two parts tiktoken's BPE joins last when it encodes `token` with the merges ranked below it."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], rank))
        if ranks.get(parts[best] + parts[best + 1], rank) >= rank:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise UserError(
            f"tiktoken token {token!r} (rank {rank}) is not reachable by merging lower-ranked tokens, so "
            "the file cannot be written as a Hugging Face BPE; export without it and tokenize with "
            "torchtitan.components.tokenizer.Tokenizer"
        )
    return parts[0], parts[1]


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable character for each byte, the alphabet of byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
