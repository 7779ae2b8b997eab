"""Start-up time and tokens/s per rank of training.dataset = "tokens" on a generated token folder.

    python scripts/benchmark_data.py [--size-mb 1024] [--folder /tmp/bench_tokens] [--seq-len 2048]
    python scripts/benchmark_data.py --mix-mb 32 --dp 1,8,64 --mix-workers 0,1,2
    python scripts/benchmark_data.py --resume

Generates (once; reused if present with the same size) a token folder of --size-mb MB of random ids
of the shipped 4k tokenizer's vocabulary (uint16), in documents of 1..4000 tokens, then for several
data-parallel layouts builds rank (D - 1)'s loader (the rank that skips the most) and prints:

- start-up: build_dataloader (open, checks, memory maps) plus the first batch, fresh and resumed
  from a state near the end of the first epoch (independent of the corpus size);
- tokens/s delivered to that rank (inputs, local_batch_size x seq_len per batch), shuffle on.

With --text-workers (e.g. 0,1,2), also the text pipeline: tokens/s delivered from the embedded
python_stdlib corpus, tokenized by the shipped sentencepiece model, with that many
training.data_workers (0: in the process that trains), shuffle on, dp 1.

With --mix-mb (e.g. 32), a mixture instead: a folder of 8 parquet shards and a folder of 8 jsonl.zst
shards (standard library text, --mix-mb MB of text each, generated once), mixed 0.5:0.5, tokenized
by the shipped sentencepiece model; for each --dp degree and --mix-workers count, rank (D - 1) reads
until both sources have been passed once, and the line gives the tokens/s delivered to that rank and
the bytes it read (its process and its data workers, /proc/PID/io rchar) against the corpus's bytes.

With --resume, the start-up of a loader resumed 1,000 and 99,500 documents into a folder of 100
jsonl.zst shards (1,000 documents each), with the documents per shard in its state and without.

For scale: the debug model trains at about 2,150 tokens/s on CPU (README, scripts/benchmark.py), so
the target is at least 100x that, 215,400 tokens/s per rank. Not a test: it prints figures.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.components import token_file  # noqa: E402
from torchtitan.components.data import build_dataloader  # noqa: E402
from torchtitan.components.tokenizer import Tokenizer  # noqa: E402
from torchtitan.config.job_config import Training  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "python_stdlib_4k.model"
DEBUG_MODEL_TOKENS_PER_S = 2_154  # README: the debug model on CPU


def generate(folder: Path, size_mb: int, tokenizer) -> dict:
    meta_file = folder / token_file.META
    num_tokens = size_mb * (1 << 20) // 2
    if meta_file.is_file() and json.loads(meta_file.read_text())["num_tokens"] == num_tokens:
        return json.loads(meta_file.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    meta_file.unlink(missing_ok=True)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    vocab = tokenizer.vocab_size
    lengths = []
    with open(folder / token_file.TOKENS, "wb") as f:
        written = 0
        while written < num_tokens:
            n = min(1 << 24, num_tokens - written)
            f.write(rng.integers(0, vocab, n, dtype=np.uint16).astype("<u2").tobytes())
            written += n
    total = 0
    while total < num_tokens:
        chunk = rng.integers(1, 4001, 1 << 16)
        lengths.append(chunk)
        total += int(chunk.sum())
    lengths = np.concatenate(lengths)
    ends = np.cumsum(lengths)
    keep = int(np.searchsorted(ends, num_tokens))
    lengths = lengths[: keep + 1]
    lengths[-1] -= int(ends[keep]) - num_tokens  # the last document ends at the last token
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<u8")
    offsets.tofile(folder / token_file.INDEX)
    fingerprint = token_file.tokenizer_fingerprint(tokenizer)
    meta = {
        "format": token_file.FORMAT, "version": token_file.FORMAT_VERSION, "dtype": "uint16",
        "source": {"description": "benchmark: random ids"}, "tokenizer": fingerprint, "vocab_size": vocab,
        "bos_id": fingerprint["bos_id"], "eos_id": fingerprint["eos_id"], "num_docs": len(lengths),
        "num_tokens": num_tokens, "max_id": vocab - 1, "source_random_access": True,
    }
    meta_file.write_text(json.dumps(meta))
    print(f"generated {folder}: {num_tokens:,} tokens, {len(lengths):,} documents in "
          f"{time.perf_counter() - start:.1f} s")
    return meta


def generate_mixture(folder: Path, mb: int) -> list[Path]:
    """A parquet folder and a jsonl.zst folder of 8 shards each, `mb` MB of standard library text each."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from torchtitan.components.data import stdlib_files

    marker = folder / f"done-{mb}"
    parquet, zst = folder / "parquet", folder / "zst"
    if marker.is_file():
        return [parquet, zst]
    texts = [f.read_text(errors="replace") for f in stdlib_files()]
    for out in (parquet, zst):
        out.mkdir(parents=True, exist_ok=True)
        docs, size, k = [], 0, 0
        while size < mb << 20:  # the library repeated, each copy marked so no two documents are equal
            docs.append(f"# copy {k // len(texts)}\n" + texts[k % len(texts)])
            size += len(docs[-1])
            k += 1
        for shard in range(8):
            part = docs[shard::8]
            if out is parquet:
                pq.write_table(pa.table({"text": part}), out / f"shard-{shard:05d}.parquet", row_group_size=256)
            else:
                lines = "".join(json.dumps({"text": d}) + "\n" for d in part).encode()
                (out / f"shard-{shard:05d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
    marker.write_text("")
    return [parquet, zst]


def bytes_read(pids: list[int]) -> int:
    """Bytes the processes have read through read() calls so far (/proc/PID/io rchar)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("rchar:"):
                    total += int(line.split()[1])
        except OSError:
            pass  # a worker that has ended
    return total


def mixture_benchmark(args, tokenizer):
    import os

    paths = generate_mixture(Path(args.mix_folder), args.mix_mb)
    corpus = sum(f.stat().st_size for p in paths for f in p.iterdir())
    print(f"mixture: {paths[0]} (8 parquet shards) and {paths[1]} (8 jsonl.zst shards), {corpus / 1e6:.1f} MB on "
          f"disk, 0.5:0.5; seq_len {args.seq_len}, local batch {args.local_batch}; rank D - 1 reads until both "
          "sources have been passed once")
    for dp in (int(d) for d in args.dp.split(",")):
        for workers in (int(w) for w in args.mix_workers.split(",") if w):
            cfg = Training(dataset_mix=[f"0.5:{paths[0]}", f"0.5:{paths[1]}"], seq_len=args.seq_len,
                           local_batch_size=args.local_batch, data_workers=workers)
            loader = build_dataloader(cfg, tokenizer, dp - 1, dp, args.local_batch * dp)
            read_before = bytes_read([os.getpid()])
            start, batches = time.perf_counter(), 0
            it = iter(loader)
            while min(part.stream.epoch for part in loader.dataset.parts) < 1:
                next(it)
                batches += 1
            seconds = time.perf_counter() - start
            rate = batches * args.local_batch * args.seq_len / seconds
            # With workers the trainer also reads their tokens through pipes, which rchar counts too.
            read = (f"read {(bytes_read([os.getpid()]) - read_before) / 1e6:8.1f} MB of the corpus's "
                    f"{corpus / 1e6:.1f} MB" if workers == 0 else "(bytes read: measured without workers)")
            print(f"dp {dp:3d} rank {dp - 1:3d}, data_workers {workers}: {rate:10,.0f} tokens/s delivered, {read} "
                  f"({seconds:.1f} s)")
            del it, loader


def resume_benchmark(args, tokenizer):
    """Start-up of a run resumed N documents into a folder of 100 jsonl.zst shards of 1,000 documents each,
    with the documents per shard its state saved (as a run that read them saves them) and without."""
    import zstandard

    folder = Path(args.resume_folder)
    if not (folder / ".done").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        texts = [f.read_text(errors="replace")[:2000] for f in stdlib_files_list()]
        for shard in range(100):
            lines = "".join(json.dumps({"text": f"# {shard}.{i}\n" + texts[(shard * 1000 + i) % len(texts)]}) + "\n"
                            for i in range(1000))
            (folder / f"shard-{shard:03d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        (folder / ".done").write_text("")  # hidden: not read as data
    cfg = Training(dataset="local", dataset_path=str(folder), seq_len=args.seq_len, local_batch_size=args.local_batch)
    names = sorted(p.name for p in folder.glob("*.zst"))
    print(f"resume: {folder}, 100 jsonl.zst shards of 1,000 documents; time to the first batch of a resumed loader")
    for n in (1_000, 100_000 - 500):
        for with_layout in (True, False):
            layout = {name: [1000, (folder / name).stat().st_size] for name in names[: n // 1000]}
            state = build_dataloader(cfg, tokenizer, 0, 1, args.local_batch).state_dict()
            state["dataset_state"].update(doc_index=n, next_sample=n, token_offset=0, carry=[],
                                          source_layout={"file_documents": layout} if with_layout else None)
            start = time.perf_counter()
            loader = build_dataloader(cfg, tokenizer, 0, 1, args.local_batch)
            loader.load_state_dict(state)
            next(iter(loader))
            print(f"  at document {n:7,}, {'with   ' if with_layout else 'without'} the saved documents per shard: "
                  f"{(time.perf_counter() - start) * 1000:8.1f} ms")


def stdlib_files_list():
    from torchtitan.components.data import stdlib_files

    return stdlib_files()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--folder", default="/tmp/bench_tokens")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--local-batch", type=int, default=8)
    parser.add_argument("--dp", default="1,8,64", help="data-parallel degrees to measure")
    parser.add_argument("--seconds", type=float, default=5.0, help="measuring time per layout")
    parser.add_argument("--text-workers", default="", help="data_workers counts for the text pipeline, e.g. 0,1,2")
    parser.add_argument("--mix-mb", type=int, default=0, help="MB of text per source of the mixture benchmark")
    parser.add_argument("--mix-folder", default="/tmp/bench_mix")
    parser.add_argument("--mix-workers", default="0", help="data_workers counts for the mixture benchmark")
    parser.add_argument("--resume", action="store_true", help="start-up of resumed loaders on jsonl.zst shards")
    parser.add_argument("--resume-folder", default="/tmp/bench_resume")
    args = parser.parse_args()
    tokenizer = Tokenizer(MODEL)
    if args.resume:
        resume_benchmark(args, tokenizer)
        return
    if args.mix_mb:
        mixture_benchmark(args, tokenizer)
        return
    for workers in (int(w) for w in args.text_workers.split(",") if w):
        cfg = Training(dataset="python_stdlib", seq_len=args.seq_len, local_batch_size=args.local_batch,
                       data_workers=workers)
        it = iter(build_dataloader(cfg, tokenizer, 0, 1, args.local_batch))
        next(it)  # the workers are started and have read ahead
        batches, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            next(it)
            batches += 1
        rate = batches * args.local_batch * args.seq_len / (time.perf_counter() - start)
        print(f"text pipeline, data_workers {workers}: {rate:12,.0f} tokens/s delivered")
    folder = Path(args.folder)
    meta = generate(folder, args.size_mb, tokenizer)
    print(f"token folder: {meta['num_tokens'] * 2 / (1 << 30):.2f} GiB, {meta['num_tokens']:,} tokens, "
          f"{meta['num_docs']:,} documents; seq_len {args.seq_len}, local batch {args.local_batch}, shuffle on")
    target = 100 * DEBUG_MODEL_TOKENS_PER_S
    for dp in (int(d) for d in args.dp.split(",")):
        rank = dp - 1
        cfg = Training(dataset="tokens", dataset_path=str(folder), seq_len=args.seq_len,
                       local_batch_size=args.local_batch, shuffle_documents=True)
        gb = args.local_batch * dp
        start = time.perf_counter()
        loader = build_dataloader(cfg, tokenizer, rank, dp, gb)
        it = iter(loader)
        next(it)
        startup = time.perf_counter() - start
        batches, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            next(it)
            batches += 1
        rate = batches * args.local_batch * args.seq_len / (time.perf_counter() - start)
        # Resumed near the end of the first epoch: start-up does not depend on the position either.
        state = loader.state_dict()
        state["dataset_state"].update(doc_index=meta["num_docs"] - 10, token_offset=0, carry=[])
        start = time.perf_counter()
        resumed = build_dataloader(cfg, tokenizer, rank, dp, gb)
        resumed.load_state_dict(state)
        next(iter(resumed))
        resumed_startup = time.perf_counter() - start
        print(f"dp {dp:3d} rank {rank:3d}: start-up {startup * 1000:6.1f} ms (resumed deep: "
              f"{resumed_startup * 1000:6.1f} ms), {rate:12,.0f} tokens/s delivered to the rank "
              f"({rate / DEBUG_MODEL_TOKENS_PER_S:,.0f}x the debug model's ~{DEBUG_MODEL_TOKENS_PER_S:,} tokens/s; "
              f"target {target:,}: {'met' if rate >= target else 'NOT met'})")


if __name__ == "__main__":
    main()
