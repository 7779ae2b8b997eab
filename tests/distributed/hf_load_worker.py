"""Worker for test_hf_sharded.py's reads: Hugging Face folders loaded into each rank's shards.

    torchrun --nproc_per_node N tests/distributed/hf_load_worker.py CASES.json OUT.json

CASES.json: [{"name", "folder", "argv": config argv (model and parallelism)}]. For each case every rank
builds the model on meta, parallelizes it as the trainer does, fills it with NaN, loads the folder
with load_hf_into, and compares each local tensor with its part of the folder's tensor read whole
(load_hf); then exports them in bf16 (save_hf_sharded), which rank 0 reads back. Rank 0 writes
OUT.json: {name: one record per rank: bytes_read, own_bytes (its local tensors that have Hugging Face
sources, each storage once, at 4 bytes an element: the folders are float32), folder_bytes, mismatches
(names), export_differs (names whose exported tensor is not the folder's cast to bf16, on rank 0),
exported (tensors compared, on rank 0)}.
"""

import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.components.checkpoint import HFFolder, load_hf, load_hf_into, meta_shapes, save_hf_sharded
from torchtitan.config import load_config
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_model
from torchtitan.distributed.process_group import destroy_distributed, exit_process
from torchtitan.models.common.spec import ParallelizeInputs
from torchtitan.models.registry import get_model_spec


def load_case(folder: str, argv: list[str], case_index: int) -> dict:
    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    whole, args = load_hf(folder, spec.hf)
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    expert_mesh = dims.build_expert_mesh("cpu") if dims.ep > 1 else None
    with torch.device("meta"):
        model = spec.model_cls(args)
    inputs = ParallelizeInputs(dims, mesh, cfg.parallelism, cfg.training, cfg.activation_checkpoint, expert_mesh)
    model = parallelize_model(model, inputs, spec).to_empty(device="cpu")
    held = model.state_dict()
    with torch.no_grad():
        for t in held.values():
            (t.to_local() if isinstance(t, DTensor) else t).fill_(float("nan"))
    figures = load_hf_into([model], folder, spec.hf, args, meta_shapes(spec, args))
    present = frozenset(HFFolder(folder).shapes)
    mismatches, own, counted = [], 0, set()
    for name, t in held.items():
        expected = whole[name].to(t.dtype)
        if isinstance(t, DTensor):
            expected = distribute_tensor(expected, t.device_mesh, t.placements, src_data_rank=None).to_local()
            t = t.to_local()
        if not torch.equal(t, expected):
            mismatches.append(name)
        sources = tuple(spec.hf.hf_names(name, args, present))
        if sources and (t.data_ptr(), sources) not in counted:  # a tied output layer is the embedding
            counted.add((t.data_ptr(), sources))
            own += t.numel() * 4
    # Export again in bf16 from these shards: the folder's tensors cast to bf16, bit for bit.
    out = Path(folder).with_name(f"{Path(folder).name}_export_{case_index}")
    save_hf_sharded(out, [model], spec.hf, args, meta_shapes(spec, args), torch.bfloat16, mesh, 2**20)
    exported = {}
    if dist.get_rank() == 0:
        back, _ = load_hf(out, spec.hf)
        exported = {name: torch.equal(back[name], whole[name].to(torch.bfloat16)) for name in whole}
        shutil.rmtree(out)
    return {
        "bytes_read": figures["bytes_read"],
        "own_bytes": own,
        "folder_bytes": figures["folder_bytes"],
        "mismatches": mismatches,
        "export_differs": [n for n, same in exported.items() if not same],
        "exported": len(exported),
    }


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    out = {}
    with open(sys.argv[1]) as f:
        cases = json.loads(f.read())
    for i, case in enumerate(cases):
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, load_case(case["folder"], case["argv"], i))
        out[case["name"]] = records
    if dist.get_rank() == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(out, f)
    destroy_distributed()
    exit_process(0)
