"""The shipped sentencepiece tokenizer and its wrapper."""

from pathlib import Path

import pytest

from torchtitan.components.data import stdlib_files
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.errors import UserError

MODEL = Path(__file__).resolve().parents[2] / "assets" / "tokenizer" / "python_stdlib_4k.model"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(MODEL)


def test_shipped_model_loads_with_expected_ids(tokenizer):
    assert tokenizer.vocab_size == 4096
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    # A small file: the model is a 4k BPE vocabulary, not something bigger checked in by mistake.
    assert MODEL.stat().st_size < 300_000


def test_bos_and_eos_only_when_asked(tokenizer):
    plain = tokenizer.encode("def f(x):\n    return x\n", bos=False, eos=False)
    assert tokenizer.bos_id not in plain and tokenizer.eos_id not in plain
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
    text = "  leading\n\tclass X:\n        pass   \n\n\n  x = 'é 中文 😀'\r\n123456789 trailing  "
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert tokenizer.decode(ids) == text  # BOS/EOS decode to nothing
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


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(UserError, match="tokenizer model not found"):
        Tokenizer(tmp_path)
