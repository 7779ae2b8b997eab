"""Throughput of the trainer against a minimal hand-written PyTorch loop training the same model,
or (--attention 1) of the trainer's attention masks and kernels against each other, or (--optimizers 1)
of the trainer with AdamW against the trainer with Muon.

    python scripts/benchmark.py [--nproc N] [--steps S] [--warmup W] [--threads T] [--repeat R] \\
        [--attention 1 | --optimizers 1] [--markdown] --job.config_file RECIPE [overrides as for run_train.sh, e.g. --training.compile]

Two measurements, each in its own process (or torchrun launch when N > 1), so that the peak
resident memory of one does not hide that of the other (RSS maxima only grow):

- framework: `torchtitan.train.train(cfg)` with the recipe and overrides, forced to log every step
  (`--metrics.log_freq 1`), to run S steps, to save no checkpoint, and to dump into a temporary
  folder. Its per-step records give tokens/s, TFLOP/s, MFU and peak memory.
- bare: the same model class, flavor, vocabulary, sequence length and seeded init, trained by a
  loop written here with plain PyTorch: forward, cross-entropy, backward, gradient clipping,
  optimizer step, zero_grad (and, for a mixture of experts, the expert-bias update that is part of
  its training algorithm); nothing else. It shares the trainer's dtype handling (FSDP
  MixedPrecisionPolicy when N > 1, torch.autocast(bfloat16) when N == 1), optimizer settings,
  micro-batching, activation checkpointing (full or every N-th block) and per-block compile. It
  trains on the very batches the trainer's data loader gives this rank, read before timing starts:
  the difference in throughput therefore includes the cost of the trainer's data loader, and the
  step-1 losses of the two must agree (printed as a check that the same model is trained). The
  bare loop keeps the peak learning rate (no schedule), so later losses differ.

--attention 1: the trainer alone, on the recipe's data, once with causal attention and once with
model.attn_mask_type = "block_causal" per attention kernel this device trains with (sdpa and split;
flex too on CUDA), each in its own process. Reported per variant: the kernel that ran (the
trainer's own choice, attention.choose_attention_kernel), tokens/s and its ratio to causal, TFLOP/s and
MFU (block_causal counts only the attention its mask lets through), the first step's time (on CUDA
mostly compilation) and the step-1 loss. Documents must be short against seq_len for block_causal
to matter: scripts/short_documents.py writes such a corpus.

--optimizers 1: the trainer alone, once with optimizer.name = AdamW and once with Muon (the recipe's
other optimizer keys for both; Muon's own keys for the Muon run only), each in its own process.
Reported per optimizer: the median step time (the trainer's per-step time, data loading included),
tokens/s, peak memory, the step-1 loss (the same for both: the update comes after it), and the ratio
of the step times, Muon over AdamW.

On a shared machine the load of others drifts over a run: --repeat R runs the pair R times, in
alternating order (framework first, then bare first, ...), and pools the steps of all repeats.

Reported: the median over the steps after the first W of each run of tokens/s, TFLOP/s and MFU per
device (rank 0's under torchrun), and peak memory (max RSS on CPU, max allocated on CUDA). The MFU denominator is
what the trainer uses: on CPU a matmul peak measured in each process in the training dtype with its
threads, on CUDA the table of GPU peaks. The last line printed is `ratio framework/bare: X.XX`, the
ratio of tokens/s.

Allocator: on CPU both processes apply the trainer's glibc settings (tune_host_allocator in
torchtitan/distributed/host_memory.py), so the ratio compares the loops, not malloc configurations.

Threads: a single process uses torch's default (all cores) unless --threads is given; torchrun sets
OMP_NUM_THREADS=1 per process unless --threads (or OMP_NUM_THREADS) says otherwise. Both
measurements always run with the same setting.

--markdown: after the usual output, the results as rows of docs/benchmarks.md's table of the mode (framework
against a bare loop, attention masks and kernels, Muon against AdamW), with the command, commit, machine
and date (scripts/benchmark_table.py).
"""  # noqa: E501 (printed as the --help text: its usage line stays one line)

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from a checkout

from torchtitan.config.errors import UserError, run_main  # noqa: E402

# Options of this script; everything else is a trainer override.
OWN_OPTIONS = {
    "--nproc": int,
    "--steps": int,
    "--warmup": int,
    "--threads": int,
    "--repeat": int,
    "--worker": str,
    "--result": str,
    "--attention": int,
    "--optimizers": int,
}
DEFAULTS = {
    "nproc": 1,
    "steps": 30,
    "warmup": 10,
    "threads": None,
    "repeat": 1,
    "worker": None,
    "result": None,
    "attention": 0,
    "optimizers": 0,
    "markdown": False,
}
PARTS = ("framework", "bare")


def split_argv(argv: list[str]) -> tuple[dict, list[str]]:
    """(this script's options, trainer overrides in their original order). Done by hand because
    argparse would regroup the unknown `--section.key VALUE` pairs it is asked to pass through."""
    opts, rest = dict(DEFAULTS), []
    i = 0
    while i < len(argv):
        if argv[i] == "--markdown":  # a flag: no value
            opts["markdown"], i = True, i + 1
            continue
        name, eq, inline = argv[i].partition("=")
        if name not in OWN_OPTIONS:
            rest.append(argv[i])
            i += 1
            continue
        if eq:
            text, i = inline, i + 1
        elif i + 1 < len(argv):
            text, i = argv[i + 1], i + 2
        else:
            raise ValueError(f"{name} needs a value")
        try:
            opts[name[2:]] = OWN_OPTIONS[name](text)
        except ValueError:
            raise ValueError(f"{name}: expected {OWN_OPTIONS[name].__name__}, got {text!r}") from None
    return opts, rest


def framework_argv(overrides: list[str], steps: int, dump_folder: str) -> list[str]:
    # Appended last: the trainer's command line lets the last occurrence of a key win.
    return overrides + [
        "--metrics.log_freq",
        "1",
        "--training.steps",
        str(steps),
        "--checkpoint.no-enable_checkpoint",
        "--job.dump_folder",
        dump_folder,
    ]


def check_supported(cfg) -> None:
    """Options the bare loop does not reproduce: refuse rather than compare unlike things."""
    p = cfg.parallelism
    others = {
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
    }
    for key, degree in others.items():
        if degree != 1:
            raise UserError(
                f"the bare loop shards over all processes with FSDP on a 1D mesh and nothing else: "
                f"set parallelism.{key} = 1 (it is {degree})"
            )
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and not str(ac.selective_ac_option).strip().isdigit():
        raise UserError(
            "the bare loop checkpoints whole blocks only: use activation_checkpoint.mode full, "
            "or selective with an integer selective_ac_option"
        )
    if cfg.model.converters:
        raise UserError("the bare loop applies no model converters (model.converters must be empty)")
    m = cfg.model
    if (m.attn_mask_type, m.attn_backend, m.use_flex_attn, cfg.training.ignore_cross_document_labels) != (
        "causal",
        "auto",
        False,
        False,
    ):
        raise UserError(
            "the bare loop attends causally with the model's default kernel and counts every label: "
            "compare masks and kernels with --attention 1"
        )
    if cfg.optimizer.name == "Muon" or cfg.optimizer.state_dtype != "float32":
        raise UserError(
            "the bare loop steps torch's AdamW or Adam with float32 state: compare Muon with AdamW in "
            "the trainer with --optimizers 1"
        )


# ---------------------------------------------------------------------------------------------
# Workers: run in their own process, write one JSON result (rank 0).


def run_framework(cfg) -> dict:
    import torch

    from torchtitan.components.metrics import setup_logging
    from torchtitan.train import train

    setup_logging()
    records = train(cfg)
    return {
        "steps": [{k: r[k] for k in ("step", "tps", "tflops", "mfu", "memory_gib", "time")} for r in records],
        # The trainer logs MFU against its peak; recover the peak to show it beside the bare loop's.
        "peak_tflops": records[-1]["tflops"] * 100 / records[-1]["mfu"],
        "threads": torch.get_num_threads(),
        "first_loss": records[0]["loss"],
        "first_step_s": records[0]["time"],
    }


def checkpoint_every(ac) -> int:
    """Checkpoint blocks 0, N, 2N, ... (N returned; 0: none), as the trainer's block-level modes do."""
    if ac.mode == "selective":
        return int(str(ac.selective_ac_option))
    return {"none": 0, "full": 1}[ac.mode]


def apply_block_options(model, every: int, compile: bool) -> int:
    """Hand-written activation checkpointing and per-block compile; returns the blocks checkpointed."""
    from torch.utils.checkpoint import checkpoint

    def checkpointed(forward):
        # A Python function rather than functools.partial: compile traces into it, not past it.
        # No dropout in the model, so there is no RNG state worth saving for the recompute.
        def run(*args, **kwargs):
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

        return run

    count = 0
    for position, block in enumerate(model.layers.values()):
        if every and position % every == 0:
            block.forward = checkpointed(block.forward)
            count += 1
        if compile:
            block.compile(fullgraph=True)
    return count


def preload_batches(cfg, tokenizer, rank: int, world: int, global_batch: int, count: int) -> list:
    """The trainer's first `count` micro-batches of this rank, read before timing starts: the bare
    loop trains on the same tokens without paying for reading them."""
    from torchtitan.components.data import build_dataloader

    loader = iter(build_dataloader(cfg.training, tokenizer, rank, world, global_batch))
    return [next(loader) for _ in range(count)]


def run_bare(cfg, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from torchtitan.components.metrics import device_peak_tflops, peak_memory_gib
    from torchtitan.components.tokenizer import Tokenizer
    from torchtitan.distributed.dtypes import DTYPES
    from torchtitan.distributed.host_memory import tune_host_allocator
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.moe import overrides_from_config as moe_overrides
    from torchtitan.models.common.spec import ParallelizeInputs
    from torchtitan.models.registry import get_model_spec, import_custom_module

    t, o = cfg.training, cfg.optimizer
    if not torch.cuda.is_available():
        tune_host_allocator()  # as the trainer does on CPU: the comparison is of the loops, not of malloc
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(t.seed)

    tokenizer = Tokenizer(cfg.model.tokenizer_path)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    mesh = dims.build_mesh(device.type)  # the trainer's mesh (None for one process); FSDP over all ranks
    global_batch, accum = dims.batch(t.local_batch_size, t.global_batch_size)
    batches = preload_batches(cfg, tokenizer, rank, world, global_batch, steps * accum)

    import_custom_module(cfg.experimental.custom_import)
    spec = get_model_spec(cfg.model.name)
    args = spec.args_for_training(cfg.model.flavor, tokenizer.vocab_size, t.seq_len, moe_overrides(cfg.moe))
    with torch.device("meta"):
        model = spec.model_cls(args)
    n_params = spec.size(args).total
    flops_tok = spec.flops_per_token(args, t.seq_len)
    # The model's own updates after each optimizer step (an MoE's balancing bias: part of its training algorithm).
    after_step = spec.post_optimizer_step
    inputs = ParallelizeInputs(dims, mesh, cfg.parallelism, t, cfg.activation_checkpoint)
    apply_block_options(model, checkpoint_every(cfg.activation_checkpoint), t.compile)
    compute_dtype = DTYPES[t.mixed_precision_param]
    if mesh is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=DTYPES[t.mixed_precision_reduce])
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp_cp_tp"], mp_policy=mp)
        fully_shard(model, mesh=mesh["dp_cp_tp"], mp_policy=mp)
    model.to_empty(device=device)
    model.init_weights(seed=t.seed)
    model.train()

    optim_cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[o.name]
    optimizer = optim_cls(
        model.parameters(),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=o.implementation == "fused",
        foreach=o.implementation == "foreach",
    )
    # As the trainer: bf16 without FSDP is autocast; with FSDP the policy above casts the parameters.
    use_autocast = mesh is None and compute_dtype == torch.bfloat16
    peak_tflops, _ = device_peak_tflops(device, compute_dtype, cfg.metrics.device_peak_tflops)

    records = []
    first_loss = torch.zeros((), device=device)
    last = time.perf_counter()
    for step in range(steps):
        for micro in range(accum):
            inputs, labels = batches[step * accum + micro]
            inputs, labels = inputs.to(device), labels.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                logits = model(inputs)
            loss = spec.loss_sum_fn(logits, labels) / (labels.numel() * accum)
            loss.backward()
            if step == 0:
                first_loss += loss.detach()  # to check against the trainer's first loss
        if t.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step([model], inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # per-step times need the step's kernels finished
        now = time.perf_counter()
        tps = accum * t.local_batch_size * t.seq_len / (now - last)
        tflops = flops_tok * tps / 1e12
        records.append(
            {
                "step": step + 1,
                "tps": tps,
                "tflops": tflops,
                "mfu": 100 * tflops / peak_tflops,
                "memory_gib": peak_memory_gib(device),
            }
        )
        print(f"bare step {step + 1}: {tps:,.0f} tokens/s", flush=True)
        last = time.perf_counter()  # the bookkeeping above is not part of the loop being measured
    if mesh is not None:
        dist.all_reduce(first_loss)
        first_loss /= world
        dist.barrier()  # no rank tears down gloo while another still talks to it
        dist.destroy_process_group()
    return {
        "steps": records,
        "peak_tflops": peak_tflops,
        "threads": torch.get_num_threads(),
        "n_params": n_params,
        "first_loss": first_loss.item(),
    }


def run_moe_layer(cfg, repeats: int = 20) -> dict:
    """One MoE block against a dense SwiGLU feed-forward of equal active FLOPs (hidden = top_k x the
    experts' hidden), forward + backward on the tokens of one micro-batch, in the training dtype:
    the MoE's achieved FLOP/s as a share of the dense block's. The MoE also computes its router and
    routes: that work is its overhead, so its FLOPs count only the experts'."""
    import torch

    from torchtitan.distributed.dtypes import DTYPES
    from torchtitan.models.common.layers import FeedForward
    from torchtitan.models.common.moe import MoE, grouped_mm_works, overrides_from_config as moe_overrides
    from torchtitan.models.registry import get_model_spec, import_custom_module

    t = cfg.training
    import_custom_module(cfg.experimental.custom_import)
    spec = get_model_spec(cfg.model.name)
    args = spec.args_for_training(cfg.model.flavor, 4096, t.seq_len, moe_overrides(cfg.moe))
    m = args.moe
    dtype = DTYPES[t.mixed_precision_param]
    g = torch.Generator().manual_seed(0)
    moe = MoE(args.dim, m).to(dtype)
    dense = FeedForward(args.dim, m.top_k * m.hidden_dim).to(dtype)
    moe.reset_buffers()
    with torch.no_grad():
        for p in [*moe.parameters(), *dense.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    x = torch.randn(t.local_batch_size, t.seq_len, args.dim, generator=g).to(dtype)

    def timed(block) -> float:
        times = []
        for _ in range(repeats + 3):
            inp = x.clone().requires_grad_()
            start = time.perf_counter()
            block(inp).float().square().mean().backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:])

    t_dense, t_moe = timed(dense), timed(moe)
    flops = 6 * x.shape[0] * x.shape[1] * 3 * args.dim * m.top_k * m.hidden_dim
    return {
        "steps": [],
        "dense_tflops": flops / t_dense / 1e12,
        "moe_tflops": flops / t_moe / 1e12,
        "grouped_mm": grouped_mm_works(x.device, dtype),
        "threads": torch.get_num_threads(),
    }


def worker(opts: dict, overrides: list[str]) -> int:
    from torchtitan.config import load_config

    part, result = opts["worker"], opts["result"]
    if part == "moe_layer":
        out = run_moe_layer(load_config(overrides))
    elif part == "framework":
        dump = str(Path(result).parent / "framework_dump")
        out = run_framework(load_config(framework_argv(overrides, opts["steps"], dump)))
    else:
        out = run_bare(load_config(overrides), opts["steps"])
    if os.environ.get("RANK", "0") == "0":
        # Written whole or not at all: the launcher may read it after a rank died at exit.
        partial = Path(result + ".partial")
        partial.write_text(json.dumps(out))
        os.replace(partial, result)
    return 0


# ---------------------------------------------------------------------------------------------
# Launcher: checks the config, runs both workers one after the other, prints the table.


def worker_command(part: str, opts: dict, overrides: list[str], result: Path) -> list[str]:
    script = [
        str(Path(__file__).resolve()),
        "--worker",
        part,
        "--result",
        str(result),
        "--steps",
        str(opts["steps"]),
        *overrides,
    ]
    if opts["nproc"] == 1:
        return [sys.executable, *script]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={opts['nproc']}",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        *script,
    ]


def summarize(results: list[dict], warmup: int) -> dict:
    """Medians over the steps after warm-up of every run; memory is the peak over all steps."""
    after = [r for result in results for r in result["steps"] if r["step"] > warmup]
    if not after:
        raise ValueError(f"no step after the {warmup} warm-up steps")
    summary = {k: statistics.median(r[k] for r in after) for k in ("tps", "tflops", "mfu")}
    summary["memory_gib"] = max(r["memory_gib"] for result in results for r in result["steps"])
    summary["peak_tflops"] = statistics.median(result["peak_tflops"] for result in results)
    summary["threads"] = results[0]["threads"]
    summary["steps_measured"] = len(after)
    return summary


def format_table(fw: dict, bare: dict) -> list[str]:
    rows = [  # (label, key, format, whether a framework/bare ratio means anything)
        ("tokens/s per device", "tps", "{:,.0f}", True),
        ("TFLOP/s per device", "tflops", "{:.4f}", True),
        ("MFU %", "mfu", "{:.1f}", True),
        ("peak memory GiB", "memory_gib", "{:.3f}", True),
        ("MFU denominator TFLOP/s", "peak_tflops", "{:.4f}", False),
        ("threads per process", "threads", "{}", False),
    ]
    lines = [f"{'':<26}{'framework':>12}{'bare':>12}{'ratio':>8}"]
    for label, key, fmt, show_ratio in rows:
        ratio = f"{fw[key] / bare[key]:.3f}" if show_ratio and bare[key] else ""
        lines.append(f"{label:<26}{fmt.format(fw[key]):>12}{fmt.format(bare[key]):>12}{ratio:>8}")
    return lines


def layout_label(cfg, opts: dict, global_batch: int) -> str:
    """The first cell of a docs/benchmarks.md row: model, processes, threads, dtype, sequence, batch."""
    t = cfg.training
    processes = f"{opts['nproc']} processes FSDP" if opts["nproc"] > 1 else "1 process"
    threads = f", {opts['threads']} thread{'s' * (opts['threads'] != 1)}" if opts["threads"] else ""
    return (
        f"{cfg.model.name} {cfg.model.flavor}, {processes}{threads}, {t.mixed_precision_param}, seq {t.seq_len}, "
        f"global batch {global_batch}"
    )


def print_markdown(columns: list[str], rows: list[list], argv: list[str]) -> None:
    """--markdown: the rows of docs/benchmarks.md (scripts/benchmark_table.py, beside this script)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchmark_table

    benchmark_table.print_rows(columns, rows, argv, __file__)


# The columns of docs/benchmarks.md's tables, before command, commit, machine and date.
BARE_COLUMNS = ["model and layout", "framework tokens/s", "bare tokens/s", "ratio", "MoE block / dense"]
ATTENTION_COLUMNS = [
    "model, seq x local batch",
    "causal (sdpa)",
    "block_causal sdpa",
    "block_causal split",
    "block_causal flex",
    "first step s (each column)",
]
OPTIMIZER_COLUMNS = ["model and layout", "AdamW step ms (tokens/s)", "Muon step ms (tokens/s)", "Muon/AdamW"]


def attention_variants(cfg, device_type: str) -> list[tuple[str, list[str]]]:
    """(label, extra overrides): causal, then block_causal with each kernel that trains here."""
    kernels = ["sdpa", "split"] + (["flex"] if device_type == "cuda" else [])
    return [("causal", ["--model.attn_mask_type", "causal", "--model.attn_backend", "auto"])] + [
        (f"block_causal {k}", ["--model.attn_mask_type", "block_causal", "--model.attn_backend", k]) for k in kernels
    ]


def run_attention(opts: dict, overrides: list[str], cfg, env: dict, tmp: Path) -> int:
    import torch

    from torchtitan.models.common.attention import choose_attention_kernel
    from torchtitan.models.registry import get_model_args

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    windowed = (
        getattr(get_model_args(cfg.model.name, cfg.model.flavor), "sliding_window", None) is not None
        or cfg.model.sliding_window is not None
    )
    rows = []
    for label, extra in attention_variants(cfg, device_type):
        masked = "block_causal" in label or windowed
        kernel = (
            choose_attention_kernel(extra[-1], device_type, masked, "block_causal" in label, cfg.training.seq_len)
            if cfg.parallelism.context_parallel_degree == 1
            else "ring"
        )
        results = []
        for repeat in range(opts["repeat"]):
            result, log = (
                tmp / f"{label.replace(' ', '_')}_{repeat}.json",
                tmp / f"{label.replace(' ', '_')}_{repeat}.log",
            )
            with open(log, "w") as f:
                subprocess.run(
                    worker_command("framework", opts, overrides + extra, result),
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            if not result.exists():
                print(f"error: the {label} run failed; log {log}:\n{log.read_text()[-6000:]}", file=sys.stderr)
                return 1
            results.append(json.loads(result.read_text()))
        summary = summarize(results, opts["warmup"])
        summary.update(
            kernel=kernel,
            first_loss=results[0]["first_loss"],
            first_step_s=statistics.median(r["first_step_s"] for r in results),
        )
        rows.append((label, summary))
        print(f"{label}: {summary['tps']:,.0f} tokens/s ({kernel} kernel), log {log}", flush=True)
    causal = rows[0][1]["tps"]
    print(
        f"{'mask and kernel':<22}{'ran':>7}{'tokens/s':>11}{'x causal':>10}{'TFLOP/s':>10}{'MFU %':>7}"
        f"{'step 1 s':>10}{'loss 1':>9}"
    )
    for label, r in rows:
        print(
            f"{label:<22}{r['kernel']:>7}{r['tps']:>11,.0f}{r['tps'] / causal:>10.2f}{r['tflops']:>10.4f}"
            f"{r['mfu']:>7.1f}{r['first_step_s']:>10.1f}{r['first_loss']:>9.4f}"
        )
    if opts["markdown"]:
        t = cfg.training
        autocast = opts["nproc"] == 1 and t.mixed_precision_param != "float32"
        dtype = f"{t.mixed_precision_param}{' autocast' * autocast}"
        got = dict(rows)
        cells = [f"{cfg.model.name} {cfg.model.flavor}, {dtype}, {t.seq_len} x {t.local_batch_size}"]
        for label in ("causal", "block_causal sdpa", "block_causal split", "block_causal flex"):
            if label not in got:
                cells.append(f"refused on {device_type.upper()}")
            elif label == "causal":
                cells.append(f"{got[label]['tps']:,.0f}")
            else:
                cells.append(f"{got[label]['tps']:,.0f} ({got[label]['tps'] / causal:.2f})")
        cells.append(" / ".join(f"{r['first_step_s']:.1f}" for _, r in rows))
        print_markdown(ATTENTION_COLUMNS, [cells], opts["argv"])
    return 0


def without_muon_keys(overrides: list[str]) -> list[str]:
    """The overrides less Muon's own keys (refused with AdamW), as --key value or --key=value."""
    out, skip = [], False
    for arg in overrides:
        if skip:
            skip = False
        elif arg.startswith("--optimizer.muon_") or arg.startswith("--optimizer.muon-"):
            skip = "=" not in arg
        else:
            out.append(arg)
    return out


def run_optimizers(opts: dict, overrides: list[str], env: dict, tmp: Path, layout: str) -> int:
    variants = [
        ("AdamW", without_muon_keys(overrides) + ["--optimizer.name", "AdamW"]),
        ("Muon", overrides + ["--optimizer.name", "Muon"]),
    ]
    runs = {label: [] for label, _ in variants}
    for repeat in range(opts["repeat"]):
        for label, argv in variants if repeat % 2 == 0 else variants[::-1]:
            result, log = tmp / f"{label}_{repeat}.json", tmp / f"{label}_{repeat}.log"
            with open(log, "w") as f:
                subprocess.run(
                    worker_command("framework", opts, argv, result), env=env, stdout=f, stderr=subprocess.STDOUT
                )
            if not result.exists():
                print(f"error: the {label} run failed; log {log}:\n{log.read_text()[-6000:]}", file=sys.stderr)
                return 1
            data = json.loads(result.read_text())
            runs[label].append(data)
            print(f"{label}: {summarize([data], opts['warmup'])['tps']:,.0f} tokens/s, log {log}", flush=True)
    rows = {}
    for label, results in runs.items():
        summary = summarize(results, opts["warmup"])
        # "time" is the seconds since the run started, logged every step: a step's time is the difference.
        summary["step_ms"] = 1000 * statistics.median(
            b["time"] - a["time"]
            for result in results
            for a, b in zip(result["steps"], result["steps"][1:])
            if b["step"] > opts["warmup"]
        )
        summary["first_loss"] = results[0]["first_loss"]
        rows[label] = summary
    print(f"{'optimizer':<12}{'step ms':>10}{'tokens/s':>11}{'peak GiB':>10}{'loss 1':>9}")
    for label, r in rows.items():
        print(f"{label:<12}{r['step_ms']:>10.1f}{r['tps']:>11,.0f}{r['memory_gib']:>10.3f}{r['first_loss']:>9.4f}")
    print(f"step time Muon/AdamW: {rows['Muon']['step_ms'] / rows['AdamW']['step_ms']:.2f}")
    if opts["markdown"]:
        cells = [layout] + [f"{rows[o]['step_ms']:,.0f} ({rows[o]['tps']:,.0f})" for o in ("AdamW", "Muon")]
        cells.append(f"{rows['Muon']['step_ms'] / rows['AdamW']['step_ms']:.2f}")
        print_markdown(OPTIMIZER_COLUMNS, [cells], opts["argv"])
    return 0


def launch(opts: dict, overrides: list[str]) -> int:
    import torch

    from torchtitan.config import HelpRequested, load_config
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.preflight import check

    if opts["nproc"] < 1 or opts["repeat"] < 1 or opts["warmup"] < 0 or opts["steps"] <= opts["warmup"]:
        raise UserError(
            f"need --nproc >= 1, --repeat >= 1 and --steps > --warmup >= 0 (got --nproc {opts['nproc']}, "
            f"--repeat {opts['repeat']}, --steps {opts['steps']}, --warmup {opts['warmup']})"
        )
    try:
        # --optimizers 1 runs Muon too: Muon's keys must load (the AdamW run leaves them out).
        cfg = load_config(overrides + (["--optimizer.name", "Muon"] if opts["optimizers"] else []))
    except HelpRequested:
        print(__doc__)
        return 0
    if not opts["attention"] and not opts["optimizers"]:
        check_supported(cfg)
    t = cfg.training
    dims = ParallelDims.from_config(cfg.parallelism, opts["nproc"])
    global_batch, _ = dims.batch(t.local_batch_size, t.global_batch_size)
    # Each trainer run as run_train.sh checks it (model, flavor, tokenizer, data, degrees), before any
    # process starts: a mistake is one line here, not a failed run's log.
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if opts["attention"]:
        runs = [overrides + extra for _, extra in attention_variants(cfg, device_type)]
    elif opts["optimizers"]:
        runs = [without_muon_keys(overrides) + ["--optimizer.name", "AdamW"], overrides + ["--optimizer.name", "Muon"]]
    else:
        runs = [overrides]
    for argv in runs:
        check(
            framework_argv(argv, opts["steps"], os.path.join(tempfile.gettempdir(), "benchmark")),
            opts["nproc"],
            check_lock=False,
        )
    env = dict(os.environ)
    if opts["threads"] is not None:
        env["OMP_NUM_THREADS"] = str(opts["threads"])

    print(
        f"{cfg.model.name} {cfg.model.flavor}, seq {t.seq_len}, global batch {global_batch} "
        f"(local {t.local_batch_size}), params {t.mixed_precision_param}, {opts['nproc']} process(es), "
        f"compile {t.compile}, activation checkpointing {cfg.activation_checkpoint.mode}, "
        f"{opts['steps']} steps, median after {opts['warmup']}, {opts['repeat']} repeat(s)",
        flush=True,
    )

    tmp = Path(tempfile.mkdtemp(prefix="benchmark_"))
    if opts["attention"]:
        return run_attention(opts, overrides, cfg, env, tmp)
    if opts["optimizers"]:
        return run_optimizers(opts, overrides, env, tmp, layout_label(cfg, opts, global_batch))
    runs = {part: [] for part in PARTS}
    for repeat in range(opts["repeat"]):
        # Alternating the order spreads a drift in background load evenly over the two.
        for part in PARTS if repeat % 2 == 0 else PARTS[::-1]:
            result, log = tmp / f"{part}_{repeat}.json", tmp / f"{part}_{repeat}.log"
            start = time.perf_counter()
            with open(log, "w") as f:
                proc = subprocess.run(
                    worker_command(part, opts, overrides, result), env=env, stdout=f, stderr=subprocess.STDOUT
                )
            if not result.exists():
                tail = log.read_text()[-6000:]
                print(f"error: the {part} run failed (exit {proc.returncode}); log {log}:\n{tail}", file=sys.stderr)
                return 1
            if proc.returncode != 0:
                # gloo on CPU now and then aborts a rank at interpreter exit ("terminate called
                # without an active exception") after all work is done; the measurement stands.
                print(
                    f"warning: the {part} run exited with status {proc.returncode} after writing its "
                    f"results; see {log}",
                    flush=True,
                )
            data = json.loads(result.read_text())
            runs[part].append(data)
            print(
                f"{part}: {summarize([data], opts['warmup'])['tps']:,.0f} tokens/s, step-1 loss "
                f"{data['first_loss']:.4f}, {time.perf_counter() - start:.0f}s, log {log}",
                flush=True,
            )
    print(f"model: {runs['bare'][0]['n_params']:,} parameters", flush=True)
    losses = {part: runs[part][0]["first_loss"] for part in PARTS}
    fw, bare = summarize(runs["framework"], opts["warmup"]), summarize(runs["bare"], opts["warmup"])
    if abs(losses["framework"] - losses["bare"]) > 1e-2:
        print(
            f"warning: the step-1 losses differ ({losses['framework']:.4f} vs {losses['bare']:.4f}): "
            "the two loops do not train the same model on the same data",
            flush=True,
        )
    moe_share = ""
    if getattr(_flavor_args(cfg), "moe", None) is not None:
        result = tmp / "moe_layer.json"
        layer_opts = dict(opts, nproc=1)
        subprocess.run(
            worker_command("moe_layer", layer_opts, overrides, result),
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        layer = json.loads(result.read_text())
        print(
            f"MoE block vs dense SwiGLU of equal active FLOPs ({layer['threads']} thread(s), "
            f"{'grouped matmul' if layer['grouped_mm'] else 'per-expert matmuls'}): "
            f"{layer['moe_tflops']:.4f} vs {layer['dense_tflops']:.4f} TFLOP/s, "
            f"share {layer['moe_tflops'] / layer['dense_tflops']:.2f}"
        )
        moe_share = (
            f"{layer['moe_tflops'] / layer['dense_tflops']:.2f} ({layer['moe_tflops']:.4f} against "
            f"{layer['dense_tflops']:.4f} TFLOP/s, {'grouped matmul' if layer['grouped_mm'] else 'per-expert matmuls'})"
        )
    print("\n".join(format_table(fw, bare)))
    print(f"ratio framework/bare: {fw['tps'] / bare['tps']:.2f}")
    if opts["markdown"]:
        cells = [layout_label(cfg, opts, global_batch), f"{fw['tps']:,.0f}", f"{bare['tps']:,.0f}"]
        print_markdown(BARE_COLUMNS, [[*cells, f"{fw['tps'] / bare['tps']:.2f}", moe_share]], opts["argv"])
    return 0


def _flavor_args(cfg):
    from torchtitan.models.registry import get_model_args, import_custom_module

    import_custom_module(cfg.experimental.custom_import)
    return get_model_args(cfg.model.name, cfg.model.flavor)


def _main(argv: list[str]) -> int:
    try:
        opts, overrides = split_argv(argv)
    except ValueError as e:
        raise UserError(str(e)) from None
    if opts["worker"] is not None:
        return worker(opts, overrides)
    opts["argv"] = list(argv)  # the command of --markdown's rows
    return launch(opts, overrides)


def main(argv: list[str]) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
