import base64
import gzip
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN_JOBS = REPO / "tests" / "distributed" / "run_jobs.py"
MODEL = REPO / "assets" / "tokenizer" / "python_stdlib_4k.model"  # the shipped tokenizer (sentencepiece, 4,096 tokens)
PYTHON_DIR = str(Path(sys.executable).parent)  # put first on PATH, so that scripts' `python` is this interpreter

# The debug model's recipe with the shipped tokenizer: the start of most command lines and configs.
RECIPE = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--model.tokenizer_path", str(MODEL)]

# A small, fast, deterministic job: the debug model at short sequences, fp32, one log line per step.
TINY = [
    "--job.config_file",
    str(REPO / "train_configs" / "debug_model.toml"),
    "--training.seq_len",
    "64",
    "--training.steps",
    "6",
    "--training.global_batch_size",
    "8",
    "--training.mixed_precision_param",
    "float32",
    "--training.deterministic",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.no-enable_tensorboard",
    "--metrics.device_peak_tflops",
    "1",
    "--model.tokenizer_path",
    str(MODEL),
]

# Job arguments shared by the multi-process tests (tests/distributed/).
FP32_TOL = 1e-5  # float32 layouts against one process: the largest difference allowed (losses, weights)
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
SAVE3 = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "3", "--checkpoint.no-last_save_model_only"]


def launch(jobs: dict[str, list[str] | dict], nproc: int, tmp: Path, timeout: int = 600) -> dict[str, list[dict]]:
    """Run named jobs (extra argv each, or a {"copy": [src, dst]} step, where "{tmp}" stands for
    `tmp`) in one launch; returns each training job's metrics.jsonl records."""
    argvs = [
        {"copy": [p.format(tmp=tmp) for p in extra["copy"]]}
        if isinstance(extra, dict)
        else TINY + ["--job.dump_folder", str(tmp / name)] + extra
        for name, extra in jobs.items()
    ]
    spec = tmp / f"jobs_{nproc}.json"
    spec.write_text(json.dumps(argvs))
    run_script(RUN_JOBS, [str(spec)], nproc, tmp, timeout)
    return {name: read_metrics(tmp / name) for name, extra in jobs.items() if not isinstance(extra, dict)}


def run_script(script: Path, args: list[str], nproc: int, cwd: Path, timeout: int = 600):
    """Run `script` with `args` in one process, or under torchrun with `nproc`; assert it succeeds."""
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0",
            str(script),
            *args,
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"launch failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def losses(records: list[dict]) -> list[float]:
    """The loss of each metrics record, in order."""
    return [r["loss"] for r in records]


def debug_config(*overrides: str):
    """The debug model's config (RECIPE) with `overrides`."""
    from torchtitan.config import load_config

    return load_config([*RECIPE, *overrides])


def load_script(path: Path, name: str):
    """The script at `path` (scripts/*.py, not a package) imported as a module named `name`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def start_lighthouse(*flags: str) -> tuple[subprocess.Popen, str]:
    """A real torchft lighthouse on a free port, once it answers (a loaded host may take seconds to start
    it, and the trainer refuses a lighthouse that does not answer); (its process, its address)."""
    import time
    import urllib.request

    port = free_port()
    proc = subprocess.Popen(
        [str(Path(PYTHON_DIR) / "torchft_lighthouse"), "--min_replicas", "1", "--bind", f"127.0.0.1:{port}", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{address}/status", timeout=1)
            return proc, address
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the lighthouse on port {port} did not answer (exit {proc.poll()})") from None
            time.sleep(0.2)


def worker_pids(text: str) -> dict[int, int]:
    """{rank: pid} of the torchrun workers (not the launcher) whose command line contains `text`."""
    workers = {}
    for pid in processes_naming(text):
        try:
            environ = dict(
                v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in v
            )
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
    pretokenize(
        FilesSource(str(text)),
        tokenizer,
        tokens,
        source_description={"description": str(text)},
        workers=1,
        log=lambda *_: None,
    )
    return [parquet, zst, tokens]


def short_documents_corpus(path: Path, count: int = 3000) -> Path:
    """A jsonl corpus of short documents (1 or 2 lines of the standard library, about 20 tokens):
    several per 64-token window (scripts/short_documents.py)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from short_documents import short_documents_corpus as write

    return write(path, count, lines=1)


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


# --- models --------------------------------------------------------------------------------------


def meta_model(model_cls, args):
    """A `model_cls` of `args` on the meta device: its parameters' shapes, no storage."""
    import torch

    with torch.device("meta"):
        return model_cls(args)


def materialized(model_cls, args, seed: int = 0):
    """A `model_cls` of `args` on the CPU, initialized by its init_weights with `seed` (built on the meta
    device first, as the trainer builds it)."""
    model = meta_model(model_cls, args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def small_llama3_args(**kw):
    """The arguments of a small Llama 3 (2 layers of width 64, GQA 4:2, 128 tokens), with `kw` changed."""
    from torchtitan.models.registry import get_model_spec

    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64)
    base.update(kw)
    return get_model_spec("llama3").args_cls(**base)


def llama3_and_batch():
    """A Llama 3 of 4 layers of width 128 (256 tokens, 128 positions) and a fixed batch of 4 windows
    (inputs and labels) for it: what the activation checkpointing and compile tests train."""
    import torch

    from torchtitan.models.registry import get_model_spec

    args = get_model_spec("llama3").args_cls(dim=128, n_layers=4, n_heads=4, vocab_size=256, max_seq_len=128)
    tokens = torch.randint(0, args.vocab_size, (4, args.max_seq_len + 1), generator=torch.Generator().manual_seed(1))
    return args, tokens


# --- checkpoint tests (tests/components/checkpoint/) ---------------------------------------------
# One-process runs of the debug model that save step-3 and step-6 (interval 3). `straight` is the
# uninterrupted run, run once per session: the tests resume from, or damage, copies of its checkpoints.

CHECKPOINT_ARGS = [
    *RECIPE,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.mixed_precision_param",
    "float32",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.device_peak_tflops",
    "1",
    "--metrics.no-enable_tensorboard",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval",
    "3",
    "--checkpoint.no-last_save_model_only",
]


def checkpoint_run(folder, *overrides, steps=6) -> list[dict]:
    from torchtitan.config import load_config
    from torchtitan.train import train

    return train(
        load_config([*CHECKPOINT_ARGS, "--job.dump_folder", str(folder), "--training.steps", str(steps), *overrides])
    )


@pytest.fixture(autouse=True)
def _no_log_handler_on_a_closed_stream():
    """An in-process run's setup_logging binds the root logger to the sys.stderr of its test, which pytest
    closes after that test; a later in-process run would log into it ("I/O operation on closed file")."""
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
            root.removeHandler(handler)
    yield


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """A 6-step run that saved step-3 and step-6."""
    folder = tmp_path_factory.mktemp("straight")
    return folder, checkpoint_run(folder)


def resume_from(straight_folder, tmp_path, step, *overrides):
    (tmp_path / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight_folder / "checkpoint" / f"step-{step}", tmp_path / "checkpoint" / f"step-{step}")
    return checkpoint_run(tmp_path, *overrides)


def copy_step(straight_folder, tmp_path, step=3):
    dst = tmp_path / "checkpoint" / f"step-{step}"
    shutil.copytree(straight_folder / "checkpoint" / f"step-{step}", dst)
    return dst


# --- data pipeline tests (tests/components/data/) ------------------------------------------------
# Shared by the tests of torchtitan/components/data/. Most use the character-level CharTokenizer
# above (CHARS), so the expected token streams can be written down independently of the code under
# test. With a global batch of one sequence there is one lane, and window k of a run must equal
# stream[k*W:(k+1)*W] of the stored order; with more, `lane_windows` states the order of
# torchtitan/components/data/lanes.py from the units' documents. Tests of stored-order behaviour
# turn shuffling off; the shuffle tests state the order through `Permutation`, the one definition
# of a shuffled order. The writers below store `docs` (a list of texts) in one format each; each
# must read back as the jsonl of the same texts does.


CHARS = CharTokenizer()


def expected_stream(docs, n_tokens, tok=CHARS):
    """One lane's token stream in stored order: framed non-empty documents, concatenated, looped."""
    out = []
    while len(out) < n_tokens:
        out += [t for doc in docs if doc for t in tok.encode(doc, bos=True, eos=True)]
    return out[:n_tokens]


def expected_windows(docs, seq_len, start, stop, tok=CHARS):
    """Windows start..stop-1 of one lane (a global batch of one sequence) in stored order."""
    w = seq_len + 1
    stream = expected_stream(docs, stop * w, tok)
    return [stream[k * w : (k + 1) * w] for k in range(start, stop)]


def document_units(docs, lanes):
    """A random-access source's units: its documents in min(n, 16 x lanes) consecutive ranges."""
    k = min(len(docs), 16 * lanes)
    return [docs[i * len(docs) // k : (i + 1) * len(docs) // k] for i in range(k)]


def lane_documents(units, lane, lanes, epoch, seed=None, random_access=False, block=10_000):
    """The documents lane `lane` of `lanes` reads in `epoch`, in order, as torchtitan/components/data/lanes.py
    states it: the units at positions q, q + lanes, ... (q = (lane + epoch) % lanes) of the unit order of
    the epoch's cycle of `lanes` epochs, or with fewer units than lanes every stride-th document of one
    unit; shuffled, in the order of a permutation (random access) or of permuted blocks (streams)."""
    from torchtitan.components.data.shuffle import Permutation, derived_seed

    n, q = len(units), (lane + epoch) % lanes
    order = [Permutation(n, seed, epoch // lanes)[j] for j in range(n)] if seed is not None else list(range(n))
    if n >= lanes:
        docs = [d for j in range(q, n, lanes) for d in units[order[j]]]
    else:
        docs = units[order[q % n]][q // n :: len(range(q % n, lanes, n))]
    if seed is None or not docs:
        return docs
    lane_seed = derived_seed(derived_seed(seed, epoch), lane)
    if random_access:
        perm = Permutation(len(docs), lane_seed, 0)
        return [docs[perm[j]] for j in range(len(docs))]
    out = []
    for b, first in enumerate(range(0, len(docs), block)):
        chunk = docs[first : first + block]
        perm = Permutation(len(chunk), lane_seed, b)
        out += [chunk[perm[j]] for j in range(len(chunk))]
    return out


def lane_windows(units, lanes, seq_len, stop, tok=CHARS, text=lambda d: d, **order):
    """Global samples 0..stop-1: sample k is window k // lanes of lane k % lanes's token stream (its
    documents of epoch 0, 1, ..., framed and concatenated). `text`: a unit entry's text."""
    w, per_lane = seq_len + 1, -(-stop // lanes)
    windows = []
    for lane in range(lanes):
        tokens, epoch = [], 0
        while len(tokens) < per_lane * w and epoch < 100:
            for d in lane_documents(units, lane, lanes, epoch, **order):
                if len(tokens) >= per_lane * w:
                    break
                if text(d):
                    tokens += tok.encode(text(d), bos=True, eos=True)
            epoch += 1
        windows.append([tokens[s * w : (s + 1) * w] for s in range(per_lane)])
    return [windows[k % lanes][k // lanes] for k in range(stop)]


def json_round_trip(state):
    return json.loads(json.dumps(state))  # fails on anything but plain ints, lists, strings, ...


def merged(states):
    """One state from single-process loaders of several ranks: each holds its own lanes."""
    out = json_round_trip(states[0])
    lanes = {p: pos for state in states for p, pos in state["dataset_state"]["lanes"]}
    out["dataset_state"]["lanes"] = [[p, lanes[p]] for p in sorted(lanes)]
    out["dataset_state"]["next_sample"] = sum(pos["next_sample"] for ps in lanes.values() for pos in ps)
    return out


def lane_position(state, lane=0, source=0):
    return dict(state["dataset_state"]["lanes"])[lane][source]


def random_docs(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij KLMNOP\n") for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def make_loader(
    path,
    seq_len,
    local_batch,
    dp_degree=1,
    dp_rank=0,
    global_batch=None,
    tok=CHARS,
    dataset="local",
    shuffle=False,
    **training,
):
    """A loader of `path`; shuffle=False unless asked (None: the default, shuffle where possible)."""
    from torchtitan.components.data import build_dataloader
    from torchtitan.config.training_sections import Training

    cfg = Training(
        dataset=dataset,
        dataset_path=None if path is None else str(path),
        seq_len=seq_len,
        local_batch_size=local_batch,
        shuffle_documents=shuffle,
        **training,
    )
    global_batch = global_batch or local_batch * dp_degree
    return build_dataloader(cfg, tok, dp_rank, dp_degree, global_batch)


def take(it, n_batches):
    """The windows (seq_len + 1 tokens each) of the next n_batches, checking the batch format."""
    import torch

    windows = []
    for _ in range(n_batches):
        inputs, labels = next(it)
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.shape == labels.shape
        assert torch.equal(inputs[:, 1:], labels[:, :-1]), "labels are inputs shifted by one"
        windows += [row + [last] for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]
    return windows


LAYOUTS = [  # (dp_degree, local_batch_size, global_batch_size)
    (1, 8, 8),
    (2, 4, 8),
    (4, 2, 8),
    (2, 2, 8),  # two accumulation micro-batches per step
]


@pytest.fixture
def docs_path(tmp_path):
    """A folder of 10 JSON lines shards of 6 documents: 10 units, one per shard."""
    docs = random_docs(60)
    (tmp_path / "docs").mkdir()
    for i in range(10):
        write_jsonl(tmp_path / "docs" / f"shard-{i:02d}.jsonl", docs[6 * i : 6 * i + 6])
    return [docs[6 * i : 6 * i + 6] for i in range(10)], tmp_path / "docs"


def run_steps(path, dp, lb, gb, steps, seq_len=16, shuffle=False):
    """Per step, the samples of every rank in rank order: list[step][rank] -> windows."""
    per_rank = []
    for rank in range(dp):
        it = iter(make_loader(path, seq_len, lb, dp, rank, gb, shuffle=shuffle))
        per_rank.append([take(it, gb // dp // lb) for _ in range(steps)])
    return [[per_rank[r][s] for r in range(dp)] for s in range(steps)]


@pytest.fixture
def shuffled_docs(tmp_path):
    """A folder of 10 JSON lines shards of 4 documents: 10 units."""
    docs = random_docs(40, seed=9)
    (tmp_path / "docs").mkdir()
    for i in range(10):
        write_jsonl(tmp_path / "docs" / f"part-{i}.jsonl", docs[4 * i : 4 * i + 4])
    return [docs[4 * i : 4 * i + 4] for i in range(10)], tmp_path / "docs"


def shuffled_steps_from(state, path, dp, lb, gb, steps, **training):
    """The windows of each of the next `steps` steps, over all ranks, when every rank of layout (dp, lb)
    loads `state` into a loader of shuffled `path` (seq_len 16)."""
    ranks = []
    for rank in range(dp):
        loader = make_loader(path, 16, lb, dp, rank, gb, shuffle=True, **training)
        loader.load_state_dict(state)
        it = iter(loader)
        ranks.append([take(it, gb // dp // lb) for _ in range(steps)])
    return [[w for r in range(dp) for w in ranks[r][s]] for s in range(steps)]


def steps_of(windows, gb, first, steps):
    return [windows[step * gb : (step + 1) * gb] for step in range(first, first + steps)]


def write_gz(path, docs):
    path.write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode()))
    return path


def write_zst(path, docs):
    zstandard = pytest.importorskip("zstandard")
    # Two frames, as pzstd or concatenated files make them.
    half = len(docs) // 2
    frames = [
        zstandard.ZstdCompressor().compress("".join(json.dumps({"text": d}) + "\n" for d in part).encode())
        for part in (docs[:half], docs[half:])
    ]
    path.write_bytes(b"".join(frames))
    return path


def arrow_table(docs, field="text"):
    pa = pytest.importorskip("pyarrow")
    return pa.table({"id": pa.array(range(len(docs)), pa.int64()), field: pa.array(docs, pa.string())})


def write_parquet(path, docs, field="text"):
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(arrow_table(docs, field), path, row_group_size=7)  # several row groups
    return path


def write_arrow(path, docs, field="text", file_format=False):
    pa = pytest.importorskip("pyarrow")
    table = arrow_table(docs, field)
    with (pa.ipc.new_file if file_format else pa.ipc.new_stream)(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=5):  # several record batches
            writer.write_batch(batch)
    return path


def write_save_to_disk(path, docs, shards=3):
    """The layout of datasets.Dataset.save_to_disk: Arrow IPC stream shards listed in state.json."""
    path.mkdir()
    size = -(-len(docs) // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        write_arrow(path / name, docs[i * size : (i + 1) * size])
    (path / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names], "_fingerprint": "x", "_split": None})
    )
    (path / "dataset_info.json").write_text("{}")
    return path


def jsonl_pieces(path, docs, pieces):
    """The units of an uncompressed JSON lines file cut into byte ranges: a line belongs to the range
    its first byte is in."""
    data, size = path.read_bytes(), path.stat().st_size
    starts = [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n")][:-1]
    units = [[] for _ in range(pieces)]
    for start, doc in zip(starts, docs):
        units[next(j for j in range(pieces) if start < (j + 1) * size // pieces)].append(doc)
    return units


def gpt_oss_mxfp4_folder(path: Path, args, bad_scales: bool = False) -> dict:
    """A Hugging Face folder of a gpt-oss model with `args` (its training init, biases drawn) whose experts
    are stored as the published checkpoints store them: MXFP4 blocks and scales of random codes (never
    +-0, so that a still training step moves no weight) and exponents 2^-9 .. 2^-3; `bad_scales`: one group
    too many. Returns {HF name: tensor} of the blocks and scales written."""
    import torch
    from safetensors.torch import save_file

    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec("gpt_oss")
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    g = torch.Generator().manual_seed(5)
    hf_sd = {
        k: v + 0.02 * torch.randn(v.shape, generator=g) if k.endswith("bias") else v
        for k, v in spec.hf.to_hf(model.state_dict(), args).items()
    }
    nonzero = torch.tensor([c for c in range(16) if c not in (0, 8)], dtype=torch.uint8)  # FP4 codes of +-0 left out
    quantized = {}
    for name in [k for k in hf_sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, fan_in, rows = hf_sd.pop(name).shape  # stored transposed: [experts, rows, fan_in / 32, 16]
        codes = nonzero[torch.randint(0, 14, (2, experts, rows, fan_in // 32, 16), generator=g)]
        quantized[name + "_blocks"] = codes[0] | (codes[1] << 4)
        groups = fan_in // 32 + (1 if bad_scales else 0)
        # 2^-9 .. 2^-3: weights of at most 0.75, outputs of order 1 (large ones would magnify round-off).
        quantized[name + "_scales"] = torch.randint(118, 125, (experts, rows, groups), dtype=torch.uint8, generator=g)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(spec.hf.config(args, torch.float32, 1, 2)))
    save_file({**hf_sd, **quantized}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return quantized


def qwen3_5_multimodal_folder(path: Path, args, sd: dict):
    """A folder laid out as the published Qwen3.5 checkpoints, written by transformers' save_pretrained:
    a Qwen3_5ForConditionalGeneration (config.json model_type 'qwen3_5', the language model's settings in
    text_config with multimodal rotary, a one-block vision tower beside it) whose language model holds our
    state dict `sd` of the dense qwen3_5 `args`. Returns that transformers model, in eval mode."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5VisionConfig

    from torchtitan.models.registry import get_model_spec

    spec = get_model_spec("qwen3_5")
    text = spec.hf.config(args)
    # Multimodal rotary (a time, height and width share of the frequencies, interleaved), as published:
    # on text the three positions are equal, so it must import as plain rotary.
    freqs = int(args.head_dim * args.partial_rotary_factor) // 2
    text["rope_parameters"] = {
        **text["rope_parameters"],
        "mrope_interleaved": True,
        "mrope_section": [freqs - 2 * (freqs // 3), freqs // 3, freqs // 3],
    }
    vision = Qwen3_5VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=args.dim)
    model = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision.to_dict(), tie_word_embeddings=args.tie_word_embeddings)
    )
    # Ours as transformers names them (model.X, lm_head.weight), the language model under model.language_model.
    hf_sd = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in spec.hf.to_hf(sd, args).items()
    }
    missing, unexpected = model.float().load_state_dict(hf_sd, strict=False)
    assert not unexpected and missing and all(k.startswith("model.visual.") for k in missing), (missing, unexpected)
    model.save_pretrained(path, safe_serialization=True)
    assert json.loads((path / "config.json").read_text())["text_config"]["model_type"] == "qwen3_5_text"
    return model.eval()


# ---- small tokenizers built offline (tests/components/test_tokenizer.py, test_tokenizer_export.py) ----

BPE_SIZE = 650  # trained pieces (the 256 byte symbols included); ids 650-652 are special, 653 added by the config
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def stdlib_texts(count: int) -> list[str]:
    """`count` source files of the standard library, spread over its sorted list."""
    from torchtitan.components.data import stdlib_files

    files = stdlib_files()
    return [p.read_text(encoding="utf-8", errors="replace") for p in files[:: len(files) // count][:count]]


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory) -> Path:
    """A Llama-3-like Hugging Face folder: a byte-level BPE trained on stdlib files, its special tokens
    in tokenizer.json, a post-processor that prepends BOS, and tokenizer_config.json naming BOS/EOS
    and declaring one more special token that tokenizer.json lacks."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(stdlib_texts(12), trainer)
    assert tok.get_vocab_size() == BPE_SIZE
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BPE_SIZE)]
    )
    folder = tmp_path_factory.mktemp("llama3_like")
    tok.save(str(folder / "tokenizer.json"))
    added = {str(BPE_SIZE + i): {"content": t, "special": True} for i, t in enumerate(SPECIALS + ["<|extra|>"])}
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "added_tokens_decoder": added,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|begin_of_text|>", "lstrip": False},
                "eos_token": {"content": "<|end_of_text|>"},
            }
        )
    )
    return folder


def byte_symbols() -> dict[str, int]:
    """The byte-level BPE alphabet: each byte's printable stand-in character -> the byte. Bytes that
    print as themselves (visible Latin-1) keep their character; the others, in order, take
    characters from U+0100 on."""
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, extra = {chr(b): b for b in visible}, 0
    for b in range(256):
        if b not in visible:
            symbols[chr(256 + extra)] = b
            extra += 1
    return symbols


def write_ranks(path: Path, tokens: list[bytes]) -> Path:
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))
    return path


@pytest.fixture(scope="session")
def tiktoken_file(hf_folder, tmp_path_factory) -> Path:
    """A tiktoken ranks file of the same BPE: each piece as raw bytes, ranked by its id (the merge
    order); no sidecar, so Llama 3's special tokens follow the ranks."""
    vocab = json.loads((hf_folder / "tokenizer.json").read_text())["model"]["vocab"]
    symbols = byte_symbols()
    tokens = [b""] * len(vocab)
    for piece, rank in vocab.items():
        tokens[rank] = bytes(symbols[c] for c in piece)
    return write_ranks(tmp_path_factory.mktemp("tiktoken") / "tokenizer.model", tokens)
