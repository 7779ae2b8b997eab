"""A mixture-of-experts feed-forward block that any family can use in place of its dense one.

Token-choice routing: each token picks its top-k experts by router score (softmax or sigmoid over a
linear gate, computed in float32), optionally only among the best expert groups (node-limited
routing), and its output is the score-weighted sum of those experts' SwiGLU outputs (plus the
shared experts', if any, optionally scaled per token by a sigmoid gate: Qwen2-MoE's, Qwen3-Next's and
Qwen3.5-MoE's shared_expert_gate). Routed experts keep their weights as 3-D tensors, experts first:
w1, w3 [experts, hidden, dim] and w2 [experts, dim, hidden] (each slice laid out like nn.Linear).

What is unusual here:
- Expert matmuls run as one grouped matmul (`torch._grouped_mm`) over the tokens sorted by expert
  when a one-time probe shows that it works, forward and backward, for the device and dtype;
  otherwise as a loop of per-expert matmuls (the same results within float32 round-off). The
  choice is logged once per (device, dtype). Under torch.autocast (the trainer's bf16 without
  FSDP) both run in autocast's dtype: autocast has no rule for `torch._grouped_mm`, so the experts
  cast their tokens and weights themselves, as autocast does for the loop's matmuls
  (`matmul_dtype`).
- Combining: the k outputs of a token are written back to its k assignment slots and summed per
  token, with no scatter-add, so the result is deterministic on every device.
- Load balancing without an auxiliary loss: a per-expert bias (buffer `expert_bias`, saved in
  checkpoints) is added to the scores for choosing experts only. After every optimizer step
  `update_expert_bias` moves it by `load_balance_coeff` x sign(mean load - expert load), with the
  token counts of the step summed over every rank that holds a share of the batch, so all ranks
  keep the same bias. Optional sequence-wise auxiliary loss and router z-loss add their gradients
  through `_AddAuxiliaryGradient` (the training loss value stays the language-model loss); their
  values are reported as metrics.
- Expert capacity (optional): an expert keeps at most ceil(capacity_factor x tokens x top_k /
  experts) assignments, those with the highest scores; the others are dropped (the token then
  gets fewer expert outputs) and their share is reported.

Experts as expert parallel sees them (torchtitan.distributed.expert_parallel, through a spec's
`expert_layers`; a family with its own MoE class presents the same): a block has `experts`, a
module with `num_experts` whose parameters all have the experts on dim 0, that multiplies its
gradients by `grad_scale` (set by expert parallel) and is called as experts(tokens sorted by
expert, tokens per expert); and a settable `dispatcher`, which, when set, the block calls as
dispatcher(experts, sorted tokens, tokens per expert) in place of experts(...). `check_expert_layer`
says what a block lacks.
"""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.layers import FeedForward, scale_gradient
from torchtitan.models.common.spec import submesh

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 768  # of each routed expert
    num_shared_experts: int = 0  # dense SwiGLU experts every token goes through (shared_width together)
    shared_hidden_dim: int | None = None  # of each shared expert; None: hidden_dim (Qwen3.5-MoE sets its own)
    # The shared experts' output times sigmoid(shared_gate(x)), a Linear(dim, 1) per block (Qwen3.5-MoE's
    # shared_expert_gate); False: added as it is (DeepSeek-V3).
    shared_gate: bool = False
    score_func: str = "softmax"  # "softmax" or "sigmoid"
    route_norm: bool = False  # renormalize the top-k scores of a token to sum to 1
    route_scale: float = 1.0
    num_expert_groups: int | None = None  # node-limited routing: experts in this many groups...
    num_limited_groups: int | None = None  # ...of which each token may use the best this many
    load_balance_coeff: float | None = 1e-3  # bias update rate of aux-loss-free balancing; None: off
    seq_aux_loss_coeff: float = 0.0  # sequence-wise auxiliary loss; 0: off
    z_loss_coeff: float = 0.0  # router z-loss; 0: off
    capacity_factor: float | None = None  # None: no capacity limit, no token dropped

    def check(self) -> list[str]:
        """What is wrong with these args, for messages before launch."""
        problems = []
        if not 1 <= self.top_k <= self.num_experts:
            problems.append(f"top_k = {self.top_k} must be between 1 and num_experts = {self.num_experts}")
        if self.score_func not in ("softmax", "sigmoid"):
            problems.append(f"score_func = {self.score_func!r} must be 'softmax' or 'sigmoid'")
        if (self.num_expert_groups is None) != (self.num_limited_groups is None):
            problems.append("num_expert_groups and num_limited_groups go together: set both or neither")
        elif self.num_expert_groups is not None and self.num_limited_groups is not None:
            g, limit = self.num_expert_groups, self.num_limited_groups
            if self.num_experts % g:
                problems.append(f"num_expert_groups = {g} does not divide num_experts = {self.num_experts}")
            elif not 1 <= limit <= g or limit * (self.num_experts // g) < self.top_k:
                problems.append(
                    f"num_limited_groups = {limit} must be in [1, {g}] and leave at least top_k = {self.top_k} experts"
                )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            problems.append(f"capacity_factor = {self.capacity_factor} must be positive (or unset)")
        if self.shared_gate and not self.num_shared_experts:
            problems.append("shared_gate = True gates the shared experts' output, but num_shared_experts = 0")
        if self.shared_hidden_dim is not None and self.shared_hidden_dim < 1:
            problems.append(f"shared_hidden_dim = {self.shared_hidden_dim} must be at least 1 (or unset)")
        return problems

    @property
    def shared_width(self) -> int:
        """The hidden width of all shared experts together (one SwiGLU of this width computes them)."""
        each = self.hidden_dim if self.shared_hidden_dim is None else self.shared_hidden_dim
        return each * self.num_shared_experts

    def active_fraction(self) -> float:
        return self.top_k / self.num_experts


# ---- expert matmuls ---------------------------------------------------------------------------

_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm gives the loop's results, forward and backward, here, with both
    operands in `dtype` (probed once per device type and dtype)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_OK:
        # Isolated from the caller's autograd state: the probe may first run inside a checkpointed
        # forward, whose saved tensors must be the same in the recomputation (which skips it). And
        # from its autocast: there the loop's matmuls would run in autocast's dtype, not in `dtype`,
        # and the comparison would judge the grouped matmul by another dtype's round-off.
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
            torch.autocast(device.type, enabled=False),
        ):
            ok = _probe_grouped_mm(device, dtype)
        _GROUPED_MM_OK[key] = ok
        logger.info(
            f"MoE experts on {device.type} in {str(dtype).removeprefix('torch.')}: "
            + (
                "one grouped matmul (torch._grouped_mm)"
                if ok
                else "a loop of per-expert matmuls (no working grouped matmul)"
            )
        )
    return _GROUPED_MM_OK[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        counts = torch.tensor([3, 0, 5], device=device)
        x = torch.randn(8, 16, generator=g).to(device, dtype).requires_grad_()
        w = torch.randn(3, 16, 16, generator=g).to(device, dtype).requires_grad_()
        up = torch.randn(8, 16, generator=g).to(device, dtype)
        fast = _grouped(x, w, counts)
        fast_grads = torch.autograd.grad(fast, (x, w), up)
        slow = _looped(x, w, counts)
        slow_grads = torch.autograd.grad(slow, (x, w), up)
    except RuntimeError:  # NotImplementedError too, a subclass
        return False
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return all(
        torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
        for a, b in zip((fast, *fast_grads), (slow, *slow_grads))
    )


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return torch._grouped_mm(x, w, offs=offsets)


def _looped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        out.append(x[start : start + n] @ w[e])
        start += n
    return torch.cat(out)


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul reading `x` runs in: autocast's where autocast is on for x's device and
    would cast x (a float32, float16 or bfloat16 tensor), else x's own."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(device)
    return x.dtype


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` sorted by expert (counts[e] rows for expert e) times w[e] ([experts, in, out]).
    Under autocast in autocast's dtype, like any matmul: autocast casts the loop's matmuls but has
    no rule for torch._grouped_mm, which would otherwise get float32 tokens and weights (or bf16
    tokens and float32 weights, and fail)."""
    dtype = matmul_dtype(x)
    x, w = x.to(dtype), w.to(dtype)
    if x.shape[0] == 0:
        # Empty, but still computed from x and w: under expert parallel the backward must reach the
        # all-to-all before these experts on every rank, also on one that received no token.
        return x @ w[0]
    if grouped_mm_works(x.device, dtype) and _grouped_layout_ok(x, w):
        return _grouped(x, w, counts)
    return _looped(x, w, counts)


def _grouped_layout_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands, forward and backward: it needs each operand's
    non-unit inner stride to be a multiple of 16 bytes, which for x [tokens, in] and w [experts, in,
    out] (and the gradients' [tokens, out]) means `in` and `out` multiples of 8 in bf16 (4 in
    float32). A flavor whose widths are not (a small custom one) takes the loop. (Its other need,
    16-byte-aligned data, holds for the tensors here: whole allocations, not offset views.)"""
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and w.shape[-1] % align == 0 and x.is_contiguous()


def local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain tensor for the routing and expert math. Under tensor parallel the MoE
    block runs on each rank's slice of the sequence with its weights replicated
    (torchtitan.distributed.tensor_parallel.TokenLocal): each rank's gradient covers its own
    tokens only, so a replicated weight's gradient is declared partial, to be summed over ranks."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(weight, DTensor):
        return weight
    grads = [Partial() if str(p) == "R" else p for p in weight.placements]
    return weight.to_local(grad_placements=grads)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        # Set by expert parallel (torchtitan.distributed.expert_parallel): a factor on the weights'
        # gradients, which there sum over the ranks of an expert group instead of averaging.
        self.grad_scale = 1.0
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: tokens sorted by expert, counts[e] of them for (local) expert e."""
        weights = [local_tensor(w) for w in (self.w1, self.w2, self.w3)]
        if self.grad_scale != 1.0:
            weights = [scale_gradient(w, self.grad_scale) for w in weights]
        # Cast once here, not in each expert_matmul: w1 and w3 then share one autocast copy of the
        # tokens (kept for their backward).
        x = x.to(matmul_dtype(x))
        w1, w2, w3 = (w.transpose(-2, -1) for w in weights)
        h = F.silu(expert_matmul(x, w1, counts)) * expert_matmul(x, w3, counts)
        return expert_matmul(h, w2, counts)


class Router(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None):
        """x [tokens, dim] -> (top-k weights [tokens, k] fp32, expert ids [tokens, k], scores
        [tokens, experts] fp32, logits fp32)."""
        a = self.args
        logits = F.linear(x, local_tensor(self.gate.weight)).float()
        scores = torch.softmax(logits, dim=-1) if a.score_func == "softmax" else torch.sigmoid(logits)
        choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias
        if a.num_expert_groups is not None and a.num_limited_groups is not None:  # both or neither (check)
            choice = _limit_to_best_groups(choice, a.num_expert_groups, a.num_limited_groups)
        ids = torch.topk(choice, a.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, ids)
        if a.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, ids, scores, logits


def _limit_to_best_groups(choice: torch.Tensor, groups: int, limit: int) -> torch.Tensor:
    """Mask the experts outside each token's `limit` best groups (a group's worth: the sum of its
    two best choice scores, or its best one for groups of one expert)."""
    grouped = choice.unflatten(-1, (groups, -1))
    best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, best.topk(limit, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


class _AddAuxiliaryGradient(torch.autograd.Function):
    """Return `x` unchanged; in backward, also backpropagate `aux_loss` (times `scale`). The loss
    value used for logging stays the language-model loss."""

    @staticmethod
    def forward(ctx, x, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # pyrefly: ignore[bad-override]  # torch's stub: (ctx, *grad_outputs); one per output
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


class MoE(nn.Module):
    """Drop-in for a feed-forward block: forward(x [batch, seq, dim]) -> [batch, seq, dim]."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        problems = args.check()
        if problems:
            raise ValueError("; ".join(problems))
        self.args = args
        self.router = Router(dim, args)
        # Any module with the expert-parallel interface (the module docstring); gpt-oss has its own.
        self.experts: nn.Module = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        self.shared_experts = FeedForward(dim, args.shared_width) if args.num_shared_experts else None
        # Qwen3.5-MoE's shared_expert_gate: one logit per token, whose sigmoid scales the shared output.
        self.shared_gate = nn.Linear(dim, 1, bias=False) if args.shared_gate else None
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        # Assignments per expert since the last optimizer step (for the bias update and metrics).
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        # The last step's counts, summed over the ranks (update_expert_bias), for the metrics.
        self.last_tokens_per_expert: torch.Tensor | None = None
        # Set by the family's parallelize: the gradient scale of the auxiliary losses (1 / the number
        # of equal shares whose gradients are summed, not averaged: accumulation steps, TP ranks),
        # and the expert-parallel dispatch (None: all experts are local).
        self.aux_grad_scale = 1.0
        self.dispatcher: Callable | None = None
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        bias = self.expert_bias if a.load_balance_coeff is not None else None
        weights, ids, scores, logits = self.router(tokens, bias)
        flat_ids = ids.flatten()
        counts = torch.bincount(flat_ids, minlength=a.num_experts)
        keep = None
        if a.capacity_factor is not None:
            keep = _within_capacity(
                flat_ids,
                weights.detach().flatten(),
                a.num_experts,
                math.ceil(a.capacity_factor * tokens.shape[0] * a.top_k / a.num_experts),
            )
        # Assignments sorted by expert (stable: within an expert, in token order).
        order = torch.argsort(flat_ids, stable=True)
        if keep is not None:
            order = order[keep[order]]
            routed = torch.bincount(flat_ids[order], minlength=a.num_experts)
        else:
            routed = counts
        if self.training and _in_training_forward():  # counted once per trained token
            with torch.no_grad():
                self.tokens_per_expert += routed.float()
        token_of = order // a.top_k
        expert_in = tokens[token_of]
        if self.dispatcher is not None:
            expert_out = self.dispatcher(self.experts, expert_in, routed)
        else:
            expert_out = self.experts(expert_in, routed)
        weighted = (expert_out.float() * weights.flatten()[order].unsqueeze(-1)).to(x.dtype)
        slots = weighted.new_zeros(flat_ids.shape[0], shape[-1])
        slots[order] = weighted
        out = slots.view(-1, a.top_k, shape[-1]).sum(1)
        if self.shared_experts is not None:  # its weights read as the router's (TokenLocal under TP)
            se = self.shared_experts
            w1, w2, w3 = (local_tensor(m.weight) for m in (se.w1, se.w2, se.w3))
            shared = F.linear(F.silu(F.linear(tokens, w1)) * F.linear(tokens, w3), w2)
            if self.shared_gate is not None:  # replicated under TP as well: its gradient summed over ranks
                shared = torch.sigmoid(F.linear(tokens, local_tensor(self.shared_gate.weight))) * shared
            out = out + shared
        out = out.view(shape)
        aux = self._auxiliary_losses(scores, logits, ids, shape[0])
        if self.training and _in_training_forward():
            dropped = (1 - routed.sum() / counts.sum()) if keep is not None else torch.zeros(())
            self.stats = {"dropped": dropped.detach(), **{k: v.detach() for k, v in aux.items()}}
        aux_total = sum(v for v in aux.values() if v is not None and v.requires_grad)
        if torch.is_tensor(aux_total) and self.training:
            out = _AddAuxiliaryGradient.apply(out, aux_total, self.aux_grad_scale)
        return out

    def _auxiliary_losses(self, scores, logits, ids, batch: int) -> dict:
        a = self.args
        aux = {}
        if a.seq_aux_loss_coeff > 0:
            # Per sequence: fraction of its assignments per expert (x experts / k) dotted with the
            # mean normalized score per expert, averaged over sequences.
            per_seq = scores.view(batch, -1, a.num_experts)
            normalized = per_seq / per_seq.sum(-1, keepdim=True)
            load = F.one_hot(ids.view(batch, -1, a.top_k), a.num_experts).sum((1, 2)).float()
            load = load * a.num_experts / (a.top_k * per_seq.shape[1])
            aux["seq_aux_loss"] = a.seq_aux_loss_coeff * (load * normalized.mean(1)).sum(-1).mean()
        if a.z_loss_coeff > 0:
            aux["z_loss"] = a.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
        return aux

    def reset_buffers(self, device=None):
        """After `to_empty`: a zero bias and zero counts (the family's init_weights draws the
        parameters, seeded by name like all others)."""
        device = device or self.expert_bias.device
        self.expert_bias = torch.zeros(self.args.num_experts, device=device)
        self.tokens_per_expert = torch.zeros(self.args.num_experts, device=device)
        for dtype in (torch.float32, torch.bfloat16):  # probe now, outside any training forward
            grouped_mm_works(torch.device(device), dtype)


def _in_training_forward() -> bool:
    """True in a forward pass that trains: not while autograd runs a backward pass (activation
    checkpointing's recomputation), nor under no_grad (evaluation, or a pipeline stage inferring
    its shapes on the first step, which would count one microbatch twice)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def _within_capacity(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Mask of the assignments each expert keeps: its `capacity` highest-weighted ones."""
    # By weight, highest first, then (stably) by expert: within an expert, highest weights first.
    by_weight = torch.argsort(weights, descending=True, stable=True)
    order = by_weight[torch.argsort(ids[by_weight], stable=True)]
    sorted_ids = ids[order]
    starts = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=ids.device))
    rank = torch.arange(ids.shape[0], device=ids.device) - starts[sorted_ids]
    keep = torch.empty_like(ids, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep


@torch.no_grad()
def update_expert_bias(moe_layers: list["MoE"], reduce_group=None) -> None:
    """After an optimizer step: move each layer's bias toward balance using the step's token counts
    summed over `reduce_group` (every rank holding a share of the batch), then reset the counts."""
    import torch.distributed as dist

    if not moe_layers:
        return
    counts = torch.stack([m.tokens_per_expert for m in moe_layers])
    if reduce_group is not None and dist.get_world_size(reduce_group) > 1:
        dist.all_reduce(counts, group=reduce_group)
    for m, c in zip(moe_layers, counts):
        if m.args.load_balance_coeff is not None:
            m.expert_bias += m.args.load_balance_coeff * torch.sign(c.mean() - c)
            m.expert_bias -= m.expert_bias.mean()  # only differences between experts matter
        m.last_tokens_per_expert = c.clone()
        m.tokens_per_expert.zero_()


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def check_expert_layer(block: nn.Module) -> None:
    """TypeError naming what `block` lacks of the expert-parallel interface (module docstring)."""
    experts = getattr(block, "experts", None)
    missing = [
        what
        for what, ok in [
            ("an `experts` module", isinstance(experts, nn.Module)),
            ("experts.num_experts", isinstance(getattr(experts, "num_experts", None), int)),
            ("experts.grad_scale", hasattr(experts, "grad_scale")),
            ("a `dispatcher` attribute", hasattr(block, "dispatcher")),
        ]
        if not ok
    ]
    if missing:
        raise TypeError(
            f"{type(block).__name__} is given as an expert layer but has no {', '.join(missing)} "
            "(see torchtitan/models/common/moe.py, 'Experts as expert parallel sees them')"
        )


def expert_layers(model: nn.Module) -> list[nn.Module]:
    """A family's spec.expert_layers when its experts are this module's MoE blocks (typed as the spec's
    field, which any family's blocks fill)."""
    return [m for _, m in moe_layers(model)]


def overrides_from_config(section) -> dict:
    """MoEArgs fields set by the [moe] config section (unset keys keep the flavor's values; 0 turns
    the bias balancing or the capacity limit off)."""
    out = {}
    if section.top_k is not None:
        out["top_k"] = section.top_k
    if section.load_balance_coeff is not None:
        out["load_balance_coeff"] = section.load_balance_coeff or None
    for key in ("seq_aux_loss_coeff", "z_loss_coeff"):
        if getattr(section, key) is not None:
            out[key] = getattr(section, key)
    if section.capacity_factor is not None:
        out["capacity_factor"] = section.capacity_factor or None
    return out


# ---- hooks for a family's spec ----------------------------------------------------------------


def _batch_group(inputs):
    """The ranks that hold shares of the same batch for the same layers: all but the pipeline's."""
    return submesh(inputs.mesh, "dp_cp_tp").get_group() if inputs.mesh is not None else None


def configure_moe(model: nn.Module, inputs) -> None:
    """A family's spec.pre_parallelize: the auxiliary losses' gradient scale. Their gradients are summed,
    not averaged, over gradient-accumulation micro-batches (a pipeline averages its microbatches
    itself) and over tensor-parallel ranks (each routes its own slice of the sequence)."""
    dims, t = inputs.parallel_dims, inputs.training
    accum = 1 if dims.pp_enabled else dims.batch(t.local_batch_size, t.global_batch_size)[1]
    for _, m in moe_layers(model):
        m.aux_grad_scale = 1.0 / (accum * dims.tp)


def balance_after_step(model_parts: list[nn.Module], inputs) -> None:
    """post_optimizer_step hook: the expert-bias update with the step's counts from every rank."""
    layers = [m for part in model_parts for _, m in moe_layers(part)]
    update_expert_bias(layers, _batch_group(inputs))


def drop_step_counts(model_parts: list[nn.Module], inputs) -> None:
    """post_skipped_step hook: a skipped step's token counts move no expert bias."""
    for part in model_parts:
        for _, m in moe_layers(part):
            m.tokens_per_expert.zero_()


def expert_load_metrics(model_parts: list[nn.Module], inputs) -> dict[str, float]:
    """metrics hook: per MoE layer, the max and mean assignments per expert of the last step (over
    all ranks), their ratio, the dropped share and the auxiliary losses (means over ranks); and two
    summaries for the console, the worst layer's max/mean and the mean dropped share."""
    import torch.distributed as dist

    group = _batch_group(inputs)
    local: dict[str, float] = {}
    for part in model_parts:
        for name, m in moe_layers(part):
            layer = name.split(".")[1] if name.startswith("layers.") else name
            counts = m.last_tokens_per_expert
            if counts is None:
                continue
            stats = {k: v.float().reshape(()) for k, v in m.stats.items()}
            if group is not None and stats:
                values = torch.stack(list(stats.values()))
                dist.all_reduce(values, group=group)
                stats = dict(zip(stats, values / dist.get_world_size(group)))
            mean = counts.mean().item()
            local[f"moe/layer{layer}/max_load"] = counts.max().item()
            local[f"moe/layer{layer}/mean_load"] = mean
            local[f"moe/layer{layer}/max_over_mean"] = counts.max().item() / mean if mean > 0 else 0.0
            local.update({f"moe/layer{layer}/{k}": v.item() for k, v in stats.items()})
    if inputs.parallel_dims.pp_enabled:  # each stage holds some of the layers
        gathered = [None] * inputs.mesh["pp"].size()
        dist.all_gather_object(gathered, local, group=inputs.mesh["pp"].get_group())
        local = {k: v for d in gathered for k, v in d.items()}
    ratios = [v for k, v in local.items() if k.endswith("/max_over_mean")]
    dropped = [v for k, v in local.items() if k.endswith("/dropped")]
    if ratios:
        local["moe_max_over_mean"] = max(ratios)
        local["moe_dropped"] = sum(dropped) / len(dropped) if dropped else 0.0
    return local


def count_moe_parameters(args: MoEArgs, dim: int) -> tuple[int, int]:
    """(all parameters of one MoE block, those a token uses)."""
    routed = 3 * dim * args.hidden_dim
    shared = 3 * dim * args.shared_width + (dim if args.shared_gate else 0)
    gate = dim * args.num_experts
    return gate + shared + routed * args.num_experts, gate + shared + routed * args.top_k
