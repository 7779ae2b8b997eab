"""What a checkpoint holds of a live run (model parts, optimizers, LR schedules, data loader,
counters, RNG states), and how it is collected and written."""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from torchtitan.components.checkpoint.folders import Peers
from torchtitan.components.checkpoint.storage import train_state_record, write_checksums, write_rng, write_train_state
from torchtitan.distributed.dtypes import DTYPES


@dataclass
class RunState:
    # Several parts when a rank holds several pipeline stages; each keeps full-model parameter names.
    parts: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    lr_schedulers: list
    dataloader: Any
    model_info: dict
    peers: Peers
    counters: dict[str, int] = field(default_factory=dict)  # the run's running totals, saved and restored with it
    rng_source: tuple[str, dict] | None = None  # (path, train_state) of a loaded checkpoint whose RNG states are due

    def model_sds(self) -> list[dict]:
        return [get_model_state_dict(part) for part in self.parts]

    def optim_sds(self) -> list[dict]:
        return [get_optimizer_state_dict(part, opt) for part, opt in zip(self.parts, self.optimizers)]

    def optim_state_to_store(self, optim_sds: list[dict]) -> dict:
        """The parts' optimizer states in one dict, each under its stored name: a copy of a weight
        shared across pipeline stages under the weight's canonical name (distributed.shared_weights),
        as an unsplit model stores it. Copies on one rank collapse into one entry (equal values)."""
        names = self.model_info.get("optimizer_names") or [{} for _ in optim_sds]
        return {renames.get(k, k): v for sd, renames in zip(optim_sds, names) for k, v in sd["state"].items()}

    def share_loaded_optim_state(self, optim_sds: list[dict], loaded: dict):
        """After a load into `loaded` (from optim_state_to_store): a copy whose entry collapsed into
        another's gets its own clone of the loaded values (optimizers must not share state tensors)."""
        names = self.model_info.get("optimizer_names") or [{} for _ in optim_sds]
        for sd, renames in zip(optim_sds, names):
            for k, v in list(sd["state"].items()):
                source = loaded[renames.get(k, k)]
                if source is not v:
                    sd["state"][k] = {
                        name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in source.items()
                    }

    def state_dict(self, model_only: bool, export_dtype: str) -> dict:
        """What DCP writes: the model (in export_dtype when model-only), and the optimizer's state."""
        model_sd = {k: v for sd in self.model_sds() for k, v in sd.items()}
        if model_only:
            dtype = DTYPES[export_dtype]
            model_sd = {k: v.to(dtype) for k, v in model_sd.items()}
            return {"model": model_sd}
        optim_state = self.optim_state_to_store(self.optim_sds())
        return {"model": model_sd, "optimizer": {"state": optim_state}}

    def train_state(self, step: int, tokens: int, model_only: bool, export_dtype: str) -> dict:
        sched = {k: v for k, v in self.lr_schedulers[0].state_dict().items() if k != "lr_lambdas"}
        # Each group's lr multiplier, so that a load can take the unmultiplied schedule from any group.
        sched["lr_mults"] = [g.get("lr_mult", 1.0) for g in self.optimizers[0].param_groups]
        return train_state_record(
            step=step,
            tokens=tokens,
            model_only=model_only,
            world_size=self.peers.world_size,
            model={k: self.model_info[k] for k in ("name", "flavor", "args")},
            dtype=export_dtype if model_only else "float32",
            optimizer_lrs=[g["lr"] for g in self.optimizers[0].param_groups],
            lr_scheduler=sched,
            dataloader=self.dataloader.state_dict(),
            counters=dict(self.counters),
        )

    def write(self, partial: str, state: dict, train_state: dict, model_only: bool):
        """Write this rank's share of a checkpoint into `partial`, all at once."""
        dcp.save(state, checkpoint_id=partial, no_dist=not self.peers.distributed)
        self.write_side_files(partial, train_state, model_only)
        write_checksums(partial, self.peers.rank)

    def write_side_files(self, partial: str, train_state: dict, model_only: bool):
        """What DCP does not write: this rank's RNG states (unless model-only) and, on rank 0, train_state.json."""
        if not model_only:
            rng = {"cpu": torch.get_rng_state()}
            if self.peers.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.peers.device)
            write_rng(partial, self.peers.rank, rng)
        if self.peers.rank == 0:
            write_train_state(partial, train_state)
