"""The planner's memory and step-time estimates against measured runs on this machine.

    python scripts/validate_memory_estimate.py [--only NAME,...] [--terms] [--allocated-only] [--markdown]
        [--section.key value ...]

(--section.key value: a training option for every layout, after the layout's own; e.g.
--training.mixed_precision_param float32 runs every row in float32, for a CPU without native bf16.)

For each layout of LAYOUTS (small flavors, up to 4 processes) it trains 6 steps with torchrun twice:
- under PyTorch's profiler, whose allocation events give the most bytes the CPU allocator held at
  once on each rank (what torch.cuda.max_memory_allocated counts on GPU);
- without it, for the peak resident memory above what the process held just before it built the
  model (the kernel's VmHWM, restarted there) and the median step time after the first two steps.
It prints, per layout, the planner's estimate for the same config (torchtitan.planner; its terms
before the allocator's fragmentation factor) against the largest rank's allocated peak, the error,
the resident peak, and the estimated step time against the measured one. --markdown also prints the rows
of docs/benchmarks.md's table (the model first), with the command, commit, machine and date.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from torchtitan.config.errors import ArgumentParser, UserError, run_main  # noqa: E402

BASE = [
    "--training.steps",
    "6",
    "--metrics.log_freq",
    "1",
    "--training.seq_len",
    "512",
    "--training.local_batch_size",
    "4",
    "--checkpoint.no-enable_checkpoint",
    "--validation.no-enabled",
    "--training.mixed_precision_param",
    "bfloat16",
]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
DSV3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
LONG = ["--training.seq_len", "2048", "--training.local_batch_size", "1"]
# (name, processes, overrides). bf16 under FSDP's policy (bf16 parameters for compute) where FSDP
# shards; without it under autocast over float32 parameters (single, tp2, pp2_1f1b); single_fp32 in
# float32.
LAYOUTS = [
    ("single_fp32", 1, ["--training.mixed_precision_param", "float32"]),
    ("single", 1, []),
    ("tp2", 2, ["--parallelism.tensor_parallel_degree", "2"]),
    ("pp2_1f1b", 2, PP2 + ["--parallelism.pipeline_parallel_schedule", "1F1B"]),
    ("fsdp2", 2, []),
    ("fsdp4", 4, []),
    (
        "hsdp2x2",
        4,
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    ),
    ("fsdp2_tp2", 4, ["--parallelism.tensor_parallel_degree", "2"]),
    ("fsdp2_pp2_1f1b", 4, PP2 + ["--parallelism.pipeline_parallel_schedule", "1F1B"]),
    ("fsdp2_pp2_zbv", 4, PP2 + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    ("cp2", 2, ["--parallelism.context_parallel_degree", "2"]),
    ("cp2_rotating", 2, CP2 + ["--parallelism.context_parallel_rotate_method", "alltoall"]),
    ("cp2_ulysses", 2, CP2 + ["--parallelism.context_parallel_method", "ulysses"]),
    # Longer sequences, where the methods' attention tensors weigh: one sequence of 2,048 tokens.
    ("cp2_2k", 2, CP2 + LONG),
    ("cp2_2k_rotating", 2, CP2 + LONG + ["--parallelism.context_parallel_rotate_method", "alltoall"]),
    ("cp2_2k_ulysses", 2, CP2 + LONG + ["--parallelism.context_parallel_method", "ulysses"]),
    ("ep2", 2, MOE + ["--parallelism.expert_parallel_degree", "2"]),
    ("fsdp2_full_ac", 2, ["--activation_checkpoint.mode", "full"]),
    (
        "fsdp2_op_ac",
        2,
        ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    ),
    ("fsdp2_accum2", 2, ["--training.global_batch_size", "16"]),
    # Emulated: this CPU has no float8 matmul kernel (oneDNN's reference one takes about 1 s for
    # 256 x 256); emulation runs the same casts and keeps the same tensors, with the matmul upcast,
    # so its time is not float8's (these rows are measured for memory only).
    ("fsdp2_float8", 2, ["--model.converters", "float8", "--float8.emulate"]),
    (
        "fsdp2_float8_all_gather",
        2,
        ["--model.converters", "float8", "--float8.emulate", "--float8.enable_fsdp_float8_all_gather"],
    ),
    ("dsv3_fsdp2", 2, DSV3),
    ("dsv3_mtp_fsdp2", 2, DSV3 + ["--model.mtp_depth", "1"]),
    ("gpt_oss_fsdp2", 2, GPT_OSS),
    (
        "gpt_oss_ep2_op_ac",
        2,
        GPT_OSS
        + [
            "--parallelism.expert_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
    ),
]


def worker(argv: list[str]) -> int:
    """One rank: the trainer, with the peak allocated memory (--profile) or the peak resident memory
    above what the process held just before the model was built (without: the profiler's own memory
    and time would count)."""
    from torchtitan import train
    from torchtitan.components.checkpoint import peak_rss, restart_peak_rss
    from torchtitan.planner.allocations import memory_profile, peak_bytes

    profiling = "--profile" in argv
    if profiling:
        argv.remove("--profile")

    class MeasuringTrainer(train.Trainer):
        def build_model(self):
            self.memory_baseline = restart_peak_rss()
            if profiling:
                self.profiler = memory_profile()
                self.profiler.__enter__()
            return super().build_model()

        def run(self):
            history = super().run()
            m = {"resident": peak_rss() - self.memory_baseline}
            if profiling:
                self.profiler.__exit__(None, None, None)
                m = {"allocated": peak_bytes(self.profiler)}
            with open(os.path.join(self.cfg.job.dump_folder, f"memory_rank{self.rank}.json"), "w") as f:
                json.dump(m, f)
            return history

    return train.main(argv, MeasuringTrainer)


def measure(nproc: int, args: list[str], folder: str, profiling: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        os.path.abspath(__file__),
        "--worker",
        *args,
        "--job.dump_folder",
        folder,
    ]
    if profiling:
        cmd.append("--profile")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    ranks = []
    for r in range(nproc):
        with open(os.path.join(folder, f"memory_rank{r}.json")) as f:
            ranks.append(json.load(f))
    result = {key: max(m[key] for m in ranks) for key in ranks[0]}
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # "time" is the time since the first step began: one step's time is the difference.
    times = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:]) if b["step"] == a["step"] + 1]
    result["step_time"] = statistics.median(times)
    return result


def estimate(nproc: int, args: list[str]):
    """The planner's estimate for `nproc` processes on this host (its CPU hardware: one device per
    process)."""
    from torchtitan.config import load_config
    from torchtitan.planner.search import default_hardware, estimate_config

    cfg = load_config(args)
    return estimate_config(cfg, nproc, "cpu", default_hardware("cpu", nproc, cfg))


def main(argv: list[str]) -> int:
    if "--worker" in argv:
        argv.remove("--worker")
        return worker(argv)
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated layout names")
    p.add_argument("--terms", action="store_true", help="print the estimate's terms (MiB) after each row")
    p.add_argument(
        "--allocated-only",
        action="store_true",
        help="only the profiled run: no resident peak or step time (their columns are left empty)",
    )
    p.add_argument("--markdown", action="store_true", help="also print the rows of docs/benchmarks.md")
    opts, extra = p.parse_known_args(argv)
    only = set(filter(None, opts.only.split(",")))
    unknown = sorted(only - {name for name, _, _ in LAYOUTS})
    if unknown:
        raise UserError(
            f"--only {','.join(unknown)}: no such layout; the layouts are {', '.join(name for name, _, _ in LAYOUTS)}"
        )
    from torchtitan.config import load_config

    models = {}  # layout -> "model flavor", for --markdown
    for name, _, overrides in LAYOUTS:  # the overrides load with every layout before any run
        if not only or name in only:
            cfg = load_config(BASE + overrides + extra)
            models[name] = f"{cfg.model.name} {cfg.model.flavor}"
    print(
        "| layout | processes | estimated MiB | allocated MiB (largest rank) | error | resident MiB | est. step s | "
        "measured step s | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, nproc, overrides in LAYOUTS:
        if only and name not in only:
            continue
        args = BASE + overrides + extra
        est = estimate(nproc, args)
        with tempfile.TemporaryDirectory() as folder:
            got = measure(nproc, args, folder, profiling=True)
        err = est.memory.subtotal / got["allocated"] - 1
        cells = [name, nproc, f"{est.memory.subtotal / 2**20:.0f}", f"{got['allocated'] / 2**20:.0f}", f"{err:+.1%}"]
        row = "| " + " | ".join(map(str, cells)) + " | "
        if opts.allocated_only or "--float8.emulate" in overrides:
            row += " | | | |"
            cells += ["", "", "", ""]
        else:
            with tempfile.TemporaryDirectory() as folder:
                got |= measure(nproc, args, folder, profiling=False)
            timing = [
                f"{got['resident'] / 2**20:.0f}",
                f"{est.step_time:.3f}",
                f"{got['step_time']:.3f}",
                f"{est.step_time / got['step_time'] - 1:+.0%}",
            ]
            row += " | ".join(timing) + " |"
            cells += timing
        rows.append([models[name], *cells])
        terms = " ".join(f"{k} {v / 2**20:.0f}" for k, v in est.memory.terms().items() if v)
        print(row + (f" {terms}" if opts.terms else ""), flush=True)
    if opts.markdown:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/benchmark_table.py
        import benchmark_table

        columns = ["model", "layout", "processes", "estimated MiB", "allocated MiB (largest rank)", "error"]
        columns += ["resident MiB", "est. step s", "measured step s", "error"]
        benchmark_table.print_rows(columns, rows, argv, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
