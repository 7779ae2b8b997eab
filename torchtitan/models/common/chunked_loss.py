"""The output layer and the next-token cross entropy chunk by chunk over the tokens
(training.loss_chunk_tokens): the [tokens, vocab] logits never exist at once, only one chunk's.

`linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens)` is `cross_entropy_sum(hidden @
weight.T, labels)`, the same sum over the labels that are not IGNORE_INDEX, in float32. For each
chunk of tokens its forward computes the chunk's logits (in the compute dtype: autocast's, or the
weight's), upcasts them to float32, takes their log-sum-exp and label logit, adds the chunk's loss
and, while the logits are at hand, the chunk's gradients with respect to the hidden states and the
weight (softmax minus one-hot): the backward only multiplies those by the incoming gradient. This
"gradient in forward" order costs the three matmuls of today's path; recomputing the logits in
backward costs a fourth (measured: 1.5x to 1.9x the CPU time of the whole pass) to spare these
gradients, which have the size of the hidden states and of the weight and which the weight's and
the hidden states' gradients become anyway (scripts/benchmark_loss.py, docs/performance.md).
Without gradients (validation) only the loss is computed.

Tensor parallel: the weight is a DTensor whose rows (the vocabulary) are sharded over the TP ranks.
Each rank then computes its shard's logits for every token (the hidden states, sequence-sharded,
are gathered) and the log-sum-exp is combined over the TP group (all-reduce of the row maxima, of
the sums of exponentials and of the label logit, which only the rank holding that label's row
contributes), as loss parallel does. The hidden states' gradient of each rank covers its vocabulary
shard only: it is declared partial and summed (reduce-scattered back onto the sequence shards).

A model computes this inside its forward (decoder.Decoder.forward(tokens, labels=...)), so that
FSDP's unsharded weight, a pipeline's last stage and context parallel's share of the tokens need
nothing more; `forward_loss_fn` is then the trainer's loss function.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torchtitan.config import UserError
from torchtitan.models.common.spec import IGNORE_INDEX

# training.loss_chunk_tokens = "auto": chunks of AUTO_CHUNK_TOKENS where one rank's micro-batch holds two
# chunks or more and its whole float32 logits would take AUTO_MIN_LOGITS_BYTES or more; the whole logits
# otherwise. At chunks of 1,024 tokens the output layer plus loss took 0.17 to 0.26 of the whole logits'
# peak memory at 0.92 to 1.01 of its CPU time; smaller chunks saved a little more memory but cost time
# under bf16 (docs/performance.md, "The output layer and the loss in chunks"). Below the size bound the
# logits are a small part of a step's activations (the debug model's: 16 MB), so its run is unchanged.
AUTO_CHUNK_TOKENS = 1024
AUTO_MIN_LOGITS_BYTES = 256 * 2**20


def auto_chunk_tokens(tokens: int, vocab_shard: int) -> int:
    """The chunk size "auto" picks for `tokens` tokens per output-layer call on a rank whose output layer
    holds `vocab_shard` rows: AUTO_CHUNK_TOKENS, or 0 (the whole logits) where chunking does not pay."""
    pays = tokens >= 2 * AUTO_CHUNK_TOKENS and tokens * vocab_shard * 4 >= AUTO_MIN_LOGITS_BYTES
    return AUTO_CHUNK_TOKENS if pays else 0


def chunking_obstacle(cfg, spec, pp: int, split_backward: bool) -> str | None:
    """Why this run cannot compute its loss chunk by chunk, or None: the model's forward must compute
    its loss (spec.chunked_loss), in high precision, under a schedule that runs each backward once
    (`split_backward`: the pipeline's schedule splits it, pipeline_parallel.splits_backward)."""
    if spec.chunked_loss is None or spec.chunked_loss is not spec.loss_sum_fn:
        return (
            f"model {spec.name}'s loss (its spec's loss_sum_fn) is not one its forward computes chunk by "
            "chunk (spec.chunked_loss)"
        )
    if "float8" in cfg.model.converters and not any(f and f in "output" for f in cfg.float8.filter_fqns):
        return (
            f"it computes the output layer in high precision, but float8.filter_fqns ({cfg.float8.filter_fqns}) "
            'lets float8 convert it; add "output" to float8.filter_fqns'
        )
    if pp > 1 and split_backward:
        p = cfg.parallelism
        schedule = (
            f"pipeline_parallel_schedule_csv {p.pipeline_parallel_schedule_csv} (its I and W actions)"
            if p.pipeline_parallel_schedule_csv
            else f"pipeline_parallel_schedule = {p.pipeline_parallel_schedule}"
        )
        return (
            f"it computes the output layer's gradients in its forward, for one backward; parallelism."
            f"{schedule} splits each backward into an input and a weight pass; choose 1F1B or Interleaved1F1B"
        )
    return None


def resolve_chunk_tokens(cfg, spec, tp: int, cp: int, pp: int, vocab_size: int, split_backward: bool) -> int:
    """training.loss_chunk_tokens as a number of tokens (0: the whole logits) for this layout: the
    setting, or what "auto" picks (auto_chunk_tokens; 0 where chunking_obstacle). A number set where
    chunking cannot run is a UserError."""
    t, setting = cfg.training, cfg.training.loss_chunk_tokens
    obstacle = chunking_obstacle(cfg, spec, pp, split_backward) if setting else None
    if setting == "auto":
        if obstacle is not None:
            return 0
        micro = cfg.parallelism.pipeline_parallel_microbatch_size if pp > 1 else t.local_batch_size
        return auto_chunk_tokens(micro * (t.seq_len // cp), vocab_size // tp)
    if obstacle is not None:
        raise UserError(f"training.loss_chunk_tokens = {setting}: {obstacle}, or set training.loss_chunk_tokens = 0")
    return setting


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """The summed cross entropy of the logits `hidden @ weight.T` ([..., dim] x [vocab, dim]) against
    `labels` ([...], IGNORE_INDEX not counted), float32, computed `chunk_tokens` tokens at a time."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    group, offset = None, 0
    if isinstance(weight, DTensor):
        group, offset = _vocab_shard(weight)
        if isinstance(hidden, DTensor):  # sequence-sharded: every rank needs every token
            mesh = hidden.device_mesh
            hidden = hidden.redistribute(mesh, [Replicate()] * mesh.ndim).to_local(
                grad_placements=[Partial()] * mesh.ndim
            )
        weight = weight.to_local()
    device = hidden.device
    compute = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight.dtype
    want = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_tokens, compute, group, offset, want
    )


def _vocab_shard(weight: DTensor):
    """(process group, first row held here) of a weight sharded on its rows."""
    mesh, placements = weight.device_mesh, weight.placements
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    if len(sharded) != 1 or any(not isinstance(p, Replicate) for i, p in enumerate(placements) if i != sharded[0]):
        raise ValueError(
            f"the output weight must be sharded on its rows (the vocabulary) over one mesh dimension, "
            f"got placements {placements}"
        )
    dim = sharded[0]
    rows = -(-weight.shape[0] // mesh.size(dim))  # torch.chunk's split, as Shard(0)'s
    return mesh.get_group(dim), rows * mesh.get_local_rank(dim)


# Under a lower compute dtype, the weight gradient's rows summed per chunk this many at a time: the
# temporaries are [_ROW_BLOCK, dim] (not [vocab, dim], the weight's size, in two dtypes).
_ROW_BLOCK = 16384


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, compute, group, offset, want_grads):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if want_grads and ctx.needs_input_grad[0] else None
            grad_weight = (
                torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                if want_grads and ctx.needs_input_grad[1]
                else None
            )
            for start in range(0, hidden.shape[0], chunk_tokens):
                part = slice(start, start + chunk_tokens)
                total += _chunk(
                    hidden[part].to(compute),
                    w,
                    labels[part],
                    group,
                    offset,
                    None if grad_hidden is None else grad_hidden[part],
                    grad_weight,
                )
        ctx.grads = (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):  # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); one per output
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None  # once: the stored gradients are scaled in place
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total.to(grad_weight.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _chunk(
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    group,
    offset: int,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk: its summed loss; its gradients written into `grad_hidden` (its rows) and added to
    `grad_weight` (None: not wanted). A function of its own, so that its [chunk, vocab] tensors are
    freed before the next chunk's are made."""
    rows = w.shape[0]
    logits = (h @ w.t()).float()
    local = y - offset
    mine = (local >= 0) & (local < rows)  # IGNORE_INDEX is negative: never anyone's
    index = torch.where(mine, local, 0)
    label_logit = logits.gather(1, index[:, None]).squeeze(1) * mine
    top = logits.amax(dim=1)
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    # exp(logits - max), in place: the chunk's one [chunk, vocab] float32 tensor, which becomes the
    # softmax, then the gradient.
    exp = logits.sub_(top[:, None]).exp_()
    sum_exp = exp.sum(dim=1)
    if group is not None:
        dist.all_reduce(sum_exp, group=group)
        dist.all_reduce(label_logit, group=group)
    valid = y != IGNORE_INDEX
    loss = torch.where(valid, top + sum_exp.log() - label_logit, 0.0).sum()
    if grad_hidden is None and grad_weight is None:
        return loss
    # d loss / d logits: softmax minus the one-hot label, zero on rows that do not count.
    grad = exp.div_(sum_exp[:, None])
    grad[mine.nonzero().squeeze(1), index[mine]] -= 1.0
    grad = grad.mul_(valid[:, None]).to(w.dtype)
    if grad_hidden is not None:
        grad_hidden.copy_(grad @ w)
    if grad_weight is not None:
        if w.dtype == torch.float32:  # summed in place: no [vocab, dim] temporary per chunk
            grad_weight.addmm_(grad.t(), h)
        else:  # the compute dtype's products summed in float32, a block of rows at a time
            for row in range(0, rows, _ROW_BLOCK):
                grad_weight[row : row + _ROW_BLOCK] += (grad[:, row : row + _ROW_BLOCK].t() @ h).float()
    return loss


def forward_loss_fn(loss_sum_fn: Callable, chunk_tokens: int) -> Callable:
    """The trainer's loss function (output, labels) -> summed loss: the spec's loss_sum_fn on the
    logits, or, where the model computed that loss itself chunk by chunk (`chunk_tokens` > 0, the
    labels given to its forward), its output as it is."""
    return loss_sum_fn if chunk_tokens <= 0 else _model_computed


def _model_computed(loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return loss_sum
