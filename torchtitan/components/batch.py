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
- A family may derive more from the whole window (spec.prepare_window, e.g. multi-token
  prediction's further tokens and labels): labels with a last dim whose column 0 is the next-token
  label, and extra keyword inputs of forward.
- With `labels_to_forward` (training.loss_chunk_tokens), the labels are also a keyword input of
  forward, which then computes the loss itself, chunk by chunk (models.common.chunked_loss).
- Everything is cut to this rank's context-parallel positions (after the document ids and the
  family's tensors are computed on the whole window) and moved to the device.

The loss of an optimizer step is the sum of the token losses over the labels that count divided by
their number in the whole step (all data- and context-parallel ranks and accumulation micro-batches),
so it does not depend on how the step's tokens are spread.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.errors import UserError
from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.models.common.attention import document_ids, document_lengths
from torchtitan.models.common.spec import IGNORE_INDEX


@dataclass(frozen=True)
class BatchPreparation:
    """How the run turns a batch of packed windows into this rank's model inputs (the module's docstring
    has the steps): where documents end, which labels count, the block-causal document ids, the family's
    own inputs (prepare_window), and this rank's context-parallel positions. One per run, shared by
    training and validation; `prepare` applies it to a batch."""

    document_end_id: int | None  # None: the data marks no document boundaries
    block_causal: bool = False
    ignore_cross_document: bool = False
    cp_positions: torch.Tensor | None = None  # this rank's positions of each window (None: all)
    # The family's (inputs, labels) -> (labels, {name: [batch, seq, ...] forward input}): spec.prepare_window.
    prepare_window: Callable | None = None
    labels_to_forward: bool = False  # the labels are forward's `labels` too (the model computes the loss)

    def prepare(
        self, inputs: torch.Tensor, labels: torch.Tensor, device: torch.device, doc_ids: torch.Tensor | None = None
    ):
        """(inputs, labels, keyword inputs of forward) of this rank, on `device`: the keyword inputs
        are `doc_ids` with block-causal attention and the family's own (prepare_window). `doc_ids`:
        the batch's own document ids (None: from document_end_id)."""
        if self.ignore_cross_document:
            if doc_ids is None:
                crossing = inputs == self._end_id()
            else:
                crossing = torch.zeros_like(inputs, dtype=torch.bool)
                crossing[:, :-1] = doc_ids[:, 1:] != doc_ids[:, :-1]
            labels = labels.masked_fill(crossing, IGNORE_INDEX)
        extra = {}
        if self.block_causal:
            extra["doc_ids"] = doc_ids if doc_ids is not None else document_ids(inputs, self._end_id())
        if self.prepare_window is not None:
            labels, family = self.prepare_window(inputs, labels)
            extra.update(family)
        if self.labels_to_forward:
            extra["labels"] = labels
        cut = lambda x: shard_sequence(x, self.cp_positions).to(device, non_blocking=True)  # noqa: E731
        return cut(inputs), cut(labels), {name: cut(x) for name, x in extra.items()}

    def document_lengths(self, inputs: torch.Tensor, doc_ids: torch.Tensor | None = None) -> list[int]:
        """The lengths of the documents attention runs within, over all rows of a (whole) batch."""
        if not self.block_causal:
            return [inputs.shape[1]] * inputs.shape[0]
        if doc_ids is None:
            doc_ids = document_ids(inputs, self._end_id())
        return [n for row in document_lengths(doc_ids) for n in row]

    def _end_id(self) -> int:
        # A batch without its own document ids is split at document_end_id, which document_end_of
        # always finds where the run needs document boundaries.
        assert self.document_end_id is not None, "the data marks no document boundaries"
        return self.document_end_id


def valid_labels(labels: torch.Tensor) -> torch.Tensor:
    """The number of labels that count (not IGNORE_INDEX), as a float64 tensor on the labels' device.
    Labels with a last dim (spec.prepare_window) count by their column 0, the next-token labels."""
    if labels.dim() == 3:
        labels = labels[..., 0]
    return (labels != IGNORE_INDEX).sum().double()


@dataclass(frozen=True)
class LossRanks:
    """The ranks a step's loss is spread over: the data- and context-parallel ranks (`mesh`), which
    split its tokens, and under a pipeline the group (`pp_group`) whose rank `loss_src` holds it."""

    mesh: DeviceMesh | None = None
    pp_group: ProcessGroup | None = None
    loss_src: int = 0

    def scale(self, labels: list[torch.Tensor]) -> torch.Tensor:
        """What a micro-batch's summed token loss is multiplied by: the number of ranks of `mesh` over
        the step's count of valid labels on all of them. Their gradients are averaged (FSDP/DDP), so
        the step's gradient is that of the sum of all token losses over that count. One scalar
        all-reduce; no host sync."""
        # A step has at least one micro-batch, so the sum is a tensor (not sum's start, 0).
        count = cast(torch.Tensor, sum(valid_labels(x) for x in labels))
        if self.mesh is None:
            return (1 / count.clamp(min=1)).float()
        torch.distributed.all_reduce(count, group=self.mesh.get_group())
        return (self.mesh.size() / count.clamp(min=1)).float()

    def sum(self, sums: torch.Tensor) -> torch.Tensor:
        """`sums` taken from the rank that holds the loss, summed over the ranks of `mesh` (in place)."""
        if self.pp_group is not None:
            torch.distributed.broadcast(sums, group=self.pp_group, group_src=self.loss_src)
        if self.mesh is not None:
            torch.distributed.all_reduce(sums, group=self.mesh.get_group())
        return sums

    def mean(self, loss: torch.Tensor) -> float:
        """The step's loss from this rank's share (scaled by `scale`): their mean over `mesh`."""
        total = self.sum(loss.detach().float().reshape(1).clone())
        return total.item() / (self.mesh.size() if self.mesh is not None else 1)


def document_end_of(dataloader, block_causal: bool, ignore_cross_document: bool) -> int | None:
    """The token that ends each document in the training data, where the run needs document
    boundaries (block-causal attention, training.ignore_cross_document_labels). A loader whose
    dataset sets `yields_document_ids` gives (inputs, labels, doc_ids) batches instead."""
    dataset = getattr(dataloader, "dataset", None)
    end = getattr(dataset, "document_end_id", None)
    if getattr(dataset, "yields_document_ids", False):
        return end
    needs = [
        what
        for what, on in (
            ("model.attn_mask_type = 'block_causal'", block_causal),
            ("training.ignore_cross_document_labels", ignore_cross_document),
        )
        if on
    ]
    if needs and end is None:
        raise UserError(
            f"{' and '.join(needs)} needs the document boundaries of the training data, but its loader "
            f"({type(dataloader).__name__}) carries no document boundaries: its dataset has no "
            f"document_end_id (the token that ends every document) and does not set yields_document_ids "
            f"(batches of inputs, labels and document ids); give it one, or use 'causal' attention and "
            f"count every label"
        )
    return end
