"""Worker for test_moe_parallel.py: trains through the real trainer with probes added by subclassing it.

    torchrun --nproc_per_node N tests/distributed/moe_worker.py OUT_DIR TRAINER_ARGS...

Writes to OUT_DIR (rank 0):
- grads.safetensors: the full gradients of the routers and experts at step 1 (before clipping);
- routers.json: for every router weight, the largest difference between tensor-parallel ranks
  after the last step (0 when every rank holds the same router);
- memory.json: this process's resident memory after every step (MiB).
"""

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from torchtitan.components.metrics import setup_logging
from torchtitan.config import load_config
from torchtitan.distributed.process_group import exit_process
from torchtitan.train import Trainer, train


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class Probe(Trainer):
    out: Path

    def optimizer_step(self):
        if not hasattr(self, "first_grads"):
            # full_tensor is a collective: every rank walks the same parameters in the same order.
            self.first_grads = {
                n: full(p.grad).detach().clone()
                for part in self.ctx.parts
                for n, p in part.named_parameters()
                if ("experts" in n or "router" in n) and p.grad is not None
            }
        return super().optimizer_step()

    def checkpoint(self, step: int, stopping: bool = False):
        super().checkpoint(step, stopping)
        self.memory = getattr(self, "memory", []) + [rss_mib()]
        if step < self.cfg.training.steps:
            return
        routers = {}
        for part in self.ctx.parts:
            for n, p in part.named_parameters():
                if "router" not in n:
                    continue
                local = p.to_local() if isinstance(p, DTensor) else p
                if self.dims.tp_enabled:
                    tp = self.ctx.mesh["tp"]
                    copies = [torch.empty_like(local) for _ in range(tp.size())]
                    dist.all_gather(copies, local.detach().contiguous(), group=tp.get_group())
                    routers[n] = max((c - copies[0]).abs().max().item() for c in copies)
                else:
                    routers[n] = 0.0
        if self.rank == 0:
            save_file({k: v.contiguous() for k, v in self.first_grads.items()}, str(self.out / "grads.safetensors"))
            (self.out / "routers.json").write_text(json.dumps(routers))
            (self.out / "memory.json").write_text(json.dumps(self.memory))


if __name__ == "__main__":
    Probe.out = Path(sys.argv[1])
    Probe.out.mkdir(parents=True, exist_ok=True)
    setup_logging()
    train(load_config(sys.argv[2:]), Probe)
    exit_process(0)
