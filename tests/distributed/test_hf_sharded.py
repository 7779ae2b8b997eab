"""Hugging Face weights in and out under every layout, one tensor at a time (hf_sharded.py).

Folders made by transformers' own save_pretrained (random weights, small max_shard_size: many files
and an index) for llama3's and Qwen3-MoE's debug flavors are loaded by training jobs under one
process, FSDP 4, TP 2, PP 2, PP 2 x TP 2, FSDP 2 x TP 2, EP 2 and EP 2 x FSDP 2, Qwen3's tied-embedding flavor under PP 2 and PP 2 x FSDP 2, and a Llama 3.2-like
folder (tied, rotary scaled) under PP 2 x FSDP 2, and DeepSeek-V3's debug flavor under PP 2 and
EP 2 x FSDP 2. Each trains one step that moves no
weight (gradients clipped to 1e-30, no weight decay) and exports at its end, under its own layout:
- import: the step-1 loss equals transformers' loss on the same batch within 1e-5 (fp32);
- round trip: the export holds the imported tensors bit for bit (fp32), in files of the hub's names
  with an index, config.json and generation_config.json;
- transformers loads the PP 2 x TP 2, EP 2 x FSDP 2, both tied PP 2 x FSDP 2 and DeepSeek-V3's EP 2 x FSDP 2 exports with logits equal to the original
  folder's within 1e-4.
"""

import dataclasses
import json

import pytest
import torch

from conftest import REPO, TINY, launch
from torchtitan.components.hf_checkpoint import HFFolder, load_hf
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.models.registry import get_model_spec
from torchtitan.models.common.rotary import RopeScaling

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

# key: (family, flavor, fields of the folder's config that differ from the flavor's). "llama32" is the
# llama debug flavor with Llama 3.2's tied embeddings and rotary scaling (16 original positions, so
# that the scaling moves the angles of a 64-token window): the trainer takes both from the folder.
FAMILIES = {"llama": ("llama3", "debugmodel", {}), "moe": ("qwen3", "debugmodel_moe", {}),
            "tied": ("qwen3", "debugmodel_tied", {}),
            "llama32": ("llama3", "debugmodel", {"tie_word_embeddings": True, "rope_scaling": RopeScaling(
                factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)}),
            "ds": ("deepseek_v3", "debugmodel", {})}
# DeepSeek-V3 jobs keep the balancing bias still (it is exported: a moved bias would differ from the import).
STILL_BIAS = ["--moe.load_balance_coeff", "0"]
STILL = ["--training.steps", "1", "--training.max_norm", "1e-30", "--optimizer.weight_decay", "0",
         "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype", "float32", "--checkpoint.hf_max_shard_mb", "2"]
# name: (family key, local batch size for the global batch of 8, layout)
LAYOUTS = {
    1: {"llama_single": ("llama", 8, []), "moe_single": ("moe", 8, [])},
    2: {"llama_tp2": ("llama", 8, ["--parallelism.tensor_parallel_degree", "2"]),
        "llama_pp2": ("llama", 8, ["--parallelism.pipeline_parallel_degree", "2"]),
        "moe_ep2": ("moe", 4, ["--parallelism.expert_parallel_degree", "2"]),
        "ds_pp2": ("ds", 8, ["--parallelism.pipeline_parallel_degree", "2", *STILL_BIAS]),
        # Tied embeddings: the embedding on the first stage, its copy as the output layer on the last.
        "tied_pp2": ("tied", 8, ["--parallelism.pipeline_parallel_degree", "2"])},
    4: {"llama_fsdp4": ("llama", 2, []),
        "llama_pp2_tp2": ("llama", 8, ["--parallelism.pipeline_parallel_degree", "2",
                                       "--parallelism.tensor_parallel_degree", "2"]),
        "moe_ep2_fsdp2": ("moe", 2, ["--parallelism.expert_parallel_degree", "2"]),
        # FSDP over TP-sharded rows: strided shards, which are read whole and all-gathered.
        "llama_fsdp2_tp2": ("llama", 4, ["--parallelism.tensor_parallel_degree", "2"]),
        "tied_pp2_fsdp2": ("tied", 4, ["--parallelism.pipeline_parallel_degree", "2"]),
        "llama32_pp2_fsdp2": ("llama32", 4, ["--parallelism.pipeline_parallel_degree", "2"]),
        "ds_ep2_fsdp2": ("ds", 2, ["--parallelism.expert_parallel_degree", "2", *STILL_BIAS])},
}


def hf_folder(path, family: str, flavor: str, changes: dict):
    """A folder written by transformers' save_pretrained for our flavor's config (with `changes`),
    random weights."""
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.args_for_training(flavor, 4096, 64), **changes)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(spec.hf.config(args, torch.float32, 1, 2)))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(path)),
                                                          torch_dtype=torch.float32)
    model.save_pretrained(str(path), max_shard_size="3MB")
    return model.eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_sharded")
    models = {key: hf_folder(tmp / f"hf_{key}", *FAMILIES[key]) for key in FAMILIES}
    results = {}
    for nproc, jobs in LAYOUTS.items():
        argv = {}
        for name, (key, local_batch, extra) in jobs.items():
            family, flavor, _ = FAMILIES[key]
            argv[name] = ["--model.name", family, "--model.flavor", flavor, "--training.local_batch_size",
                          str(local_batch), "--checkpoint.initial_load_path", str(tmp / f"hf_{key}"), "--checkpoint.initial_load_in_hf",
                          *STILL, *extra]
        results.update(launch(argv, nproc, tmp))
    return tmp, models, results


def first_batch(tmp):
    from torchtitan.components.data import build_dataloader
    from torchtitan.config import load_config

    cfg = load_config(TINY + ["--training.local_batch_size", "8"])
    return next(iter(build_dataloader(cfg.training, Tokenizer(cfg.model.tokenizer_path), 0, 1, 8)))


def test_save_pretrained_wrote_many_files_with_an_index(runs):
    tmp, _, _ = runs
    for key in FAMILIES:
        assert (tmp / f"hf_{key}" / "model.safetensors.index.json").is_file()
        assert len(list((tmp / f"hf_{key}").glob("model-*.safetensors"))) > 3


@pytest.mark.parametrize("name", [n for jobs in LAYOUTS.values() for n in jobs])
def test_imported_weights_give_transformers_loss(runs, name):
    tmp, models, results = runs
    inputs, labels = first_batch(tmp)
    with torch.no_grad():
        logits = models[name.split("_")[0]](inputs).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten()).item()
    got = results[name][0]["loss"]
    assert abs(got - expected) < 1e-5, f"{name}: step-1 loss {got}, transformers {expected}"


@pytest.mark.parametrize("name", [n for jobs in LAYOUTS.values() for n in jobs])
def test_export_holds_the_imported_tensors_bit_for_bit(runs, name):
    tmp, _, _ = runs
    key = name.split("_")[0]
    family, _, _ = FAMILIES[key]
    spec = get_model_spec(family)
    out = tmp / name / "checkpoint" / "step-1-hf"
    assert {"config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    exported = HFFolder(out)
    assert len(set(exported.file_of.values())) > 3 and (out / "model.safetensors.index.json").is_file()
    ours_out, _ = load_hf(out, spec.hf)
    ours_in, _ = load_hf(tmp / f"hf_{key}", spec.hf)
    assert ours_out.keys() == ours_in.keys()
    for k in ours_in:
        assert torch.equal(ours_out[k], ours_in[k]), f"{name}: {k} changed"


@pytest.mark.parametrize("name", ["llama_pp2_tp2", "moe_ep2_fsdp2", "tied_pp2_fsdp2", "llama32_pp2_fsdp2",
                                  "ds_ep2_fsdp2"])
def test_transformers_loads_the_export(runs, name):
    tmp, models, _ = runs
    out = tmp / name / "checkpoint" / "step-1-hf"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (loaded(tokens).logits - models[name.split("_")[0]](tokens).logits).abs().max().item()
    assert diff < 1e-4
