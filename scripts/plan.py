"""Choose a parallel layout before launching: every layout of a recipe at a world size, with its
memory per rank and estimated step time, ranked; the best written as a recipe.

    python scripts/plan.py --job.config_file RECIPE --ngpu 512 --gpus_per_node 8 --gpu_memory_gib 80 \\
        [--output best.toml] [--top 20] [--no-simulate] [--peak_tflops T] [--efficiency E] \\
        [--intra_node_gbps B] [--inter_node_gbps B] [--device cuda|cpu] [--markdown] [any --section.key override]

Prints a table of the layouts that fit (fastest first): layout, activation checkpointing, micro-batch,
the memory terms per rank in GiB, step time, tokens/s per device and MFU. Every layout in it (and the
one written) is one the trainer accepts: the planner checks each, fastest first, as run_train.sh would
(the config rules and torchtitan.preflight, judged for --device), leaves out those it refuses
and says why. Then the best layout is applied for real over a fake process group of the target world
size, one rank per pipeline rank, to prove the plan valid (--no-simulate skips it); its per-rank
parameter counts must equal the estimate's. --output writes it as a recipe run_train.sh takes as it is
(a new file in an existing folder, checked before planning). When nothing fits, it says what the
smallest layout needs and exits 2. --device cpu plans for CPU processes on this machine (gloo), where
--gpu_memory_gib is the host memory per process. --ngpu is a whole number of nodes of
--gpus_per_node (or part of one node). Mistakes: one line on stderr, exit status 2. --markdown also
prints the planner's run as a row of docs/benchmarks.md's table, with the command, commit, machine and date.
"""

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan.config.errors import ArgumentParser, UserError, check_output_path, run_main  # noqa: E402


def parse(argv: list[str]):
    p = ArgumentParser(description="Choose a parallel layout before launching.", allow_abbrev=False)
    p.add_argument(
        "--ngpu", type=int, required=True, help="world size: devices (or CPU processes) in all, a whole number of nodes"
    )
    p.add_argument("--gpus_per_node", type=int, default=8)
    p.add_argument("--gpu_memory_gib", type=float, required=True, help="memory of one device (CPU: per process)")
    p.add_argument(
        "--output", default=None, help="write the best layout as a TOML recipe here (a new file in an existing folder)"
    )
    p.add_argument("--top", type=int, default=20, help="rows of the table")
    p.add_argument("--no-simulate", dest="simulate", action="store_false")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--peak_tflops", type=float, default=0, help="per device (default: H100/H200 989; CPU: measured)")
    p.add_argument(
        "--efficiency", type=float, default=0, help="fraction of the peak reached, in (0, 1] (default 0.40 on CUDA)"
    )
    p.add_argument("--intra_node_gbps", type=float, default=0, help="GB/s per device within a node (default 450)")
    p.add_argument("--inter_node_gbps", type=float, default=0, help="GB/s per device across nodes (default 50)")
    p.add_argument("--markdown", action="store_true", help="also print the run as a row of docs/benchmarks.md")
    opts, rest = p.parse_known_args(argv)
    check_options(opts)
    return opts, rest


def check_options(opts) -> None:
    """The numbers and the output path, before anything is planned."""
    if opts.ngpu < 1 or opts.gpus_per_node < 1:
        raise UserError(f"--ngpu ({opts.ngpu}) and --gpus_per_node ({opts.gpus_per_node}) must be 1 or more")
    if not (math.isfinite(opts.gpu_memory_gib) and opts.gpu_memory_gib > 0):
        raise UserError(f"--gpu_memory_gib must be a positive number of GiB, got {opts.gpu_memory_gib}")
    if opts.top < 1:
        raise UserError(f"--top must be 1 or more (rows of the table), got {opts.top}")
    for name in ("peak_tflops", "intra_node_gbps", "inter_node_gbps"):
        value = getattr(opts, name)
        if not (math.isfinite(value) and value >= 0):
            raise UserError(f"--{name} must be a positive number (0: the default), got {value}")
    if not (math.isfinite(opts.efficiency) and 0 <= opts.efficiency <= 1):
        raise UserError(
            f"--efficiency is the fraction of the peak reached, in (0, 1] (0: the default), got {opts.efficiency}"
        )
    if opts.output:
        check_output_path(opts.output, "--output", create_parents=False)
    from torchtitan.planner.search import check_world  # imports torch: after the checks that need nothing

    check_world(opts.ngpu, opts.gpus_per_node)


def run(argv: list[str]) -> int:
    opts, rest = parse(argv)  # before the imports: a mistake in the options costs nothing
    import dataclasses

    from torchtitan.config import load_config
    from torchtitan.planner.memory import GiB
    from torchtitan.planner.search import default_hardware, explain, rank_layouts, refusals, table, write_recipe

    start = time.perf_counter()
    cfg = load_config(rest)
    hw = default_hardware(opts.device, opts.gpus_per_node, cfg)
    hw = dataclasses.replace(
        hw,
        **{
            k: v
            for k, v in (
                ("peak_flops", opts.peak_tflops * 1e12),
                ("efficiency", opts.efficiency),
                ("intra_node_bandwidth", opts.intra_node_gbps * 1e9),
                ("inter_node_bandwidth", opts.inter_node_gbps * 1e9),
            )
            if v > 0
        },
    )
    memory = opts.gpu_memory_gib * GiB
    ranking = rank_layouts(cfg, opts.ngpu, opts.gpus_per_node, memory, opts.device, hw, keep=opts.top)
    fits, smallest = ranking.fits, ranking.smallest
    # A CPU peak measured now moves with the host's load: the times built on it only rank the layouts.
    measured = opts.device == "cpu" and not opts.peak_tflops and not cfg.metrics.device_peak_tflops
    caveat = (
        " (measured now on this host's CPU: it moves with the load, so the step times, tokens/s and MFU "
        "below rank the layouts against each other and do not predict a run's)"
        if measured
        else ""
    )
    print(
        f"{cfg.model.name} {cfg.model.flavor}, seq_len {cfg.training.seq_len}, on {opts.ngpu} devices of "
        f"{opts.gpu_memory_gib:g} GiB ({opts.gpus_per_node} per node); peak {hw.peak_flops / 1e12:.3g} TFLOP/s"
        f"{caveat} x efficiency {hw.efficiency:.2f}; {ranking.fitting} of {ranking.searched} layouts fit"
    )
    if ranking.refused:
        print(
            f"the trainer's preflight refused {sum(map(len, ranking.refused.values()))} of the layouts checked "
            f"(fastest first), left out:\n{refusals(ranking.refused)}"
        )
    if not fits:
        if smallest is None and ranking.refused:
            why, layouts = max(ranking.refused.items(), key=lambda item: len(item[1]))
            raise UserError(
                f"the trainer refuses every layout of {cfg.model.name} {cfg.model.flavor} on {opts.ngpu} "
                f"devices, e.g. {layouts[0]}: {why}"
            )
        need = (
            f"; the smallest needs {smallest.memory.total / GiB:.2f} GiB per rank ({smallest.layout()} with AC "
            f"{smallest.ac()}, largest term {smallest.memory.largest()})"
            if smallest
            else ""
        )
        raise UserError(
            f"no layout of {cfg.model.name} {cfg.model.flavor} fits {opts.gpu_memory_gib:g} GiB per "
            f"device on {opts.ngpu} devices{need}; use more or larger devices, or a shorter seq_len"
        )
    print(table(fits, opts.top))
    if smallest is not None:
        print(
            explain(smallest, memory)
            if smallest.step_time < fits[0].step_time
            else f"(the fastest layouts fit; {ranking.searched - ranking.fitting} others do not)"
        )
    best = fits[0]
    simulated = "none"
    if opts.simulate:
        from torchtitan.planner.search import check_by_simulation

        took, ranks = check_by_simulation(best)
        simulated = f"{ranks} of {best.dims.pp}"
        print(
            f"simulated {best.layout()} on a fake process group of {opts.ngpu} ranks ({ranks} of its {best.dims.pp} "
            f"pipeline rank(s): one per distinct stage, {took:.1f} s): every parameter shard equals the estimate's"
        )
    if opts.output:
        write_recipe(best, opts.output, opts.device)
        nodes = opts.ngpu // opts.gpus_per_node
        where = f" on each of the {nodes} nodes (NNODES={nodes}, RDZV_ENDPOINT: docs/launching.md)" if nodes > 1 else ""
        print(f"wrote {opts.output}: NGPU={opts.gpus_per_node} CONFIG_FILE={opts.output} ./run_train.sh{where}")
    elapsed = time.perf_counter() - start
    print(f"planned in {elapsed:.1f} s")
    if opts.markdown:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/benchmark_table.py
        import benchmark_table

        columns = ["model", "devices", "layouts searched", "pipeline ranks simulated", "planned in s"]
        model = f"{cfg.model.name} {cfg.model.flavor}, seq {cfg.training.seq_len}"
        cells = [
            model,
            f"{opts.ngpu} x {opts.gpu_memory_gib:g} GiB",
            f"{ranking.searched:,}",
            simulated,
            f"{elapsed:.1f}",
        ]
        benchmark_table.print_rows(columns, [cells], argv, __file__)
    return 0


def main(argv: list[str]) -> int:
    """The exit status: 0 planned, 2 a mistake or nothing fits (one line on stderr)."""
    return run_main(run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
