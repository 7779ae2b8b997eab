"""Choose a parallel layout before launching: every layout of a recipe at a world size, with its
memory per rank and estimated step time, ranked; the best written as a recipe.

    python scripts/plan.py --job.config_file RECIPE --ngpu 512 --gpus_per_node 8 --gpu_memory_gib 80 \\
        [--output best.toml] [--top 20] [--no-simulate] [--peak_tflops T] [--efficiency E] \\
        [--intra_node_gbps B] [--inter_node_gbps B] [--device cuda|cpu] [any --section.key override]

Prints a table of the layouts that fit (fastest first): layout, activation checkpointing, micro-batch,
the memory terms per rank in GiB, step time, tokens/s per device and MFU. Then the best layout is
applied for real over a fake process group of the target world size, one rank per pipeline rank, to
prove the plan valid (--no-simulate skips it); its per-rank parameter counts must equal the estimate's.
--output writes it as a recipe run_train.sh takes as it is. When nothing fits, it says what the smallest
layout needs and exits 2. --device cpu plans for CPU processes on this machine (gloo), where
--gpu_memory_gib is the host memory per process.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan.config import UserError  # noqa: E402


def parse(argv: list[str]):
    p = argparse.ArgumentParser(description="Choose a parallel layout before launching.", allow_abbrev=False)
    p.add_argument("--ngpu", type=int, required=True, help="world size: devices (or CPU processes) in all")
    p.add_argument("--gpus_per_node", type=int, default=8)
    p.add_argument("--gpu_memory_gib", type=float, required=True, help="memory of one device (CPU: per process)")
    p.add_argument("--output", default=None, help="write the best layout as a TOML recipe here")
    p.add_argument("--top", type=int, default=20, help="rows of the table")
    p.add_argument("--no-simulate", dest="simulate", action="store_false")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--peak_tflops", type=float, default=0, help="per device (default: H100/H200 989; CPU: measured)")
    p.add_argument("--efficiency", type=float, default=0, help="fraction of the peak reached (default 0.40 on CUDA)")
    p.add_argument("--intra_node_gbps", type=float, default=0, help="GB/s per device within a node (default 450)")
    p.add_argument("--inter_node_gbps", type=float, default=0, help="GB/s per device across nodes (default 50)")
    return p.parse_known_args(argv)


def run(argv: list[str]) -> int:
    import dataclasses

    from torchtitan.config import load_config
    from torchtitan.planner.memory import GiB
    from torchtitan.planner.plan import default_hardware, explain, plan, table, write_recipe

    start = time.perf_counter()
    opts, rest = parse(argv)
    if opts.ngpu < 1 or opts.gpus_per_node < 1 or opts.gpu_memory_gib <= 0:
        raise UserError("--ngpu and --gpus_per_node must be positive integers and --gpu_memory_gib a positive number")
    if opts.output and os.path.exists(opts.output):
        raise UserError(f"--output {opts.output} exists; choose a new path (the planner does not overwrite a recipe)")
    cfg = load_config(rest)
    hw = default_hardware(opts.device, opts.gpus_per_node, cfg)
    hw = dataclasses.replace(
        hw, **{k: v for k, v in (("peak_flops", opts.peak_tflops * 1e12), ("efficiency", opts.efficiency),
                                 ("intra_node_bandwidth", opts.intra_node_gbps * 1e9),
                                 ("inter_node_bandwidth", opts.inter_node_gbps * 1e9)) if v > 0})
    memory = opts.gpu_memory_gib * GiB
    fits, too_big = plan(cfg, opts.ngpu, opts.gpus_per_node, memory, opts.device, hw)
    print(f"{cfg.model.name} {cfg.model.flavor}, seq_len {cfg.training.seq_len}, on {opts.ngpu} devices of "
          f"{opts.gpu_memory_gib:g} GiB ({opts.gpus_per_node} per node); peak {hw.peak_flops / 1e12:.1f} TFLOP/s x "
          f"efficiency {hw.efficiency:.2f}; {len(fits)} of {len(fits) + len(too_big)} layouts fit")
    if not fits:
        smallest = too_big[0] if too_big else None
        need = f"; the smallest needs {smallest.memory.total / GiB:.2f} GiB per rank ({smallest.layout()} with AC " \
               f"{smallest.ac()}, largest term {smallest.memory.largest()})" if smallest else ""
        raise UserError(f"no layout of {cfg.model.name} {cfg.model.flavor} fits {opts.gpu_memory_gib:g} GiB per "
                        f"device on {opts.ngpu} devices{need}; use more or larger devices, or a shorter seq_len")
    print(table(fits, opts.top))
    if too_big:
        print(explain(too_big[0], memory) if too_big[0].step_time < fits[0].step_time else
              f"(the fastest layouts fit; {len(too_big)} others do not)")
    best = fits[0]
    if opts.simulate:
        from torchtitan.planner.plan import check_by_simulation

        took, ranks = check_by_simulation(best)
        print(f"simulated {best.layout()} on a fake process group of {opts.ngpu} ranks ({ranks} of its {best.dims.pp} "
              f"pipeline rank(s): one per distinct stage, {took:.1f} s): every parameter shard equals the estimate's")
    if opts.output:
        write_recipe(best, opts.output)
        print(f"wrote {opts.output}: NGPU={opts.ngpu} CONFIG_FILE={opts.output} ./run_train.sh")
    print(f"planned in {time.perf_counter() - start:.1f} s")
    return 0


def main() -> int:
    from torchtitan.config import HelpRequested

    try:
        return run(sys.argv[1:])
    except HelpRequested as h:
        print(h.text)
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
