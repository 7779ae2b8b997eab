import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_JOBS = REPO / "tests" / "distributed" / "run_jobs.py"

# A small, fast, deterministic job: the debug model at short sequences, fp32, one log line per step.
TINY = [
    "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
    "--training.seq_len", "64",
    "--training.steps", "6",
    "--training.global_batch_size", "8",
    "--training.mixed_precision_param", "float32",
    "--training.deterministic",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.no-enable_tensorboard",
    "--metrics.device_peak_tflops", "1",
    "--model.tokenizer_path", str(REPO / "assets" / "tokenizer" / "python_stdlib_4k.model"),
]


def launch(jobs: dict[str, list[str] | dict], nproc: int, tmp: Path, timeout: int = 600) -> dict[str, list[dict]]:
    """Run named jobs (extra argv each, or a {"copy": [src, dst]} step, where "{tmp}" stands for
    `tmp`) in one launch; returns each training job's metrics.jsonl records."""
    argvs = [{"copy": [p.format(tmp=tmp) for p in extra["copy"]]} if isinstance(extra, dict)
             else TINY + ["--job.dump_folder", str(tmp / name)] + extra for name, extra in jobs.items()]
    spec = tmp / f"jobs_{nproc}.json"
    spec.write_text(json.dumps(argvs))
    run_script(RUN_JOBS, [str(spec)], nproc, tmp, timeout)
    return {name: read_metrics(tmp / name) for name, extra in jobs.items() if not isinstance(extra, dict)}


def run_script(script: Path, args: list[str], nproc: int, cwd: Path, timeout: int = 600):
    """Run `script` with `args` in one process, or under torchrun with `nproc`; assert it succeeds."""
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", str(script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"launch failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on at the moment (for a rendezvous endpoint)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_naming(text: str) -> list[int]:
    """Pids of live (not zombie) processes, other than this one, whose command line contains `text`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z" and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


def worker_pids(text: str) -> dict[int, int]:
    """{rank: pid} of the torchrun workers (not the launcher) whose command line contains `text`."""
    workers = {}
    for pid in processes_naming(text):
        try:
            environ = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in v)
        except OSError:
            continue
        if "TORCHELASTIC_RUN_ID" in environ and "RANK" in environ:
            workers[int(environ["RANK"])] = pid
    return workers


# --- data ------------------------------------------------------------------------------------------


class CharTokenizer:
    """One token per character; BOS = 1, EOS = 2: token streams the tests can write down by hand."""

    bos_id, eos_id = 1, 2

    def __init__(self, vocab_size=1000):
        self.vocab_size = vocab_size

    def encode(self, text, bos, eos):
        return [1] * bos + [3 + ord(c) % 997 for c in text] + [2] * eos


def lane_streams(windows: list[list[int]], lanes: int) -> list[list[int]]:
    """Each lane's token stream from windows in global sample order: sample k is lane k % lanes's
    sample k // lanes (torchtitan/components/data/lanes.py)."""
    return [[t for w in windows[p::lanes] for t in w] for p in range(lanes)]


def framed_documents(tokens: list[int]) -> list[str]:
    """The complete documents ([BOS] text [EOS] of CharTokenizer, ASCII text) in a token stream, in
    order; a document cut by the start or the end of the stream is left out."""
    docs, current = [], None
    for t in tokens:
        if t == CharTokenizer.bos_id:
            current = []
        elif t == CharTokenizer.eos_id:
            if current is not None:
                docs.append("".join(chr(c - 3) for c in current))
            current = None
        elif current is not None:
            current.append(t)
    return docs


def mixture_corpus(folder: Path, docs: list[list[str]], tokenizer) -> list[Path]:
    """Three sources as pre-training corpora are published: a folder of two parquet shards (docs[0]), a
    folder of two jsonl.zst shards (docs[1]) and a token folder written by pretokenize (docs[2])."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from torchtitan.components.data.files import FilesSource
    from torchtitan.components.data.token_folder import pretokenize

    parquet, zst, text, tokens = (folder / name for name in ("parquet", "zst", "text", "tokens"))
    for path in (parquet, zst, text):
        path.mkdir(parents=True)
    for shard, part in enumerate((docs[0][::2], docs[0][1::2])):
        pq.write_table(pa.table({"text": part}), parquet / f"shard-{shard:05d}.parquet", row_group_size=8)
    for shard, part in enumerate((docs[1][::2], docs[1][1::2])):
        lines = "".join(json.dumps({"text": d}) + "\n" for d in part).encode()
        (zst / f"shard-{shard:05d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (text / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[2]))
    pretokenize(FilesSource(str(text)), tokenizer, tokens, source_description={"description": str(text)},
                workers=1, log=lambda *_: None)
    return [parquet, zst, tokens]



def short_documents_corpus(path: Path, count: int = 3000) -> Path:
    """A jsonl corpus of short documents (1 or 2 lines of the standard library, about 20 tokens):
    several per 64-token window (scripts/short_documents.py)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from short_documents import short_documents_corpus as write

    return write(path, count, lines=1)


def float8_matmul_too_slow() -> str | None:
    """Why float8 training cannot be tested here in reasonable time, or None. Where oneDNN has no
    float8 kernel for this CPU's instruction set it runs its reference one: a 256 x 256 float8 matmul
    then takes ~0.27 s against ~0.002 s in bf16 (measured), and a 10-step debug-model job hours."""
    import time

    import torch

    a = torch.randn(256, 256).to(torch.float8_e4m3fn)
    b = torch.randn(256, 256).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    start = time.perf_counter()
    torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    seconds = time.perf_counter() - start
    if seconds > 0.05:
        return (f"a 256 x 256 float8 matmul takes {seconds:.2f} s on this CPU (oneDNN's reference kernel: no "
                f"float8 kernel for its instruction set); the float8 training jobs would take hours")
    return None


def train_in_process(folder: Path, *extra: str) -> list[dict]:
    """One process's job (TINY + `extra`, dumping to `folder`) run in this process, on one thread
    like `launch`'s processes (OMP_NUM_THREADS=1: several threads per process slow a shared host
    down); its metrics records. The thread count and TINY's deterministic algorithms are
    process-wide, set back after the job so that later tests run as they would alone."""
    import torch

    from torchtitan.config import load_config
    from torchtitan.train import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(load_config(TINY + ["--job.dump_folder", str(folder), *extra]))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
