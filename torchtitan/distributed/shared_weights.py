"""Weights shared by modules on different pipeline stages (tied input embedding and output layer).

A pipeline split gives each stage its own copy of such a weight, so the copies are kept equal by
hand, as one weight would be:
- at start, every copy takes the value of the copy on the lowest stage (its "canonical" name is the
  name that copy has, the one the whole model's `named_parameters` gives);
- after each backward, the copies' gradients are summed over the ranks that hold them (the
  gradient of a shared weight is the sum of its uses'), so every copy gets the same gradient, the
  same optimizer state and the same update;
- the gradient norm counts the weight once (only the canonical copy);
- a checkpoint stores the optimizer state of every copy under the canonical name, as the unsplit
  model's optimizer does, so a checkpoint reshards between pipelined and unpipelined layouts.

The copies have the same global shape and, under FSDP and TP, the same placements (the embedding
and the output layer both shard the vocabulary rows), so their local shards line up element for
element and one all-reduce of the local gradients suffices. The ranks that hold copies of one weight
differ only in their pipeline coordinate; a process group per such set of ranks carries the sums.
"""

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from torchtitan.models.common.init import local_part


@dataclass
class _Copies:
    """One shared weight on this rank: its copies (model part index, name), the canonical name, and
    the group of ranks that hold copies (None: every copy is on this rank)."""

    canonical: str
    copies: list[tuple[int, str]]
    holds_canonical: bool
    group: ProcessGroup | None = None
    canonical_group_rank: int = 0


@dataclass
class SharedWeights:
    """This rank's copies of weights shared across pipeline stages; empty when there are none."""

    parts: list[nn.Module] = field(default_factory=list)
    weights: list[_Copies] = field(default_factory=list)

    def _param(self, part: int, name: str) -> nn.Parameter:
        return self.parts[part].get_parameter(name)

    @torch.no_grad()
    def copy_canonical_values(self):
        """Give every copy the canonical copy's value (after initialization)."""
        for w in self.weights:
            params = [self._param(i, n) for i, n in w.copies]
            source = local_part(params[0]) if w.holds_canonical else None
            if w.group is not None:
                buf = local_part(params[0]).clone() if source is None else source.clone()
                dist.broadcast(buf, group=w.group, group_src=w.canonical_group_rank)
                source = buf
            # Without a group every copy is on this rank, the canonical one included.
            assert source is not None
            for p in params:
                if local_part(p) is not source:
                    local_part(p).copy_(source)

    @torch.no_grad()
    def sum_gradients(self):
        """Replace each copy's gradient by the sum of all copies' (before clipping)."""
        for w in self.weights:
            params = [self._param(i, n) for i, n in w.copies]
            grads = [local_part(p.grad) for p in params if p.grad is not None]
            if len(grads) != len(params):  # a stage that did not use its copy this step
                grads = []
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grads.append(local_part(p.grad))
            total = grads[0].clone() if len(grads) > 1 else grads[0]
            for g in grads[1:]:
                total.add_(g)
            if w.group is not None:
                dist.all_reduce(total, group=w.group)
            for g in grads:
                if g is not total:
                    g.copy_(total)

    def duplicates(self) -> list[nn.Parameter]:
        """The copies the gradient norm leaves out (all but the canonical one)."""
        out = []
        for w in self.weights:
            for k, (i, n) in enumerate(w.copies):
                if not (w.holds_canonical and k == 0):
                    out.append(self._param(i, n))
        return out

    def checkpoint_names(self) -> list[dict[str, str]]:
        """Per model part, {name of a copy: the canonical name} for copies that are not canonical:
        the name their optimizer state is saved and loaded under."""
        names: list[dict[str, str]] = [{} for _ in self.parts]
        for w in self.weights:
            for i, n in w.copies:
                if n != w.canonical:
                    names[i][n] = w.canonical
        return names


def build_shared_weights(
    ties: list[dict[int, str]], parts: list[nn.Module], stage_ids: list[int], rank_of_stage, mesh
) -> SharedWeights:
    """This rank's SharedWeights. `ties`: for each shared weight, {stage id: its name there}, the same
    list on every rank (pipeline_parallel.shared_weights); `rank_of_stage(stage id)` is the pp rank
    holding that stage; `mesh` the world mesh with a "pp" dimension. Every rank must call this (it
    creates process groups), in the same order."""
    shared = SharedWeights(parts=parts)
    if not ties:
        return shared
    pp_dim = mesh.mesh_dim_names.index("pp")
    ranks = mesh.mesh.movedim(pp_dim, 0)  # [pp, everything else]
    my_pp = mesh["pp"].get_local_rank()
    for tie in ties:
        stages = sorted(tie)
        canonical = tie[stages[0]]
        pp_ranks = sorted({rank_of_stage(s) for s in stages})
        group, canonical_group_rank = None, 0
        if len(pp_ranks) > 1:
            # One group per coordinate outside pp; every rank takes part in creating all of them.
            members = ranks[pp_ranks].reshape(len(pp_ranks), -1).T.tolist()
            mine, _ = dist.new_subgroups_by_enumeration(members)
            # Every rank is in one of the groups: `mine` is a ProcessGroup (torch's type also allows
            # the marker of a rank in none).
            group = cast(ProcessGroup, mine) if my_pp in pp_ranks else None
            canonical_group_rank = pp_ranks.index(rank_of_stage(stages[0]))
        copies = [(stage_ids.index(s), tie[s]) for s in stages if s in stage_ids]
        if copies:
            shared.weights.append(_Copies(canonical, copies, stages[0] in stage_ids, group, canonical_group_rank))
    return shared
