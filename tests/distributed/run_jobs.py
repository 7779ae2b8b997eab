"""Run several training jobs in one launch, sharing one process group (each torchrun launch costs
6-28 s of start-up on a small CPU machine, so tests group their jobs).

    torchrun --nproc_per_node 4 tests/distributed/run_jobs.py jobs.json
    python tests/distributed/run_jobs.py jobs.json        # one process, no process group

jobs.json holds a list of jobs: an argument list as given to `python -m torchtitan.train`, or
{"copy": [src, dst]} to copy a folder (rank 0, then all ranks wait), e.g. to resume from a
checkpoint of an earlier job in a fresh dump folder.
"""

import json
import shutil
import sys
import warnings

import torch.distributed as dist

from torchtitan.components.metrics import setup_logging
from torchtitan.config import load_config
from torchtitan.distributed.process_group import destroy_distributed, exit_process, init_distributed
from torchtitan.train import train

# Warnings the trainer's own code caused once in every run of some families: each fails the launch (and with it the
# parity test of whichever layout brings it back) instead of cluttering the logs again.
OWN_WARNINGS = ("Slicing a flattened dim from root mesh", "Mismatch dtype between input and weight")


def main(path: str):
    with open(path) as f:
        jobs = json.load(f)
    for message in OWN_WARNINGS:
        warnings.filterwarnings("error", message=message)
    setup_logging()
    init_distributed(timeout_seconds=120)
    try:
        for job in jobs:
            if isinstance(job, dict):
                if not dist.is_initialized() or dist.get_rank() == 0:
                    shutil.copytree(*job["copy"])
                if dist.is_initialized():
                    dist.barrier()
            else:
                train(load_config(job))
    except BaseException:
        destroy_distributed(wait_for_peers=False)
        raise
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)
