import glob
import json

import pytest
import torch

from torchtitan.components.metrics import MetricsLogger, device_peak_tflops, measure_matmul_tflops, peak_memory_gib
from torchtitan.config import Metrics


def record(step, loss):
    return {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tps": 100.0, "tflops": 0.1, "mfu": 10.0,
            "memory_gib": 0.5, "time": 1.0}


def test_jsonl_and_tensorboard_written(tmp_path):
    logger = MetricsLogger(Metrics(enable_tensorboard=True, save_tb_folder="tbx"), str(tmp_path), write=True)
    logger.log(record(1, 5.0))
    logger.log(record(2, 4.0))
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lines] == [5.0, 4.0]
    events = glob.glob(str(tmp_path / "tbx" / "events.out.tfevents.*"))
    assert events

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tbx"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [5.0, 4.0]
    assert {"loss", "grad_norm", "lr", "tps", "mfu", "memory_gib"} <= set(acc.Tags()["scalars"])


def test_non_writing_rank_writes_nothing(tmp_path):
    logger = MetricsLogger(Metrics(enable_tensorboard=True), str(tmp_path / "x"), write=False)
    logger.log(record(1, 5.0))
    logger.close()
    assert not (tmp_path / "x").exists()


def test_peak_sources():
    assert device_peak_tflops(torch.device("cpu"), torch.float32, configured=2.5) == (2.5, "configured")
    peak, source = device_peak_tflops(torch.device("cpu"), torch.float32, configured=0)
    assert source == f"measured (torch.float32, {torch.get_num_threads()} threads)"
    reference = _timed_matmul_tflops()
    assert 0.5 * reference < peak < 3 * reference, (peak, reference)


def _timed_matmul_tflops(n: int = 1024, reps: int = 8) -> float:
    """An independent count: reps n x n matmuls of 2 n^3 FLOPs each, timed as a whole."""
    import time

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return reps * 2 * n**3 / (time.perf_counter() - start) / 1e12


def test_measured_matmul_rate_counts_flops_like_an_independent_timing():
    # The measurement keeps its best burst, so it is at least about the timed average and not far above it;
    # a FLOP count off by a power of n would miss by 1000x.
    reference = _timed_matmul_tflops()
    assert 0.5 * reference < measure_matmul_tflops(torch.float32, seconds=0.3) < 3 * reference


def test_peak_memory_is_resident_set_on_cpu():
    """Against the kernel's own high-water mark (VmHWM), in a fresh process after touching 1 GiB: right
    source and units (KiB -> GiB), and it grows with the allocation."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from torchtitan.components.metrics import peak_memory_gib\n"
        "x = torch.ones(2**30 // 4)\n"
        "hwm = [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')][0] / 2**20\n"
        "print(peak_memory_gib(torch.device('cpu')), hwm)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    peak, hwm = map(float, out.split())
    assert abs(peak - hwm) < 0.01 and peak > 1.0, (peak, hwm)
