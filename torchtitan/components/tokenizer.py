"""Tokenizers behind one interface, chosen from what `model.tokenizer_path` holds.

Three kinds are read:

- **Hugging Face** (the `tokenizers` library): a folder holding `tokenizer.json`, or a
  `tokenizer.json` file. BOS/EOS come from `tokenizer_config.json` next to it (`bos_token`,
  `eos_token`; a key it lacks is taken from `special_tokens_map.json`; a null `bos_token`, as
  Qwen3 ships, means no BOS). Where the two files disagree the folder loads as transformers'
  AutoTokenizer loads it: tokens of `added_tokens_decoder`, `bos_token` or `eos_token` that
  tokenizer.json lacks are appended after its vocabulary (not at the declared id), a token it has
  keeps its id there, and one warning names them. This is how Llama 3 and Qwen3 ship on the hub
  (scripts/fetch_tokenizer.py fetches those files).
- **tiktoken**: a text file of `<base64 token> <rank>` lines, as Llama 3's original
  `tokenizer.model`; split with Llama 3's pattern. Special tokens: those of a `tokenizer_config.json`
  in the same folder (`added_tokens_decoder`, `bos_token`, `eos_token`) if it has them; otherwise
  Llama 3's 256 special tokens appended after the ranks (ids N..N+255 for N ranks; for Llama 3's
  128,000 ranks exactly its layout: <|begin_of_text|> 128000 is BOS, <|end_of_text|> 128001 is EOS,
  <|eot_id|> 128009, ...).
- **sentencepiece**: a sentencepiece model file, as the shipped
  assets/tokenizer/python_stdlib_4k.model (made by scripts/train_tokenizer.py).

How the kind is chosen (`detect`): a folder is a Hugging Face tokenizer and must hold tokenizer.json
(nothing else in a folder is guessed at: a folder with only `original/tokenizer.model` is refused,
naming that file to point at instead); a file named `*.json`, or whose content starts with `{`, is a
tokenizer.json; a text file whose first lines are mostly `<base64> <integer>` is a tiktoken file (so
a broken line is reported with its number); any other file is loaded as sentencepiece (a protobuf).

The interface, the same for all three: `encode(text, bos=False, eos=False)` returns the ids of the
text with no special token added (the data pipeline asks for BOS/EOS explicitly; BOS is skipped
when the tokenizer has none); special-token strings inside the text are encoded as ordinary text
unless `allow_special=True`. `decode(ids)` drops special tokens (`skip_special_tokens=False` keeps
their text) and ids at or above `vocab_size` (the model's padding rows, which `encode` never
produces); it round-trips any text, non-ASCII included. `vocab_size` counts every id the tokenizer
can produce, special tokens included (the model pads it: torchtitan.models.common.spec.padded_vocab_size).
Every mistake in the files is a UserError naming the file and the fix.
"""

import base64
import binascii
import json
import logging
import re
from pathlib import Path

from torchtitan.config.errors import UserError

logger = logging.getLogger(__name__)

HF = "huggingface"
TIKTOKEN = "tiktoken"
SENTENCEPIECE = "sentencepiece"

_DEFAULT = "./assets/tokenizer/python_stdlib_4k.model"
_KINDS_HINT = (
    "point model.tokenizer_path at a Hugging Face tokenizer folder (holding tokenizer.json) or "
    "tokenizer.json, a tiktoken BPE file (Llama 3's original tokenizer.model) or a sentencepiece "
    f".model file (the default is {_DEFAULT}, made by scripts/train_tokenizer.py); a model's tokenizer from "
    "the Hugging Face hub: python scripts/fetch_tokenizer.py REPO_ID --out FOLDER (e.g. meta-llama/Llama-3.1-8B)"
)

# Llama 3's pre-tokenizer split, written from its description: English contractions (any case);
# a run of letters, optionally led by one character that is not a letter, digit or line break;
# numbers in groups of up to three digits; a run of other symbols, optionally led by a space, with
# the line breaks that follow it; whitespace ending in line breaks; whitespace not followed by a
# non-space (so a word keeps its single leading space); any remaining whitespace.
LLAMA3_PATTERN = "|".join(
    [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def llama3_special_tokens(first_id: int) -> dict[str, int]:
    """Llama 3's 256 special tokens (the 3.1 names), numbered from `first_id` (128000 in Llama 3)."""
    names = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    names += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(names))]
    return {name: first_id + i for i, name in enumerate(names)}


LLAMA3_RANKS = 128_000
LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*[ \t]+[0-9]+[ \t\r]*$")
# tiktoken's BPE is quadratic in the length of one pre-token piece; like Llama 3's reference, text
# is cut inside runs of more than this many consecutive whitespace (or non-whitespace) characters.
_MAX_RUN = 25_000
_LONG_RUN = re.compile(r"\S{%d,}|\s{%d,}" % (_MAX_RUN + 1, _MAX_RUN + 1))  # noqa: UP031 (an f-string doubles the regex's braces)


def detect(path: str | Path) -> tuple[str, Path]:
    """(kind, file to load) for `path`; cheap (reads at most 64 KiB). Raises UserError for a missing
    path, a folder without tokenizer.json and an empty file."""
    given = path
    path = Path(path)
    if path.is_dir():
        file = path / "tokenizer.json"
        if file.is_file():
            return HF, file
        held = sorted(p.name for p in path.iterdir())[:8]
        hint = ""
        for candidate in (path / "tokenizer.model", path / "original" / "tokenizer.model"):
            if candidate.is_file():
                hint = (
                    f"; or, to use the {candidate.relative_to(path)} it has, set model.tokenizer_path = '{candidate}'"
                )
                break
        raise UserError(
            f"tokenizer folder {path} has no tokenizer.json (it holds: {', '.join(held) or 'nothing'}); a Hugging "
            f"Face tokenizer folder needs tokenizer.json with its tokenizer_config.json: fetch them with "
            f"`python scripts/fetch_tokenizer.py <hub repo id> --out {path}`{hint}"
        )
    if not path.is_file():
        raise UserError(
            f"tokenizer model not found at '{given}' (model.tokenizer_path); {_KINDS_HINT}. Relative paths are "
            f"relative to the working directory {Path.cwd()}."
        )
    with open(path, "rb") as f:
        head = f.read(65536)
    if path.suffix == ".json" or head.lstrip()[:1] == b"{":
        return HF, path
    if _looks_like_tiktoken(head):
        return TIKTOKEN, path
    return SENTENCEPIECE, path


def _looks_like_tiktoken(head: bytes) -> bool:
    if not head or b"\0" in head:
        return False
    lines = [line for line in head.split(b"\n")[:17] if line.strip()]
    if len(head) == 65536:
        lines = lines[:16]  # the 17th may be cut short
    matching = sum(1 for line in lines if _TIKTOKEN_LINE.match(line))
    return matching > 0 and 2 * matching >= len(lines)


class Tokenizer:
    """The tokenizer `path` holds (see the module docstring for the kinds and how one is chosen).

    Attributes: `kind` ("huggingface", "tiktoken" or "sentencepiece"), `path` (the file loaded),
    `vocab_size`, `bos_id` (None: the tokenizer has no BOS, as Qwen3), `eos_id`, `special_tokens`
    ({text: id}).
    """

    def __init__(self, path: str | Path):
        self.kind, self.path = detect(path)
        backend = {HF: _HuggingFace, TIKTOKEN: _Tiktoken, SENTENCEPIECE: _SentencePiece}[self.kind]
        self._impl = backend(self.path)
        self.vocab_size: int = self._impl.vocab_size
        self.bos_id: int | None = self._impl.bos_id
        self.eos_id: int = self._impl.eos_id
        self.special_tokens: dict[str, int] = dict(self._impl.special_tokens)
        self._special_ids = frozenset(self.special_tokens.values())

    def encode(self, text: str, bos: bool = False, eos: bool = False, allow_special: bool = False) -> list[int]:
        """The ids of `text`, then BOS first (when asked and the tokenizer has one) and EOS last (when
        asked). `allow_special`: special-token strings in the text become their ids (for prompts in a
        chat format); by default they are ordinary text, so data cannot inject control tokens. A
        sentencepiece model never maps text to its control pieces, whatever the flag."""
        ids = self._impl.encode(text, allow_special)
        if bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of `ids`. Special tokens (BOS, EOS, ...) decode to nothing unless
        `skip_special_tokens=False`, which keeps their text; ids at or above vocab_size (padding
        rows of the model's vocabulary) decode to nothing."""
        clean = []
        for i in ids:
            i = int(i)
            if i < 0:
                raise ValueError(f"token id {i} is negative")
            if i < self.vocab_size and not (skip_special_tokens and i in self._special_ids):
                clean.append(i)
        return self._impl.decode(clean, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token (a special token's text, or a piece of the vocabulary); None if absent."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self._impl.token_to_id(token)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, kind={self.kind}, vocab_size={self.vocab_size})"


# ---- sentencepiece --------------------------------------------------------------------------


class _SentencePiece:
    def __init__(self, path: Path):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.load(str(path))
        except (OSError, RuntimeError) as e:
            size = path.stat().st_size
            if size == 0 or _is_text(path):
                raise UserError(
                    f"{path} holds no tokenizer this trainer reads: it is {'empty' if size == 0 else 'text'}, so not a "
                    f"valid sentencepiece model; nor a tiktoken BPE file (its first lines are not "
                    f"'<base64 token> <rank>') or a Hugging Face tokenizer.json; {_KINDS_HINT}"
                ) from None
            raise UserError(
                f"{path} is not a valid sentencepiece model ({str(e).strip()}); the file is corrupt or truncated: "
                f"download or train it again (scripts/train_tokenizer.py), or {_KINDS_HINT}"
            ) from None
        sp = self._sp
        self.vocab_size = sp.get_piece_size()
        # Documents end with EOS; a model trained without one cannot frame them.
        if sp.eos_id() < 0:
            raise UserError(
                f"sentencepiece model {path} has no EOS piece; retrain it with eos_id set (see "
                "scripts/train_tokenizer.py)"
            )
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        self.eos_id = sp.eos_id()
        self.special_tokens = {sp.id_to_piece(i): i for i in range(self.vocab_size) if sp.is_control(i)}
        self._control = frozenset(self.special_tokens.values())

    def encode(self, text: str, allow_special: bool) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens or not self._control.intersection(ids):
            return self._sp.decode(ids)  # control pieces decode to nothing
        # Kept special tokens: their piece text between the decoded runs of ordinary ids.
        out, run = [], []
        for i in ids:
            if i in self._control:
                out += [self._sp.decode(run), self._sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(out) + self._sp.decode(run)

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not any(b < 32 and b not in (9, 10, 13) for b in head)


# ---- special tokens from Hugging Face config files --------------------------------------------


class _SpecialConfig:
    """What tokenizer_config.json and special_tokens_map.json in `folder` say about special tokens.
    `bos`/`eos`: the token text, None (declared null: no such token) or _UNSET (not declared)."""

    def __init__(self, folder: Path):
        self.files: list[str] = []
        self.bos = self.eos = _UNSET
        # id -> (text, the AddedToken flags the entry sets: special, lstrip, rstrip, single_word, normalized)
        self.added: dict[int, tuple[str, dict[str, bool]]] | None = None
        config = self._read(folder / "tokenizer_config.json")
        smap = self._read(folder / "special_tokens_map.json")
        for key in ("bos_token", "eos_token"):
            if key in config:
                setattr(self, key[:3], _token_text(config[key], "tokenizer_config.json", folder, key))
            elif key in smap:
                setattr(self, key[:3], _token_text(smap[key], "special_tokens_map.json", folder, key))
        if "added_tokens_decoder" in config:
            self.added = {}
            decoder = config["added_tokens_decoder"]
            if not isinstance(decoder, dict):
                raise UserError(
                    f"{folder / 'tokenizer_config.json'}: added_tokens_decoder must be an object of "
                    "id -> token; fix the file or fetch it again"
                )
            for key, entry in decoder.items():
                text = _token_text(entry, "tokenizer_config.json", folder, f"added_tokens_decoder[{key}]")
                if not str(key).isdigit() or not text:  # an empty token cannot be added
                    raise UserError(
                        f"{folder / 'tokenizer_config.json'}: added_tokens_decoder entry {key!r} is not "
                        "'<id>': {\"content\": <token>}; fix the file or fetch it again"
                    )
                # Only the flags the entry sets: the others keep tokenizers.AddedToken's defaults, as in
                # transformers (which builds AddedToken(**entry)).
                flags = {f: entry[f] for f in _ADDED_TOKEN_FLAGS if f in entry} if isinstance(entry, dict) else {}
                for flag, value in flags.items():
                    if not isinstance(value, bool):
                        raise UserError(
                            f"{folder / 'tokenizer_config.json'}: added_tokens_decoder[{key}].{flag} "
                            f"is {value!r}, not true or false; fix the file or fetch it again"
                        )
                self.added[int(key)] = (text, flags)

    def _read(self, file: Path) -> dict:
        if not file.is_file():
            return {}
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(
                f"{file} cannot be read as UTF-8 text ({e}); fix it or fetch it again (scripts/fetch_tokenizer.py)"
            ) from None
        try:
            value = json.loads(text)
        except ValueError as e:
            raise UserError(
                f"{file} is not valid JSON ({e}); fix it or fetch it again (scripts/fetch_tokenizer.py)"
            ) from None
        if not isinstance(value, dict):
            raise UserError(f"{file} must hold a JSON object; fix it or fetch it again (scripts/fetch_tokenizer.py)")
        self.files.append(file.name)
        return value


_UNSET = object()
# The keys of an added_tokens_decoder entry that transformers passes to tokenizers.AddedToken.
_ADDED_TOKEN_FLAGS = ("special", "lstrip", "rstrip", "single_word", "normalized")


def _token_text(value, file: str, folder: Path, key: str) -> str | None:
    """A token as the config files write it: a string, {"content": str, ...} or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise UserError(f'{folder / file}: {key} is {value!r}, not a token (a string or {{"content": ...}}); fix the file')


def _resolve_bos_eos(config: _SpecialConfig, lookup, where: str, default_bos=_UNSET, default_eos=_UNSET):
    """(bos_id or None, eos_id) from the config's names, looked up with `lookup` (text -> id or None)."""
    ids = []
    for name, declared, default in (("bos_token", config.bos, default_bos), ("eos_token", config.eos, default_eos)):
        text = default if declared is _UNSET else declared
        if text is _UNSET or text is None:
            ids.append(None)
            continue
        token_id = lookup(text)
        if token_id is None:
            raise UserError(
                f"{where}: {name} {text!r} is not a token of the tokenizer; fix {name} in tokenizer_config.json "
                f"or fetch the model's tokenizer files again (scripts/fetch_tokenizer.py)"
            )
        ids.append(token_id)
    if ids[1] is None:
        read = " and ".join(config.files) or "no tokenizer_config.json or special_tokens_map.json"
        raise UserError(
            f"{where}: no EOS token (read {read}); the data pipeline ends every document with EOS: set "
            f"eos_token in tokenizer_config.json next to the tokenizer (scripts/fetch_tokenizer.py fetches it "
            f"with tokenizer.json)"
        )
    return ids[0], ids[1]


# ---- Hugging Face tokenizers ------------------------------------------------------------------


class _HuggingFace:
    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise UserError(
                f"{path} is a Hugging Face tokenizer, which needs the `tokenizers` package: pip install tokenizers "
                "(or pip install -e '.[tokenizers]')"
            ) from None
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise UserError(
                f"{path} is not a valid Hugging Face tokenizer.json ({str(e).strip()[:200]}); fetch the model's "
                f"tokenizer files again (scripts/fetch_tokenizer.py), or {_KINDS_HINT}"
            ) from None
        tok, folder = self._tok, path.parent
        config = _SpecialConfig(folder)
        _add_config_tokens(tok, config, path)
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.special_tokens = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self.bos_id, self.eos_id = _resolve_bos_eos(config, tok.token_to_id, str(path))
        self._allow_special = True

    def encode(self, text: str, allow_special: bool) -> list[int]:
        if allow_special != self._allow_special:
            self._tok.encode_special_tokens = not allow_special  # True: special tokens split as text
            self._allow_special = allow_special
        return self._tok.encode(text, add_special_tokens=False).ids  # no post-processor BOS

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _add_config_tokens(tok, config: _SpecialConfig, path: Path) -> None:
    """Add to `tok` (loaded from tokenizer.json at `path`) the tokens tokenizer_config.json declares,
    the way transformers' AutoTokenizer does (TokenizersBackend / PreTrainedTokenizerFast __init__), so
    a folder trains with the ids it was published with:

    - every added_tokens_decoder entry, in order of its declared id, is added with the entry's own
      flags (as tokenizers.AddedToken(**entry); an entry naming bos_token/eos_token is forced special).
      A token tokenizer.json already has keeps tokenizer.json's id, whatever id the config declares
      (transformers never moves a token), and takes the entry's flags; a token it lacks is appended
      after the vocabulary (at the next free id, not the declared one, which may be far off);
    - then bos_token and eos_token, when not added tokens already, are added as special tokens
      (appended if missing, as above). transformers appends the other named tokens (unk, pad, the
      additional special tokens, ...) after these too; the trainer never produces them, so they are
      left out: coming last, they change no id of the tokens added here.

    For a folder whose files agree (as transformers writes them) this changes nothing. Otherwise
    one warning names each appended token and each token kept at tokenizer.json's id."""
    from tokenizers import AddedToken

    named = [text for text in (config.bos, config.eos) if isinstance(text, str)]
    queued: list[tuple[AddedToken, int | None]] = []  # (token, id the config declares or None)
    # Every entry, even one tokenizer.json already has with the same flags: transformers means to skip
    # those but compares against the ids of its added tokens, so it re-adds them all (a no-op when the
    # flags agree; otherwise the entry's flags win, e.g. an entry without "special" is not special).
    for declared, (text, flags) in sorted((config.added or {}).items()):
        if text in named:
            flags = {**flags, "special": True}
        queued.append((AddedToken(text, **flags), declared))
    have = {t.content for t in tok.get_added_tokens_decoder().values()} | {t.content for t, _ in queued}
    for text in dict.fromkeys(named):
        if text not in have:
            queued.append((AddedToken(text, special=True), None))
    if not queued:
        return
    before = {t.content: tok.token_to_id(t.content) for t, _ in queued}
    tok.add_tokens([t for t, _ in queued])  # AddedToken.special picks special vs ordinary, as in transformers
    appended, kept = [], []
    for token, declared in queued:
        text, now = token.content, tok.token_to_id(token.content)
        if before[text] is None:
            where = (
                f"declared {declared}" if declared is not None else ("bos_token" if text == config.bos else "eos_token")
            )
            appended.append(f"{text!r} as {now} ({where})")
            before[text] = now  # a repeated entry is reported once
        elif declared is not None and declared != now:
            kept.append(f"{text!r} at {now} (declared {declared})")
    if appended or kept:
        parts = []
        if appended:
            parts.append(
                f"appended {len(appended)} token(s) that {path.name} lacks after its vocabulary: " + ", ".join(appended)
            )
        if kept:
            parts.append(
                f"kept {path.name}'s id for {len(kept)} token(s) the config places elsewhere: " + ", ".join(kept)
            )
        logger.warning(
            "%s: tokenizer_config.json and %s disagree; loaded as transformers does: %s. To silence this, fetch "
            "the files together (scripts/fetch_tokenizer.py) or save the tokenizer again with transformers",
            path.parent,
            path.name,
            "; ".join(parts),
        )


# ---- tiktoken ---------------------------------------------------------------------------------


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """The `<base64 token> <rank>` lines of a tiktoken BPE file; UserError naming a bad line."""
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}  # rank -> line
    with open(path, "rb") as f:
        data = f.read()
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        parts = line.split()
        problem = None
        if len(parts) != 2 or not parts[1].isdigit():
            problem = "is not '<base64 token> <rank>'"
        else:
            try:
                token = base64.b64decode(parts[0], validate=True)
            except (binascii.Error, ValueError):
                problem = "has a token that is not valid base64"
            else:
                rank = int(parts[1])
                if not token:
                    problem = "has an empty token"
                elif token in ranks:
                    problem = f"repeats the token of line {seen[ranks[token]]}"
                elif rank in seen:
                    problem = f"repeats rank {rank} of line {seen[rank]}"
                else:
                    ranks[token] = rank
                    seen[rank] = lineno
        if problem:
            shown = line[:60].decode("utf-8", "replace")
            raise UserError(
                f"tiktoken BPE file {path}, line {lineno} {problem}: {shown!r}; every line must be a base64 token, a "
                f"space and its rank: fix or delete the line, or fetch the file again"
            )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise UserError(
            f"tiktoken BPE file {path} has no rank for {len(missing)} of the 256 single bytes (the first: "
            f"0x{missing[0]:02x}); a byte-level BPE file ranks every byte, so any text encodes: add them"
        )
    return ranks


class _Tiktoken:
    def __init__(self, path: Path):
        try:
            import tiktoken
        except ImportError:
            raise UserError(
                f"{path} is a tiktoken BPE file, which needs the `tiktoken` package: pip install tiktoken "
                "(or pip install -e '.[tokenizers]')"
            ) from None
        ranks = read_tiktoken_ranks(path)
        config = _SpecialConfig(path.parent)
        where = f"tiktoken BPE file {path}"
        if config.added is not None:
            specials = {text: token_id for token_id, (text, _) in config.added.items()}
            default_bos = default_eos = _UNSET
            source = f"{path.parent / 'tokenizer_config.json'} (added_tokens_decoder)"
        else:
            specials = llama3_special_tokens(max(ranks.values()) + 1)
            default_bos, default_eos = LLAMA3_BOS, LLAMA3_EOS
            source = "Llama 3's special tokens after the ranks"
        by_rank = {rank: token for token, rank in ranks.items()}
        for text, token_id in specials.items():
            if token_id in by_rank:
                raise UserError(
                    f"{where}: special token {text!r} from {source} has id {token_id}, which is the rank of "
                    f"{by_rank[token_id]!r}; special tokens need ids of their own: fix added_tokens_decoder"
                )
        self.special_tokens = specials
        self._enc = tiktoken.Encoding(
            name=path.stem, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        self._ranks = ranks
        self._known = (
            None
            if len(ranks) + len(specials) == self._enc.max_token_value + 1
            else (frozenset(ranks.values()) | frozenset(specials.values()))
        )
        self.vocab_size = self._enc.max_token_value + 1
        self.bos_id, self.eos_id = _resolve_bos_eos(config, specials.get, where, default_bos, default_eos)

    def encode(self, text: str, allow_special: bool) -> list[int]:
        ids: list[int] = []
        for piece in _bounded_pieces(text):
            if allow_special:
                ids += self._enc.encode(piece, allowed_special="all", disallowed_special=())
            else:
                ids += self._enc.encode_ordinary(piece)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self._known is not None:  # ranks with holes: an unused id decodes to nothing
            ids = [i for i in ids if i in self._known]
        return self._enc.decode(ids)  # invalid UTF-8 (a cut multi-byte character) becomes U+FFFD

    def token_to_id(self, token: str) -> int | None:
        return self._ranks.get(token.encode("utf-8"))


def _bounded_pieces(text: str) -> list[str]:
    """`text` cut inside runs longer than _MAX_RUN characters (see _MAX_RUN); usually [text]."""
    if len(text) <= _MAX_RUN or not _LONG_RUN.search(text):
        return [text]
    pieces, start = [], 0
    for m in _LONG_RUN.finditer(text):
        for cut in range(m.start() + _MAX_RUN, m.end(), _MAX_RUN):
            pieces.append(text[start:cut])
            start = cut
    pieces.append(text[start:])
    return pieces
