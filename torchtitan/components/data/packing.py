"""Packing: documents framed as [BOS] + text + [EOS], concatenated into one token stream, cut into windows.

Each document is tokenized as [BOS] + text + [EOS], the documents are concatenated into one token
stream, and the stream is cut into consecutive non-overlapping windows of seq_len + 1 tokens. At
the end of the source the stream goes on with the next epoch's first document, without dropping
the tokens carried over the boundary. Empty documents (and null texts) are skipped (no BOS/EOS pair
for them), but they keep their document index.
"""

import logging
from collections.abc import Callable, Iterator

from torchtitan.components.data.shuffle import Permutation
from torchtitan.components.data.workers import worker_documents
from torchtitan.config.errors import UserError

logger = logging.getLogger(__name__)



def encode_document(tokenizer, text: str | None) -> list[int]:
    """The tokens of one document in the packed stream: [BOS] + text + [EOS]; an empty document (or a
    null text) is no tokens at all. The one definition, shared by the text pipeline and pretokenize."""
    return tokenizer.encode(text, bos=True, eos=True) if text else []


class TokenizedSource:
    """A text source seen as documents of tokens (encode_document of each text), with the source's
    random access and document count."""

    def __init__(self, source, tokenizer):
        self.source, self.tokenizer = source, tokenizer
        self.name = source.name
        self.random_access = source.random_access

    def documents(self, start: int, keep: Callable[[int], bool] | None = None) -> Iterator[list[int] | None]:
        """The documents from position `start` in stored order; with `keep`, the ones it refuses (by
        position) are read but not tokenized, and come as None."""
        for position, text in enumerate(self.source.documents(start), start):
            yield encode_document(self.tokenizer, text) if keep is None or keep(position) else None

    def num_documents(self) -> int:
        return self.source.num_documents()

    def document(self, index: int) -> list[int]:
        return encode_document(self.tokenizer, self.source.document(index))

    def layout(self) -> dict | None:
        """What the source has learned of its layout by reading (documents per file), saved with the
        position so that a resume skips what was read without reading it again; None if it has nothing."""
        layout = getattr(self.source, "layout", None)
        return layout() if layout is not None else None

    def set_stream_order(self, seed: int, epoch: int, block: int):
        self.source.set_stream_order(seed, epoch, block)

    def load_layout(self, layout: dict | None):
        load = getattr(self.source, "load_layout", None)
        if layout and load is not None:
            load(layout)


class TokenStream:
    """Windows of window_len tokens cut from the global token stream, one after another.

    `docs` is a source of documents of tokens: `documents(start)` yields token lists in stored order,
    and with random access `num_documents()` and `document(i)`; a source that also has
    `document_length(i)` (a token file) is skipped over by lengths alone, without reading tokens.

    The position is (epoch, doc_index, offset): the next token is `offset` into the token list of
    the document at position `doc_index` of the epoch's order (stored order, or with a shuffle
    seed the permutation of the document indices for the epoch). `carry` holds tokens read but not
    yet part of an emitted window; it is always empty between reads, as the position is exact, but
    a saved carry is honoured.
    """

    def __init__(self, docs, window_len: int, shuffle_seed: int | None = None,
                 num_documents: int | None = None, workers: int = 0, shuffle_block: int | None = None):
        self.source = docs
        self.workers = workers  # > 0: documents are read and tokenized in that many processes
        self.window_len = window_len
        self.shuffle_seed = shuffle_seed  # None: stored order
        self.num_documents = num_documents  # with a shuffle seed: the permutation's size
        # With a shuffle seed, a source read as a stream orders each epoch itself (set_stream_order): its
        # files permuted, its documents permuted within blocks of this many positions.
        self.shuffle_block = shuffle_block
        self.next_sample = 0  # global index of the window read next
        self.epoch = 0
        self.doc_index = 0
        self.offset = 0
        self.carry: list[int] = []
        self._docs: Iterator | None = None  # yields document doc_index next, when _tokens is None
        self._tokens = None  # token list of document doc_index
        self._order: tuple[int, Permutation] | None = None  # (epoch, its permutation)

    def seek(self, next_sample: int, epoch: int, doc_index: int, offset: int, carry: list[int]):
        self._close_documents()
        self.next_sample, self.epoch, self.doc_index, self.offset = next_sample, epoch, doc_index, offset
        self.carry = list(carry)

    def _close_documents(self):
        if self._docs is not None and hasattr(self._docs, "close"):
            self._docs.close()  # releases an open file
        self._docs = None
        self._tokens = None

    def _permutation(self) -> Permutation:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, Permutation(self.num_documents, self.shuffle_seed, self.epoch))
        return self._order[1]

    def _epoch_documents(self, start: int) -> Iterator:
        """The token lists of the documents at positions start, start + 1, ... of this epoch's order."""
        if self.shuffle_block is not None:  # set before the workers fork: they read in this order too
            self.source.set_stream_order(self.shuffle_seed, self.epoch, self.shuffle_block)
        order = None if self.shuffle_seed is None or self.shuffle_block is not None else self._permutation()
        if self.workers:
            yield from worker_documents(self.source, start, order, self.num_documents, self.workers)
            return
        if order is None:
            yield from self.source.documents(start)
            return
        for position in range(start, self.num_documents):
            yield self.source.document(order[position])

    def _document_tokens(self):
        """The token list of document doc_index; None past the last document."""
        if self._tokens is None:
            if self._docs is None:
                self._docs = self._epoch_documents(self.doc_index)
            self._tokens = next(self._docs, None)
        return self._tokens

    def _start_epoch(self, tokens_read: int):
        if self.epoch == 0 and self.next_sample == 0:
            raise UserError(
                f"dataset {self.source.name} is too small: all of it tokenizes to {tokens_read} tokens, "
                f"fewer than one sequence of seq_len + 1 = {self.window_len}; add data or lower "
                "training.seq_len"
            )
        documents = self.doc_index
        if documents == 0:  # a whole pass without a document: wrapping again would spin forever
            raise UserError(f"dataset {self.source.name} is empty: it has no document")
        self._close_documents()
        self.epoch += 1
        self.doc_index = 0
        self.offset = 0
        logger.warning(
            "dataset %s exhausted after %d documents: starting epoch %d (the data repeats%s)",
            self.source.name, documents, self.epoch,
            ", in a new order" if self.shuffle_seed is not None else "",
        )

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

    def skip(self, windows: int):
        """Move past the next `windows` windows: as many read()s, leaving the same position, but with
        document lengths alone where the source has them (the tokens are not read)."""
        length_of = getattr(self.source, "document_length", None)
        if length_of is None:
            for _ in range(windows):
                self.read()
            return
        if windows <= 0:
            return
        total = self.num_documents if self.shuffle_seed is not None else self.source.num_documents()
        first, carried = self.next_sample, len(self.carry)
        need = windows * self.window_len - carried
        wanted, self.carry = need, []
        self._close_documents()
        while need > 0:
            if self.doc_index >= total:
                # The sample being passed at the epoch's end, for _start_epoch's "too small" rule.
                self.next_sample = first + (carried + wanted - need) // self.window_len
                self._start_epoch(carried + wanted - need)
                continue
            index = self.doc_index if self.shuffle_seed is None else self._permutation()[self.doc_index]
            left = length_of(index) - self.offset
            if left > need:
                self.offset += need
                need = 0
            else:
                need -= left
                self.doc_index += 1
                self.offset = 0
        self.next_sample = first + windows
