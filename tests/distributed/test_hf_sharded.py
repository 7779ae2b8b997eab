"""Hugging Face weights in and out under every layout, one tensor at a time (hf_sharded.py).

Folders made by transformers' own save_pretrained (random weights, small max_shard_size: many files
and an index) for llama3's and Qwen3-MoE's debug flavors are loaded by training jobs under one
process, FSDP 4, TP 2, PP 2, PP 2 x TP 2, FSDP 2 x TP 2, EP 2 and EP 2 x FSDP 2, Qwen3's
tied-embedding flavor under PP 2 and PP 2 x FSDP 2, and a Llama 3.2-like
folder (tied, rotary scaled) under PP 2 x FSDP 2, DeepSeek-V3's debug flavor under PP 2 and
EP 2 x FSDP 2, and gpt-oss's (sinks, windows, biased experts) under one process, TP 2, PP 2, CP 2, EP 2,
EP 2 x FSDP 2 and EP 2 x TP 2, and a gpt-oss folder whose experts are stored in MXFP4 (as published)
under EP 2 and EP 2 x FSDP 2, dequantized as each rank reads its experts (transformers' loss computed
with its own dequantization), and Qwen3.5's (DeltaNet layers, zero-centered norms) under FSDP 2 and
Qwen3.5-MoE's under EP 2. Each trains one step that moves no
weight (gradients clipped to 1e-30, no weight decay) and exports at its end, under its own layout:
- import: the step-1 loss equals transformers' loss on the same batch within 1e-5 (fp32);
- round trip: the export holds the imported tensors bit for bit (fp32), in files of the hub's names
  with an index, config.json and generation_config.json;
- transformers loads the PP 2 x TP 2, EP 2 x FSDP 2, both tied PP 2 x FSDP 2, DeepSeek-V3's EP 2 x FSDP 2 and
  gpt-oss's EP 2 x TP 2 exports with logits equal to the original
  folder's within 1e-4.

Reads (tests/distributed/hf_load_worker.py loads folders written by our adapters, float32, straight into
each rank's shards, without training): every rank's tensors equal their part of the folder's, and
a rank reads exactly its own shards' bytes wherever each shard is one block: renames, Llama's
permuted q/k (head-aligned rows), experts stacked from one tensor per expert or sliced from the
fused ones, under FSDP 4, FSDP 2 x TP 2 (strided shards), EP 2 x FSDP 2, tied embeddings read once;
rows that cross a head boundary (FSDP 3) read those heads' rows, each rank under 40% of the folder.
Exported again from those shards in bf16 (each block cast before it is sent to its file's writer),
every tensor is the folder's cast to bf16.
"""

import dataclasses
import json

import pytest
import torch

from torchtitan.components.checkpoint import HFFolder, load_hf, save_hf
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.models.common.hf_conversion import FUSED_DOWN, FUSED_GATE_UP
from torchtitan.models.common.rotary import RopeScaling
from torchtitan.models.registry import get_model_spec

from helpers.launch import launch, run_script
from helpers.paths import MODEL, REPO, TINY

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

transformers = pytest.importorskip("transformers")

# key: (family, flavor, fields of the folder's config that differ from the flavor's). "llama32" is the
# llama debug flavor with Llama 3.2's tied embeddings and rotary scaling (16 original positions, so
# that the scaling moves the angles of a 64-token window): the trainer takes both from the folder.
FAMILIES = {
    "llama": ("llama3", "debugmodel", {}),
    "moe": ("qwen3", "debugmodel_moe", {}),
    "tied": ("qwen3", "debugmodel_tied", {}),
    "llama32": (
        "llama3",
        "debugmodel",
        {
            "tie_word_embeddings": True,
            "rope_scaling": RopeScaling(
                factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
            ),
        },
    ),
    "ds": ("deepseek_v3", "debugmodel", {}),
    "gptoss": ("gpt_oss", "debugmodel", {}),
    # gpt-oss with its experts in MXFP4, as published (a folder our test helper writes: transformers
    # writes no MXFP4 on the CPU); its transformers model holds transformers' own dequantization.
    "mxfp4": ("gpt_oss", "debugmodel", {}),
    # Qwen3.5 (gated DeltaNet and gated attention, zero-centered norms) and Qwen3.5-MoE (shared
    # expert and its gate).
    "qwen35": ("qwen3_5", "debugmodel", {}),
    "qwen35moe": ("qwen3_5", "debugmodel_moe", {}),
}
# DeepSeek-V3 jobs keep the balancing bias still (it is exported: a moved bias would differ from the import).
STILL_BIAS = ["--moe.load_balance_coeff", "0"]
STILL = [
    "--training.steps",
    "1",
    "--training.max_norm",
    "1e-30",
    "--optimizer.weight_decay",
    "0",
    "--checkpoint.last_save_in_hf",
    "--checkpoint.export_dtype",
    "float32",
    "--checkpoint.hf_max_shard_mb",
    "2",
]
# name: (family key, local batch size for the global batch of 8, layout)
LAYOUTS = {
    1: {"llama_single": ("llama", 8, []), "moe_single": ("moe", 8, []), "gptoss_single": ("gptoss", 8, [])},
    2: {
        "llama_tp2": ("llama", 8, ["--parallelism.tensor_parallel_degree", "2"]),
        "llama_pp2": ("llama", 8, ["--parallelism.pipeline_parallel_degree", "2"]),
        "moe_ep2": ("moe", 4, ["--parallelism.expert_parallel_degree", "2"]),
        "ds_pp2": ("ds", 8, ["--parallelism.pipeline_parallel_degree", "2", *STILL_BIAS]),
        # Tied embeddings: the embedding on the first stage, its copy as the output layer on the last.
        "tied_pp2": ("tied", 8, ["--parallelism.pipeline_parallel_degree", "2"]),
        # gpt-oss: sinks split by head under TP, experts by expert under EP.
        "gptoss_tp2": ("gptoss", 8, ["--parallelism.tensor_parallel_degree", "2"]),
        "gptoss_pp2": ("gptoss", 8, ["--parallelism.pipeline_parallel_degree", "2"]),
        "gptoss_cp2": ("gptoss", 8, ["--parallelism.context_parallel_degree", "2"]),
        "gptoss_ep2": ("gptoss", 4, ["--parallelism.expert_parallel_degree", "2"]),
        "mxfp4_ep2": ("mxfp4", 4, ["--parallelism.expert_parallel_degree", "2"]),
        # Qwen3.5 under FSDP 2 (each rank reads its shards' rows) and Qwen3.5-MoE under EP 2 (its experts).
        "qwen35_fsdp2": ("qwen35", 4, []),
        "qwen35moe_ep2": ("qwen35moe", 4, ["--parallelism.expert_parallel_degree", "2"]),
    },
    4: {
        "llama_fsdp4": ("llama", 2, []),
        "llama_pp2_tp2": (
            "llama",
            8,
            ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
        ),
        "moe_ep2_fsdp2": ("moe", 2, ["--parallelism.expert_parallel_degree", "2"]),
        # FSDP over TP-sharded rows: strided shards, which are read whole and all-gathered.
        "llama_fsdp2_tp2": ("llama", 4, ["--parallelism.tensor_parallel_degree", "2"]),
        "tied_pp2_fsdp2": ("tied", 4, ["--parallelism.pipeline_parallel_degree", "2"]),
        "llama32_pp2_fsdp2": ("llama32", 4, ["--parallelism.pipeline_parallel_degree", "2"]),
        "ds_ep2_fsdp2": ("ds", 2, ["--parallelism.expert_parallel_degree", "2", *STILL_BIAS]),
        "gptoss_ep2_fsdp2": ("gptoss", 2, ["--parallelism.expert_parallel_degree", "2"]),
        "mxfp4_ep2_fsdp2": ("mxfp4", 2, ["--parallelism.expert_parallel_degree", "2"]),
        "gptoss_ep2_tp2": (
            "gptoss",
            4,
            ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
        ),
    },
}


def hf_folder(path, family: str, flavor: str, changes: dict):
    """A folder written by transformers' save_pretrained for our flavor's config (with `changes`),
    random weights."""
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.args_for_training(flavor, 4096, 64), **changes)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(spec.hf.config(args, torch.float32, 1, 2)))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(str(path)), torch_dtype=torch.float32
    )
    if family == "gpt_oss":  # its zero-initialized biases would move by Adam's ~1e-26 in the still step
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "bias" in name and not p.any():
                    p.normal_(0.0, 0.02)
    if family == "qwen3_5":
        # Every tensor away from its init: the zero-centered norms start at 0 (they would move by Adam's
        # ~1e-26 in the still step), and norms or DeltaNet decays that are all equal would hide a swap.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02))
    model.save_pretrained(str(path), max_shard_size="3MB")
    return model.eval()


def mxfp4_folder(path, family: str, flavor: str, changes: dict):
    """gpt-oss's folder with MXFP4 experts, and transformers' model of it, dequantized by transformers."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from helpers.hf import gpt_oss_mxfp4_folder

    spec = get_model_spec(family)
    args = dataclasses.replace(spec.args_for_training(flavor, 4096, 64), **changes)
    quantized = gpt_oss_mxfp4_folder(path, args)
    hf_sd = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if k not in quantized}
    for blocks in [k for k in quantized if k.endswith("_blocks")]:
        name = blocks.removesuffix("_blocks")
        hf_sd[name] = convert_moe_packed_tensors(quantized[blocks], quantized[name + "_scales"], dtype=torch.float32)
    config = transformers.AutoConfig.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.load_state_dict(hf_sd, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_sharded")
    models = {
        key: (mxfp4_folder if key == "mxfp4" else hf_folder)(tmp / f"hf_{key}", *FAMILIES[key]) for key in FAMILIES
    }
    results = {}
    for nproc, jobs in LAYOUTS.items():
        argv = {}
        for name, (key, local_batch, extra) in jobs.items():
            family, flavor, _ = FAMILIES[key]
            argv[name] = [
                "--model.name",
                family,
                "--model.flavor",
                flavor,
                "--training.local_batch_size",
                str(local_batch),
                "--checkpoint.initial_load_path",
                str(tmp / f"hf_{key}"),
                "--checkpoint.initial_load_in_hf",
                *STILL,
                *extra,
            ]
        results.update(launch(argv, nproc, tmp))
    return tmp, models, results


def first_batch(tmp):
    from torchtitan.components.data import build_dataloader
    from torchtitan.config import load_config

    cfg = load_config(TINY + ["--training.local_batch_size", "8"])
    return next(iter(build_dataloader(cfg.training, Tokenizer(cfg.model.tokenizer_path), 0, 1, 8)))


def test_save_pretrained_wrote_many_files_with_an_index(runs):
    tmp, _, _ = runs
    for key in set(FAMILIES) - {"mxfp4"}:  # one file, written by our helper
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


# transformers (5.25) loads the tokenizer of a folder whose config.json has model_type 'qwen3_5_moe_text' as its
# own Qwen3_5Tokenizer whatever tokenizer_config.json names (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), and that
# class splits text its own way: the export's tokenizer does not survive it yet.
def test_every_export_holds_the_runs_tokenizer(runs):
    # The jobs train with the shipped sentencepiece model; each export writes it in Hugging Face form
    # (the rank that publishes the folder), and AutoTokenizer encodes as the trainer does: Qwen3.5-MoE's
    # too, whose model type transformers would tokenize with its own class (tokenizer_export.py).
    tmp, _, _ = runs
    text = "def f(x):\n    return x + 1\n"
    expected = Tokenizer(MODEL).encode(text, bos=True)
    for name in [n for jobs in LAYOUTS.values() for n in jobs]:
        out = tmp / name / "checkpoint" / "step-1-hf"
        assert transformers.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == expected, name


@pytest.mark.parametrize(
    "name",
    [
        "llama_pp2_tp2",
        "moe_ep2_fsdp2",
        "tied_pp2_fsdp2",
        "llama32_pp2_fsdp2",
        "ds_ep2_fsdp2",
        "gptoss_ep2_tp2",
        "qwen35_fsdp2",
        "qwen35moe_ep2",
    ],
)
def test_transformers_loads_the_export(runs, name):
    tmp, models, _ = runs
    out = tmp / name / "checkpoint" / "step-1-hf"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (loaded(tokens).logits - models[name.split("_")[0]](tokens).logits).abs().max().item()
    assert diff < 1e-4


def fuse_experts(hf_sd: dict, layers: int) -> dict:
    """The hub layout's per-expert tensors as transformers 5 holds them in memory: gate_up_proj
    [experts, 2 x hidden, dim] (gate rows first) and down_proj [experts, dim, hidden] per layer."""
    out = dict(hf_sd)
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        per = {k: out.pop(k) for k in list(out) if k.startswith(prefix)}
        experts = range(len(per) // 3)
        if per:
            out[f"model.layers.{layer}.{FUSED_GATE_UP}"] = torch.stack(
                [torch.cat([per[f"{prefix}{e}.gate_proj.weight"], per[f"{prefix}{e}.up_proj.weight"]]) for e in experts]
            )
            out[f"model.layers.{layer}.{FUSED_DOWN}"] = torch.stack(
                [per[f"{prefix}{e}.down_proj.weight"] for e in experts]
            )
    return out


def adapter_folder(path, family: str, flavor: str, fused: bool):
    """A float32 folder written by our adapter (1 MiB files) from the flavor's seeded init; with
    `fused`, the experts as transformers 5's fused tensors."""
    spec = get_model_spec(family)
    args = spec.args_for_training(flavor, 4096, 64)
    torch.manual_seed(0)
    with torch.no_grad():
        sd = {
            k: v.float().normal_() if v.is_floating_point() else v for k, v in spec.model_cls(args).state_dict().items()
        }
    adapter = spec.hf
    if fused:
        adapter = dataclasses.replace(
            adapter, to_hf=lambda sd, args: fuse_experts(spec.hf.to_hf(sd, args), args.n_layers)
        )
    save_hf(path, sd, adapter, args, torch.float32, max_shard_bytes=2**20)
    return path


EP2 = ["--parallelism.expert_parallel_degree", "2"]
# name: (family, flavor, experts fused, layout, each rank reads exactly its shards' bytes)
READS = {
    3: {"llama_fsdp3": ("llama3", "debugmodel", False, [], False)},
    4: {
        "llama_fsdp4": ("llama3", "debugmodel", False, [], True),
        "llama_fsdp2_tp2": ("llama3", "debugmodel", False, ["--parallelism.tensor_parallel_degree", "2"], True),
        "moe_fsdp4": ("qwen3", "debugmodel_moe", False, [], True),
        # The output layer is the embedding: read once.
        "tied_fsdp4": ("qwen3", "debugmodel_tied", False, [], True),
        "moe_ep2_fsdp2": ("qwen3", "debugmodel_moe", False, EP2, True),
        "moe_fused_ep2_fsdp2": ("qwen3", "debugmodel_moe", True, EP2, True),
        "ds_ep2_fsdp2": ("deepseek_v3", "debugmodel", False, EP2, True),
    },
}


@pytest.fixture(scope="module")
def reads(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_reads")
    folders = {}
    results = {}
    for nproc, cases in READS.items():
        spec = []
        for name, (family, flavor, fused, layout, _) in cases.items():
            key = (family, flavor, fused)
            if key not in folders:
                folders[key] = adapter_folder(tmp / f"{family}_{flavor}_{fused}", *key)
            spec.append(
                {
                    "name": name,
                    "folder": str(folders[key]),
                    "argv": [
                        "--job.config_file",
                        str(REPO / "train_configs" / "debug_model.toml"),
                        "--model.name",
                        family,
                        "--model.flavor",
                        flavor,
                        *layout,
                    ],
                }
            )
        (tmp / f"cases_{nproc}.json").write_text(json.dumps(spec))
        run_script(
            REPO / "tests" / "distributed" / "hf_load_worker.py",
            [str(tmp / f"cases_{nproc}.json"), str(tmp / f"out_{nproc}.json")],
            nproc,
            tmp,
        )
        results.update(json.loads((tmp / f"out_{nproc}.json").read_text()))
    return results


@pytest.mark.parametrize("name", [n for cases in READS.values() for n in cases])
def test_each_rank_reads_only_its_shards(reads, name):
    exact = next(cases[name][-1] for cases in READS.values() if name in cases)
    for rank, r in enumerate(reads[name]):
        assert not r["mismatches"], f"{name} rank {rank}: {r['mismatches'][:5]} differ from the folder"
        if exact:
            assert r["bytes_read"] == r["own_bytes"], (name, rank, r)
        assert r["bytes_read"] < 0.4 * r["folder_bytes"], (name, rank, r)
    # Exported again from the shards in bf16: each tensor is the folder's cast to bf16.
    assert reads[name][0]["exported"] > 10 and not reads[name][0]["export_differs"], reads[name][0]
