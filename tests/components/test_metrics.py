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
    assert peak > 0.001 and source.startswith("measured")


def test_measured_matmul_rate_is_plausible():
    # A 1024^2 fp32 matmul runs between 1 GFLOP/s and 100 TFLOP/s on any CPU.
    assert 1e-3 < measure_matmul_tflops(torch.float32, seconds=0.2) < 100


def test_peak_memory_is_resident_set_on_cpu():
    before = peak_memory_gib(torch.device("cpu"))
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB
    x += 1
    assert peak_memory_gib(torch.device("cpu")) >= before
    assert before > 0.01
