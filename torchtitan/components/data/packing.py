"""Packing: documents framed as [BOS] + text + [EOS], concatenated into one token stream, cut into windows.

Each document is tokenized as [BOS] + text + [EOS], the documents are concatenated into one token
stream, and the stream is cut into consecutive non-overlapping windows of seq_len + 1 tokens. At
the end of the source the stream goes on with the next epoch's first document, without dropping
the tokens carried over the boundary. Empty documents (and null texts) are skipped (no BOS/EOS pair
for them), but they keep their document index.
"""

import logging
from collections.abc import Iterator

from torchtitan.config.errors import UserError

logger = logging.getLogger(__name__)


def encode_document(tokenizer, text: str | None) -> list[int]:
    """The tokens of one document in the packed stream: [BOS] + text + [EOS]; an empty document (or a
    null text) is no tokens at all. The one definition, shared by the text pipeline and pretokenize."""
    return tokenizer.encode(text, bos=True, eos=True) if text else []


def too_small(name: str, tokens: int, window_len: int, fix: str = "add data") -> UserError:
    """The error of a source (`name`: how the config names it) whose documents tokenize to `tokens` < window_len
    in all: no lane can cut a sample from it (every lane reads all of it once per cycle of epochs, lanes.py)."""
    if tokens == 0:
        return UserError(f"{name} is empty: its documents hold no tokens; {fix}")
    return UserError(
        f"{name} is too small: its documents tokenize to {tokens} tokens in all, fewer than one sequence of "
        f"training.seq_len + 1 = {window_len}, so no sample can be cut from it; {fix}, or lower training.seq_len"
    )


class TokenStream:
    """Windows of window_len tokens cut from one lane's token stream of one source, one after another.

    `docs`: the lane's documents of tokens, epoch by epoch (`documents(epoch, start)`: a lanes.LaneView).

    The position is (epoch, doc_index, offset): the next token is `offset` into the token list of the
    document at position `doc_index` of the lane's epoch. `carry` holds tokens read but not yet part of
    an emitted window; it is always empty between reads, as the position is exact, but a saved carry
    is honoured.
    """

    def __init__(self, docs, window_len: int):
        self.source = docs
        self.window_len = window_len
        self.next_sample = 0  # the lane's windows of this source read so far
        self.epoch = 0
        self.doc_index = 0
        self.offset = 0
        self.carry: list[int] = []
        self._docs: Iterator | None = None  # yields document doc_index next, when _tokens is None
        self._tokens = None  # token list of document doc_index
        self.on_new_epoch = None  # called with (name, epoch, documents of the epoch ended)

    def position(self) -> dict:
        return {
            "next_sample": self.next_sample,
            "epoch": self.epoch,
            "doc_index": self.doc_index,
            "token_offset": self.offset,
            "carry": list(self.carry),
        }

    def seek(self, position: dict):
        self._close_documents()
        self.next_sample, self.epoch = position["next_sample"], position["epoch"]
        self.doc_index, self.offset = position["doc_index"], position["token_offset"]
        self.carry = list(position["carry"])

    def _close_documents(self):
        if self._docs is not None and hasattr(self._docs, "close"):
            self._docs.close()  # releases an open file
        self._docs = None
        self._tokens = None

    def _document_tokens(self):
        """The token list of document doc_index; None past the lane's last document of the epoch."""
        if self._tokens is None:
            if self._docs is None:
                self._docs = iter(self.source.documents(self.epoch, self.doc_index))
            self._tokens = next(self._docs, None)
        return self._tokens

    def _start_epoch(self, tokens_read: int):
        # A lane visits every position class of the units in `lanes` epochs (lanes.lane_share), so a lane
        # that has read nothing, or not one window, in that many is on a source too small for it.
        if self.next_sample == 0 and self.epoch + 1 >= self.source.lanes:
            if tokens_read == 0:
                raise UserError(f"dataset {self.source.name} is empty: it has no document")
            raise UserError(
                f"dataset {self.source.name} is too small: one lane's share of {self.epoch + 1} epochs tokenizes to "
                f"{tokens_read} tokens, fewer than one sequence of seq_len + 1 = {self.window_len} (the source is "
                f"split into {self.source.lanes} lanes, one per sample of the global batch, and a lane reads all of it "
                f"in {self.source.lanes} epochs: a smaller global batch does not help); add data, or lower "
                "training.seq_len"
            )
        documents = self.doc_index
        self._close_documents()
        self.epoch += 1
        self.doc_index = 0
        self.offset = 0
        if self.on_new_epoch is not None:
            self.on_new_epoch(self.source.name, self.epoch, documents)

    def read(self) -> list[int]:
        window, self.carry = self.carry, []
        while len(window) < self.window_len:
            tokens = self._document_tokens()
            if tokens is None:
                self._start_epoch(len(window))
                continue
            taken = tokens[self.offset : self.offset + self.window_len - len(window)]
            window += taken if isinstance(taken, list) else taken.tolist()
            self.offset += len(taken)
            if self.offset >= len(tokens):
                self.doc_index += 1
                self.offset = 0
                self._tokens = None
        self.next_sample += 1
        return window
