"""The planner's memory and step-time estimates against measured runs on this machine.

    python scripts/validate_memory_estimate.py [--steps 6] [--only NAME,...] [--markdown]

For each layout of LAYOUTS (small flavors, up to 4 processes), trains a few steps with torchrun and
measures on each rank the peak resident memory above the memory the process held just before it
built the model (the kernel's VmHWM, restarted there), and the median step time after the first two
steps; then prints, per layout, the estimate of torchtitan.planner for the same config (on CPU:
the largest rank's training state, no reserve) against the largest measured rank, and the error.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BASE = ["--training.steps", "6", "--metrics.log_freq", "1", "--training.seq_len", "512", "--training.local_batch_size",
        "4", "--checkpoint.no-enable_checkpoint", "--validation.no-enabled"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
# (name, processes, overrides)
LAYOUTS = [
    ("single", 1, []),
    ("fsdp2", 2, []),
    ("fsdp4", 4, []),
    ("hsdp2x2", 4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
    ("tp2", 2, ["--parallelism.tensor_parallel_degree", "2"]),
    ("fsdp2_tp2", 4, ["--parallelism.tensor_parallel_degree", "2"]),
    ("pp2_1f1b", 2, PP2 + ["--parallelism.pipeline_parallel_schedule", "1F1B"]),
    ("pp2_zbv", 2, PP2 + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    ("cp2", 2, ["--parallelism.context_parallel_degree", "2"]),
    ("ep2", 2, MOE + ["--parallelism.expert_parallel_degree", "2"]),
    ("fsdp2_full_ac", 2, ["--activation_checkpoint.mode", "full"]),
    ("fsdp2_op_ac", 2, ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
]
# Float8 is left out: this CPU has no float8 matmul kernel (oneDNN's reference one takes about 1 s for
# 256 x 256), so six steps take hours; the planner does not model float8 yet either.


def worker(argv: list[str]) -> int:
    """One rank: the trainer, with the peak memory counted from just before the model is built."""
    from torchtitan import train
    from torchtitan.components.hf_sharded import peak_rss, restart_peak_rss

    class MeasuringTrainer(train.Trainer):
        def build_model(self):
            self.memory_baseline = restart_peak_rss()
            return super().build_model()

        def run(self):
            history = super().run()
            out = os.path.join(self.cfg.job.dump_folder, f"memory_rank{self.rank}.json")
            with open(out, "w") as f:
                json.dump({"baseline": self.memory_baseline, "peak": peak_rss()}, f)
            return history

    return train.main(argv, MeasuringTrainer)


def measure(nproc: int, args: list[str], folder: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", os.path.abspath(__file__), "--worker", *args, "--job.dump_folder", folder]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    peaks = []
    for r in range(nproc):
        with open(os.path.join(folder, f"memory_rank{r}.json")) as f:
            m = json.load(f)
        peaks.append(m["peak"] - m["baseline"])
    rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    # "time" is the time since the first step began: one step's time is the difference.
    times = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:]) if b["step"] == a["step"] + 1]
    return {"peak": max(peaks), "peaks": peaks, "step_time": statistics.median(times)}


def estimate(nproc: int, args: list[str], hw):
    from torchtitan.config import load_config
    from torchtitan.planner.plan import estimate_config

    return estimate_config(load_config(args), nproc, "cpu", hw)


def main() -> int:
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        return worker(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated layout names")
    p.add_argument("--markdown", action="store_true")
    opts, extra = p.parse_known_args()
    only = set(filter(None, opts.only.split(",")))
    from torchtitan.config import load_config
    from torchtitan.planner.plan import default_hardware

    hw = default_hardware("cpu", 4, load_config(BASE))  # the matmul peak measured once, for every row
    print("| layout | processes | estimated MiB | measured MiB (largest rank) | error | est. step s | measured step s |")
    print("|---|---|---|---|---|---|---|")
    for name, nproc, overrides in LAYOUTS:
        if only and name not in only:
            continue
        args = BASE + overrides + extra
        est = estimate(nproc, args, hw)
        with tempfile.TemporaryDirectory() as folder:
            got = measure(nproc, args, folder)
        err = est.memory.total / got["peak"] - 1
        print(f"| {name} | {nproc} | {est.memory.total / 2**20:.0f} | {got['peak'] / 2**20:.0f} | {err:+.1%} | "
              f"{est.step_time:.3f} | {got['step_time']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
