"""Peak memory and time of the forward and backward of the output layer plus the loss, with the whole
logits (today's path: F.linear, then the spec's cross_entropy_sum) and chunk by chunk
(training.loss_chunk_tokens: models.common.chunked_loss); how to read it: docs/performance.md.

    python scripts/benchmark_loss.py [--tokens 4096] [--dim 1024] [--vocab 151936,248320] \\
        [--dtype float32,bfloat16] [--chunks 0,256,1024,2048] [--recompute 1024] [--repeat 1] [--markdown]

Each (vocabulary, dtype, chunk size) runs in its own process, so that one's peak does not hide
another's (RSS maxima only grow). The process builds the hidden states [tokens, dim] (requiring a
gradient, as the final norm's output does), the output weight [vocab, dim] in float32 and the labels
(one in ten IGNORE_INDEX), then times `repeat` forward+backward passes (after one untimed pass on
CUDA); the loss is float32 in every case. bfloat16 is the trainer's one-process mixed precision:
float32 weights under torch.autocast(bfloat16). Reported per case: the median wall time and process
CPU time (on a shared CPU host the wall time follows the load of others; the CPU time, all threads
together, much less: compare that), and the peak
memory the pass needs beyond its inputs: on CPU the process's RSS high-water mark above its RSS
before the first pass, on CUDA the allocator's peak above what was allocated before; both include
the weight's and the hidden states' gradients, which exist whatever the path (the next column leaves
them out: what the path itself needs, the logits' share).

--recompute C adds a variant that keeps each chunk's log-sum-exp only and recomputes the chunk's logits
in the backward (a fourth matmul) instead of computing the gradients in the forward, the order
chunked_loss uses: it justifies that choice.

--step FLAVOR: instead, whole training steps (forward, backward, AdamW step) of Qwen3's FLAVOR (default
debugmodel: 6 layers of width 256) with its real 151,936-token vocabulary (--vocab's first entry),
`--batch` sequences of --tokens tokens on random tokens, in float32 or bfloat16 autocast, the loss
whole and in each chunk size: peak RSS (or CUDA peak allocated) of the process and tokens/s (the
median step after the first).

The last column is the ratio of each case's peak memory and time to the whole-logits case of its
vocabulary and dtype. --markdown also prints the rows of docs/benchmarks.md's table (with a tokens
column first, or the model for --step), with the command, commit, machine and date.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan.models.common.chunked_loss import linear_cross_entropy_sum
from torchtitan.models.common.spec import IGNORE_INDEX, cross_entropy_sum


class _Recompute(torch.autograd.Function):
    """Chunked, the logits recomputed in backward (the alternative to chunked_loss's order)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):
        shape = hidden.shape
        hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        compute = (
            torch.get_autocast_dtype(hidden.device.type)
            if torch.is_autocast_enabled(hidden.device.type)
            else weight.dtype
        )
        with torch.autocast(hidden.device.type, enabled=False):
            w, total, lses = weight.to(compute), torch.zeros((), device=hidden.device), []
            for start in range(0, hidden.shape[0], chunk):
                logits = (hidden[start : start + chunk].to(compute) @ w.t()).float()
                y = labels[start : start + chunk]
                lse = logits.logsumexp(1)
                picked = logits.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
                total += torch.where(y != IGNORE_INDEX, lse - picked, 0.0).sum()
                lses.append(lse)
        ctx.save_for_backward(hidden, weight, labels, torch.cat(lses))
        ctx.chunk, ctx.compute, ctx.shape = chunk, compute, shape
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk, compute = ctx.chunk, ctx.compute
        w = weight.to(compute)
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros(weight.shape, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk].to(compute)
            y = labels[start : start + chunk]
            grad = (h @ w.t()).float().sub_(lse[start : start + chunk, None]).exp_()
            valid = y != IGNORE_INDEX
            rows = valid.nonzero().squeeze(1)
            grad[rows, y[rows]] -= 1.0
            grad = grad.mul_(valid[:, None] * grad_total).to(compute)
            grad_hidden[start : start + chunk] = grad @ w
            grad_weight += (grad.t() @ h).float()
        return grad_hidden.view(ctx.shape), grad_weight.to(weight.dtype), None, None


def loss_of(hidden, weight, labels, chunk: int, recompute: bool):
    if chunk == 0:
        return cross_entropy_sum(F.linear(hidden, weight), labels)
    if recompute:
        return _Recompute.apply(hidden, weight, labels, chunk)
    return linear_cross_entropy_sum(hidden, weight, labels, chunk)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_case(tokens: int, dim: int, vocab: int, dtype: str, chunk: int, recompute: bool, repeat: int) -> dict:
    """Run in a fresh process: the case's median time and peak memory beyond its inputs."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(1, tokens, dim, device=device, generator=g).requires_grad_()
    weight = torch.empty(vocab, dim, device=device).normal_(0, dim**-0.5, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), device=device, generator=g)
    labels[:, ::10] = IGNORE_INDEX
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def step():
        with amp:
            loss = loss_of(hidden, weight, labels, chunk, recompute)
        loss.backward()
        return loss.item()

    if device.type == "cuda":
        step()  # kernels and allocator warmed up; the gradients exist from here on, as in training
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = rss_bytes()
    times, cpu_times, loss = [], [], None
    for _ in range(repeat):
        hidden.grad = weight.grad = None
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    grads = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    return {
        "time_s": statistics.median(times),
        "cpu_s": statistics.median(cpu_times),
        "peak_gib": peak / 2**30,
        "activations_gib": (peak - grads) / 2**30,
        "loss": loss,
        "device": device.type,
    }


def one_step_case(flavor: str, tokens: int, batch: int, vocab: int, dtype: str, chunk: int, steps: int) -> dict:
    """Run in a fresh process: whole Qwen3 training steps, the loss whole or chunked."""
    from torchtitan.models.common.chunked_loss import forward_loss_fn
    from torchtitan.models.registry import get_model_spec

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = get_model_spec("qwen3")
    args = spec.args_for_training(flavor, vocab, tokens)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    model.loss_chunk_tokens = chunk
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = forward_loss_fn(spec.loss_sum_fn, chunk)
    g = torch.Generator(device=device).manual_seed(0)
    window = torch.randint(0, vocab, (batch, tokens + 1), device=device, generator=g)
    inputs, labels = window[:, :-1], window[:, 1:]
    times, loss = [], None
    for _ in range(steps):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            out = model(inputs, labels=labels) if chunk else model(inputs)
            loss = loss_fn(out, labels) / labels.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "tps": batch * tokens / statistics.median(times[1:] or times),
        "peak_gib": peak / 2**30,
        "loss": loss.item(),
        "params": sum(p.numel() for p in model.parameters()),
    }


# docs/benchmarks.md's columns, before command, commit, machine and date.
PASS_COLUMNS = [
    "tokens",
    "vocab",
    "dtype",
    "chunk tokens",
    "peak GiB",
    "of which not gradients",
    "time s",
    "CPU s",
    "peak, CPU s vs whole",
]
STEP_COLUMNS = [
    "model, tokens x batch",
    "dtype",
    "chunk tokens",
    "peak GiB (process)",
    "tokens/s",
    "last step's loss",
    "peak, tokens/s vs whole",
]


def print_markdown(columns: list[str], rows: list[list], argv: list[str]) -> None:
    """--markdown: the rows of docs/benchmarks.md (scripts/benchmark_table.py, beside this script)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchmark_table

    benchmark_table.print_rows(columns, rows, argv, __file__)


def whole_steps(args) -> int:
    vocab = int(args.vocab.split(",")[0])
    print(
        f"qwen3 {args.step}, vocab {vocab:,}: {args.steps} steps of {args.batch} x {args.tokens} tokens, "
        f"{'cuda' if torch.cuda.is_available() else f'cpu ({torch.get_num_threads()} threads)'}"
    )
    print("| dtype | chunk tokens | peak GiB (process) | tokens/s | last step's loss | peak, tokens/s vs whole |")
    print("|---|---|---|---|---|---|")
    model, rows = f"qwen3 {args.step}, {args.tokens} x {args.batch}", []
    for dtype in args.dtype.split(","):
        whole = None
        for chunk in map(int, args.chunks.split(",")):
            case = dict(
                flavor=args.step,
                tokens=args.tokens,
                batch=args.batch,
                vocab=vocab,
                dtype=dtype,
                chunk=chunk,
                steps=args.steps,
            )
            out = subprocess.run(
                [sys.executable, __file__, "--step-case", json.dumps(case)], capture_output=True, text=True
            )
            if out.returncode != 0:
                print(f"| {dtype} | {chunk} | failed: {out.stderr.strip().splitlines()[-1]} | | | |")
                rows.append([model, dtype, chunk, f"failed: {out.stderr.strip().splitlines()[-1]}", "", "", ""])
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            whole = r if chunk == 0 else whole
            ratio = f"{r['peak_gib'] / whole['peak_gib']:.2f}, {r['tps'] / whole['tps']:.2f}" if whole else ""
            print(
                f"| {dtype} | {'whole logits' if chunk == 0 else chunk} | {r['peak_gib']:.2f} | {r['tps']:,.0f} | "
                f"{r['loss']:.4f} | {ratio} |",
                flush=True,
            )
            name = "whole logits" if chunk == 0 else chunk
            rows.append([model, dtype, name, f"{r['peak_gib']:.2f}", f"{r['tps']:,.0f}", f"{r['loss']:.4f}", ratio])
    if args.markdown:
        print_markdown(STEP_COLUMNS, rows, args.argv)
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--vocab", default="151936,248320")
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--chunks", default="0,256,1024,2048", help="chunk sizes; 0 is the whole logits")
    p.add_argument(
        "--recompute", type=int, default=0, help="also this chunk size with the logits recomputed in backward"
    )
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--step", help="whole training steps of this Qwen3 flavor instead (e.g. debugmodel)")
    p.add_argument("--batch", type=int, default=1, help="--step: sequences per step")
    p.add_argument("--steps", type=int, default=3, help="--step: steps per case")
    p.add_argument("--markdown", action="store_true", help="also print the rows of docs/benchmarks.md")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case as JSON, in this process
    p.add_argument("--step-case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv  # the command of --markdown's rows
    if args.case:
        print(json.dumps(one_case(**json.loads(args.case))), flush=True)
        return 0
    if args.step_case:
        print(json.dumps(one_step_case(**json.loads(args.step_case))), flush=True)
        return 0
    if args.step:
        return whole_steps(args)
    print(
        f"output layer + loss, forward and backward: {args.tokens} tokens, hidden {args.dim}, "
        f"{'cuda' if torch.cuda.is_available() else f'cpu ({torch.get_num_threads()} threads)'}, "
        f"median of {args.repeat}"
    )
    print(
        "| vocab | dtype | chunk tokens | peak GiB | of which not gradients | time s | CPU s | peak, CPU s vs whole |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for vocab in map(int, args.vocab.split(",")):
        for dtype in args.dtype.split(","):
            cases = [(int(c), False) for c in args.chunks.split(",")] + (
                [(args.recompute, True)] if args.recompute else []
            )
            whole = None
            for chunk, recompute in cases:
                case = dict(
                    tokens=args.tokens,
                    dim=args.dim,
                    vocab=vocab,
                    dtype=dtype,
                    chunk=chunk,
                    recompute=recompute,
                    repeat=args.repeat,
                )
                out = subprocess.run(
                    [sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True
                )
                if out.returncode != 0:
                    failed = f"failed: {out.stderr.strip().splitlines()[-1]}"
                    print(f"| {vocab:,} | {dtype} | {chunk} | {failed} | | | | |")
                    rows.append([args.tokens, f"{vocab:,}", dtype, chunk, failed, "", "", "", ""])
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                if chunk == 0:
                    whole = r
                name = "whole logits" if chunk == 0 else f"{chunk}" + (" (recompute in backward)" if recompute else "")
                ratio = f"{r['peak_gib'] / whole['peak_gib']:.2f}, {r['cpu_s'] / whole['cpu_s']:.2f}" if whole else ""
                print(
                    f"| {vocab:,} | {dtype} | {name} | {r['peak_gib']:.2f} | {r['activations_gib']:.2f} | "
                    f"{r['time_s']:.2f} | {r['cpu_s']:.1f} | {ratio} |",
                    flush=True,
                )
                figures = [
                    f"{r['peak_gib']:.2f}",
                    f"{r['activations_gib']:.2f}",
                    f"{r['time_s']:.2f}",
                    f"{r['cpu_s']:.1f}",
                ]
                rows.append([args.tokens, f"{vocab:,}", dtype, name, *figures, ratio])
    if args.markdown:
        print_markdown(PASS_COLUMNS, rows, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
