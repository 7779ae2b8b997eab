"""What a batch of packed windows becomes before the model sees it, in training and validation alike.

- Labels that do not count are set to IGNORE_INDEX: with `ignore_cross_document`, the prediction of
  each document's first token from the previous document's EOS (the label after an EOS).
- With `block_causal`, each token's document index (attention.document_ids) goes with the batch, so
  attention stays inside documents. Documents end at `document_end_id`, the EOS the data pipeline
  writes after every document.
- Everything is cut to this rank's context-parallel positions (after the document ids are computed
  on the whole window) and moved to the device.

The loss of an optimizer step is the sum of the token losses over the labels that count divided by
their number in the whole step (all data- and context-parallel ranks and accumulation micro-batches),
so it does not depend on how the step's tokens are spread.
"""

from dataclasses import dataclass

import torch

from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.models.attention import document_ids, document_lengths
from torchtitan.models.spec import IGNORE_INDEX


@dataclass(frozen=True)
class BatchRule:
    document_end_id: int | None  # None: the data marks no document boundaries
    block_causal: bool = False
    ignore_cross_document: bool = False
    cp_positions: torch.Tensor | None = None  # this rank's positions of each window (None: all)

    def prepare(self, inputs: torch.Tensor, labels: torch.Tensor, device: torch.device):
        """(inputs, labels, doc_ids or None) of this rank, on `device`."""
        doc_ids = None
        if self.ignore_cross_document:
            labels = labels.masked_fill(inputs == self.document_end_id, IGNORE_INDEX)
        if self.block_causal:
            doc_ids = shard_sequence(document_ids(inputs, self.document_end_id), self.cp_positions)
            doc_ids = doc_ids.to(device, non_blocking=True)
        inputs = shard_sequence(inputs, self.cp_positions).to(device, non_blocking=True)
        labels = shard_sequence(labels, self.cp_positions).to(device, non_blocking=True)
        return inputs, labels, doc_ids

    def document_lengths(self, inputs: torch.Tensor) -> list[int]:
        """The lengths of the documents attention runs within, over all rows of a (whole) batch."""
        if not self.block_causal:
            return [inputs.shape[1]] * inputs.shape[0]
        return [n for row in document_lengths(document_ids(inputs, self.document_end_id)) for n in row]


def valid_labels(labels: torch.Tensor) -> torch.Tensor:
    """The number of labels that count (not IGNORE_INDEX), as a float64 tensor on the labels' device."""
    return (labels != IGNORE_INDEX).sum().double()
