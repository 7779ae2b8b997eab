"""Context-parallel methods against each other: the trainer under CP N with the ring (gathered keys and
values; rotating, with and without overlapped transfers) and with Ulysses (all-to-all), at one or more
sequence lengths, each variant its own torchrun launch (run_train.sh).

    python scripts/benchmark_cp.py [--nproc 2] [--seq 4096,16384] [--steps 6] [--warmup 2] [--repeat 1] \\
        [--variants allgather,alltoall,alltoall_no_overlap,ulysses] [--markdown] [overrides as for run_train.sh]

Every launch trains the recipe (default train_configs/debug_model.toml) for S steps with one sequence of
seq tokens per step (local and global batch 1: every rank holds seq / N tokens of it), fp32, logging
every step into a temporary dump folder. Reported per variant and length: the median over the steps
after the first W (pooled over the repeats) of rank 0's tokens/s (its own tokens: seq / N per step),
of its step time, and the largest peak memory rank 0 reported (max RSS on CPU, max allocated on
CUDA), and the CPU seconds the launch used over all its processes (user + system, start-up included:
on a shared host wall time moves with the other jobs' load, CPU time much less). --repeat R runs the
variants R times in rotating order, so that a drift of the machine's load falls on all of them. A launch
that fails (e.g. out of memory) is reported as such, and the others go on. --markdown also prints the
results as rows of docs/benchmarks.md's table, with the command, commit, machine and date.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {
    "allgather": ["--parallelism.context_parallel_rotate_method", "allgather"],
    "alltoall": ["--parallelism.context_parallel_rotate_method", "alltoall"],
    "alltoall_no_overlap": [
        "--parallelism.context_parallel_rotate_method",
        "alltoall",
        "--parallelism.no-context_parallel_ring_overlap",
    ],
    "ulysses": ["--parallelism.context_parallel_method", "ulysses"],
}
# docs/benchmarks.md's columns, before command, commit, machine and date.
COLUMNS = [
    "model",
    "seq",
    "CP",
    "method",
    "tokens/s per rank",
    "step time (s)",
    "peak memory (GiB)",
    "CPU s per launch",
]
LABELS = {
    "allgather": "ring, gathered (allgather)",
    "alltoall": "ring, rotating, overlapped",
    "alltoall_no_overlap": "ring, rotating, no overlap",
    "ulysses": "Ulysses (all-to-all)",
}


def launch_argv(nproc: int, seq: int, steps: int, variant: str, overrides: list[str], folder: Path) -> list[str]:
    """The trainer's arguments for one variant: the overrides come last, so the recipe's config file leads."""
    return [
        *overrides,
        "--training.steps",
        str(steps),
        "--training.seq_len",
        str(seq),
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "1",
        "--training.mixed_precision_param",
        "float32",
        "--parallelism.context_parallel_degree",
        str(nproc),
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(folder),
        *VARIANTS[variant],
    ]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(
    nproc: int, seq: int, steps: int, variant: str, overrides: list[str], folder: Path, timeout: int
) -> tuple[list[dict], float] | str:
    """Rank 0's per-step records of one launch and the CPU seconds of all its processes, or the reason
    it failed."""
    argv = launch_argv(nproc, seq, steps, variant, overrides, folder)
    env = dict(os.environ, NGPU=str(nproc))
    cpu_before = _children_cpu_s()  # the launcher waits for its workers, so their time counts here
    try:
        proc = subprocess.run(
            [str(REPO / "run_train.sh"), *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout} s"
    metrics = folder / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"failed ({proc.returncode}): {tail[0][:200]}"
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "tps" in r], _children_cpu_s() - cpu_before


def main(argv: list[str]) -> int:
    from torchtitan.config.errors import ArgumentParser, positive_int
    from torchtitan.preflight import check

    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=positive_int, default=2)
    parser.add_argument("--seq", default="4096")
    parser.add_argument("--steps", type=positive_int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=positive_int, default=1)
    parser.add_argument("--timeout", type=positive_int, default=900)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--markdown", action="store_true", help="also print the rows of docs/benchmarks.md")
    opts, overrides = parser.parse_known_args(argv)
    variants = opts.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if not all(s.isdigit() and int(s) > 0 for s in opts.seq.split(",")):
        parser.error(f"--seq {opts.seq}: comma-separated sequence lengths of 1 or more")
    if not any(a == "--job.config_file" for a in overrides):
        overrides = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), *overrides]
    for seq in opts.seq.split(","):  # the trainer's own checks, before any launch: one line and exit 2
        for variant in variants:
            check(
                launch_argv(opts.nproc, int(seq), opts.steps, variant, overrides, Path("/tmp/unused")),
                opts.nproc,
                check_lock=False,
            )
    print(
        f"CP {opts.nproc}, {opts.steps} steps (median after {opts.warmup}), {opts.repeat} repeat(s); "
        f"load average before: {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in (int(s) for s in opts.seq.split(",")):
            pooled: dict[str, list[dict] | str] = {v: [] for v in variants}
            cpu: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(opts.repeat):
                order = variants[r % len(variants) :] + variants[: r % len(variants)]
                for variant in order:
                    if isinstance(pooled[variant], str):
                        continue  # failed before: do not try again
                    got = run_one(
                        opts.nproc,
                        seq,
                        opts.steps,
                        variant,
                        overrides,
                        Path(tmp) / f"{variant}_{seq}_{r}",
                        opts.timeout,
                    )
                    if isinstance(got, str):
                        pooled[variant] = got
                    else:
                        pooled[variant] += got[0][opts.warmup :]
                        cpu[variant].append(got[1])
                    done = got if isinstance(got, str) else f"ok, {got[1]:.0f} CPU s"
                    print(f"  seq {seq} {variant} repeat {r}: {done}", flush=True)
            for variant in variants:
                records = pooled[variant]
                if isinstance(records, str) or not records:
                    rows.append((seq, variant, None, None, None, None, records or "no steps"))
                    continue
                tps = statistics.median(r["tps"] for r in records)
                rows.append(
                    (
                        seq,
                        variant,
                        tps,
                        seq / opts.nproc / tps,
                        max(r["memory_gib"] for r in records),
                        statistics.median(cpu[variant]),
                        "",
                    )
                )
    print("\n| seq | CP | method | tokens/s per rank | step time (s) | peak memory (GiB) | CPU s per launch |")
    print("|---|---|---|---|---|---|---|")
    for seq, variant, tps, step, mem, cpu_s, note in rows:
        if tps is None:
            print(f"| {seq} | {opts.nproc} | {LABELS[variant]} | {note} | | | |")
        else:
            print(f"| {seq} | {opts.nproc} | {LABELS[variant]} | {tps:,.0f} | {step:.2f} | {mem:.2f} | {cpu_s:,.0f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if opts.markdown:
        from torchtitan.config import load_config

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import benchmark_table

        cfg = load_config(overrides)
        model = f"{cfg.model.name} {cfg.model.flavor}" + (
            f", {cfg.model.attn_mask_type}" if cfg.model.attn_mask_type != "causal" else ""
        )
        cells = []
        for seq, variant, tps, step, mem, cpu_s, note in rows:
            method = LABELS[variant] if opts.nproc > 1 else "(CP 1)"
            if tps is None:
                figures = [note, "", "", ""]
            else:
                figures = [f"{tps:,.0f}", f"{step:.2f}", f"{mem:.2f}", f"{cpu_s:,.0f}"]
            cells.append([model, seq, opts.nproc, method, *figures])
        benchmark_table.print_rows(COLUMNS, cells, argv, __file__)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from torchtitan.config.errors import run_main

    sys.exit(run_main(main, sys.argv[1:]))
