"""Check a job before launching it: config, parallel degrees against WORLD_SIZE, model, tokenizer
and dataset, with no process group. The launcher (torchtitan/launch.py, which run_train.sh runs)
calls `check` in its own process before starting any worker, so that a mistake is reported in about
a second, once, instead of by every rank after the workers have started.

    WORLD_SIZE=4 python -m torchtitan.preflight --job.config_file train_configs/debug_model.toml

Exit status: 0 the job can start, 2 a user mistake (one line on stderr), 3 --help was printed.
"""

import os
import sys

from torchtitan.config import JobConfig, load_config
from torchtitan.config.errors import UserError, run_main


def check(argv: list[str], world_size: int, check_lock: bool = True) -> JobConfig:
    """The resolved config of a job that can start on `world_size` processes. Raises UserError (a
    mistake) or HelpRequested. `check_lock`: refuse a dump folder that a live run holds; only where
    no worker of this job can hold it yet (one node, or node rank 0 of several: the others may start
    after this job's rank 0 took the lock)."""
    cfg = load_config(argv)
    from torchtitan.components.data import build_dataloader
    from torchtitan.components.run_lock import refuse_if_locked
    from torchtitan.components.tokenizer import Tokenizer
    from torchtitan.train import preflight

    plan = preflight(cfg, world_size)
    if plan.memory_estimate:
        print(plan.memory_estimate, flush=True)
    if check_lock:
        refuse_if_locked(cfg.job.dump_folder)
    # Opening the data source as rank 0 finds a missing path or an empty dataset.
    build_dataloader(cfg.training, Tokenizer(cfg.model.tokenizer_path), 0, plan.parallel_dims.dp_degree,
                     plan.global_batch_size)
    return cfg


def main(argv: list[str]) -> int:
    def run() -> None:
        text = os.environ.get("WORLD_SIZE", "1")
        if not text.isdigit() or int(text) < 1:
            raise UserError(f"WORLD_SIZE={text!r} must be the number of processes of the job, 1 or more")
        check(argv, int(text))

    return run_main(run, help_status=3)  # --help is not an error, but there is nothing to launch


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
