"""The layout planner (torchtitan.planner, scripts/plan.py):
- the analytic per-rank parameter shards equal those of the real parallelization over a fake process
  group, for every kind of layout (FSDP, HSDP, TP, PP 1F1B and ZBV, CP, EP, EP x TP) of the three
  families, and at 512 ranks for Llama 3 405B and 256 for Qwen3-MoE 235B-A22B (slow);
- the memory terms follow the layout: FSDP divides the parameter state, bf16 optimizer state halves
  it, Muon keeps one momentum for its matrices, CPU offload moves the state off the device, full
  checkpointing keeps less than none, a pipeline's last stage holds the logits;
- plan.py ranks layouts, writes a recipe that loads back to the best layout, and refuses bad input
  with exit 2 and one line: a world size the recipe's fixed degrees cannot divide or that is not a
  whole number of nodes, a memory no layout fits (with the smallest need), a family without
  activation counts (naming the field), an --output that exists or whose folder does not (before
  planning), an unknown flavor, a [model] field the family lacks, bad numbers;
- the planner and the trainer agree: every layout it shows or writes passes the trainer's preflight
  (judged for the device planned for), so DeepSeek-V3 with multi-token prediction never gets a
  zero-bubble schedule, which the trainer refuses with it;
- the recipe it writes for the debug model on 4 CPU processes trains as it is (slow).
"""

import re
import subprocess
import sys

import pytest

from torchtitan.config import load_config
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.planner.memory import estimate_memory, param_shards
from torchtitan.planner.search import estimate_config, recipe_facts
from torchtitan.planner.simulate import simulate

from helpers.launch import load_script
from helpers.paths import REPO

PLAN = REPO / "scripts" / "plan.py"
DEBUG = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")]
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
DSV3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]

LAYOUTS = {
    "fsdp4": (4, []),
    "hsdp2x2": (
        4,
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    ),
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2_1f1b_fsdp2": (4, PP2 + ["--parallelism.pipeline_parallel_schedule", "1F1B"]),
    "pp2_zbv": (2, PP2 + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    "cp2_tp2": (4, ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    "tied_pp2_tp2": (
        4,
        ["--model.name", "qwen3", "--model.flavor", "debugmodel_tied", "--parallelism.tensor_parallel_degree", "2"]
        + PP2,
    ),
    "moe_ep2_tp2": (
        8,
        MOE + ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
    ),
    "moe_ep4_hsdp": (
        8,
        MOE + ["--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2"],
    ),
    "dsv3_pp2_ep2": (8, DSV3 + PP2 + ["--parallelism.expert_parallel_degree", "2"]),
    # The last stage keeps a copy of the input embedding for multi-token prediction.
    "dsv3_mtp_pp2": (4, DSV3 + PP2 + ["--model.mtp_depth", "1"]),
}


def config(*args: str):
    return load_config(DEBUG + ["--training.compile", "false", *args])


def check_against_simulation(world: int, args: list[str]):
    cfg = config(*args)
    p = recipe_facts(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    analytic = param_shards(p.spec, p.model, dims, cfg.parallelism)
    simulated = simulate(p.spec, p.args, dims, cfg)
    assert set(simulated) == set(analytic) == set(range(dims.pp))
    for rank, held in simulated.items():
        assert held == {name: s.local for name, s in analytic[rank].items()}, rank
    return analytic


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_analytic_shards_equal_the_simulated_ones(name):
    world, args = LAYOUTS[name]
    analytic = check_against_simulation(world, args)
    assert all(sum(s.local for s in held.values()) > 0 for held in analytic.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,args",
    [
        (
            512,
            [
                "--model.flavor",
                "405B",
                "--training.seq_len",
                "8192",
                "--parallelism.tensor_parallel_degree",
                "8",
                "--parallelism.pipeline_parallel_degree",
                "16",
                "--parallelism.data_parallel_shard_degree",
                "4",
            ],
        ),
        (
            256,
            [
                "--model.name",
                "qwen3",
                "--model.flavor",
                "235B-A22B",
                "--training.seq_len",
                "4096",
                "--parallelism.tensor_parallel_degree",
                "4",
                "--parallelism.pipeline_parallel_degree",
                "4",
                "--parallelism.data_parallel_shard_degree",
                "16",
                "--parallelism.expert_parallel_degree",
                "8",
            ],
        ),
    ],
    ids=["llama3_405B_512", "qwen3_235B_A22B_256"],
)
def test_simulation_at_scale(world, args):
    analytic = check_against_simulation(world, args)
    assert len(analytic) == 4 if world == 256 else 16


def test_memory_terms_follow_the_layout():
    one = estimate_config(config(), 1, "cpu")
    fsdp4 = estimate_config(config(), 4, "cpu")
    assert fsdp4.memory.params == pytest.approx(one.memory.params / 4, rel=0.01)
    assert fsdp4.memory.optimizer == 2 * fsdp4.memory.params
    full = estimate_config(config("--activation_checkpoint.mode", "full"), 4, "cpu")
    assert full.memory.activations < fsdp4.memory.activations / 2
    bf16 = estimate_config(config("--optimizer.state_dtype", "bfloat16"), 4, "cpu")
    assert bf16.memory.optimizer == fsdp4.memory.optimizer / 2
    muon = estimate_config(config("--optimizer.name", "Muon"), 4, "cpu")
    # Muon keeps one momentum for the hidden matrices (most of the debug model), two moments elsewhere.
    assert fsdp4.memory.params < muon.memory.optimizer < 0.7 * fsdp4.memory.optimizer
    offload = estimate_config(config("--training.enable_cpu_offload"), 4, "cuda")
    assert offload.memory.params == offload.memory.grads == offload.memory.optimizer == 0
    cfg = config(*PP2)
    p = recipe_facts(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, 2)
    last = estimate_memory(p.spec, p.model, p.args, dims, cfg, "cpu")
    assert last.pp_rank in (0, 1) and (last.logits > 0) == (last.pp_rank == 1)


def test_the_logits_terms_follow_the_loss_chunk_size():
    # The debug recipe on one process: micro-batches of 4 x 256 = 1,024 tokens, a 4,096-token vocabulary.
    def memory(*args):
        return estimate_config(config(*args), 1, "cpu").memory

    whole = memory()
    chunks = {n: memory("--training.loss_chunk_tokens", str(n)) for n in (128, 256, 512, 1024, 4096)}
    # Kept until backward: the gradients of the final norm's output and of the output weight, not the
    # log-softmax of every token (7.3 MB against 18.9: at this small vocabulary the weight's gradient,
    # 4 MB, is a large share); the chunk's logits exist during the forward only (in activations' peak).
    assert chunks[128].logits == chunks[512].logits < whole.logits / 2
    assert chunks[128].activations < chunks[256].activations < chunks[512].activations < whole.activations
    step = chunks[256].activations - chunks[128].activations
    assert chunks[512].activations - chunks[256].activations == pytest.approx(2 * step)
    assert chunks[4096].activations == chunks[1024].activations  # a chunk holds at most the micro-batch
    # "auto" (the default) is resolved per layout as the trainer does: the whole logits here, chunks of
    # 1,024 at 16,384 tokens a micro-batch (256 MiB of float32 logits), the whole logits again under TP 2.
    assert config().training.loss_chunk_tokens == "auto" and whole == memory("--training.loss_chunk_tokens", "0")
    big = ("--training.seq_len", "2048", "--training.local_batch_size", "8")
    assert memory(*big) == memory(*big, "--training.loss_chunk_tokens", "1024")
    assert memory(*big).logits < memory(*big, "--training.loss_chunk_tokens", "0").logits / 2
    tp2 = ("--parallelism.tensor_parallel_degree", "2")
    assert (
        estimate_config(config(*big, *tp2), 2, "cpu").memory
        == estimate_config(config(*big, *tp2, "--training.loss_chunk_tokens", "0"), 2, "cpu").memory
    )
    # [memory_estimation] prints the same estimate before launch (in GiB to 2 places: 0.02 and 0.01).
    from torchtitan.preflight import preflight

    lines = [
        preflight(config("--memory_estimation.enabled", *args), 1).memory_estimate
        for args in ((), ("--training.loss_chunk_tokens", "128"))
    ]
    logits = [float(re.search(r"logits ([0-9.]+)", line).group(1)) for line in lines]
    assert logits[1] < logits[0], lines


def test_context_parallel_methods_are_searched_and_costed():
    from torchtitan.planner.search import candidates
    from torchtitan.planner.timing import cp_volume

    cfg = config("--training.seq_len", "4096", "--training.global_batch_size", "8")
    p = recipe_facts(cfg)
    # llama3 debugmodel: 16 heads, no grouped-query attention. The ring sends its key/value block cp - 1
    # times (and the gradients back): 4 (cp - 1) hidden units; Ulysses 8 (cp - 1) / cp.
    assert [cp_volume("ring", p.args, cp, 1) for cp in (2, 4, 8)] == [4, 12, 28]
    assert [cp_volume("ulysses", p.args, cp, 1) for cp in (2, 4, 8)] == [4, 6, 7]
    layouts = {
        (
            c.parallelism.context_parallel_degree,
            c.parallelism.tensor_parallel_degree,
            c.parallelism.context_parallel_method,
        )
        for c in candidates(cfg, 8, 8, p.spec, p.args)
    }
    assert {(2, 1, "ring"), (2, 1, "ulysses"), (8, 1, "ulysses"), (4, 2, "ulysses")} <= layouts
    ring = estimate_config(config("--training.seq_len", "4096", "--parallelism.context_parallel_degree", "4"), 4, "cpu")
    uly = estimate_config(
        config(
            "--training.seq_len",
            "4096",
            "--parallelism.context_parallel_degree",
            "4",
            "--parallelism.context_parallel_method",
            "ulysses",
        ),
        4,
        "cpu",
    )
    assert uly.time.communication < ring.time.communication and uly.layout() == "cp4u" and ring.layout() == "cp4"
    # A recipe that asks for Ulysses keeps it; a degree that cannot split the heads offers the ring only.
    fixed = config("--training.seq_len", "4096", "--parallelism.context_parallel_method", "ulysses")
    assert {
        c.parallelism.context_parallel_method
        for c in candidates(fixed, 8, 8, p.spec, p.args)
        if c.parallelism.context_parallel_degree > 1
    } == {"ulysses"}
    qwen = config("--model.name", "qwen3", "--training.seq_len", "4096", "--training.global_batch_size", "8")
    q = recipe_facts(qwen)  # 8 query heads: TP 4 leaves 2 per rank, so CP 4 and 8 are ring only
    methods = {
        (c.parallelism.context_parallel_degree, c.parallelism.context_parallel_method)
        for c in candidates(qwen, 16, 16, q.spec, q.args)
        if c.parallelism.tensor_parallel_degree == 4
    }
    assert (4, "ring") in methods and (2, "ulysses") in methods and (4, "ulysses") not in methods


def run_plan(*args: str, cwd=REPO):
    return subprocess.run([sys.executable, str(PLAN), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_plan_writes_the_best_layout_as_a_recipe(tmp_path):
    out = tmp_path / "best.toml"
    proc = run_plan(
        *DEBUG, "--ngpu", "4", "--gpus_per_node", "4", "--gpu_memory_gib", "4", "--device", "cpu", "--output", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    assert "every parameter shard equals the estimate's" in proc.stdout
    # The CPU peak is measured now and says what its figures are worth; never rounded to "0.0".
    assert re.search(
        r"peak (?!0\.0 |0 )[0-9][0-9.e-]* TFLOP/s \(measured now on this host's CPU: it moves with the load",
        proc.stdout,
    ), proc.stdout
    assert f"wrote {out}: NGPU=4 CONFIG_FILE={out} ./run_train.sh\n" in proc.stdout  # per node, as the docs say
    rows = [line for line in proc.stdout.splitlines() if line.strip().startswith("1  ")]
    best = rows[0].split()[1]
    cfg = load_config(["--job.config_file", str(out)])
    est = estimate_config(cfg, 4, "cpu")
    assert est.layout() == best
    assert cfg.training.global_batch_size == 16  # the recipe's own: local_batch_size 4 x 4 ranks
    again = run_plan(*DEBUG, "--ngpu", "4", "--gpu_memory_gib", "4", "--device", "cpu", "--output", str(out))
    assert again.returncode == 2 and "exists" in again.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (
            [
                "--ngpu",
                "12",
                "--gpus_per_node",
                "4",
                "--gpu_memory_gib",
                "80",
                "--parallelism.tensor_parallel_degree",
                "8",
            ],
            "does not divide the world size 12",
        ),
        (
            ["--ngpu", "12", "--gpus_per_node", "8", "--gpu_memory_gib", "80"],
            "12 devices is not a whole number of nodes of 8",
        ),
        (["--ngpu", "8", "--gpu_memory_gib", "80", "--model.flavor", "nope"], "unknown model.flavor 'nope'"),
        (["--ngpu", "8", "--gpu_memory_gib", "80", "--model.sliding_window", "64"], "has no sliding-window attention"),
        (
            [
                "--ngpu",
                "8",
                "--gpu_memory_gib",
                "80",
                "--model.name",
                "deepseek_v3",
                "--parallelism.pipeline_parallel_degree",
                "8",
            ],
            "the recipe fixes pipeline_parallel_degree = 8: cannot split",
        ),
        (
            ["--ngpu", "8", "--gpu_memory_gib", "80", "--model.tokenizer_path", "/nonexistent"],
            "the trainer refuses every layout of llama3 debugmodel on 8 devices",
        ),
        (["--ngpu", "8", "--gpu_memory_gib", "nan"], "--gpu_memory_gib must be a positive number"),
        (["--ngpu", "eight", "--gpu_memory_gib", "80"], "argument --ngpu: invalid int value: 'eight'"),
        (["--ngpu", "8", "--gpu_memory_gib", "80", "--top", "0"], "--top must be 1 or more"),
        (["--ngpu", "8", "--gpu_memory_gib", "80", "--efficiency", "2"], "--efficiency is the fraction of the peak"),
        (["--ngpu", "2", "--gpu_memory_gib", "0.001", "--device", "cpu"], "the smallest needs"),
        (
            [
                "--ngpu",
                "2",
                "--gpu_memory_gib",
                "80",
                "--experimental.custom_import",
                str(REPO / "tests" / "models" / "test_custom_family.py"),
                "--model.name",
                "tiny_nope",
                "--model.flavor",
                "debug",
            ],
            "its spec has no activation_counts",
        ),
    ],
)
def test_plan_refuses_bad_input(args, message):
    proc = run_plan(*DEBUG, *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: ")


@pytest.mark.parametrize(
    "where,message",
    [
        ("{tmp}/missing/best.toml", "the folder {tmp}/missing does not exist"),
        ("{tmp}/a_file/best.toml", "{tmp}/a_file is a file, not a folder"),
        ("/proc/best.toml", "cannot create anything in /proc"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_planning(tmp_path, where, message):
    (tmp_path / "a_file").write_text("x")
    proc = run_plan(*DEBUG, "--ngpu", "8", "--gpu_memory_gib", "80", "--output", where.format(tmp=tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: --output {where.format(tmp=tmp_path)}: {message.format(tmp=tmp_path)}"
    ), lines
    assert proc.stdout == ""  # nothing was planned: the plan's first line comes after the search


@pytest.fixture(scope="module")
def plan_script():
    return load_script(PLAN, "plan_script")


MTP_ZBV = DEBUG + DSV3 + ["--model.mtp_depth", "1", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]


def test_a_multi_token_prediction_plan_never_picks_a_zero_bubble_layout(plan_script, tmp_path, capsys):
    """On 8 GPUs the fastest estimate is a ZBV pipeline, which the trainer refuses with MTP: the planner
    leaves it out, says why, and writes a recipe that the trainer's preflight accepts."""
    from torchtitan.planner.search import rank_layouts, refusal
    from torchtitan.preflight import preflight

    cfg = load_config(MTP_ZBV)
    ranking = rank_layouts(cfg, 8, 8, 80 * 2**30, "cuda", keep=10)
    assert ranking.fits and all(e.dims.pp == 1 for e in ranking.fits)
    assert all(refusal(e.cfg, 8, "cuda") is None for e in ranking.fits)
    assert any("ZBVZeroBubble splits each backward" in why for why in ranking.refused)
    out = tmp_path / "best.toml"
    assert (
        plan_script.main(
            [*MTP_ZBV, "--ngpu", "8", "--gpu_memory_gib", "80", "--top", "5", "--no-simulate", "--output", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"wrote {out}: NGPU=8 CONFIG_FILE={out} ./run_train.sh\n" in printed and "measured now" not in printed
    assert "the trainer's preflight refused" in printed and "pp2xfsdp4 with AC none" in printed
    written = load_config(["--job.config_file", str(out)])
    assert written.parallelism.pipeline_parallel_degree == 1
    preflight(written, 8)  # the trainer's own check (on this CPU host) accepts it
    assert [p.name for p in tmp_path.iterdir()] == ["best.toml"]  # no staging file left


def test_layouts_are_judged_for_the_device_planned_for(plan_script, capsys):
    """FlexAttention trains on CUDA only: a CUDA plan of a flex recipe made on this CPU host is not
    refused, a CPU plan is."""
    args = [
        *DEBUG,
        "--ngpu",
        "2",
        "--gpus_per_node",
        "2",
        "--gpu_memory_gib",
        "80",
        "--no-simulate",
        "--top",
        "1",
        "--model.attn_backend",
        "flex",
    ]
    assert plan_script.main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert plan_script.main([*args, "--device", "cpu"]) == 2
    assert "cannot train on cpu" in capsys.readouterr().err


def test_keys_the_trainer_accepts_plan(plan_script, capsys):
    """Keys that made the planner trace back or find nothing: an odd seq_len (no context parallel),
    and multi-token prediction under a pipeline (the last stage's copy of the embedding)."""
    mtp_pp2 = DSV3 + ["--model.mtp_depth", "1", "--parallelism.pipeline_parallel_degree", "2"]
    for extra in (["--training.seq_len", "7"], mtp_pp2):
        assert (
            plan_script.main(
                [*DEBUG, "--ngpu", "4", "--gpus_per_node", "4", "--gpu_memory_gib", "80", "--top", "1", *extra]
            )
            == 0
        ), capsys.readouterr().err
        assert "every parameter shard equals the estimate's" in capsys.readouterr().out


@pytest.mark.slow
def test_the_written_recipe_trains_on_4_processes(tmp_path):
    out = tmp_path / "best.toml"
    proc = run_plan(
        *DEBUG,
        "--ngpu",
        "4",
        "--gpus_per_node",
        "4",
        "--gpu_memory_gib",
        "4",
        "--device",
        "cpu",
        "--no-simulate",
        "--output",
        str(out),
        "--training.steps",
        "4",
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--checkpoint.no-enable_checkpoint",
    )
    assert proc.returncode == 0, proc.stderr
    train = subprocess.run(
        ["bash", "run_train.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "NGPU": "4", "CONFIG_FILE": str(out)},
    )
    assert train.returncode == 0, train.stderr[-3000:]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) >= 2


def preflight(*args: str):
    import os

    return subprocess.run(
        [sys.executable, "-m", "torchtitan.preflight", *DEBUG, "--memory_estimation.enabled", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "WORLD_SIZE": "2"},
    )


def test_memory_estimation_prints_the_estimate_before_launch():
    proc = preflight()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("memory estimate for fsdp2 with AC none: ")
    assert "the host's memory over its 2 process(es)" in proc.stdout


def test_memory_estimation_refuses_a_layout_that_cannot_fit():
    proc = preflight("--model.flavor", "8B", "--training.seq_len", "8192")
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert line.startswith("error: memory_estimation: fsdp2 needs an estimated") and "\n" not in line
    assert "the largest term is activations" in line and "activation checkpointing" in line


@pytest.mark.slow
def test_the_published_405B_layout_fits_80_GiB():
    """Llama 3 405B's published training layout (TP 8 x PP 16 x data parallel, full checkpointing, seq 8192)."""
    from torchtitan.planner.memory import GiB

    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs" / "llama3_405b.toml"),
            "--parallelism.pipeline_parallel_degree",
            "16",
            "--parallelism.data_parallel_shard_degree",
            "4",
            "--training.global_batch_size",
            "256",
        ]
    )
    e = estimate_config(
        cfg,
        512,
        "cuda",
        __import__("torchtitan.planner.timing", fromlist=["Hardware"]).Hardware(989e12, 0.4, 450e9, 50e9, 8),
    )
    assert e.layout() == "pp16xfsdp4xtp8" and e.ac() == "full"
    assert 10 * GiB < e.memory.total < 80 * GiB


def test_a_replica_group_recipe_is_planned_without_asking_its_lighthouse():
    """The lighthouse is a service of the run, not of a layout: the planner checks every layout with the trainer's
    preflight but never contacts it (before: preflight asked it once per candidate, and a lighthouse that accepts
    connections but never answers held each one fault_tolerance.timeout_seconds, hours for a plan)."""
    import socket
    import threading

    from torchtitan.planner.search import rank_layouts

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    accepted = []

    def accept():
        while True:
            try:
                accepted.append(silent.accept()[0])  # held open, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        cfg = load_config(
            [
                *DEBUG,
                "--fault_tolerance.enabled",
                "--fault_tolerance.group_count",
                "2",
                "--fault_tolerance.lighthouse",
                f"http://127.0.0.1:{silent.getsockname()[1]}",
                "--fault_tolerance.timeout_seconds",
                "1",
                "--training.global_batch_size",
                "8",
            ]
        )
        ranking = rank_layouts(cfg, 4, 4, 80 * 2**30, "cpu", keep=3)
        assert ranking.fits and not accepted
    finally:
        silent.close()
        for connection in accepted:
            connection.close()
