"""What one data-parallel rank's data loader costs and delivers: start-up, tokens/s, bytes read.

    python scripts/benchmark_data.py [--size-mb 1024] [--folder /tmp/bench_tokens] [--dp 1,8,64]
    python scripts/benchmark_data.py --text-workers 0,1,2 --dp 1 --size-mb 64
    python scripts/benchmark_data.py --mix-mb 16 [--dp 1,8,64] [--mix-workers 0,1,2]
    python scripts/benchmark_data.py --resume
    (each with --markdown: also the rows of docs/benchmarks.md's tables, with the command, commit, machine and date)

Every source is split into lanes (torchtitan/components/data/lanes.py): global sample k is lane k % G's
sample k // G, G being the global batch size in samples (here local batch x D), and data-parallel rank
r of D owns lanes [r*G/D, (r+1)*G/D) and reads only their data (their files, pieces of files, ranges of
documents). No rank reads or skips another's data, so one process building rank D - 1's loader,
build_dataloader(cfg, tokenizer, D - 1, D, G), measures what any rank of a D-rank job costs; the
ranks are simulated, no process group is started. tokens/s are those delivered to that rank: inputs,
local batch x seq_len per batch.

Token folder (default mode): generates (once; reused if present with the same size) a token folder of
--size-mb MB of random ids of the shipped 4k tokenizer's vocabulary (uint16), in documents of 1..4000
tokens; for each --dp degree prints rank D - 1's start-up (build_dataloader, then the first batch),
fresh and resumed with every lane of the rank near the end of its share of the first epoch (the
position does not change the start-up), and the tokens/s delivered to it over --seconds, shuffled
(the default for a token folder).

--text-workers (e.g. 0,1,2): first the text pipeline alone: tokens/s delivered from the embedded
python_stdlib corpus, tokenized by the shipped sentencepiece model, at dp 1 (local batch lanes) with
that many training.data_workers (0: in the process that trains; a worker reads whole lanes, at most
one worker per lane), shuffled, over --seconds; then the token folder mode.

--mix-mb M: a mixture instead, 0.5:0.5, of a folder of parquet files and a folder of jsonl.zst files,
each holding the same M MB of documents of 4,096 characters cut from the standard library (generated
once, again when M or the lanes change). The folders are sized for the most lanes measured, L =
max(--dp) x local batch (512 by default): L jsonl.zst shards (compressed files do not split: one per
lane at the largest dp) and L / 8 parquet files of 8 row groups (a folder with fewer files than lanes
is read in pieces, here row groups: again one per lane). For each --dp degree D and --mix-workers
count, rank D - 1 (lanes G - local batch .. G - 1, G = D x local batch) reads until it has been
delivered its share of one pass over both sources (the corpus's tokens, framed as [BOS] + text +
[EOS], / D; counted when generated), in stored order (--mix-shuffle: shuffled, as local files are by
default; a shuffled lane reads a whole block of training.shuffle_buffer documents at once, so the
lanes that pass the end of their share before the measurement stops read their next share whole).
Each line gives:

- start-up: build_dataloader plus the first batch (with workers: forking them and their first
  windows); tokens/s: delivered after the first batch, until the rank's share is delivered;
- the bytes the rank read (/proc/PID/io rchar: read() calls, page cache hits included) as a share of
  the corpus's bytes on disk, against the rank's share of the data, 1/D:
  - opening: read by the process that trains during build_dataloader: the start-up checks. Rank 0
    opens every file (pyarrow reads the last 64 KiB of a parquet file for its footer; a compressed
    file's first block is decoded); the other ranks open the first file, and every parquet file's
    footer when there are fewer parquet files than lanes (its row groups make the pieces). Also
    given per file of the corpus. The generated files are small (about 9 KiB of jsonl.zst, 100 KiB
    of parquet at M = 16), so a footer is a large part of a parquet file: a lane's first read of its
    parquet file (counted under reading) reads its footer too;
  - reading: the data itself: without workers, read by the process that trains; with workers, by the
    forked workers (read from loader.dataset.worker_pids() before they are stopped: the trainer then
    reads only the windows they send it through pipes, which are not counted). Compressed bytes are
    not exactly proportional to tokens, so a rank's share of them is only about 1/D. Workers read up to
    4 windows per lane ahead, so their bytes include the start of what comes after the share.

--resume: start-up (build_dataloader + load_state_dict + the first batch, the best of --repeats) of
a loader resumed N = 1,000 and N = 99,500 documents into a folder of 100 jsonl.zst shards of 1,000
documents (of at most 2,000 characters) each, generated once: one lane (global batch 1), stored order,
the lane's position at document N of epoch 0; with the documents per shard of the shards before N in
the state's source_layout (as a run that read them saves them: "unit_documents", with each file's
size; a resume skips those shards without reading them) and without (the resume reads the shards before
N to count their documents). Also checks that the first window starts with document N and that both
give the same first batch, and prints the ratio of the start-ups at the two positions.

For scale: the debug model trains at about 2,150 tokens/s on CPU (docs/benchmarks.md, scripts/benchmark.py), so
the target is at least 100x that, 215,400 tokens/s per rank. Not a test: it prints figures.
"""

import argparse
import gc
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.components.data import build_dataloader, encode_document, stdlib_files, token_folder  # noqa: E402
from torchtitan.components.tokenizer import Tokenizer  # noqa: E402
from torchtitan.config.errors import ArgumentParser, check_output_path, positive_int, run_main  # noqa: E402
from torchtitan.config.training_sections import Training  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "python_stdlib_4k.model"
DEBUG_MODEL_TOKENS_PER_S = 2_154  # docs/benchmarks.md: the debug model on CPU
MIX_DOC_CHARS = 4096  # characters per document of the mixture's corpus
MIX_ROW_GROUPS = 8  # row groups per parquet file of the mixture's corpus


def generate(folder: Path, size_mb: int, tokenizer) -> dict:
    meta_file = folder / token_folder.META
    num_tokens = size_mb * (1 << 20) // 2
    if meta_file.is_file() and json.loads(meta_file.read_text())["num_tokens"] == num_tokens:
        return json.loads(meta_file.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    meta_file.unlink(missing_ok=True)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    vocab = tokenizer.vocab_size
    lengths = []
    with open(folder / token_folder.TOKENS, "wb") as f:
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
    offsets.tofile(folder / token_folder.INDEX)
    fingerprint = token_folder.tokenizer_fingerprint(tokenizer)
    meta = {
        "format": token_folder.FORMAT,
        "version": token_folder.FORMAT_VERSION,
        "dtype": "uint16",
        "source": {"description": "benchmark: random ids"},
        "tokenizer": fingerprint,
        "vocab_size": vocab,
        "bos_id": fingerprint["bos_id"],
        "eos_id": fingerprint["eos_id"],
        "num_docs": len(lengths),
        "num_tokens": num_tokens,
        "max_id": vocab - 1,
        "source_random_access": True,
    }
    meta_file.write_text(json.dumps(meta))
    print(
        f"generated {folder}: {num_tokens:,} tokens, {len(lengths):,} documents in {time.perf_counter() - start:.1f} s"
    )
    return meta


# --- the token folder --------------------------------------------------------------------------------


def token_benchmark(args, tokenizer):
    folder = Path(args.folder)
    meta = generate(folder, args.size_mb, tokenizer)
    print(
        f"token folder: {meta['num_tokens'] * 2 / (1 << 30):.2f} GiB, {meta['num_tokens']:,} tokens, "
        f"{meta['num_docs']:,} documents; seq_len {args.seq_len}, local batch {args.local_batch}, shuffle on; "
        "rank D - 1 of D (every rank reads only its lanes)"
    )
    target = 100 * DEBUG_MODEL_TOKENS_PER_S
    rows = []
    for dp in _ints(args.dp):
        rank = dp - 1
        cfg = Training(
            dataset="tokens",
            dataset_path=str(folder),
            seq_len=args.seq_len,
            local_batch_size=args.local_batch,
            shuffle_documents=True,
        )
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
        # Resumed with each of the rank's lanes 10 documents before the end of its share of epoch 0:
        # start-up does not depend on the position either.
        state = loader.state_dict()
        ends = {lane.index: lane.streams[0].source.count(0) for lane in loader.dataset.lanes}
        for index, position in state["dataset_state"]["lanes"]:
            position[0].update(epoch=0, doc_index=max(0, ends[index] - 10), token_offset=0, carry=[])
        start = time.perf_counter()
        resumed = build_dataloader(cfg, tokenizer, rank, dp, gb)
        resumed.load_state_dict(state)
        next(iter(resumed))
        resumed_startup = time.perf_counter() - start
        print(
            f"dp {dp:3d} rank {rank:3d}: start-up {startup * 1000:6.1f} ms (resumed deep: "
            f"{resumed_startup * 1000:6.1f} ms), {rate:12,.0f} tokens/s delivered to the rank "
            f"({rate / DEBUG_MODEL_TOKENS_PER_S:,.0f}x the debug model's ~{DEBUG_MODEL_TOKENS_PER_S:,} tokens/s; "
            f"target {target:,}: {'met' if rate >= target else 'NOT met'})"
        )
        rows.append([dp, f"{startup * 1000:.1f}", f"{resumed_startup * 1000:.1f}", f"{rate:,.0f}"])
        del it, loader, resumed
    markdown(args, ["dp", "start-up ms", "resumed start-up ms", "tokens/s delivered"], rows)


def text_benchmark(args, tokenizer):
    rows = []
    for workers in _ints(args.text_workers):
        cfg = Training(
            dataset="python_stdlib", seq_len=args.seq_len, local_batch_size=args.local_batch, data_workers=workers
        )
        loader = build_dataloader(cfg, tokenizer, 0, 1, args.local_batch)
        it = iter(loader)
        next(it)  # the workers are started and have read ahead
        batches, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            next(it)
            batches += 1
        rate = batches * args.local_batch * args.seq_len / (time.perf_counter() - start)
        print(
            f"text pipeline (python_stdlib, dp 1, {args.local_batch} lanes), data_workers {workers}: "
            f"{rate:12,.0f} tokens/s delivered"
        )
        rows.append([workers, f"{rate:,.0f}"])
        del it, loader
        gc.collect()  # the workers stop with their loader
    if rows:
        markdown(args, ["data workers", "tokens/s delivered"], rows)


# --- the mixture -----------------------------------------------------------------------------------


def generate_mixture(folder: Path, mb: int, lanes: int, tokenizer) -> dict:
    """A folder of `lanes` jsonl.zst shards and one of lanes / MIX_ROW_GROUPS parquet files of
    MIX_ROW_GROUPS row groups each, holding the same documents: about `mb` MB of the standard library
    cut into MIX_DOC_CHARS characters each (a multiple of `lanes` of them, so that every shard and row
    group holds as many). Returns the meta: documents, tokens (framed, per source), the two folders."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    if lanes % MIX_ROW_GROUPS:
        raise SystemExit(f"the most lanes measured, {lanes}, is not a multiple of {MIX_ROW_GROUPS}")
    meta_file = folder / "meta.json"
    per_lane = max(1, math.ceil((mb << 20) / MIX_DOC_CHARS / lanes))  # documents per shard and row group
    want = {"mb": mb, "lanes": lanes, "doc_chars": MIX_DOC_CHARS, "documents": per_lane * lanes}
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if all(meta.get(k) == v for k, v in want.items()):
            return meta
    start = time.perf_counter()
    meta_file.unlink(missing_ok=True)
    parquet, zst = folder / "parquet", folder / "zst"
    for out in (parquet, zst):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    library = "".join(f.read_text(errors="replace") for f in stdlib_files())
    docs, at = [], 0
    while len(docs) < want["documents"]:  # the library cut in pieces, repeated; each piece numbered
        if at + MIX_DOC_CHARS > len(library):
            at = 0
        docs.append(f"# document {len(docs)}\n" + library[at : at + MIX_DOC_CHARS])
        at += MIX_DOC_CHARS
    files = lanes // MIX_ROW_GROUPS
    rows = len(docs) // files
    for f in range(files):
        pq.write_table(
            pa.table({"text": docs[f * rows : (f + 1) * rows]}),
            parquet / f"shard-{f:05d}.parquet",
            row_group_size=rows // MIX_ROW_GROUPS,
        )
    compressor = zstandard.ZstdCompressor(level=3)
    for s in range(lanes):
        lines = "".join(json.dumps({"text": d}) + "\n" for d in docs[s * per_lane : (s + 1) * per_lane])
        (zst / f"shard-{s:05d}.jsonl.zst").write_bytes(compressor.compress(lines.encode()))
    tokens = sum(len(encode_document(tokenizer, d)) for d in docs)
    meta = {**want, "tokens_per_source": tokens, "paths": [str(parquet), str(zst)]}
    meta_file.write_text(json.dumps(meta))
    print(
        f"generated {folder}: {len(docs):,} documents, {tokens:,} tokens per source, in "
        f"{time.perf_counter() - start:.1f} s"
    )
    return meta


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
    import pyarrow.parquet  # noqa: F401  (imported before any measurement: imports read files too)
    import zstandard  # noqa: F401

    dps = _ints(args.dp)
    lanes = max(dps) * args.local_batch
    meta = generate_mixture(Path(args.mix_folder), args.mix_mb, lanes, tokenizer)
    paths = [Path(p) for p in meta["paths"]]
    sizes = [sum(f.stat().st_size for f in p.iterdir()) for p in paths]
    corpus, files = sum(sizes), sum(len(list(p.iterdir())) for p in paths)
    pid = os.getpid()
    print(
        f"mixture 0.5:0.5 of {paths[0]} ({lanes // MIX_ROW_GROUPS} parquet files of {MIX_ROW_GROUPS} row groups, "
        f"{sizes[0] / 1e6:.1f} MB) and {paths[1]} ({lanes} jsonl.zst shards, {sizes[1] / 1e6:.1f} MB): "
        f"{meta['documents']:,} documents of {MIX_DOC_CHARS:,} characters each ({meta['mb']} MB), "
        f"{meta['tokens_per_source']:,} tokens each; seq_len {args.seq_len}, local batch {args.local_batch}, "
        f"{'shuffled' if args.mix_shuffle else 'stored order'}; rank D - 1 of D (lanes "
        f"G - {args.local_batch} .. G - 1 of G = D x {args.local_batch}) until it has its share of one pass"
    )

    def config(workers: int) -> Training:
        return Training(
            dataset_mix=[f"0.5:{paths[0]}", f"0.5:{paths[1]}"],
            seq_len=args.seq_len,
            local_batch_size=args.local_batch,
            data_workers=workers,
            shuffle_documents=args.mix_shuffle,
        )

    # Once, unmeasured: whatever the first loader imports or caches is not counted for the first line.
    warm = build_dataloader(config(0), tokenizer, max(dps) - 1, max(dps), lanes)
    next(iter(warm))
    del warm
    rows = []
    for dp in dps:
        gb = args.local_batch * dp
        share = 2 * meta["tokens_per_source"] / dp  # framed tokens of one pass over both sources, / D
        batches = max(2, math.ceil(share / (args.seq_len + 1) / args.local_batch))
        for workers in _ints(args.mix_workers):
            before = bytes_read([pid])
            start = time.perf_counter()
            loader = build_dataloader(config(workers), tokenizer, dp - 1, dp, gb)
            opening = bytes_read([pid]) - before
            it = iter(loader)
            next(it)
            first = time.perf_counter()
            for _ in range(batches - 1):
                next(it)
            end = time.perf_counter()
            pids = loader.dataset.worker_pids()
            if workers:  # read before they are stopped; the trainer reads only windows, from pipes
                reading = bytes_read(pids)
            else:
                reading = bytes_read([pid]) - before - opening
            rate = (batches - 1) * args.local_batch * args.seq_len / (end - first)
            total = opening + reading
            print(
                f"dp {dp:3d} rank {dp - 1:3d}, data_workers {workers}: {rate:10,.0f} tokens/s delivered "
                f"(start-up {(first - start) * 1000:6.0f} ms, {batches:4d} batches in {end - start:5.1f} s); read "
                f"{total / 1e6:6.2f} MB = {100 * total / corpus:6.2f}% of the corpus (its share: {100 / dp:6.2f}%): "
                f"opening {100 * opening / corpus:5.2f}% ({opening / files / 1024:4.1f} KiB a file), reading "
                f"{100 * reading / corpus:6.2f}%"
            )
            read = f"{100 * opening / corpus:.1f}% + {100 * reading / corpus:.1f}%"
            rows.append([dp, workers, f"{rate:,.0f}", f"{(first - start) * 1000:.0f}", read, f"{100 / dp:.1f}%"])
            del it, loader
            gc.collect()  # the workers stop with their loader
            if any(Path(f"/proc/{p}").exists() for p in pids):
                raise SystemExit(f"data workers {pids} still run after their loader was collected")
    columns = ["dp", "data workers", "tokens/s delivered", "start-up ms"]
    markdown(args, [*columns, "read, % of the corpus: opening + reading", "the rank's share"], rows)


# --- resuming streamed shards ------------------------------------------------------------------------


def resume_benchmark(args, tokenizer):
    """Start-up of a run resumed N documents into a folder of 100 jsonl.zst shards of 1,000 documents each,
    with the documents per shard before N in its state (as a run that read them saves them) and without."""
    import zstandard

    folder = Path(args.resume_folder)
    texts = [f.read_text(errors="replace")[:2000] for f in stdlib_files()]

    def document(shard: int, i: int) -> str:
        return f"# {shard}.{i}\n" + texts[(shard * 1000 + i) % len(texts)]

    if not (folder / ".done").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for shard in range(100):
            lines = "".join(json.dumps({"text": document(shard, i)}) + "\n" for i in range(1000))
            (folder / f"shard-{shard:03d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        (folder / ".done").write_text("")  # hidden: not read as data
    # One lane (global batch 1), stored order: the lane reads the shards in order, and document N of
    # its epoch is document N of the folder.
    cfg = Training(
        dataset="local", dataset_path=str(folder), seq_len=args.seq_len, local_batch_size=1, shuffle_documents=False
    )
    names = sorted(p.name for p in folder.glob("*.zst"))
    print(
        f"resume: {folder}, 100 jsonl.zst shards of 1,000 documents, one lane (global batch 1), stored order; "
        f"start-up (build_dataloader + load_state_dict + first batch) of a resumed loader, best of {args.repeats}"
    )
    template = build_dataloader(cfg, tokenizer, 0, 1, 1).state_dict()
    times, batches = {}, {}
    for n in (1_000, 100_000 - 500):
        for with_layout in (True, False):
            layout = {f"{name}#0/1": [1000, (folder / name).stat().st_size] for name in names[: n // 1000]}
            state = json.loads(json.dumps(template))
            data = state["dataset_state"]
            data["lanes"] = [[0, [{"next_sample": 0, "epoch": 0, "doc_index": n, "token_offset": 0, "carry": []}]]]
            data["next_sample"] = 0
            data["source_layout"] = {"unit_documents": layout} if with_layout else None
            best = math.inf
            for _ in range(args.repeats):
                start = time.perf_counter()
                loader = build_dataloader(cfg, tokenizer, 0, 1, 1)
                loader.load_state_dict(state)
                batch = next(iter(loader))
                best = min(best, time.perf_counter() - start)
                del loader
            times[n, with_layout], batches[n, with_layout] = best, batch
            print(
                f"  at document {n:6,}, {'with   ' if with_layout else 'without'} the saved documents per shard: "
                f"{best * 1000:8.1f} ms"
            )
        same = all(a.equal(b) for a, b in zip(batches[n, True], batches[n, False]))
        expected = encode_document(tokenizer, document(*divmod(n, 1000)))[: args.seq_len]
        starts = batches[n, True][0][0, : len(expected)].tolist() == expected
        print(
            f"  at document {n:6,}: the first window starts with document {n:,}: {'yes' if starts else 'NO'}; "
            f"the same first batch with and without: {'yes' if same else 'NO'}"
        )
    rows = [[f"{n:,}", f"{times[n, True] * 1000:.1f}", f"{times[n, False] * 1000:.1f}"] for n in (1_000, 99_500)]
    for with_layout in (True, False):
        ratio = times[99_500, with_layout] / times[1_000, with_layout]
        print(
            f"start-up at document 99,500 / at 1,000, {'with   ' if with_layout else 'without'} the saved "
            f"documents per shard: {ratio:5.2f}x"
            + (f" ({'under' if ratio < 1.5 else 'NOT under'} 1.5x)" if with_layout else "")
        )
    markdown(args, ["resumed at document", "with the saved counts, ms", "without them, ms"], rows)


def markdown(args, columns: list[str], rows: list[list]) -> None:
    """--markdown: the rows of docs/benchmarks.md (scripts/benchmark_table.py, beside this script)."""
    if not args.markdown:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchmark_table

    benchmark_table.print_rows(columns, rows, args.argv, __file__)


def _quiet_epochs():
    """Drops the loader's "a lane read its share of epoch e" warnings: small folders at high dp pass many."""
    logging.getLogger("torchtitan.components.data.loader").addFilter(
        lambda record: "a lane read its share of epoch" not in str(record.msg)
    )


def _ints(values: str) -> list[int]:
    return [int(v) for v in values.split(",") if v]


def _counts(least: int):
    """argparse type: a comma list of integers, each `least` or more."""

    def parse(text: str) -> str:
        try:
            values = _ints(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
        if any(v < least for v in values):
            raise argparse.ArgumentTypeError(f"each must be {least} or more, got {text!r}")
        return text

    return parse


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def main(argv: list[str]) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=positive_int, default=1024)
    parser.add_argument("--folder", default="/tmp/bench_tokens")
    parser.add_argument("--seq-len", type=positive_int, default=2048)
    parser.add_argument("--local-batch", type=positive_int, default=8)
    parser.add_argument(
        "--dp", type=_counts(1), default="1,8,64", help="data-parallel degrees to measure (rank D - 1 of each)"
    )
    parser.add_argument("--seconds", type=_seconds, default=5.0, help="measuring time per layout")
    parser.add_argument(
        "--text-workers", type=_counts(0), default="", help="data_workers counts for the text pipeline, e.g. 0,1,2"
    )
    parser.add_argument("--mix-mb", type=int, default=0, help="MB of text per mixture source, e.g. 16")
    parser.add_argument("--mix-folder", default="/tmp/bench_mix_lanes")
    parser.add_argument(
        "--mix-workers", type=_counts(0), default="0,1,2", help="data_workers counts for the mixture benchmark"
    )
    parser.add_argument("--mix-shuffle", action="store_true", help="the mixture shuffled (default: stored order)")
    parser.add_argument("--resume", action="store_true", help="start-up of resumed loaders on jsonl.zst shards")
    parser.add_argument("--resume-folder", default="/tmp/bench_resume")
    parser.add_argument("--repeats", type=positive_int, default=3, help="--resume: the best of this many start-ups")
    parser.add_argument("--markdown", action="store_true", help="also print the rows of docs/benchmarks.md")
    args = parser.parse_args(argv)
    args.argv = argv  # the command of --markdown's rows
    if args.mix_mb < 0:
        parser.error(f"argument --mix-mb: must be 0 (no mixture) or more, got {args.mix_mb}")
    # The folder this run writes (generated data, reused by the next run), before minutes of generating.
    folder = (
        ("--resume-folder", args.resume_folder)
        if args.resume
        else ("--mix-folder", args.mix_folder)
        if args.mix_mb
        else ("--folder", args.folder)
    )
    check_output_path(folder[1], folder[0], existing="write_into")
    _quiet_epochs()
    tokenizer = Tokenizer(MODEL)
    if args.resume:
        resume_benchmark(args, tokenizer)
        return
    if args.mix_mb:
        mixture_benchmark(args, tokenizer)
        return
    text_benchmark(args, tokenizer)
    token_benchmark(args, tokenizer)


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
