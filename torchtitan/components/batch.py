"""What a batch of packed windows becomes before the model sees it, in training and validation alike.

- Documents: a batch (inputs, labels) has its documents end at `document_end_id`, the EOS the data
  pipeline writes after every document (attention.document_ids numbers them); a loader of a fork's
  may instead yield (inputs, labels, doc_ids), the document index of each input token.
- Labels that do not count are set to IGNORE_INDEX: with `ignore_cross_document`, the prediction of
  each document's first token from the previous document's last (the label after an EOS; with
  explicit ids, where the next input token's id differs, so the window's last label, whose next token
  the ids do not cover, counts). Labels the loader set to IGNORE_INDEX stay ignored.
- With `block_causal`, each token's document index goes with the batch, so attention stays inside
  documents.
- Everything is cut to this rank's context-parallel positions (after the document ids are computed
  on the whole window) and moved to the device.

The loss of an optimizer step is the sum of the token losses over the labels that count divided by
their number in the whole step (all data- and context-parallel ranks and accumulation micro-batches),
so it does not depend on how the step's tokens are spread.
"""

from dataclasses import dataclass

import torch

from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.models.common.attention import document_ids, document_lengths
from torchtitan.models.common.spec import IGNORE_INDEX


@dataclass(frozen=True)
class BatchRule:
    document_end_id: int | None  # None: the data marks no document boundaries
    block_causal: bool = False
    ignore_cross_document: bool = False
    cp_positions: torch.Tensor | None = None  # this rank's positions of each window (None: all)

    def prepare(self, inputs: torch.Tensor, labels: torch.Tensor, device: torch.device,
                doc_ids: torch.Tensor | None = None):
        """(inputs, labels, doc_ids or None) of this rank, on `device`. `doc_ids`: the batch's own
        document ids (None: from document_end_id)."""
        if self.ignore_cross_document:
            if doc_ids is None:
                crossing = inputs == self.document_end_id
            else:
                crossing = torch.zeros_like(inputs, dtype=torch.bool)
                crossing[:, :-1] = doc_ids[:, 1:] != doc_ids[:, :-1]
            labels = labels.masked_fill(crossing, IGNORE_INDEX)
        if self.block_causal:
            if doc_ids is None:
                doc_ids = document_ids(inputs, self.document_end_id)
            doc_ids = shard_sequence(doc_ids, self.cp_positions).to(device, non_blocking=True)
        else:
            doc_ids = None
        inputs = shard_sequence(inputs, self.cp_positions).to(device, non_blocking=True)
        labels = shard_sequence(labels, self.cp_positions).to(device, non_blocking=True)
        return inputs, labels, doc_ids

    def document_lengths(self, inputs: torch.Tensor, doc_ids: torch.Tensor | None = None) -> list[int]:
        """The lengths of the documents attention runs within, over all rows of a (whole) batch."""
        if not self.block_causal:
            return [inputs.shape[1]] * inputs.shape[0]
        if doc_ids is None:
            doc_ids = document_ids(inputs, self.document_end_id)
        return [n for row in document_lengths(doc_ids) for n in row]


def valid_labels(labels: torch.Tensor) -> torch.Tensor:
    """The number of labels that count (not IGNORE_INDEX), as a float64 tensor on the labels' device."""
    return (labels != IGNORE_INDEX).sum().double()
