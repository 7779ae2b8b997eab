"""scripts/convert_checkpoint.py on a hand-made step-N folder, both directions, as the user runs it."""

import importlib.util
import json
import subprocess
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpoint import load_hf, meta_shapes, read_dcp_model
from torchtitan.models.registry import get_model_spec

from helpers.tiny_models import small_llama3_args, small_qwen3_5_args

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "convert_checkpoint.py"
SPEC = get_model_spec("llama3")
Transformer = SPEC.model_cls
ARGS = small_llama3_args()
QWEN = get_model_spec("qwen3")
QWEN_TIED = QWEN.args_cls(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    hidden_dim=128,
    vocab_size=128,
    max_seq_len=64,
    tie_word_embeddings=True,
)


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, argv)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_checkpoint(folder: Path, spec, args) -> dict[str, torch.Tensor]:
    """A step-5 folder as the trainer writes it: model and optimizer state, train_state.json."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    sd = model.state_dict()
    optimizer = {"state": {k: {"exp_avg": torch.randn_like(v)} for k, v in sd.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd, "optimizer": optimizer}, checkpoint_id=folder, no_dist=True)
    train_state = {
        "format_version": 1,
        "step": 5,
        "tokens": 640,
        "model_only": False,
        "model": {"name": spec.name, "flavor": "tiny", "args": asdict(args)},
    }
    (folder / "train_state.json").write_text(json.dumps(train_state))
    return sd


@pytest.fixture
def checkpoint(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    return tmp_path / "step-5", write_checkpoint(tmp_path / "step-5", SPEC, ARGS)


def test_qwen3_tied_to_transformers_and_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    sd = write_checkpoint(tmp_path / "step-5", QWEN, QWEN_TIED)
    proc = run("to-hf", tmp_path / "step-5", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "Qwen3ForCausalLM" in proc.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ours = QWEN.model_cls(QWEN_TIED)
    ours.load_state_dict(sd)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() < 1e-4
    # from-hf finds the family by config.json's model_type and keeps the tie.
    proc = run("from-hf", tmp_path / "hf", tmp_path / "step-0")
    assert proc.returncode == 0, proc.stderr
    back, back_args, train_state = read_dcp_model(tmp_path / "step-0", QWEN)
    assert back_args == QWEN_TIED and train_state["model"]["name"] == "qwen3"
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


QWEN3_5 = get_model_spec("qwen3_5")
QWEN3_5_SMALL = small_qwen3_5_args()  # DeltaNet, attention, DeltaNet, attention


def test_from_hf_converts_a_published_qwen3_5_folder(tmp_path, script, capsys):
    """The published Qwen3.5 layout (Qwen3_5ForConditionalGeneration: model_type 'qwen3_5', the text model in
    text_config and under model.language_model., a vision tower beside it), which the trainer imports,
    converts as it is: the family found by text_config's model_type, its language model's tensors as the
    trainer's import reads them (bit for bit) and as they were written (within the round-off of the
    norms' 1 + w form), the vision tower left out."""
    pytest.importorskip("transformers")
    from helpers.hf import qwen3_5_multimodal_folder

    torch.manual_seed(0)
    sd = {k: v.normal_(0, 0.1) for k, v in QWEN3_5.model_cls(QWEN3_5_SMALL).state_dict().items()}
    qwen3_5_multimodal_folder(tmp_path / "hf", QWEN3_5_SMALL, sd)
    assert script.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "step-0")]) == 0, capsys.readouterr().err
    assert "model-only qwen3_5 checkpoint" in capsys.readouterr().out
    back, back_args, train_state = read_dcp_model(tmp_path / "step-0", QWEN3_5)
    assert back_args == QWEN3_5_SMALL and train_state["model"]["name"] == "qwen3_5"
    imported, _ = load_hf(tmp_path / "hf", QWEN3_5.hf, meta_shapes(QWEN3_5, QWEN3_5_SMALL))
    assert back.keys() == imported.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], imported[k]), k
        assert torch.allclose(back[k], sd[k], rtol=0, atol=1e-6), k


def test_to_hf_and_back(tmp_path, checkpoint):
    folder, sd = checkpoint
    proc = run("to-hf", folder, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "step 5" in proc.stdout
    hf_sd, hf_args = load_hf(tmp_path / "hf", SPEC.hf, meta_shapes(SPEC, ARGS))
    for k in sd:
        assert torch.equal(hf_sd[k], sd[k]), k

    proc = run("from-hf", tmp_path / "hf", tmp_path / "step-0", "--flavor-name", "tiny")
    assert proc.returncode == 0, proc.stderr
    back, back_args, train_state = read_dcp_model(tmp_path / "step-0", SPEC)
    assert train_state["model_only"] is True and train_state["model"]["flavor"] == "tiny"
    assert back_args.ffn_hidden_dim == ARGS.ffn_hidden_dim and back_args.kv_heads == ARGS.kv_heads
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_to_hf_bfloat16(tmp_path, checkpoint, script):
    folder, sd = checkpoint
    assert script.main(["to-hf", str(folder), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    hf_sd, _ = load_hf(tmp_path / "hf", SPEC.hf)
    assert torch.equal(hf_sd["layers.1.feed_forward.w2.weight"], sd["layers.1.feed_forward.w2.weight"].bfloat16())


def test_missing_folder_exits_2_without_traceback(tmp_path):
    proc = run("to-hf", tmp_path / "nope", tmp_path / "hf")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: checkpoint folder") and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_user_errors(tmp_path, checkpoint, script, capsys):
    folder, _ = checkpoint
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert script.main(["to-hf", str(folder), str(tmp_path / "out")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err

    (folder / "train_state.json").unlink()
    assert script.main(["to-hf", str(folder), str(tmp_path / "hf")]) == 2
    assert "train_state.json is missing" in capsys.readouterr().err

    (folder / ".metadata").unlink()
    assert script.main(["to-hf", str(folder), str(tmp_path / "hf")]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err

    assert script.main(["from-hf", str(folder), str(tmp_path / "dcp")]) == 2
    assert "config.json not found" in capsys.readouterr().err
    # A multimodal config is read by its language model's model_type: one that no family reads, and a vision
    # tower alone, are named as such (before any weight is read).
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(
        json.dumps({"model_type": "mistral3", "vision_config": {}, "text_config": {"model_type": "mistral"}})
    )
    assert script.main(["from-hf", str(tmp_path / "vl"), str(tmp_path / "dcp")]) == 2
    assert (
        "has text_config.model_type (inside model_type 'mistral3') = 'mistral', which no registered model reads; "
        "supported: " in capsys.readouterr().err
    )
    (tmp_path / "vl" / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "vision_config": {}}))
    assert script.main(["from-hf", str(tmp_path / "vl"), str(tmp_path / "dcp")]) == 2
    assert "describes a vision tower only (vision_config, no text_config)" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "dcp").exists()


PEAK = """
import sys, runpy
sys.argv = [sys.argv[1]] + sys.argv[2:]
import torch, torchtitan.components.checkpoint  # imports are not the converter's

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])

open("/proc/self/clear_refs", "w").write("5")  # Linux: the peak (VmHWM) restarts from the current size
before = status("VmRSS:")
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print("PEAK_GROWTH_KB", status("VmHWM:") - before)
"""


def peak_growth_mib(*argv) -> float:
    """The converter's peak resident memory above what its imports took, in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-c", PEAK, str(SCRIPT), *map(str, argv)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split("PEAK_GROWTH_KB")[-1]) / 1024


def test_conversion_streams_one_file_at_a_time(tmp_path):
    """A 148 MiB float32 model (no optimizer state, no tensor over 3 MiB) converts both ways with peak
    memory growth under half its size (the whole model in memory, as before streaming, is more than
    its size): to-hf holds about one 8 MiB output file, from-hf about one tensor (measured: 52 and
    39 MiB)."""
    args = SPEC.args_cls(
        dim=512, n_layers=12, n_heads=8, n_kv_heads=4, vocab_size=1024, multiple_of=256, max_seq_len=64
    )
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=1)
    sd = model.state_dict()
    model_mib = sum(t.numel() * 4 for t in sd.values()) / 2**20
    folder = tmp_path / "step-5"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd}, checkpoint_id=folder, no_dist=True)
    train_state = {
        "format_version": 1,
        "step": 5,
        "tokens": 640,
        "model_only": True,
        "model": {"name": "llama3", "flavor": "big", "args": asdict(args)},
    }
    (folder / "train_state.json").write_text(json.dumps(train_state))
    del model
    to_hf = peak_growth_mib("to-hf", folder, tmp_path / "hf", "--max-shard-mb", "8")
    from_hf = peak_growth_mib("from-hf", tmp_path / "hf", tmp_path / "back")
    assert model_mib > 140 and len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 15
    print(f"model {model_mib:.0f} MiB, peak growth to-hf {to_hf:.0f} MiB, from-hf {from_hf:.0f} MiB")
    assert to_hf < model_mib / 2 and from_hf < model_mib / 2, (model_mib, to_hf, from_hf)
    back, _, _ = read_dcp_model(str(tmp_path / "back"), SPEC)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
