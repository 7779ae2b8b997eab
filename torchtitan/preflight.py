"""Check a job before launching it: config, parallel degrees against WORLD_SIZE, model, tokenizer
and dataset, with no process group. run_train.sh calls this so that a mistake is reported in about
a second, once, instead of by every rank after torchrun has started them.

    WORLD_SIZE=4 python -m torchtitan.preflight --job.config_file train_configs/debug_model.toml
"""

import os
import sys

from torchtitan.config import HelpRequested, UserError, load_config


def main(argv: list[str]) -> int:
    try:
        cfg = load_config(argv)
        from torchtitan.components.data import build_dataloader
        from torchtitan.components.tokenizer import Tokenizer
        from torchtitan.train import preflight

        from torchtitan.components.run_lock import refuse_if_locked

        plan = preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        refuse_if_locked(cfg.job.dump_folder)
        # Opening the data source as rank 0 finds a missing path or an empty dataset.
        build_dataloader(cfg.training, Tokenizer(cfg.model.tokenizer_path), 0, plan.parallel_dims.dp_degree,
                         plan.global_batch_size)
    except HelpRequested as h:
        print(h.text)
        return 3  # not an error, but nothing to launch
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
