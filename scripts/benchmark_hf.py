"""Hugging Face load and save at scale: per-rank peak memory and times of the trainer's sharded load
(checkpoint.initial_load_in_hf) and export (checkpoint.last_save_in_hf).

    python scripts/benchmark_hf.py make FOLDER [--model llama3] [--flavor 1B]   # transformers, random weights
    torchrun --nproc_per_node 4 scripts/benchmark_hf.py run FOLDER [--model.name llama3 --model.flavor 1B]
        [trainer overrides, e.g. a layout] [--markdown]

`make` writes a folder as the hub has it: transformers builds the Hugging Face model of our family's
flavor (llama3 1B: Llama 3.2 1B's config, tied embeddings and rotary scaling included; qwen3 1.7B: Qwen3-1.7B's)
from its config.json with random weights, and save_pretrained writes it in bfloat16 with
max_shard_size="500MB". `run` builds the model under the layout the overrides give
(default: FSDP over every process), loads the folder into it, exports it again (bfloat16, 500 MiB
files), and prints per rank: its peak resident memory during the load above its size before the load
(a rank that loads nothing stays at that size), the bytes it read, and the load and export times. The
last line is the largest peak growth as a fraction of the folder's bytes. With --markdown, `run` also
prints the launch as a row of docs/benchmarks.md's table (ranges over the ranks), with the command,
commit, machine and date.

Mistakes (a `make` folder that exists or cannot be created, a `run` folder that does not exist, an
unknown model or flavor) are reported in one line on stderr with exit status 2, before any work.
"""

import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from a checkout

from torchtitan.config.errors import ArgumentParser, UserError, check_output_path, run_main  # noqa: E402


def make(folder: str, model: str, flavor: str):
    check_output_path(folder, "FOLDER")
    from torchtitan.models.registry import get_model_args, get_model_spec

    spec = get_model_spec(model)
    args = get_model_args(model, flavor)
    if spec.hf is None:
        raise UserError(f"model '{model}' has no Hugging Face adapter in its spec: there is no folder to make for it")
    try:
        import transformers
    except ImportError:
        raise UserError("make builds the model with transformers: pip install transformers") from None
    import torch

    Path(folder).mkdir(parents=True)
    (Path(folder) / "config.json").write_text(json.dumps(spec.hf.config(args, torch.bfloat16, None, None)))
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    hf_model.save_pretrained(folder, max_shard_size="500MB")
    files = len(list(Path(folder).glob("*.safetensors")))
    print(
        f"wrote {folder}: {model} {flavor}, {sum(p.numel() for p in hf_model.parameters()):,} parameters, {files} files"
    )


# docs/benchmarks.md's columns, before command, commit, machine and date.
COLUMNS = [
    "model",
    "layout",
    "load: peak memory growth per rank",
    "read per rank",
    "load s",
    "export s",
    "export: peak memory growth",
]


def layout_name(p, world: int) -> str:
    """`PP 2 x FSDP 2 (4 processes)`: the parallel degrees of a config's [parallelism] on `world` ranks."""
    pp, tp, cp, ep = (
        p.pipeline_parallel_degree,
        p.tensor_parallel_degree,
        p.context_parallel_degree,
        p.expert_parallel_degree,
    )
    replicate = p.data_parallel_replicate_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        shard = max(1, world // (pp * tp * cp * replicate))
    parts = [f"PP {pp}"] if pp > 1 else []
    if replicate > 1:
        parts.append(f"HSDP {replicate} x {shard}" if shard > 1 else f"DDP {replicate}")
    elif shard > 1:
        parts.append(f"FSDP {shard}")
    parts += [f"{name} {d}" for name, d in (("CP", cp), ("TP", tp), ("EP", ep)) if d > 1]
    return f"{' x '.join(parts) or 'one process'} ({world} processes)"


def spread(values: list[float], unit: str = "") -> str:
    """`lo-hi unit` over the ranks (one value when they agree to the shown precision)."""
    lo, hi = f"{min(values):,.1f}", f"{max(values):,.1f}"
    return f"{lo if lo == hi else f'{lo}-{hi}'}{unit}"


def markdown_row(cfg, records: list[dict], size: int, argv: list[str]) -> None:
    """--markdown: the launch as a row of docs/benchmarks.md (scripts/benchmark_table.py, beside this script)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchmark_table

    mib = 2**20
    growth = [r["peak_growth"] / mib for r in records]
    cells = [
        f"{cfg.model.name} {cfg.model.flavor}",
        layout_name(cfg.parallelism, len(records)),
        f"{spread(growth, ' MiB')} ({max(growth) * mib / size:.2f}x the folder)",
        spread([r["bytes_read"] / mib for r in records], " MiB"),
        spread([r["load_s"] for r in records]),
        spread([r["save_s"] for r in records]),
        f"at most {max(r['save_peak_growth'] for r in records) / mib:,.0f} MiB",
    ]
    launcher = ["torchrun", "--nproc_per_node", str(len(records))]
    benchmark_table.print_rows(COLUMNS, [cells], argv, __file__, launcher)


def run(folder: str, overrides: list[str], markdown: bool = False):
    if not Path(folder).is_dir():
        raise UserError(
            f"FOLDER {folder} does not exist or is not a folder; write one with "
            f"`python scripts/benchmark_hf.py make {folder}` first"
        )
    import torch.distributed as dist

    from torchtitan.components.checkpoint import peak_rss, restart_peak_rss
    from torchtitan.components.metrics import setup_logging
    from torchtitan.config import load_config
    from torchtitan.distributed.determinism import set_determinism
    from torchtitan.train import Trainer, train

    class LoadAndExport(Trainer):
        """The trainer's start-up up to its checkpoint load, then an export; no step."""

        def _run(self):
            ctx = self.ctx
            set_determinism(self.cfg.training.seed, False)
            ctx.mesh = self.dims.build_mesh(self.device.type)
            ctx.dataloader = self.build_dataloader()
            ctx.model = self.build_model()
            ctx.parts, ctx.pipeline = ctx.model.parts, ctx.model.pipeline
            ctx.optim = self.build_optimizer()
            ctx.checkpointer = self.build_checkpointer()
            start = time.perf_counter()
            ctx.checkpointer.load()
            load_s = time.perf_counter() - start
            figures = ctx.checkpointer.hf_load_figures
            before = restart_peak_rss()
            start = time.perf_counter()
            ctx.checkpointer.export_hf(0, self.tokenizer.bos_id, self.tokenizer.eos_id, ctx.mesh)
            save_s = time.perf_counter() - start
            record = dict(figures, load_s=load_s, save_s=save_s, save_peak_growth=peak_rss() - before, rank=self.rank)
            records = [None] * self.dims.world_size
            dist.all_gather_object(records, record)
            return records

    setup_logging()
    # A fresh folder per launch (an export never overwrites a folder), named after the launcher's
    # process so that every local rank picks the same, removed at the end.
    import tempfile

    dump = Path(tempfile.gettempdir()) / f"benchmark_hf_{os.getppid()}"
    cfg = load_config(
        [
            "--job.config_file",
            str(REPO_ROOT / "train_configs" / "debug_model.toml"),
            "--model.name",
            "llama3",
            "--model.flavor",
            "1B",
            "--training.seq_len",
            "256",
            "--checkpoint.initial_load_path",
            folder,
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.export_dtype",
            "bfloat16",
            "--checkpoint.hf_max_shard_mb",
            "500",
            "--job.dump_folder",
            str(dump),
            *overrides,
        ]
    )
    records = train(cfg, LoadAndExport)
    if os.environ.get("RANK", "0") == "0":
        import shutil

        shutil.rmtree(dump, ignore_errors=True)
        size = records[0]["folder_bytes"]
        print(
            f"folder {size / 2**30:.2f} GiB; per rank: peak memory growth while loading / exporting, bytes read, "
            f"load s, export s"
        )
        for r in records:
            print(
                f"rank {r['rank']}: {r['peak_growth'] / 2**20:,.0f} MiB ({r['peak_growth'] / size:.2f}x) / "
                f"{r['save_peak_growth'] / 2**20:,.0f} MiB, read {r['bytes_read'] / 2**20:,.0f} MiB, "
                f"{r['load_s']:.1f} s, {r['save_s']:.1f} s"
            )
        print(f"largest load peak growth: {max(r['peak_growth'] for r in records) / size:.2f}x the folder's bytes")
        if markdown:
            markdown_row(cfg, records, size, ["run", folder, *overrides])


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if not argv or argv[0] not in ("make", "run"):
        raise UserError(
            "give a command: `make FOLDER [--model NAME] [--flavor FLAVOR]` or `run FOLDER [trainer "
            "overrides]` (see the top of scripts/benchmark_hf.py)"
        )
    if argv[0] == "make":
        p = ArgumentParser(prog="benchmark_hf.py make", description="write a Hugging Face folder with random weights")
        p.add_argument("folder", help="a new folder")
        p.add_argument("--model", default="llama3")
        p.add_argument("--flavor", default="1B")
        opts = p.parse_args(argv[1:])
        make(opts.folder, opts.model, opts.flavor)
    else:
        if len(argv) < 2 or argv[1].startswith("--"):
            raise UserError("run needs the FOLDER to load: `run FOLDER [trainer overrides]`")
        run(argv[1], [a for a in argv[2:] if a != "--markdown"], markdown="--markdown" in argv[2:])


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
