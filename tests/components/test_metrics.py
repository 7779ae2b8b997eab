import glob
import json
import logging
import re
import time

import pytest
import torch

from torchtitan.components.metrics import (
    ROUGH_MFU_NOTE,
    MetricsLogger,
    device_peak_tflops,
    duration,
    measure_matmul_tflops,
    slow_cpu_bfloat16,
)
from torchtitan.config import Metrics


def record(step, loss):
    return {
        "step": step,
        "loss": loss,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tps": 100.0,
        "tflops": 0.1,
        "mfu": 10.0,
        "memory_gib": 0.5,
        "time": 1.0,
    }


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


def _tb_losses(folder) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss")]


def test_a_rerun_keeps_the_earlier_runs_events_apart_and_a_resume_replaces_the_redone_steps(tmp_path):
    """A second run from step 0 in the same dump folder: the first run's events move to tb.1, so that TensorBoard
    shows two runs instead of one curve going back and forth. A resume from step 2 of a run that had logged to step
    4 (a restart redoes steps 3-4): TensorBoard hides the earlier steps 3-4 and shows the redone ones."""
    cfg = Metrics(enable_tensorboard=True, save_tb_folder="tb")

    def run(losses: dict[int, float], append=False, start_step=0):
        logger = MetricsLogger(cfg, str(tmp_path), write=True, append=append, start_step=start_step)
        for step, loss in losses.items():
            logger.log(record(step, loss))
        logger.close()

    run({1: 9.0, 2: 8.0})
    run({1: 7.0, 2: 6.0, 3: 5.0, 4: 4.0})
    assert _tb_losses(tmp_path / "tb.1") == [(1, 9.0), (2, 8.0)]
    assert _tb_losses(tmp_path / "tb") == [(1, 7.0), (2, 6.0), (3, 5.0), (4, 4.0)]
    run({3: 3.5, 4: 3.0}, append=True, start_step=2)
    assert _tb_losses(tmp_path / "tb") == [(1, 7.0), (2, 6.0), (3, 3.5), (4, 3.0)]
    assert not (tmp_path / "tb.2").exists()


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


def _timed_matmul_tflops(dtype: torch.dtype = torch.float32, n: int = 1024, reps: int = 8) -> float:
    """An independent count: reps n x n matmuls of 2 n^3 FLOPs each, timed as a whole."""
    import time

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return reps * 2 * n**3 / (time.perf_counter() - start) / 1e12


def test_measured_matmul_rate_counts_flops_like_an_independent_timing():
    # The measurement keeps its best burst, so it is about the timed average; a FLOP count off by a power
    # of n would miss by 1000x. The band is 10x either way: on a shared host the two timings, taken a
    # moment apart, once differed by 2.7x (0.027 against 0.074 TFLOP/s in a CI run).
    reference = _timed_matmul_tflops()
    assert 0.1 * reference < measure_matmul_tflops(torch.float32, seconds=0.3) < 10 * reference


def test_a_cpu_without_native_bfloat16_is_named_with_the_fix():
    """Against independent timings of both dtypes: a CPU whose bf16 matmul is several times slower than its
    float32 one gets the warning, with its fix; one where bf16 is at least as fast gets none."""
    ratio = _timed_matmul_tflops(torch.float32, n=256) / _timed_matmul_tflops(torch.bfloat16, n=256)
    warning = slow_cpu_bfloat16([("the model's matmuls", "--training.mixed_precision_param float32")])
    if ratio > 8:
        assert warning and "the model's matmuls run about" in warning, (ratio, warning)
        assert "--training.mixed_precision_param float32 trains faster" in warning
    elif ratio < 1:
        assert warning is None, (ratio, warning)


@pytest.mark.slow
@pytest.mark.multiprocess
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


def wandb_values(data: bytes, key: str) -> list[float]:
    """The values logged under `key` in a .wandb file: each history item is a protobuf message of the
    key (field 2) and its JSON value (field 16), both length-prefixed."""
    k = key.encode()
    pattern = re.escape(b"\x12" + bytes([len(k)]) + k + b"\x82\x01")
    return [float(data[m.end() + 1 : m.end() + 1 + data[m.end()]]) for m in re.finditer(pattern, data)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_wandb_offline_run_and_resume(tmp_path, monkeypatch):
    """Without an API key the run is written offline into the dump folder; a resumed job continues the
    same wandb run."""
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login
    monkeypatch.setenv("WANDB_SILENT", "true")
    # wandb's service keeps its files under the temporary folder; a private one keeps another job's
    # wandb run (a concurrent test session) out of this one's.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    from torchtitan.components.metrics import wandb_mode

    assert wandb_mode() == "offline"
    cfg = Metrics(enable_wandb=True)
    first = MetricsLogger(cfg, str(tmp_path), write=True, run_config={"training": {"steps": 2}})
    first.log(record(1, 5.0))
    first.log_validation(
        {
            "step": 1,
            "validation_loss": 6.0,
            "validation_perplexity": 403.4,
            "validation_batches": 1,
            "validation_tokens": 64,
            "validation_time": 0.1,
        }
    )
    first.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    runs = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and glob.glob(f"{runs[0]}/run-{run_id}.wandb")
    # wandb's service process writes the run file; on a busy host it may still be writing it when
    # finish() has returned (a 7-byte file was seen): wait for the records, up to 60 s.
    deadline = time.monotonic() + 60
    while True:
        with open(f"{runs[0]}/run-{run_id}.wandb", "rb") as f:
            logged = f.read()
        if set(wandb_values(logged, "loss")) == {5.0} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # (in the step's history record, and again in the run's summary)
    assert set(wandb_values(logged, "loss")) == {5.0} and set(wandb_values(logged, "validation_loss")) == {6.0}
    assert b'{"steps":2}' in logged  # the run's config

    resumed = MetricsLogger(cfg, str(tmp_path), write=True, append=True)
    resumed.log(record(2, 4.0))
    resumed.close()
    assert (tmp_path / "wandb_run_id").read_text() == run_id
    fresh = MetricsLogger(cfg, str(tmp_path), write=True)  # a new run in the folder: a new wandb run
    fresh.close()
    assert (tmp_path / "wandb_run_id").read_text() != run_id


def test_wandb_missing_package_is_refused_before_launch(tmp_path, monkeypatch):
    import importlib.util

    from torchtitan.config import UserError, load_config
    from torchtitan.preflight import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config(["--metrics.enable_wandb", "--job.dump_folder", str(tmp_path)])
    with pytest.raises(UserError, match="metrics.enable_wandb needs the wandb package: pip install wandb"):
        preflight(cfg, 1)


# ---- MFU against a peak that a step's achieved rate can exceed (issue 22) ----------------------------


def test_a_measured_peak_below_the_achieved_rate_is_re_measured_not_reported_above_100():
    """The rule, with a stand-in measurement: the old MFU, achieved / start-up peak, read 200% here."""
    from torchtitan.components.metrics import MfuPeak

    calls = []
    peak = MfuPeak(0.05, "measured (torch.float32, 2 threads)", probe=lambda: calls.append(1) or 0.3)
    # Below the peak: the first line only says that a measured CPU peak is rough, and no later line does.
    assert peak.fields(0.02) == {"mfu": pytest.approx(40.0), "peak_tflops": 0.05, "mfu_note": ROUGH_MFU_NOTE}
    assert peak.fields(0.02) == {"mfu": pytest.approx(40.0), "peak_tflops": 0.05}
    first = peak.fields(0.1)
    assert first["mfu"] == pytest.approx(100 * 0.1 / 0.3) and first["peak_tflops"] == 0.3 and len(calls) == 1
    assert (
        first["mfu_note"]
        == "peak re-measured: 0.3 TFLOP/s; the start-up measurement (0.05) was below the achieved rate"
    )
    assert peak.fields(0.2) == {"mfu": pytest.approx(100 * 0.2 / 0.3), "peak_tflops": 0.3} and len(calls) == 1


def test_a_peak_still_below_after_re_measuring_becomes_the_achieved_rate():
    """A probe that stays below (the model's matmuls run faster than the probe's): MFU reads 100% and says
    why. Later re-measurements wait until all of them stay within a share of the time since start-up."""
    import time

    from torchtitan.components.metrics import MfuPeak

    calls = []

    def probe():
        calls.append(1)
        time.sleep(0.05)
        return 0.08

    peak = MfuPeak(0.05, "measured", probe=probe, probe_share=0.001)
    first = peak.fields(0.1)
    assert first["mfu"] == 100.0 and first["peak_tflops"] == 0.1 and peak.probe_s >= 0.05
    assert first["mfu_note"] == (
        "peak raised to the achieved rate: the start-up measurement (0.05 TFLOP/s) and a "
        "re-measurement (0.08) were below it"
    )
    again = peak.fields(0.12)  # 2 x 0.05 s of probing within 0.1% of (much) less than 100 s: not yet
    assert len(calls) == 1 and peak.probe_s == 0.0 and again["mfu"] == 100.0 and again["peak_tflops"] == 0.12
    assert again["mfu_note"] == "peak raised to the achieved rate: an earlier achieved rate (0.1 TFLOP/s) was below it"
    peak.created -= 1000  # 1000 s later the budget allows one more
    peak.fields(0.13)
    assert len(calls) == 2


def test_a_configured_peak_is_kept_and_a_line_above_100_says_why(caplog):
    import logging

    from torchtitan.components.metrics import MfuPeak

    peak = MfuPeak.for_device(torch.device("cpu"), torch.float32, configured=0.001)
    assert peak.source == "configured" and peak.probe is None
    with caplog.at_level(logging.WARNING, logger="torchtitan.components.metrics"):
        values = [peak.fields(0.002), peak.fields(0.003), peak.fields(0.0005)]
    assert [v["mfu"] for v in values] == [pytest.approx(200.0), pytest.approx(300.0), pytest.approx(50.0)]
    note = "above 100%: the peak, 0.001 TFLOP/s configured, is below the achieved rate"
    assert values[0]["mfu_note"] == values[1]["mfu_note"] == note and "mfu_note" not in values[2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "metrics.device_peak_tflops should be one device's peak" in warnings[0]


def test_the_note_follows_mfu_in_the_console_line_and_reaches_metrics_jsonl(tmp_path):
    from torchtitan.components.metrics import step_line

    values = dict(record(10, 4.0), mfu=33.3, peak_tflops=0.3, mfu_note="peak re-measured: 0.3 TFLOP/s")
    assert "mfu: 33.30% (peak re-measured: 0.3 TFLOP/s)  eta: 5s" in step_line(values, eta_seconds=5)
    assert "(" not in step_line(record(10, 4.0)) and "peak_tflops" not in step_line(values)
    logger = MetricsLogger(Metrics(enable_tensorboard=True), str(tmp_path), write=True)
    logger.log(values)  # a text field among TensorBoard's scalars
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["mfu_note"] == "peak re-measured: 0.3 TFLOP/s"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_start_up_measurement_on_a_busy_cpu_does_not_put_mfu_above_100():
    """Real contention: the peak is measured at start-up while busy processes (4 per core) share the
    CPU, as on a machine running other jobs; then they stop, and the achieved rate of quiet work (the
    same matmuls, timed as a whole) exceeds that start-up figure, which the old rule turned into MFU
    above 100%. Now the peak is re-measured and the line says so."""
    import os
    import subprocess
    import sys
    import time

    from torchtitan.components.metrics import MfuPeak

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.5)  # all running
        peak = MfuPeak.for_device(torch.device("cpu"), torch.float32, configured=0)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    start_up = peak.tflops
    achieved = _timed_matmul_tflops()
    assert achieved > start_up, f"contention did not lower the start-up measurement: {start_up} >= {achieved}"
    values = peak.fields(achieved)
    assert values["mfu"] <= 100.0 and values["peak_tflops"] >= achieved, (values, 100 * achieved / start_up)
    assert values["mfu_note"].startswith(("peak re-measured: ", "peak raised to the achieved rate: "))
    assert f"the start-up measurement ({start_up:.3g}" in values["mfu_note"]


def test_training_whose_start_up_peak_was_too_low_logs_mfu_at_most_100(tmp_path, monkeypatch):
    """The trainer's records: a start-up measurement far below what a step achieves (as on a CPU whose
    whole capacity was taken at the time) gives the first step a real re-measurement and the note."""
    from pathlib import Path

    from torchtitan.components import metrics
    from torchtitan.config import load_config
    from torchtitan.train import train

    real, calls = metrics.measure_matmul_tflops, []

    def start_up_starved(dtype, seconds=1.0, n=1024):
        calls.append(seconds)
        return 1e-9 if len(calls) == 1 else real(dtype, seconds, n)

    monkeypatch.setattr(metrics, "measure_matmul_tflops", start_up_starved)
    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(
        [
            "--job.config_file",
            str(repo / "train_configs" / "debug_model.toml"),
            "--model.tokenizer_path",
            str(repo / "assets" / "tokenizer" / "python_stdlib_4k.model"),
            "--job.dump_folder",
            str(tmp_path),
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "3",
            "--metrics.log_freq",
            "1",
            "--metrics.device_peak_tflops",
            "0",
            "--training.mixed_precision_param",
            "float32",
            "--metrics.no-enable_tensorboard",
        ]
    )
    history = train(cfg)
    assert calls == [1.0, 0.5]  # the start-up measurement, and one re-measurement at the first step
    first = history[0]
    assert 0 < first["mfu"] <= 100 and first["peak_tflops"] >= first["tflops"] > 1e-9
    assert first["mfu_note"].startswith(("peak re-measured: ", "peak raised to the achieved rate: "))
    assert "the start-up measurement (1e-09" in first["mfu_note"]
    assert all(r["mfu"] == pytest.approx(100 * r["tflops"] / r["peak_tflops"]) for r in history)
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == history


def test_the_time_left_comes_from_recent_lines_not_the_start_up(caplog):
    """The first line's step carries the start-up: it gets no time left and does not slow the later
    estimates; a step rate that changes shows within ETA_WINDOW lines."""
    from torchtitan.components.metrics import ETA_WINDOW

    logger = MetricsLogger(Metrics(), "", write=False, total_steps=100)
    with caplog.at_level(logging.INFO, logger="torchtitan.components.metrics"):
        logger.log(dict(record(1, 4.0), time=60.0))  # a minute of compilation and loading
        logger.log(dict(record(10, 4.0), time=69.0))  # then 1 s a step
        for i in range(ETA_WINDOW):
            logger.log(dict(record(20 + 10 * i, 4.0), time=89.0 + 20 * i))  # then 2 s a step
    lines = [r.getMessage() for r in caplog.records]
    assert "eta" not in lines[0]
    assert lines[1].endswith("eta: 1m30s")  # 90 steps left at 1 s
    assert lines[-1].endswith(
        f"eta: {duration(2 * (100 - (20 + 10 * (ETA_WINDOW - 1))))}"
    )  # only 2 s steps in the window
