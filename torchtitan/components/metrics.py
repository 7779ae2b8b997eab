"""Training metrics: one console line per logged step, TensorBoard scalars, and
{dump_folder}/metrics.jsonl with one JSON object per logged step (and one per validation run: the
step and its validation_* values).

MFU divides achieved FLOP/s per device by the device's peak: a table of dense bf16 peaks for known
GPUs, or, on CPU, a peak measured at start-up with a short matmul in the training dtype and with the
threads this process uses (so it is the reachable peak of this process's share of the machine). A
measured peak is raised when a step achieves more (`MfuPeak`), so that MFU never reads above 100%; a
configured or table peak is kept, and a line whose MFU exceeds 100% against it says why.
"""

import collections
import contextlib
import json
import logging
import os
import resource
import time
from collections.abc import Callable
from typing import Literal, cast

import torch

from torchtitan.config import Metrics

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks in TFLOP/s, matched by substring of torch.cuda.get_device_name().
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "MI300X": 1307.0,
    "MI325X": 1307.0,
}


def measure_matmul_tflops(dtype: torch.dtype, seconds: float = 1.0, n: int = 1024) -> float:
    """Best rate over short trials of one matmul each, so that a moment of contention does not lower the peak;
    at least one trial, however slow the matmul (bfloat16 on a CPU without it takes seconds)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(2):  # warm-up: thread pool, kernel selection, clock ramp
        torch.mm(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best / 1e12


def slow_cpu_bfloat16(uses: list[tuple[str, str]]) -> str | None:
    """A warning when this CPU multiplies bfloat16 matrices far slower than float32 ones (no native bf16
    instructions: the kernel converts element by element, tens of times slower), else None. `uses`: what runs in
    bf16 and the option that moves it to float32, each. Measured on small matrices: a fraction of a second."""
    bf16 = measure_matmul_tflops(torch.bfloat16, seconds=0.2, n=256)
    fp32 = measure_matmul_tflops(torch.float32, seconds=0.2, n=256)
    if bf16 * 2 >= fp32:
        return None
    return (
        f"this CPU multiplies bfloat16 matrices at {bf16 * 1e3:.1f} GFLOP/s and float32 ones at {fp32 * 1e3:.1f}: "
        f"it has no native bfloat16 arithmetic, so {' and '.join(what for what, _ in uses)} run about "
        f"{fp32 / bf16:.0f}x slower here than in float32; {' '.join(fix for _, fix in uses)} trains faster on it"
    )


def device_peak_tflops(device: torch.device, dtype: torch.dtype, configured: float) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the figure comes from)."""
    if configured > 0:
        return configured, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_TFLOPS.items():
            if key in name:
                return peak, f"table ({name}, dense bf16)"
        logger.warning(f"unknown GPU '{name}': set metrics.device_peak_tflops for MFU; assuming A100's 312")
        return 312.0, f"assumed ({name})"
    peak = measure_matmul_tflops(dtype)
    return peak, f"measured ({dtype}, {torch.get_num_threads()} threads)"


# A peak measured on a CPU moves with what else the host runs, and MFU with it: the first step line says
# so next to its MFU.
ROUGH_MFU_NOTE = "rough: the peak is measured on this CPU and moves with its load"


class MfuPeak:
    """The MFU denominator of one device, and the note a step line carries when its MFU needs one.

    A configured peak (metrics.device_peak_tflops) or a GPU table's is the user's or the vendor's
    figure: MFU is computed against it as it is; a step above 100% says so in its line (and a warning,
    once, says what to fix). A peak measured at start-up (`probe` re-measures it) is only as good as that
    moment: on a busy machine it measures low, and the achieved rate of a later, quieter step exceeds
    it. When a logged step's achieved rate is above the peak, the matmul is measured again (the first
    time always; later only while all re-measurements together stay within `probe_share` of the time
    since start-up) and the peak becomes the largest of the old peak, the new measurement and the
    achieved rate. So MFU never reads above 100%, and the line where the peak rose says why. Another
    re-measurement needs a step faster than the raised peak, so there are rarely more than one or two.
    `probe_s` is the time the last `fields` call spent measuring (to leave out of the step rate)."""

    def __init__(self, tflops: float, source: str, probe: Callable[[], float] | None = None, probe_share: float = 0.05):
        self.tflops, self.source, self.probe, self.probe_share = tflops, source, probe, probe_share
        self.previous = "the start-up measurement"  # what the peak is, for the note when it is exceeded
        self.probes, self.probe_total, self.probe_s = 0, 0.0, 0.0
        self.created = time.perf_counter()
        self.warned = False
        self.said_rough = False

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype, configured: float) -> "MfuPeak":
        tflops, source = device_peak_tflops(device, dtype, configured)
        if not source.startswith("measured"):
            return cls(tflops, source)
        return cls(
            tflops,
            source + "; raised when a step achieves more",
            probe=lambda: measure_matmul_tflops(dtype, seconds=0.5),
        )

    def _may_probe(self) -> bool:
        if self.probes == 0:
            return True
        spent = self.probe_total * (self.probes + 1) / self.probes  # with one more of the average length
        return spent <= self.probe_share * (time.perf_counter() - self.created)

    def fields(self, achieved: float) -> dict:
        """{"mfu", "peak_tflops"} for a step that achieved `achieved` TFLOP/s per device, and "mfu_note"
        when the peak was raised for it, or when MFU is above 100% of a configured or table peak."""
        self.probe_s = 0.0
        note = None
        if achieved > self.tflops and self.probe is not None:
            old, remeasured = self.tflops, None
            if self._may_probe():
                start = time.perf_counter()
                remeasured = self.probe()
                self.probe_s = time.perf_counter() - start
                self.probes, self.probe_total = self.probes + 1, self.probe_total + self.probe_s
            if remeasured is not None and remeasured >= achieved:
                self.tflops = remeasured
                note = (
                    f"peak re-measured: {remeasured:.3g} TFLOP/s; "
                    f"{self.previous} ({old:.3g}) was below the achieved rate"
                )
                self.previous = "the re-measured peak"
            else:
                self.tflops = achieved
                also = f" and a re-measurement ({remeasured:.3g})" if remeasured is not None else ""
                note = (
                    f"peak raised to the achieved rate: {self.previous} ({old:.3g} TFLOP/s){also} "
                    f"{'were' if also else 'was'} below it"
                )
                self.previous = "an earlier achieved rate"
        elif achieved > self.tflops:
            note = f"above 100%: the peak, {self.tflops:.4g} TFLOP/s {self.source}, is below the achieved rate"
            if not self.warned:
                self.warned = True
                fix = (
                    "metrics.device_peak_tflops should be one device's peak in the training dtype"
                    if self.source == "configured"
                    else "the table holds dense bf16 peaks (fp8 or sparse matmuls run faster) or the model's "
                    "FLOP count is too high; set metrics.device_peak_tflops to the device's peak"
                )
                logger.warning(
                    f"a step achieved {achieved:.4g} TFLOP/s per device, above the MFU peak of "
                    f"{self.tflops:.4g} TFLOP/s {self.source}: its MFU reads above 100% (and each such "
                    f"line says so); {fix}"
                )
        if note is None and self.probe is not None and not self.said_rough:
            # The first line says once, next to the figure, that a measured CPU peak moves with the load.
            note = ROUGH_MFU_NOTE
        self.said_rough = True
        mfu = 100 * achieved / self.tflops if self.tflops > 0 else 0.0
        if self.probe is not None:
            mfu = min(mfu, 100.0)  # the peak is at least the achieved rate: only rounding could pass 100
        values: dict[str, float | str] = {"mfu": mfu, "peak_tflops": self.tflops}
        if note is not None:
            values["mfu_note"] = note
        return values


def peak_memory_gib(device: torch.device) -> float:
    """Max allocated on CUDA; max resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


# Intervals between logged lines whose rate gives the time left (eta).
ETA_WINDOW = 3

_STANDARD = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tps",
    "tflops",
    "mfu",
    "memory_gib",
    "time",
    "tokens",
    "skipped_steps",
    "data_wait_s",
    "peak_tflops",
    "mfu_note",
    "step_time_max_over_median",
    "straggler_rank",
}  # a straggler has a line of its own (components/watchdog.py)


_COLORS = {"step": "\033[36m", "loss": "\033[32m", "memory": "\033[33m", "tps": "\033[34m", "mfu": "\033[35m"}


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def step_line(
    values: dict, extra: str = "", color: bool = False, total_steps: int | None = None, eta_seconds: float | None = None
) -> str:
    """The console summary of a logged step; ANSI-colored field names when `color`. With
    `total_steps`, the step reads N/total; with `eta_seconds`, the time left closes the line."""

    def name(key: str) -> str:
        return f"{_COLORS[key]}{key}:\033[0m" if color and key in _COLORS else f"{key}:"

    step = f"{values['step']:>5}" + (f"/{total_steps}" if total_steps else "")
    note = f" ({values['mfu_note']})" if values.get("mfu_note") else ""
    if values.get("skipped_steps"):
        extra = f"  skipped_steps: {values['skipped_steps']}{extra}"
    if eta_seconds is not None:
        extra += f"  eta: {duration(eta_seconds)}"
    return (
        f"{name('step')} {step}  {name('loss')} {values['loss']:8.4f}  grad_norm: {values['grad_norm']:8.4f}  "
        f"lr: {values['lr']:.2e}  {name('memory')} {values['memory_gib']:5.2f}GiB  {name('tps')} {values['tps']:,.0f}  "
        f"tflops: {values['tflops']:.2f}  {name('mfu')} {values['mfu']:.2f}%{note}{extra}"
    )


def wandb_mode() -> str:
    """WANDB_MODE if set; else online when an API key is configured and the service answers within 2 s,
    otherwise offline (the run is written locally; `wandb sync` uploads it later)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    if not has_key:
        import netrc

        try:
            has_key = netrc.netrc().authenticators("api.wandb.ai") is not None
        except (OSError, netrc.NetrcParseError):  # no ~/.netrc, or one wandb cannot read either: no key
            has_key = False
    if not has_key:
        return "offline"
    import socket

    try:
        socket.create_connection(("api.wandb.ai", 443), timeout=2).close()
    except OSError:
        return "offline"
    return "online"


def start_wandb(dump_folder: str, run_config: dict | None, resume: bool):
    """A wandb run for this job; a resumed job (resume) continues the run whose id the folder keeps."""
    import wandb

    id_file = os.path.join(dump_folder, "wandb_run_id")
    run_id = None
    if resume and os.path.isfile(id_file):
        with open(id_file) as f:
            run_id = f.read().strip() or None
    mode = wandb_mode()
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT", "torchtitan"),
        dir=dump_folder,
        config=run_config,
        id=run_id,
        resume="allow" if run_id else None,
        mode=cast(Literal["online", "offline", "disabled", "shared"], mode),  # WANDB_MODE as set: wandb checks it
    )
    with open(id_file, "w") as f:
        f.write(run.id)
    where = f"; upload it with: wandb sync {run.dir.rsplit('/files', 1)[0]}" if mode == "offline" else ""
    logger.info(f"wandb run {run.id} ({mode}){where}")
    return run


class MetricsLogger:
    """Writes logged steps to the console (every rank) and, on the writing rank, to TensorBoard,
    Weights & Biases and metrics.jsonl. Values must already be global (reduced over ranks) where
    that matters."""

    def __init__(
        self,
        cfg: Metrics,
        dump_folder: str,
        write: bool,
        append: bool = False,
        color: bool = False,
        total_steps: int | None = None,
        start_step: int = 0,
        run_config: dict | None = None,
    ):
        self.write = write
        self.color = color
        self.total_steps = total_steps
        # (step, time) of the recent lines, for the time left: the rate over the last few intervals
        # between lines. The first line of a launch starts the window: its step carries the start-up
        # (compilation, warm-up, loading) and gets no time left.
        self.recent: collections.deque = collections.deque(maxlen=ETA_WINDOW + 1)
        self.jsonl = None
        self.tb = None
        self.wandb = None
        if write:
            os.makedirs(dump_folder, exist_ok=True)
            # Open for the whole run, closed by close().
            self.jsonl = open(os.path.join(dump_folder, "metrics.jsonl"), "a" if append else "w")  # noqa: SIM115
            if cfg.enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                tb_folder = os.path.join(dump_folder, cfg.save_tb_folder)
                # As metrics.jsonl: a fresh start keeps an earlier run's events as {folder}.N (TensorBoard then
                # shows it as a run of its own instead of drawing both runs on one curve); a resume from step S
                # hides the earlier run's events after S (a restart redoes those steps).
                if not append and os.path.isdir(tb_folder) and os.listdir(tb_folder):
                    keep_earlier(tb_folder, "TensorBoard events")
                self.tb = SummaryWriter(tb_folder, purge_step=start_step + 1 if append else None)
            if cfg.enable_wandb:
                self.wandb = start_wandb(dump_folder, run_config, resume=append)

    def log(self, values: dict):
        step = values["step"]
        # A model's own summaries (keys without "/", beyond the standard ones) close the line.
        extra = "".join(f"  {k}: {v:.4g}" for k, v in values.items() if k not in _STANDARD and "/" not in k)
        eta = None
        if self.total_steps and "time" in values and (not self.recent or step > self.recent[-1][0]):
            self.recent.append((step, values["time"]))
            if len(self.recent) > 1:
                (first, start), (last, now) = self.recent[0], self.recent[-1]
                eta = (now - start) / (last - first) * (self.total_steps - step)
        logger.info(step_line(values, extra, self.color, self.total_steps, eta))
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(values) + "\n")
            self.jsonl.flush()
        self._scalars({k: v for k, v in values.items() if k != "step"}, step)

    def _scalars(self, values: dict, step: int):
        values = {k: v for k, v in values.items() if not isinstance(v, str)}  # mfu_note is text
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def log_validation(self, values: dict):
        """A validation record (step, validation_loss, validation_perplexity, ...): its own console line,
        its own metrics.jsonl line, and TensorBoard scalars at the training step it follows."""
        logger.info(
            f"validation  step: {values['step']:>5}  loss: {values['validation_loss']:8.4f}  perplexity: "
            f"{values['validation_perplexity']:.4g}  ({values['validation_batches']} batches, "
            f"{values['validation_tokens']:,} tokens, {values['validation_time']:.1f}s)"
        )
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(values) + "\n")
            self.jsonl.flush()
        self._scalars({k: values[k] for k in ("validation_loss", "validation_perplexity")}, values["step"])

    def close(self):
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def keep_earlier(path: str, what: str):
    """Rename an earlier run's file to {path}.N (the first free N) instead of overwriting it."""
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.rename(path, f"{path}.{n}")
    logger.warning(f"{path} holds an earlier run's {what}; kept it as {path}.{n}")


def write_run_file(folder: str, name: str, text: str, what: str) -> str:
    """Write `text` as `folder`/`name` (returned), keeping an earlier run's different file (keep_earlier)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    if os.path.isfile(path):
        with open(path) as f:
            differs = f.read() != text
        if differs:
            keep_earlier(path, what)
    with open(path, "w") as f:
        f.write(text)
    return path


def left_behind(dump_folder: str, cfg: Metrics, checkpoint: str | None, hf_folder: str | None = None) -> str:
    """A finished run's last line: what it wrote and where, its last checkpoint (or that it left none)
    and its Hugging Face export."""
    files = "config.toml, metrics.jsonl" + (f", {cfg.save_tb_folder}/ (TensorBoard)" if cfg.enable_tensorboard else "")
    if checkpoint is None:
        saved = (
            "no checkpoint: checkpointing is off (checkpoint.enable_checkpoint; turn it on to keep one for "
            "resuming" + (")" if hf_folder else ", scripts/generate.py and the Hugging Face export)")
        )
    else:
        saved = f"checkpoint {checkpoint}"
    return f"left in {dump_folder}: {files}; {saved}" + (f"; Hugging Face folder {hf_folder}" if hf_folder else "")


def rewind_metrics(path: str, start_step: int):
    """Before a run writes metrics.jsonl: a fresh start keeps the earlier file as metrics.jsonl.N; a
    resume from step S keeps the records up to S, and the whole earlier file as .N when it also holds
    later steps (a restart redoes them), so the file reads as one run."""
    if start_step == 0:
        keep_earlier(path, "metrics")
        return
    with open(path) as f:
        lines = f.read().splitlines()

    def before_resume(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= start_step
        except ValueError:  # a line cut short by a kill
            return False

    kept = [line for line in lines if before_resume(line)]
    if len(kept) == len(lines):
        return
    keep_earlier(path, "metrics")
    with open(path, "w") as f:
        f.writelines(line + "\n" for line in kept)


@contextlib.contextmanager
def startup_phase(what: str, times: dict[str, float]):
    """A start-up phase: said when it begins (a large model or checkpoint takes minutes), timed into `times`."""
    logger.info(f"{what}...")
    start = time.perf_counter()
    yield
    times[what] = time.perf_counter() - start


def startup_line(times: dict[str, float]) -> str:
    """The start-up's phases and their seconds, and how long after the process started the first step ended."""
    phases = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in times.items())
    since = process_age()
    return f"start-up: {phases}" + (f"; first step done {since:.1f}s after the process started" if since else "")


def process_age() -> float | None:
    """Seconds since this process started (Linux; None elsewhere): start-up including imports."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started_ticks / os.sysconf("SC_CLK_TCK")


def setup_logging():
    """Log lines start with the rank, unless torchrun already prefixes each line of the worker's output
    (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, which the launcher sets): one prefix, not two."""
    prefixed = bool(os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")) and "TORCHELASTIC_RUN_ID" in os.environ
    rank = "" if prefixed else f"[rank{os.environ.get('RANK', '0')}] "
    logging.basicConfig(
        level=logging.INFO,
        format=f"{rank}%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
