"""The run's tokenizer written in Hugging Face form (tokenizer_export.py): transformers' AutoTokenizer
loads it and encodes as the trainer does (BOS, then the same ids), for the shipped sentencepiece
model, a tiktoken BPE file and a Hugging Face folder (copied); a tokenizer it cannot write alike is
refused with the reason; scripts/convert_checkpoint.py to-hf writes it with --tokenizer."""

import json

import pytest

from torchtitan.components.tokenizer import HF, SENTENCEPIECE, TIKTOKEN, Tokenizer
from torchtitan.components.tokenizer_export import export_tokenizer
from torchtitan.config.errors import UserError

from helpers.launch import load_script
from helpers.paths import MODEL, REPO
from helpers.tokenizer_files import stdlib_texts

pytestmark = [pytest.mark.hf]

transformers = pytest.importorskip("transformers")

# Source files, then what a byte-level or a sentencepiece split can get wrong: runs of spaces and tabs,
# leading and trailing spaces, digits, accents, CJK and an emoji (byte fallback), sentencepiece's own
# space mark in the text, line endings.
TEXTS = [
    *stdlib_texts(4),
    "  leading\n\tclass X:\n        pass   \n\n\n",
    "x = 'é 中文 😀 Ünïcödé'\r\n",
    "123456789 trailing  ",
    "a\u2581b  \u2581 c",
    " ",
    "",
    "if x:\n    return  y",
]


@pytest.fixture(scope="module")
def paths(hf_folder, tiktoken_file):
    return {SENTENCEPIECE: MODEL, TIKTOKEN: tiktoken_file, HF: hf_folder}


@pytest.mark.parametrize("kind", [SENTENCEPIECE, TIKTOKEN, HF])
def test_auto_tokenizer_encodes_and_decodes_as_the_trainer(paths, kind, tmp_path):
    ours = Tokenizer(paths[kind])
    written = export_tokenizer(paths[kind], tmp_path)
    assert "tokenizer.json" in written and all((tmp_path / name).is_file() for name in written)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ids == ours.encode(text, bos=True), text[:60]
        # Decoded as the trainer decodes: the text itself, but where sentencepiece's space mark was in
        # the text (sentencepiece decodes it as a space, and so does the export).
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
        assert ours.decode(ids) == text or (kind == SENTENCEPIECE and "\u2581" in text)


def _family_flavors() -> list[tuple[str, str]]:
    from torchtitan.models.registry import get_model_spec, model_names

    return [
        (name, flavor)
        for name in model_names()
        if get_model_spec(name).hf is not None
        for flavor in get_model_spec(name).flavors
        if flavor.startswith("debugmodel")
    ]


@pytest.mark.parametrize("name, flavor", _family_flavors())
def test_every_familys_export_tokenizes_as_the_trainer(name, flavor, tmp_path):
    """An export folder holds the family's config.json (what checkpoint.last_save_in_hf and convert_checkpoint
    write first) and then the run's tokenizer: transformers' AutoTokenizer of that folder encodes and decodes as the
    trainer, whatever class transformers binds to the model type (Qwen3.5-MoE's would rebuild the shipped
    tokenizer as Qwen's and give other ids)."""
    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec(name)
    ours = Tokenizer(MODEL)
    args = spec.args_for_training(flavor, ours.vocab_size, 64)
    (tmp_path / "config.json").write_text(json.dumps(spec.hf.config(args)))
    export_tokenizer(MODEL, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ids == ours.encode(text, bos=True), (type(theirs).__name__, text[:60])
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)


def test_a_unigram_sentencepiece_model_is_refused_with_the_reason(tmp_path):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(stdlib_texts(4)),
        model_prefix=str(tmp_path / "uni"),
        model_type="unigram",
        vocab_size=300,
        eos_id=2,
        minloglevel=2,
    )
    with pytest.raises(UserError, match="model type UNIGRAM .only BPE is written.*add_dummy_prefix"):
        export_tokenizer(tmp_path / "uni.model", tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()


def test_convert_checkpoint_writes_the_tokenizer(straight, tmp_path):
    step = straight[0] / "checkpoint" / "step-6"
    convert = load_script(REPO / "scripts" / "convert_checkpoint.py", "convert_checkpoint")
    out = tmp_path / "hf"
    assert convert.main(["to-hf", str(step), str(out), "--tokenizer", str(MODEL)]) == 0
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    text = "def f(x):\n    return x + 1\n"
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == Tokenizer(MODEL).encode(
        text, bos=True
    )
    # A wrong path is reported before any weight is read, and nothing is written.
    assert convert.main(["to-hf", str(step), str(tmp_path / "hf2"), "--tokenizer", str(REPO / "no_such.model")]) == 2
    assert not (tmp_path / "hf2").exists()
