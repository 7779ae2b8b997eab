"""A thin wrapper over a sentencepiece model.

The shipped model (assets/tokenizer/python_stdlib_4k.model, made by scripts/train_tokenizer.py)
is trained for source code: no normalization, whitespace kept as is, byte fallback. So any
text encodes, and decode(encode(text)) == text exactly, indentation included. BOS and EOS are
added by the caller (the data pipeline frames each document with them), never by
sentencepiece itself.
"""

from pathlib import Path

import sentencepiece as spm

from torchtitan.config.errors import UserError


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise UserError(
                f"tokenizer model not found at {path}; set model.tokenizer_path to a sentencepiece "
                "model file (the default is ./assets/tokenizer/python_stdlib_4k.model, made by "
                "scripts/train_tokenizer.py)"
            )
        self.path = path
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.load(str(path))
        except (OSError, RuntimeError) as e:
            raise UserError(
                f"{path} is not a valid sentencepiece model ({e}); set model.tokenizer_path to a "
                ".model file written by sentencepiece"
            ) from None
        # Documents are framed with BOS/EOS; a model trained without them cannot do that.
        if self._sp.bos_id() < 0 or self._sp.eos_id() < 0:
            raise UserError(
                f"sentencepiece model {path} has no BOS or EOS piece; retrain it with bos_id and "
                "eos_id set (see scripts/train_tokenizer.py)"
            )

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        ids = self._sp.encode(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"
