"""Muon for the hidden matrices and AdamW for the other parameters, in one torch.optim.Optimizer.

Each parameter group carries `algorithm`: "muon" or "adamw". One optimizer (rather than a Muon and an
AdamW side by side) keeps what is built around an optimizer unchanged: the checkpoint's optimizer
state keyed by parameter name (DCP's get/set_optimizer_state_dict), the LR schedule (one LambdaLR on
every group's initial lr) and the per-group lr multipliers.

Muon (Keller Jordan; "Muon is Scalable for LLM Training", Moonlight): a momentum buffer per matrix,
B <- mu B + (1 - mu) g (the update uses g + mu (B - g) with Nesterov, else B), orthogonalized by
Newton-Schulz iterations, then applied with decoupled weight decay at a learning rate adjusted to
the matrix's shape A x B. A parameter of more than two dims is a stack of matrices on its last two
dims (MoE experts [experts, out, in]): each matrix is orthogonalized alone.

What is unusual here:
- Sharded parameters (DTensors): the orthogonalization needs each whole matrix. When this rank's
  shard holds whole matrices (a replicated parameter; experts split on the expert dim only) it runs
  on the shard. Matrices split along one mesh dim (FSDP, TP, HSDP) each get one owner among that
  dim's ranks, which gathers the pieces, orthogonalizes and scatters them back
  (SpreadOrthogonalization), so the ranks share the iterations. Otherwise (split over two mesh dims:
  FSDP over TP's rows) the update is gathered (full_tensor), orthogonalized on every rank alike, and
  this rank keeps its own part. Every layout thus computes what one process computes.
- The Newton-Schulz iterations run in bfloat16 by default, as torch.optim.Muon and the reference do (the
  iteration is built to tolerate it, and bf16 matmuls are 2-4x faster where the hardware has them);
  `ns_dtype` float32 runs them in float32 (a CPU without native bf16 multiplies bf16 matrices tens of
  times slower than float32 ones).
- state_dtype = bfloat16 keeps the momentum and AdamW's moments in bf16; the update is computed in
  float32 from them (a plain-torch AdamW, the same formula as torch's). With float32 state, the
  AdamW groups run torch's own AdamW kernels (fused, foreach or for-loop as configured).
"""

import math
from collections.abc import Callable
from typing import cast, overload

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.adamw import adamw as torch_adamw

from torchtitan.models.common.init import local_part

# The quintic Newton-Schulz coefficients of Keller Jordan's Muon (as torch.optim.Muon's).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
DEFAULT_MOMENTUM, DEFAULT_NESTEROV, DEFAULT_NS_STEPS, DEFAULT_ADJUST_LR = 0.95, True, 5, "match_rms_adamw"
ADJUST_LR = ("match_rms_adamw", "original", "none")


def newton_schulz(x: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalization of each matrix on the last two dims of `x` (about U V^T of its SVD), in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    shape = x.shape
    y = x.reshape(-1, shape[-2], shape[-1]).to(dtype)
    wide = shape[-2] <= shape[-1]
    if not wide:  # iterate on the wide form: the Gram matrix is the smaller one
        y = y.mT
    # Frobenius norm >= spectral norm: every singular value is brought to at most 1.
    y = y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = y @ y.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        y = torch.baddbmm(y, poly, y, beta=a)  # a Y + (b G + c G^2) Y
    if not wide:
        y = y.mT
    return y.reshape(shape)


def adjusted_lr(lr: float, rule: str, rows: int, cols: int) -> float:
    """Muon's learning rate for a rows x cols matrix: match_rms_adamw scales the orthogonalized update
    (RMS about 1 / sqrt(max(rows, cols))) to AdamW's typical RMS of 0.2; original is Keller Jordan's."""
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr


def holds_whole_matrices(p: torch.Tensor) -> bool:
    """Whether this rank's shard of `p` is made of whole matrices (last two dims unsplit)."""
    if not isinstance(p, DTensor):
        return True
    # is_shard() is no type guard: a placement that says it is a Shard is one.
    return all(not pl.is_shard() or cast(Shard, pl).dim < p.ndim - 2 for pl in p.placements)


def orthogonalize(
    update: torch.Tensor, p: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Newton-Schulz of `update` (this rank's shard, laid out like `p`'s) in `dtype`, each matrix whole, on every
    rank alike; this rank's part."""
    if not isinstance(p, DTensor) or holds_whole_matrices(p):
        return newton_schulz(update, steps, dtype)
    mesh, placements = p.device_mesh, p.placements
    full = DTensor.from_local(update, mesh, placements, shape=p.shape, stride=p.stride()).full_tensor()
    ortho = newton_schulz(full, steps, dtype)
    replicated = DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, placements).to_local()


def split_mesh_dim(p: torch.Tensor) -> int | None:
    """The one mesh dim whose plain Shard splits `p`'s matrices, when every other mesh dim replicates
    `p` or splits only its leading (stack) dims: the ranks along that dim then hold the pieces of the
    same matrices, torch.chunk's along one dim, which one of them can gather whole. None otherwise
    (whole matrices, or matrices split over two mesh dims, e.g. FSDP over TP's rows)."""
    if not isinstance(p, DTensor):
        return None
    splitting = [i for i, pl in enumerate(p.placements) if pl.is_shard() and cast(Shard, pl).dim >= p.ndim - 2]
    if len(splitting) != 1 or type(p.placements[splitting[0]]) is not Shard:
        return None
    if any(type(pl) not in (Shard, Replicate) for pl in p.placements):
        return None
    return splitting[0]


class SpreadOrthogonalization:
    """Newton-Schulz of matrices split along one mesh dim (FSDP's, TP's, HSDP's shard dim), spread
    over that dim's ranks instead of repeated on each: every matrix has one owner, the rank least
    loaded so far (by elements) among its group, the same choice on every rank. The owner gathers the
    pieces (cast to `dtype` first, where the iterations start anyway, so the result is the same bits),
    orthogonalizes, and scatters each rank's piece back. Per rank: 1/n of the iterations, and its own
    pieces sent and received once, instead of every matrix gathered whole."""

    def __init__(self, steps: int, dtype: torch.dtype = torch.bfloat16):
        self.steps, self.dtype = steps, dtype
        self.jobs: list[tuple[DTensor, torch.Tensor, int]] = []  # (p, update, mesh dim)
        self.loads: dict[tuple[int, ...], list[int]] = {}

    def add(self, p: DTensor, update: torch.Tensor, dim: int):
        self.jobs.append((p, update, dim))

    def run(self) -> list[torch.Tensor]:
        """Each added update's orthogonalized piece for this rank, in order."""
        plans = []
        for p, update, dim in self.jobs:
            mesh = p.device_mesh
            group, me = mesh.get_group(dim), mesh.get_local_rank(dim)
            ranks = tuple(dist.get_process_group_ranks(group))
            loads = self.loads.setdefault(ranks, [0] * len(ranks))
            owner = min(range(len(ranks)), key=lambda r: (loads[r], r))
            loads[owner] += p.numel()
            split = cast(Shard, p.placements[dim]).dim  # split_mesh_dim found a plain Shard there
            sizes = [len(c) for c in torch.arange(p.shape[split]).chunk(len(ranks))]
            sizes += [0] * (len(ranks) - len(sizes))
            piece = _pad(update.to(self.dtype), split, max(sizes))
            pieces = [torch.empty_like(piece) for _ in ranks] if me == owner else None
            work = cast(dist.Work, dist.gather(piece, pieces, group=group, group_dst=owner, async_op=True))
            # The buffers stay referenced until the collective is waited on: gloo reads and writes
            # them from its own threads.
            plans.append((p, update, split, sizes, group, me, owner, pieces, work, piece))
        # All gathers, then this rank's iterations, then all scatters: the ranks' iterations overlap.
        for *_, work, _ in plans:
            work.wait()
        scatters = []
        for _p, update, split, sizes, group, me, owner, pieces, _, _ in plans:
            if pieces is not None:  # this rank owns the matrix
                full = torch.cat([x.narrow(split, 0, n) for x, n in zip(pieces, sizes)], dim=split)
                ortho = newton_schulz(full, self.steps, self.dtype)
                pieces = [_pad(x, split, max(sizes)) for x in ortho.split(sizes, dim=split)]
            shape = list(update.shape)
            shape[split] = max(sizes)
            mine = update.new_empty(shape, dtype=self.dtype)
            scatters.append(
                (
                    mine,
                    split,
                    sizes[me],
                    cast(dist.Work, dist.scatter(mine, pieces, group=group, group_src=owner, async_op=True)),
                    pieces,
                )
            )
        out = []
        for mine, split, size, work, _ in scatters:
            work.wait()
            out.append(mine.narrow(split, 0, size))
        return out


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`x` zero-padded along `dim` to `size` (gather and scatter take equal pieces)."""
    if x.shape[dim] == size:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


class MuonAdamW(torch.optim.Optimizer):
    """Groups with algorithm "muon" (matrices, or stacks of them) take Muon's step, the others AdamW's.

    Muon's group keys: lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr; AdamW's: lr,
    weight_decay, betas, eps. `implementation` (fused, foreach, for-loop) is the AdamW kernel used with
    float32 state; `state_dtype` the dtype of every state tensor but AdamW's step count; `ns_dtype` the
    dtype of the Newton-Schulz iterations (an attribute, not a group key); `spread`
    spreads the Newton-Schulz of matrices split along one mesh dim over its ranks
    (SpreadOrthogonalization) rather than repeating it on each.
    """

    def __init__(
        self,
        params,
        lr: float,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        momentum: float = DEFAULT_MOMENTUM,
        nesterov: bool = DEFAULT_NESTEROV,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr: str = DEFAULT_ADJUST_LR,
        implementation: str = "for-loop",
        state_dtype: torch.dtype = torch.float32,
        spread: bool = True,
        ns_dtype: torch.dtype = torch.bfloat16,
    ):
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr=adjust_lr,
            algorithm="adamw",
        )
        super().__init__(params, defaults)
        self.implementation, self.state_dtype, self.spread = implementation, state_dtype, spread
        if ns_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"ns_dtype must be torch.bfloat16 or torch.float32, got {ns_dtype}")
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            if group["algorithm"] not in ("muon", "adamw"):
                raise ValueError(f"a group's algorithm must be 'muon' or 'adamw', got {group['algorithm']!r}")
            if group["algorithm"] == "muon" and any(p.ndim < 2 for p in group["params"]):
                raise ValueError("Muon takes matrices (or stacks of them): a 0-D or 1-D parameter belongs to AdamW")

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["algorithm"] == "muon":
                self._muon_step(group, params)
            elif self.state_dtype == torch.float32:
                self._adamw_step(group, params)
            else:
                self._adamw_step_low_precision_state(group, params)
        return loss

    def _state(self, p: torch.Tensor, *names: str) -> list[torch.Tensor]:
        state = self.state[p]
        if not state:
            if "exp_avg" in names:
                # As torch's AdamW keeps it: a float32 scalar on the CPU (on the device when fused).
                fused = self.implementation == "fused" and self.state_dtype == torch.float32
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
            for name in names:
                state[name] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return [state[name] for name in names]

    def _muon_step(self, group: dict, params: list[torch.Tensor]):
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        updates = []
        for p in params:
            (buf,) = self._state(p, "momentum_buffer")
            grad, buf_local = local_part(_grad(p)), local_part(buf)
            momentum = buf_local.float() if buf_local.dtype != torch.float32 else buf_local
            momentum.lerp_(grad.float(), 1 - mu)
            if momentum is not buf_local:
                buf_local.copy_(momentum)
            updates.append(grad.float().lerp(momentum, mu) if group["nesterov"] else momentum)
        spread = SpreadOrthogonalization(group["ns_steps"], self.ns_dtype)
        orthos: list[torch.Tensor | None] = [None] * len(params)
        for i, (p, update) in enumerate(zip(params, updates)):
            dim = split_mesh_dim(p) if self.spread else None
            if dim is None:
                orthos[i] = orthogonalize(update, p, group["ns_steps"], self.ns_dtype)
            else:
                spread.add(cast(DTensor, p), update, dim)  # split_mesh_dim finds a mesh dim of DTensors only
        spread_out = iter(spread.run())
        for p, ortho in zip(params, orthos):
            ortho = next(spread_out) if ortho is None else ortho
            p_local = local_part(p)
            p_local.mul_(1 - lr * wd)
            p_local.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape[-2], p.shape[-1]))

    def _adamw_step(self, group: dict, params: list[torch.Tensor]):
        """torch's AdamW (the kernels torch.optim.AdamW runs with the same settings)."""
        states = [self._state(p, "exp_avg", "exp_avg_sq") for p in params]
        beta1, beta2 = group["betas"]
        torch_adamw(
            params,
            [_grad(p) for p in params],
            [s[0] for s in states],
            [s[1] for s in states],
            [],
            [self.state[p]["step"] for p in params],
            foreach=self.implementation == "foreach",
            fused=self.implementation == "fused",
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _adamw_step_low_precision_state(self, group: dict, params: list[torch.Tensor]):
        """AdamW with its moments stored in state_dtype, computed in float32 (torch's for-loop formula)."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in params:
            exp_avg, exp_avg_sq = self._state(p, "exp_avg", "exp_avg_sq")
            step_t = self.state[p]["step"]
            step_t += 1
            step = step_t.item()
            grad = local_part(_grad(p)).float()
            m, v = local_part(exp_avg).float(), local_part(exp_avg_sq).float()
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            local_part(exp_avg).copy_(m)
            local_part(exp_avg_sq).copy_(v)
            p_local = local_part(p)
            p_local.mul_(1 - lr * wd)
            denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
            p_local.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # step() passes on only the parameters with a gradient
    return p.grad


def state_bytes(optimizers) -> int:
    """Bytes of optimizer state held by this rank (local shards of DTensors)."""
    return sum(
        local_part(t).numel() * local_part(t).element_size()
        for opt in optimizers
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
