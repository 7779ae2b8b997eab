"""Run several training jobs in one launch, sharing one process group (each torchrun launch costs
6-28 s of start-up on a small CPU machine, so tests group their jobs).

    torchrun --nproc_per_node 4 tests/distributed/run_jobs.py jobs.json
    python tests/distributed/run_jobs.py jobs.json        # one process, no process group

jobs.json holds a list of argument lists, each as given to `python -m torchtitan.train`.
"""

import json
import sys

from torchtitan.config import load_config
from torchtitan.distributed.utils import destroy_distributed, init_distributed
from torchtitan.train import setup_logging, train


def main(path: str):
    with open(path) as f:
        jobs = json.load(f)
    setup_logging()
    init_distributed(timeout_seconds=120)
    try:
        for argv in jobs:
            train(load_config(argv))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
