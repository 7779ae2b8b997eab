"""FlexAttention where it trains (CUDA): numerics against SDPA with the same mask, and the same
under torch.compile of the model. Prints one line per check and exits 1 if one fails.

    python scripts/flex_attention_check.py [--markdown]

--markdown also prints the checks as rows of docs/benchmarks.md's table, with the command, commit, machine
and date.

Speed is measured by scripts/benchmark.py --attention 1 (tokens/s of causal against block_causal
with each kernel, and the first step's time, which on CUDA is mostly compilation), e.g.

    python scripts/short_documents.py /tmp/docs.jsonl --lines 20
    python scripts/benchmark.py --attention 1 --steps 12 --warmup 4 --job.config_file \\
        train_configs/debug_model.toml --model.name qwen3 --model.flavor 0.6B --training.seq_len 4096 \\
        --training.local_batch_size 2 --training.dataset local --training.dataset_path /tmp/docs.jsonl
"""

import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from a checkout

import torch  # noqa: E402

from torchtitan.config.errors import UserError, run_main  # noqa: E402
from torchtitan.models.common.attention import document_ids, flex_attention_fn, sdpa_attention, set_attention_fn  # noqa: E402
from torchtitan.models.registry import get_model_spec  # noqa: E402

EOS = 2


def random_documents(batch: int, seq: int, mean_length: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 1000, (batch, seq), generator=g)
    tokens[torch.rand(batch, seq, generator=g) < 1 / mean_length] = EOS
    return tokens.to(device)


def kernel_diffs(dtype, window, device) -> tuple[float, float]:
    """(max |flex - sdpa| over the output and the q, k, v gradients, the largest |value| of SDPA's)."""
    torch.manual_seed(0)
    b, h, kv, s, d = 2, 8, 2, 2048, 64
    doc_ids = document_ids(random_documents(b, s, 100, device), EOS)
    base = [torch.randn(b, n, s, d, device=device, dtype=dtype) for n in (h, kv, kv)]
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)
    results = []
    for fn in (flex_attention_fn(compiled=True), sdpa_attention):
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = fn(q, k, v, doc_ids, window)
        out.backward(grad)
        results.append([out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()])
    diff = max((a - b).abs().max().item() for a, b in zip(*results))
    return diff, max(t.abs().max().item() for t in results[1])


def model_diff(device, compile_model: bool) -> float:
    """Qwen3 debug flavor with a sliding window, block_causal: the loss and gradients with flex
    against sdpa, optionally with the blocks under torch.compile."""
    spec = get_model_spec("qwen3")
    args = spec.args_for_training("debugmodel", 2048, 1024, overrides={"sliding_window": 128, "max_window_layers": 1})
    tokens = random_documents(4, 1025, 60, device)
    doc_ids = document_ids(tokens[:, :-1], EOS)
    grads = []
    for fn in (flex_attention_fn(compiled=True), sdpa_attention):
        with torch.device("meta"):
            model = spec.model_cls(args)
        model.to_empty(device=device)
        model.init_weights(seed=0)
        set_attention_fn(model, spec.cp_attention, fn)
        if compile_model:
            for name, block in model.layers.named_children():
                model.layers.register_module(name, torch.compile(block))
        loss = spec.loss_sum_fn(model(tokens[:, :-1], doc_ids=doc_ids), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        grads.append([loss.detach()] + [p.grad.detach().clone() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


COLUMNS = ["check", "max difference", "largest value", "result"]  # docs/benchmarks.md's, before the provenance


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if set(argv) - {"--markdown"}:
        raise UserError(f"unknown arguments {sorted(set(argv) - {'--markdown'})}; the only option is --markdown")
    rows = []
    if not torch.cuda.is_available():
        raise UserError("FlexAttention trains on CUDA only; this machine has no GPU")
    device = torch.device("cuda")
    failed = False
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 5e-2)):  # relative to the largest value
        for window in (None, 256):
            start = time.perf_counter()
            diff, scale = kernel_diffs(dtype, window, device)
            ok = diff < tol * scale
            failed |= not ok
            print(
                f"kernel {str(dtype).split('.')[-1]:>8} window {str(window):>4}: max |flex - sdpa| {diff:.2e} "
                f"(largest value {scale:.2f}, tolerance {tol:g} of it) {'ok' if ok else 'FAILED'} "
                f"[{time.perf_counter() - start:.1f}s with compilation]",
                flush=True,
            )
            name = str(dtype).split(".")[-1]
            check = f"FlexAttention (compiled) against SDPA, {name}, window {window}: forward and q/k/v gradients"
            rows.append([check, f"{diff:.1e}", f"{scale:.1f}", "ok" if ok else "FAILED"])
    for compile_model in (False, True):
        start = time.perf_counter()
        diff = model_diff(device, compile_model)
        ok = diff < 1e-3
        failed |= not ok
        print(
            f"qwen3 debug, window 128, block_causal, compile {compile_model}: loss and gradients max |flex - "
            f"sdpa| {diff:.2e} {'ok' if ok else 'FAILED'} [{time.perf_counter() - start:.1f}s]",
            flush=True,
        )
        check = f"qwen3 debug, window 128, block_causal, compile {compile_model}: loss and gradients"
        rows.append([check, f"{diff:.1e}", "", "ok" if ok else "FAILED"])
    if "--markdown" in argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/benchmark_table.py
        import benchmark_table

        benchmark_table.print_rows(COLUMNS, rows, argv, __file__)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
