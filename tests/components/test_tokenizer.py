"""Tokenizers behind one interface: the shipped sentencepiece model, a Hugging Face folder and a
tiktoken BPE file (both built here, offline, from the stdlib corpus), the vocabulary padding, every
bad-input message, scripts/fetch_tokenizer.py without a network, a folder whose tokenizer_config.json
and tokenizer.json disagree (loaded as transformers.AutoTokenizer loads it), and two training steps with a
Hugging Face tokenizer."""

import json
import logging
import math
import shutil
import socket
from pathlib import Path

import pytest

from torchtitan.components.data import stdlib_files
from torchtitan.components.tokenizer import HF, SENTENCEPIECE, TIKTOKEN, Tokenizer, detect, llama3_special_tokens
from torchtitan.config.errors import UserError

from helpers.launch import load_script
from helpers.paths import MODEL, REPO
from helpers.tokenizer_files import BPE_SIZE, SPECIALS, stdlib_texts, write_ranks

UNICODE = "  leading\n\tclass X:\n        pass   \n\n\n  x = 'é 中文 😀 Ünïcödé'\r\n123456789 trailing  "


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(MODEL)


@pytest.fixture(scope="module")
def kinds(tokenizer, hf_folder, tiktoken_file) -> dict[str, Tokenizer]:
    return {SENTENCEPIECE: tokenizer, HF: Tokenizer(hf_folder), TIKTOKEN: Tokenizer(tiktoken_file)}


# ---- the shipped sentencepiece model -----------------------------------------------------------


def test_shipped_model_loads_with_expected_ids(tokenizer):
    assert tokenizer.vocab_size == 4096
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert tokenizer.kind == SENTENCEPIECE
    # A small file: the model is a 4k BPE vocabulary, not something bigger checked in by mistake.
    assert MODEL.stat().st_size < 300_000


def test_bos_and_eos_only_when_asked(tokenizer):
    plain = tokenizer.encode("def f(x):\n    return x\n", bos=False, eos=False)
    assert tokenizer.bos_id not in plain and tokenizer.eos_id not in plain
    assert tokenizer.encode("def f(x):\n    return x\n") == plain  # nothing added by default
    assert tokenizer.encode("def f(x):\n    return x\n", bos=True, eos=True) == [1, *plain, 2]
    assert tokenizer.encode("x", bos=True, eos=False)[0] == 1
    assert tokenizer.encode("x", bos=False, eos=True)[-1] == 2


def test_round_trip_of_stdlib_files(tokenizer):
    files = stdlib_files()
    for path in files[:: len(files) // 8] + files[-1:]:  # the tail was held out of training
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = tokenizer.encode(text, bos=False, eos=False)
        assert tokenizer.decode(ids) == text, path
        assert len(ids) < len(text.encode()) / 2, "a code tokenizer should compress stdlib code"


def test_round_trip_of_whitespace_and_unseen_characters(tokenizer):
    ids = tokenizer.encode(UNICODE, bos=True, eos=True)
    assert tokenizer.decode(ids) == UNICODE  # BOS/EOS decode to nothing
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + UNICODE + "</s>"
    assert 0 not in ids, "byte fallback means no unknown token"


def test_indentation_is_compact(tokenizer):
    # Whitespace-only pieces: 8 spaces of indentation are one token, not eight.
    assert len(tokenizer.encode("        ", bos=False, eos=False)) == 1


def test_missing_model_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="tokenizer model not found at .*model.tokenizer_path"):
        Tokenizer(tmp_path / "nope.model")


@pytest.mark.parametrize("content", [b"", b"definitely not a sentencepiece model"])
def test_invalid_model_is_a_user_error(tmp_path, content):
    path = tmp_path / "bad.model"
    path.write_bytes(content)
    with pytest.raises(UserError, match="not a valid sentencepiece model"):
        Tokenizer(path)


# ---- choosing the kind ------------------------------------------------------------------------


def test_kind_is_chosen_from_what_the_path_holds(hf_folder, tiktoken_file, tmp_path):
    assert detect(hf_folder) == (HF, hf_folder / "tokenizer.json")
    assert detect(hf_folder / "tokenizer.json") == (HF, hf_folder / "tokenizer.json")
    assert detect(tiktoken_file) == (TIKTOKEN, tiktoken_file)
    assert detect(MODEL) == (SENTENCEPIECE, MODEL)
    # By content, not name: a tokenizer.json under another name, a ranks file named .txt.
    shutil.copy(hf_folder / "tokenizer.json", tmp_path / "renamed.model")
    shutil.copy(tiktoken_file, tmp_path / "ranks.txt")
    assert detect(tmp_path / "renamed.model")[0] == HF
    assert detect(tmp_path / "ranks.txt")[0] == TIKTOKEN
    assert Tokenizer(tmp_path / "ranks.txt").vocab_size == BPE_SIZE + 256


# ---- the same interface for every kind ---------------------------------------------------------


@pytest.mark.parametrize("kind", [SENTENCEPIECE, HF, TIKTOKEN])
def test_round_trip_ascii_and_non_ascii(kinds, kind):
    tok = kinds[kind]
    for text in [*stdlib_texts(3), UNICODE, "", " ", "\n\n"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        framed = tok.encode(text, bos=True, eos=True)
        assert framed == ([tok.bos_id] if tok.bos_id is not None else []) + ids + [tok.eos_id]
        assert tok.decode(framed) == text  # special tokens skipped
        assert tok.decode(ids + [tok.vocab_size, tok.vocab_size + 7]) == text  # padding ids decode to nothing
        assert all(0 <= i < tok.vocab_size for i in framed)
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_hf_folder_takes_bos_eos_and_added_tokens_from_its_config(kinds):
    tok = kinds[HF]
    assert (tok.bos_id, tok.eos_id) == (BPE_SIZE, BPE_SIZE + 1)
    # <|extra|> is only in tokenizer_config.json's added_tokens_decoder: added at its declared id.
    assert tok.special_tokens == {t: BPE_SIZE + i for i, t in enumerate(SPECIALS + ["<|extra|>"])}
    assert tok.vocab_size == BPE_SIZE + 4
    assert tok.token_to_id("<|eot_id|>") == BPE_SIZE + 2 and tok.token_to_id("no such piece") is None


def test_encode_never_adds_the_post_processor_bos(kinds, hf_folder):
    from tokenizers import Tokenizer as HFTokenizer

    raw = HFTokenizer.from_file(str(hf_folder / "tokenizer.json"))
    text = "import os\n"
    assert raw.encode(text).ids[0] == BPE_SIZE  # the file's own post-processor prepends BOS...
    assert kinds[HF].encode(text) == raw.encode(text, add_special_tokens=False).ids  # ...ours never does
    assert kinds[HF].encode(text, bos=True)[:1] == [BPE_SIZE] and kinds[HF].encode(text, bos=True)[1] != BPE_SIZE


@pytest.mark.parametrize("kind", [HF, TIKTOKEN])
def test_special_token_text_is_ordinary_unless_allowed(kinds, kind):
    tok = kinds[kind]
    eot = tok.special_tokens["<|eot_id|>"]
    text = "x = 1<|eot_id|>y = 2<|end_of_text|>"
    plain = tok.encode(text)
    assert eot not in plain and tok.eos_id not in plain  # data cannot inject control tokens
    assert tok.decode(plain) == text
    allowed = tok.encode(text, allow_special=True)
    assert eot in allowed and allowed[-1] == tok.eos_id
    assert tok.decode(allowed) == "x = 1y = 2"
    assert tok.decode(allowed, skip_special_tokens=False) == text


def test_qwen3_like_folder_has_no_bos(hf_folder, tmp_path):
    # Qwen3: bos_token null; EOS named only in special_tokens_map.json here (it fills what the config lacks).
    shutil.copy(hf_folder / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "pad_token": "<|end_of_text|>"}))
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}})
    )
    tok = Tokenizer(tmp_path)
    assert tok.bos_id is None and tok.eos_id == BPE_SIZE + 2
    plain = tok.encode("def f(): pass")
    assert tok.encode("def f(): pass", bos=True, eos=True) == [*plain, BPE_SIZE + 2]  # no BOS prepended


# ---- tokenizer_config.json declaring tokens tokenizer.json lacks, or places elsewhere -------------------
# Such a folder loads as transformers' AutoTokenizer loads it (checked against transformers below):
# missing tokens are appended after the vocabulary in order of their declared ids, a token tokenizer.json
# has keeps its id there, and one warning names them.

_SPECIALS_DECODER = {str(BPE_SIZE + i): {"content": t, "special": True} for i, t in enumerate(SPECIALS)}
# Declared far beyond the 653 tokens of tokenizer.json, with gaps; <|eos|> only as eos_token.
APPENDED = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|bos|>",
    "eos_token": "<|eos|>",
    "added_tokens_decoder": {
        **_SPECIALS_DECODER,
        "900": {"content": "<|bos|>", "special": True},
        "700": {"content": "<|fim|>", "special": True},
        "800": {"content": "<tool>", "special": False},
    },
}
APPENDED_IDS = {"<|fim|>": 653, "<tool>": 654, "<|bos|>": 655, "<|eos|>": 656}  # what transformers assigns
# <|end_of_text|> (651 in tokenizer.json) and the BPE piece "self" declared at other ids.
MOVED = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "added_tokens_decoder": {
        **_SPECIALS_DECODER,
        "5": {"content": "<|end_of_text|>", "special": True},
        "3000": {"content": "self", "special": True},
    },
}
# Compared with transformers: the two above; BOS named only by bos_token; entries without flags (an
# AddedToken's defaults: not special, unless it is bos/eos); the shared fixture's config.
AS_TRANSFORMERS = {
    "appended": APPENDED,
    "moved": MOVED,
    "bos only named": {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<nope>",
        "eos_token": "<|end_of_text|>",
    },
    "entries without flags": {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|eot_id|>",
        "added_tokens_decoder": {
            "650": {"content": "<|begin_of_text|>"},
            "652": {"content": "<|eot_id|>"},
            "653": {"content": "<|new|>"},
        },
    },
    "fixture": None,
}


def _config_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "torchtitan.components.tokenizer" and r.levelno == logging.WARNING
    ]


@pytest.fixture(scope="module")
def appended_folder(hf_folder, tmp_path_factory) -> Path:
    return _hf_with_config(tmp_path_factory.mktemp("appended"), hf_folder, APPENDED)


def test_config_tokens_missing_from_tokenizer_json_are_appended(appended_folder, caplog):
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        tok = Tokenizer(appended_folder)  # refused with a UserError before
    assert {t: tok.token_to_id(t) for t in APPENDED_IDS} == APPENDED_IDS
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (655, 656, 657)
    assert tok.special_tokens == {
        **{t: BPE_SIZE + i for i, t in enumerate(SPECIALS)},
        "<|fim|>": 653,
        "<|bos|>": 655,
        "<|eos|>": 656,
    }  # <tool> is not special
    [warning] = _config_warnings(caplog)
    for token, token_id in APPENDED_IDS.items():
        assert f"{token!r} as {token_id}" in warning, warning
    assert "<|eot_id|>" not in warning and "\n" not in warning  # only what was appended
    text = "x = 1<|fim|>y<tool> z<|bos|><|eos|>"
    allowed = tok.encode(text, allow_special=True)
    assert [i for i in allowed if i >= BPE_SIZE] == [653, 654, 655, 656]
    assert tok.decode(allowed, skip_special_tokens=False) == text
    assert tok.decode(allowed) == "x = 1y<tool> z"
    assert tok.encode("x", bos=True, eos=True) == [655, *tok.encode("x"), 656]
    # By default special-token text is ordinary text; <tool> is an ordinary added token, so it stays whole.
    plain = tok.encode(text)
    assert {653, 655, 656}.isdisjoint(plain) and 654 in plain and tok.decode(plain) == text


def test_config_placing_a_token_elsewhere_keeps_tokenizer_json_id(hf_folder, tmp_path, caplog):
    # transformers never moves a token tokenizer.json has: it keeps that id (a vocabulary piece the config
    # declares special becomes special there), whatever id the config gives.
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        tok = Tokenizer(_hf_with_config(tmp_path, hf_folder, MOVED))
    self_id = json.loads((hf_folder / "tokenizer.json").read_text())["model"]["vocab"]["self"]
    assert (tok.eos_id, tok.token_to_id("self"), tok.vocab_size) == (BPE_SIZE + 1, self_id, BPE_SIZE + 3)
    assert tok.special_tokens == {**{t: BPE_SIZE + i for i, t in enumerate(SPECIALS)}, "self": self_id}
    [warning] = _config_warnings(caplog)
    assert f"'<|end_of_text|>' at {BPE_SIZE + 1} (declared 5)" in warning and "'self' at" in warning, warning


def test_folder_whose_files_agree_loads_without_warning(hf_folder, tmp_path, caplog):
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "added_tokens_decoder": _SPECIALS_DECODER,
    }
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        tok = Tokenizer(_hf_with_config(tmp_path, hf_folder, config))
    assert _config_warnings(caplog) == []
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (BPE_SIZE, BPE_SIZE + 1, BPE_SIZE + 3)
    assert tok.special_tokens == {t: BPE_SIZE + i for i, t in enumerate(SPECIALS)}


@pytest.mark.hf
@pytest.mark.parametrize("case", list(AS_TRANSFORMERS))
def test_disagreeing_config_loads_as_transformers_loads_it(case, hf_folder, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = AS_TRANSFORMERS[case]
    if config is None:
        config = {**json.loads((hf_folder / "tokenizer_config.json").read_text())}
    folder = _hf_with_config(tmp_path, hf_folder, config)
    ours, theirs = Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    tokens = [e["content"] for e in config.get("added_tokens_decoder", {}).values()]
    tokens += [config[k] for k in ("bos_token", "eos_token") if config.get(k)]
    assert {t: ours.token_to_id(t) for t in tokens} == {t: theirs.convert_tokens_to_ids(t) for t in tokens}
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.vocab_size == len(theirs)
    assert ours.special_tokens == {t.content: i for i, t in theirs.added_tokens_decoder.items() if t.special}
    # The tokens of a text holding every declared token (transformers matches them: allow_special).
    text = "def f(self):\n    return x" + "".join(f" {t}y" for t in tokens) + " myself."
    ids = ours.encode(text, allow_special=True)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ids == theirs.convert_tokens_to_ids(theirs.tokenize(text))


def test_tiktoken_file_gets_llama3_specials_after_its_ranks(kinds, tiktoken_file):
    tok = kinds[TIKTOKEN]
    assert (tok.bos_id, tok.eos_id) == (BPE_SIZE, BPE_SIZE + 1)
    assert tok.special_tokens["<|eot_id|>"] == BPE_SIZE + 9 and len(tok.special_tokens) == 256
    assert tok.vocab_size == BPE_SIZE + 256
    text = stdlib_texts(2)[1]
    assert len(tok.encode(text)) < len(text.encode()) / 2  # the merges of the trained BPE work


def test_llama3_original_layout(tmp_path):
    # A file of 128,000 ranks (Llama 3's count): its 256 special tokens sit exactly where Llama 3's do.
    tokens = [bytes([b]) for b in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    tokens += [bytes([97, b, c]) for b in range(256) for c in range(256)]
    tok = Tokenizer(write_ranks(tmp_path / "tokenizer.model", tokens[:128_000]))
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (128_000, 128_001, 128_256)
    assert {n: tok.special_tokens[n] for n in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")} == {
        "<|start_header_id|>": 128_006,
        "<|end_header_id|>": 128_007,
        "<|eot_id|>": 128_009,
    }
    assert llama3_special_tokens(128_000)["<|reserved_special_token_247|>"] == 128_255
    assert tok.encode("<|eot_id|>", allow_special=True) == [128_009]


def test_tiktoken_sidecar_config_names_the_special_tokens(tiktoken_file, tmp_path):
    path = shutil.copy(tiktoken_file, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "added_tokens_decoder": {str(BPE_SIZE): {"content": "[BOS]"}, str(BPE_SIZE + 1): {"content": "[EOS]"}},
            }
        )
    )
    tok = Tokenizer(path)
    assert tok.special_tokens == {"[BOS]": BPE_SIZE, "[EOS]": BPE_SIZE + 1}
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (BPE_SIZE, BPE_SIZE + 1, BPE_SIZE + 2)


def test_model_vocabulary_is_padded_for_tensor_parallel(kinds):
    from torchtitan.distributed.tensor_parallel import check_tp_divisibility
    from torchtitan.models.common.spec import padded_vocab_size
    from torchtitan.models.registry import get_model_spec

    assert [padded_vocab_size(n) for n in (4096, 128_256, 151_669, 906, 1)] == [4096, 128_256, 151_680, 960, 64]
    spec = get_model_spec("llama3")
    args = spec.args_for_training("debugmodel", kinds[TIKTOKEN].vocab_size, 64)
    assert args.vocab_size == 960 >= kinds[TIKTOKEN].vocab_size
    for tp in (2, 4, 8, 16):
        check_tp_divisibility(spec.tp_sizes(args), tp, 64)


# ---- bad input: one clear message each, naming the file and the fix --------------------------------


def _folder_without_tokenizer_json(tmp, hf_folder, tiktoken_file):
    shutil.copy(hf_folder / "tokenizer_config.json", tmp / "tokenizer_config.json")
    (tmp / "original").mkdir()
    shutil.copy(tiktoken_file, tmp / "original" / "tokenizer.model")
    return tmp, ["has no tokenizer.json", "fetch_tokenizer.py", str(tmp / "original" / "tokenizer.model")]


def _ranks_with_line(tmp, tiktoken_file, lineno, line):
    lines = tiktoken_file.read_bytes().split(b"\n")
    lines[lineno - 1] = line
    path = tmp / "tokenizer.model"
    path.write_bytes(b"\n".join(lines))
    return path


def _missing_bytes(tmp, hf, tt):
    return write_ranks(tmp / "t.model", [bytes([b]) for b in range(200)]), ["56 of the 256 single bytes", "0xc8"]


def _text_file(tmp, hf, tt):
    path = _write(tmp / "notes.model", b"hello\nthis is a text file\n")
    return path, ["holds no tokenizer", "tiktoken", "tokenizer.json"]


def _cut_sentencepiece(tmp, hf, tt):
    path = _write(tmp / "cut.model", MODEL.read_bytes()[:20_000])
    return path, ["not a valid sentencepiece model", "corrupt or truncated"]


def _json_without_configs(tmp, hf, tt):
    path = Path(shutil.copy(hf / "tokenizer.json", tmp / "tokenizer.json"))
    return path, ["no EOS token", "set eos_token in tokenizer_config.json"]


# case -> (tmp folder, HF folder, tiktoken file) -> (path, parts of the message)
BAD = {
    "folder without tokenizer.json": _folder_without_tokenizer_json,
    "tiktoken broken line": lambda tmp, hf, tt: (_ranks_with_line(tmp, tt, 57, b"QUJD"), ["line 57 is not"]),
    "tiktoken bad base64": lambda tmp, hf, tt: (
        _ranks_with_line(tmp, tt, 3, b"not*base64 2"),
        ["line 3 has a token that"],
    ),
    "tiktoken repeated rank": lambda tmp, hf, tt: (
        _ranks_with_line(tmp, tt, 300, b"QUJDRA== 5"),
        ["line 300 repeats rank 5 of line 6"],
    ),
    "tiktoken missing bytes": _missing_bytes,
    "none of the three kinds": _text_file,
    "corrupt sentencepiece": _cut_sentencepiece,
    "tokenizer.json without configs": _json_without_configs,
    "config not JSON": lambda tmp, hf, tt: (
        _hf_with_config(tmp, hf, "{oops"),
        ["tokenizer_config.json is not valid JSON"],
    ),
    "config not UTF-8": lambda tmp, hf, tt: (
        _hf_with_config(tmp, hf, b'{"eos_token": "\xff"}'),
        ["tokenizer_config.json cannot be read as UTF-8"],
    ),
    "added token flag not a bool": lambda tmp, hf, tt: (
        _hf_with_config(
            tmp,
            hf,
            {"eos_token": "<|end_of_text|>", "added_tokens_decoder": {"700": {"content": "<|x|>", "special": "yes"}}},
        ),
        ["added_tokens_decoder[700].special is 'yes'"],
    ),
    "empty added token": lambda tmp, hf, tt: (
        _hf_with_config(tmp, hf, {"eos_token": "<|end_of_text|>", "added_tokens_decoder": {"700": {"content": ""}}}),
        ["added_tokens_decoder entry '700' is not"],
    ),
    "invalid tokenizer.json": lambda tmp, hf, tt: (
        _write(tmp / "tokenizer.json", b'{"version": "1.0"}'),
        ["not a valid Hugging Face tokenizer.json"],
    ),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _hf_with_config(tmp: Path, hf_folder: Path, config) -> Path:
    shutil.copy(hf_folder / "tokenizer.json", tmp / "tokenizer.json")
    if isinstance(config, bytes):
        (tmp / "tokenizer_config.json").write_bytes(config)
    else:
        (tmp / "tokenizer_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return tmp


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_clear_user_error(case, hf_folder, tiktoken_file, tmp_path):
    path, expected = BAD[case](tmp_path, hf_folder, tiktoken_file)
    with pytest.raises(UserError) as raised:
        Tokenizer(path)
    message = str(raised.value)
    assert str(path) in message or str(path.parent) in message, message  # names the file
    for part in expected:
        assert part in message, message
    assert "\n" not in message


@pytest.mark.parametrize("case", ["folder without tokenizer.json", "tiktoken broken line"])
def test_preflight_refuses_a_bad_tokenizer_before_launch(case, hf_folder, tiktoken_file, tmp_path, capsys):
    from torchtitan import preflight

    (tmp_path / "tok").mkdir()
    path, expected = BAD[case](tmp_path / "tok", hf_folder, tiktoken_file)
    argv = [
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        "--model.tokenizer_path",
        str(path),
        "--job.dump_folder",
        str(tmp_path / "out"),
    ]
    assert preflight.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected[0] in err and err.count("\n") == 1


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(UserError, match="has no tokenizer.json .it holds: nothing"):
        Tokenizer(tmp_path)


# ---- scripts/fetch_tokenizer.py ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fetch():
    return load_script(REPO / "scripts" / "fetch_tokenizer.py", "fetch_tokenizer")


def test_fetch_without_network_is_one_line_and_exit_2(fetch, tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert fetch.main(["meta-llama/Llama-3.1-8B", "--out", str(tmp_path / "out"), "--endpoint", endpoint]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach {endpoint} to fetch meta-llama/Llama-3.1-8B") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_fetch_writes_a_loadable_folder(fetch, hf_folder, tiktoken_file, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    def fake_download(repo_id, filename, *, local_dir, **kwargs):
        source = tiktoken_file if filename == "original/tokenizer.model" else hf_folder / filename
        target = Path(local_dir) / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        return shutil.copy(source, target)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(fetch, "_unreachable", lambda url: None)
    out = tmp_path / "Llama-like"
    assert fetch.main(["org/Llama-like", "--out", str(out), "--original"]) == 0
    printed = capsys.readouterr().out
    assert f'model.tokenizer_path = "{out}"' in printed and "huggingface: 654 tokens" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "original",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert Tokenizer(out / "original" / "tokenizer.model").kind == TIKTOKEN


@pytest.mark.network
def test_fetch_from_the_hub_writes_a_folder_that_trains(fetch, tmp_path, capsys):
    """The real hub: Qwen3's tokenizer (not gated) is fetched, checked and loaded as training would; its
    byte-level BPE round-trips text, and its end-of-text token is one id."""
    out = tmp_path / "Qwen3-0.6B"
    assert fetch.main(["Qwen/Qwen3-0.6B", "--out", str(out)]) == 0
    assert f'model.tokenizer_path = "{out}"' in capsys.readouterr().out
    tok = Tokenizer(out)
    assert tok.kind == HF
    text = "def f(x):\n    return x ** 2  # ü"
    assert tok.decode(tok.encode(text)) == text
    assert tok.token_to_id("<|endoftext|>") is not None


# ---- end to end ----------------------------------------------------------------------------------


def two_steps_with(tokenizer_path, tmp_path, caplog) -> list[dict]:
    """The metrics records of 2 steps of the debug model (fp32) with the tokenizer at `tokenizer_path`, its
    torchtitan log lines in `caplog`."""
    from torchtitan.config import load_config
    from torchtitan.train import train

    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs" / "debug_model.toml"),
            "--model.tokenizer_path",
            str(tokenizer_path),
            "--job.dump_folder",
            str(tmp_path),
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "2",
            "--lr_scheduler.warmup_steps",
            "1",
            "--metrics.log_freq",
            "1",
            "--metrics.device_peak_tflops",
            "1",
            "--metrics.no-enable_tensorboard",
            "--training.mixed_precision_param",
            "float32",
        ]
    )
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        return train(cfg)


def test_training_runs_with_a_hugging_face_folder(hf_folder, tmp_path, caplog):
    history = two_steps_with(hf_folder, tmp_path, caplog)
    assert [r["step"] for r in history] == [1, 2]
    assert history[0]["loss"] == pytest.approx(math.log(704), abs=1.0)  # about ln(vocabulary) at init, not ln(4096)
    assert "vocab 704: the huggingface tokenizer's 654 tokens padded to a multiple of 64" in caplog.text


def test_training_runs_with_a_folder_whose_config_appends_tokens(appended_folder, tmp_path, caplog):
    history = two_steps_with(appended_folder, tmp_path, caplog)
    assert [r["step"] for r in history] == [1, 2] and all(math.isfinite(r["loss"]) for r in history)
    assert "vocab 704: the huggingface tokenizer's 657 tokens padded to a multiple of 64" in caplog.text
