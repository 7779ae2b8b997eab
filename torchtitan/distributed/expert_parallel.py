"""Expert parallelism: each rank of an `ep` group holds num_experts / ep of every MoE layer's routed
experts, and tokens travel to the rank of their expert and back by all-to-all.

The ep ranks are taken from data-parallel sharding (and context parallel): the dp_shard x cp ranks
of a pipeline stage and tensor-parallel position are split into groups of ep consecutive ranks
(ParallelDims.build_expert_mesh). Each group holds every expert once; FSDP shards an expert's
weights over the groups (mesh "expert_dp"). Under tensor parallel each rank routes its own slice of
the sequence (see TokenLocal), so the all-to-all runs among ranks of the same TP position.

Per MoE layer and micro-batch (torchtitan.models.common.moe.MoE calls the dispatcher with its assignments
sorted by global expert id):
1. the assignment counts are exchanged (all-to-all of a [ep, experts/ep] table), so every rank knows
   how many tokens it receives for each of its experts from each source;
2. the tokens go to their experts' ranks (all-to-all with those counts as splits), are regrouped by
   local expert, run through the local experts, put back in arrival order and returned (the
   reverse all-to-all). Both all-to-alls are differentiated by autograd: the backward of one is the
   other with the splits swapped.

Gradient scale: an expert's weight gradient sums the contributions of the tokens of all ep ranks of
its group, each rank's loss being a mean over its own tokens. Dense weights average those ranks'
gradients (FSDP), experts average only over the groups (FSDP over "expert_dp"), so the experts'
gradients are scaled by 1 / ep to be the same average.
"""

from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from torchtitan.distributed.comms import all_to_all
from torchtitan.models.common.moe import check_expert_layer


class ExpertParallel:
    """The MoE dispatcher for one ep group: call(experts, tokens sorted by expert, counts per expert)."""

    def __init__(self, ep_mesh):
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()

    @torch._dynamo.disable  # data-dependent splits and collectives: eager between compiled graphs
    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        local_experts = counts.numel() // self.size
        sent = counts.view(self.size, local_experts)  # [destination rank, its local expert]
        received = torch.empty_like(sent)  # [source rank, my local expert]
        dist.all_to_all_single(received, sent.contiguous(), group=self.group)
        send_splits, recv_splits = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = all_to_all(x, self.group, send_splits, recv_splits)
        # Arrived in (source, local expert) order; the experts want (local expert, source) order.
        by_expert = _regroup(received)
        out = torch.empty_like(arrived)
        out[by_expert] = experts(arrived[by_expert], received.sum(0))
        return all_to_all(out, self.group, recv_splits, send_splits)


def _regroup(counts: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder blocks laid out [source][expert] (sizes `counts`) into [expert][source]."""
    sources, experts = counts.shape
    starts = (torch.cumsum(counts.flatten(), 0) - counts.flatten()).view(sources, experts)
    blocks = [
        torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e]))
        for e in range(experts)
        for s in range(sources)
    ]
    return torch.cat(blocks).to(counts.device) if blocks else counts.new_zeros(0)


def apply_ep(moe_layers: list[nn.Module], expert_mesh, tp: int) -> list[nn.Module]:
    """Split the routed experts of each MoE layer (the spec's expert_layers, each with the interface
    of torchtitan.models.common.moe's "Experts as expert parallel sees them") over the "ep"
    dimension of `expert_mesh` (weights become DTensors sharded on the expert dim, replicated over
    tensor-parallel ranks) and route their tokens through ExpertParallel. Returns the experts
    modules, for FSDP over "expert_dp". Apply before tensor parallel (which replicates what remains)
    and FSDP."""
    ep_mesh = expert_mesh["ep"]
    mesh, placements = (expert_mesh["ep", "tp"], [Shard(0), Replicate()]) if tp > 1 else (ep_mesh, [Shard(0)])
    dispatcher = ExpertParallel(ep_mesh)
    experts_modules = []
    for moe in moe_layers:
        check_expert_layer(moe)  # experts: a module with an int num_experts
        experts = cast(nn.Module, moe.experts)
        num_experts = cast(int, experts.num_experts)
        if num_experts % ep_mesh.size():
            raise ValueError(f"{num_experts} experts cannot be split over {ep_mesh.size()} ranks")
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements)))
        experts.grad_scale = 1.0 / ep_mesh.size()
        moe.dispatcher = dispatcher  # pyrefly: ignore[bad-argument-type]  # torch types Module.__setattr__'s value Tensor | Module; it takes any
        experts_modules.append(experts)
    return experts_modules
