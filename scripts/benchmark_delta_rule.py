"""The gated delta rule's chunked kernel (torchtitan.models.common.delta_rule) against causal softmax
attention of the same heads and head size, forward and backward, at several sequence lengths:
time and peak allocated memory, and the chunked kernel's agreement with the token-by-token one.

    python scripts/benchmark_delta_rule.py [--lengths 1024,4096,16384] [--heads 4] [--head-dim 64]
        [--chunk 64] [--repeat 3] [--check-lengths 1024,4096,16384] [--markdown]
    python scripts/benchmark_delta_rule.py --layers [--flavor debugmodel] [--lengths ...] [--repeat 3] [--markdown]

Per length, one sequence (batch 1), float32 on the CPU: q, k, v [1, seq, heads, head_dim] (q and k
L2-normalized, as gated DeltaNet feeds the rule), g and beta [1, seq, heads]; the attention case runs
torch's scaled_dot_product_attention (is_causal) on the same q, k, v. Reported: the median wall time
of `repeat` forward+backward passes, and the most bytes the CPU allocator held at once during one
pass beyond its inputs (the profiler's allocation events, torchtitan.planner.allocations). The check
runs the token-by-token form (forward only: a Python loop over the tokens) at --check-lengths and
prints the largest difference of the outputs.

--layers instead times whole Qwen3.5 blocks of one flavor (the same width): a gated DeltaNet block
(projections, conv, the chunked rule, gated norm, SwiGLU) against a gated full-attention block (SDPA,
the default kernel), forward and backward of one sequence, float32, parameters' gradients included.

--markdown: after the table, its rows for docs/benchmarks.md, with the command, commit, machine and date.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torchtitan.config.errors import ArgumentParser, UserError, run_main  # noqa: E402


def print_markdown(header: str, rows: list[str], argv: list[str]) -> None:
    """--markdown: the printed table's rows (`header`'s columns) for docs/benchmarks.md, through
    scripts/benchmark_table.py (beside this script)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchmark_table

    split = [[c.strip() for c in line.strip()[1:-1].split("|")] for line in [header, *rows]]
    benchmark_table.print_rows(split[0], split[1:], argv, __file__)


def numbers(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise UserError(f"{what} takes comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{what} takes whole numbers of 1 or more, got {text!r}")
    return values


def inputs(seq: int, heads: int, dim: int):
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, seq, heads, dim, generator=gen), dim=-1) * dim**-0.5
    k = F.normalize(torch.randn(1, seq, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, seq, heads, dim, generator=gen)
    g = -torch.rand(1, seq, heads, generator=gen)
    beta = torch.rand(1, seq, heads, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def measure(fn, tensors, repeat: int) -> tuple[float, float, int]:
    """(median wall seconds and process CPU seconds of forward+backward, peak bytes allocated during one
    pass). On a shared host the wall time follows the others' load; the CPU time, much less."""
    from torchtitan.planner.allocations import memory_profile, peak_bytes

    def step():
        out = fn()
        out.backward(torch.ones_like(out))
        for t in tensors:
            t.grad = None

    times, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    with memory_profile() as prof:
        step()
    return statistics.median(times), statistics.median(cpu), peak_bytes(prof)


def benchmark(argv: list[str]) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--check-lengths",
        default="1024,4096,16384",
        help="lengths at which the token-by-token form is run too (slow: a loop over the tokens)",
    )
    p.add_argument("--layers", action="store_true", help="whole Qwen3.5 blocks instead of the bare kernels")
    p.add_argument("--flavor", default="debugmodel", help="--layers: the qwen3_5 flavor whose blocks are timed")
    p.add_argument("--markdown", action="store_true", help="also print the rows of docs/benchmarks.md")
    opts = p.parse_args(argv)
    opts.argv = argv  # the command of --markdown's rows
    lengths = numbers(opts.lengths, "--lengths")
    if opts.layers:
        return layer_rows(opts, lengths)
    checks = set(numbers(opts.check_lengths, "--check-lengths")) if opts.check_lengths else set()
    for name in ("heads", "head_dim", "chunk", "repeat"):
        if getattr(opts, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(opts, name)}")

    from torchtitan.models.common import delta_rule

    print(
        f"heads {opts.heads}, head_dim {opts.head_dim}, chunk {opts.chunk}, float32, batch 1, "
        f"{torch.get_num_threads()} threads; forward+backward, median of {opts.repeat}"
    )
    header = (
        "| tokens | delta rule s (CPU s) | delta rule MiB | attention s (CPU s) | attention MiB | "
        "delta rule / attention CPU time | max diff to token by token |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|")
    rows = []
    for seq in lengths:
        q, k, v, g, beta = x = inputs(seq, opts.heads, opts.head_dim)
        # measure() calls each function in this iteration; the default arguments bind this length's tensors.
        rule_s, rule_cpu, rule_b = measure(
            lambda q=q, k=k, v=v, g=g, beta=beta: delta_rule.chunked(q, k, v, g, beta, chunk=opts.chunk)[0],
            x,
            opts.repeat,
        )
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        attn_s, attn_cpu, attn_b = measure(
            lambda qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
            [qt, kt, vt],
            opts.repeat,
        )
        diff = ""
        if seq in checks:
            with torch.no_grad():
                ref, _ = delta_rule.recurrent(q, k, v, g, beta)
                got, _ = delta_rule.chunked(q, k, v, g, beta, chunk=opts.chunk)
            diff = f"{(ref - got).abs().max().item():.1e}"
        rows.append(
            f"| {seq} | {rule_s:.3f} ({rule_cpu:.3f}) | {rule_b / 2**20:.1f} | {attn_s:.3f} ({attn_cpu:.3f}) | "
            f"{attn_b / 2**20:.1f} | {rule_cpu / attn_cpu:.2f} | {diff} |"
        )
        print(rows[-1], flush=True)
    if opts.markdown:
        print_markdown(header, rows, opts.argv)


def layer_rows(opts, lengths: list[int]) -> None:
    from torchtitan.models.registry import get_model_args, get_model_spec

    spec = get_model_spec("qwen3_5")
    get_model_args("qwen3_5", opts.flavor)  # an unknown flavor is a UserError naming the known ones
    args = spec.args_for_training(opts.flavor, 4096, max(lengths))
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights(seed=0)
    kinds = {
        "gated DeltaNet": next(i for i in range(args.n_layers) if not args.is_full_attention(i)),
        "gated attention": next(i for i in range(args.n_layers) if args.is_full_attention(i)),
    }
    print(
        f"qwen3_5 {opts.flavor}: dim {args.dim}; DeltaNet {args.linear_num_key_heads} key / "
        f"{args.linear_num_value_heads} value heads of {args.linear_key_head_dim} / {args.linear_value_head_dim}, "
        f"chunk {args.delta_chunk}; attention {args.n_heads} / {args.n_kv_heads} heads of {args.head_dim}; float32, "
        f"batch 1, {torch.get_num_threads()} threads; forward+backward of one block, median of {opts.repeat}"
    )
    header = (
        "| tokens | DeltaNet block s (CPU s) | DeltaNet block MiB | attention block s (CPU s) | attention block MiB "
        "| DeltaNet / attention CPU time |"
    )
    print(header)
    print("|---|---|---|---|---|---|")
    rows = []
    for seq in lengths:
        row = []
        for layer in kinds.values():
            block = model.layers[str(layer)]
            x = torch.randn(1, seq, args.dim, generator=torch.Generator().manual_seed(0), requires_grad=True)
            # measure() calls the function in this iteration; the default arguments bind this block and input.
            row.append(
                measure(
                    lambda block=block, x=x, seq=seq: block(x, model.rope[:seq]), [x, *block.parameters()], opts.repeat
                )
            )
        (d_s, d_cpu, d_b), (a_s, a_cpu, a_b) = row
        rows.append(
            f"| {seq} | {d_s:.3f} ({d_cpu:.3f}) | {d_b / 2**20:.1f} | {a_s:.3f} ({a_cpu:.3f}) | {a_b / 2**20:.1f} "
            f"| {d_cpu / a_cpu:.2f} |"
        )
        print(rows[-1], flush=True)
    if opts.markdown:
        print_markdown(header, rows, opts.argv)


if __name__ == "__main__":
    sys.exit(run_main(benchmark, sys.argv[1:]))
