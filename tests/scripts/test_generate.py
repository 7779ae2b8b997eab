"""scripts/generate.py: the KV-cache path gives the training forward's logits, greedy decoding of an
imported Hugging Face model gives transformers' own tokens, the command line prints the same text from
a step-N folder and from its Hugging Face export, and mistakes end with one line and exit status 2."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from torchtitan.components.checkpoint import save_hf, write_dcp_model
from torchtitan.components.tokenizer import Tokenizer
from torchtitan.components.tokenizer_export import export_tokenizer
from torchtitan.models.common.layers import kv_caches
from torchtitan.models.common.moe import MoEArgs, moe_layers
from torchtitan.models.registry import get_model_spec

from helpers.launch import launch, load_script
from helpers.paths import MODEL, RECIPE, REPO
from helpers.tiny_models import small_llama3_args, small_qwen3_5_args

SCRIPT = REPO / "scripts" / "generate.py"
LLAMA, QWEN, QWEN3_5 = get_model_spec("llama3"), get_model_spec("qwen3"), get_model_spec("qwen3_5")
SMALL = {
    "llama3": (LLAMA, small_llama3_args()),
    "qwen3_tied": (
        QWEN,
        QWEN.args_cls(
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=32,
            hidden_dim=128,
            vocab_size=128,
            max_seq_len=64,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": (
        QWEN,
        QWEN.args_cls(
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            hidden_dim=128,
            vocab_size=128,
            max_seq_len=64,
            moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=32, route_norm=True),
        ),
    ),
    # DeltaNet, attention, DeltaNet, attention; chunks of 8, so a prompt of 10 spans two.
    "qwen3_5": (
        QWEN3_5,
        small_qwen3_5_args(delta_chunk=8),
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared CPU: one intra-op thread (measured: 10 s -> 0.8 s for a test's 100
    forwards on 2 busy cores, where two threads wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gen():
    return load_script(SCRIPT, "generate")


def small_model(family: str, seed: int = 1):
    """A SMALL model on the CPU, randomized, in eval mode (built directly: its constructor's default
    init is overwritten anyway, and init_weights' truncated normals are slow)."""
    spec, args = SMALL[family]
    model = spec.model_cls(args)
    randomize(model, seed)
    return model.eval()


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 1):
    """Every matrix ~ N(0, 1/fan_in), norms around 1: logits of order 1 whose argmax is far from
    ties, so that round-off cannot flip a greedy choice, and a wrong position or mask shows far above
    the tolerances. (fan_in: the last dimension, also of embeddings and 3-D expert weights.)"""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif name.endswith(("A_log", "dt_bias")):  # DeltaNet's decay: exp(A_log) in [1, 3], dt_bias around 0
            p.copy_(torch.rand(p.shape, generator=g) - 0.5 + (0.5 if name.endswith("A_log") else 0.0))
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def tokens(n: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(seed))


# ---- the cache against the training forward ----


def assert_close(ours: torch.Tensor, full: torch.Tensor, rtol: float = 1e-5):
    """Equal within fp32 round-off: max |difference| under rtol x the largest |logit|."""
    diff, scale = (ours - full).abs().max().item(), full.abs().max().item()
    assert diff <= rtol * scale, f"max |difference| {diff:.3g} for logits up to {scale:.3g}"


@pytest.mark.parametrize("family", list(SMALL))
@torch.no_grad()
def test_kv_cache_logits_equal_the_training_forward(family):
    model = small_model(family)
    x = tokens(24)
    cache = kv_caches(model, 24)
    # The prompt through the cache: the training forward's logits (within fp32 round-off: 1e-5 of the
    # largest logit, which is about 3 here; measured up to 1.1e-6).
    prompt = model(x[:, :10], cache=cache, start_pos=0)
    assert_close(prompt, model(x[:, :10]))
    # Then a chunk of 3 (masked within the chunk) and single tokens: each position's logits are the
    # full forward's over the sequence so far.
    chunk = model(x[:, 10:13], cache=cache, start_pos=10)
    assert_close(chunk, model(x[:, :13])[:, 10:])
    for pos in range(13, 24):
        step = model(x[:, pos : pos + 1], cache=cache, start_pos=pos)
        assert_close(step[:, 0], model(x[:, : pos + 1])[:, -1])
    # A wrong position is seen: the same token at another position gives other logits.
    again = model(x[:, 23:24], cache=kv_caches(model, 24), start_pos=0)
    assert (again - step).abs().max().item() > 1e-2
    with pytest.raises(ValueError, match="do not fit a KV cache"):
        model(x[:, :1], cache=cache, start_pos=24)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(x[:, :1], cache=kv_caches(model, 100), start_pos=64)
    # Decoding an MoE model leaves its training state alone (token counts, balancing bias, stats).
    for _, moe in moe_layers(model):
        assert not moe.tokens_per_expert.any() and not moe.expert_bias.any() and not moe.stats


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe", "qwen3_5"])
def test_generate_with_and_without_cache_gives_the_same_tokens(gen, family):
    model = small_model(family, seed=3)
    prompt = tokens(6)[0].tolist()
    greedy = gen.generate(model, prompt, 20)
    assert greedy == gen.generate(model, prompt, 20, use_cache=False) and len(greedy) == 20
    sampled = gen.generate(model, prompt, 20, temperature=1.0, top_k=20, top_p=0.9, seed=5)
    assert sampled == gen.generate(model, prompt, 20, temperature=1.0, top_k=20, top_p=0.9, seed=5, use_cache=False)
    assert sampled != greedy and sampled != gen.generate(model, prompt, 20, temperature=1.0, seed=6)
    # Stops after EOS, EOS included.
    assert gen.generate(model, prompt, 20, eos_id=greedy[4]) == greedy[: greedy.index(greedy[4]) + 1]


def test_sample_next_filters(gen):
    logits = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05]))
    g = torch.Generator().manual_seed(0)
    assert gen.sample_next(logits) == 1
    draws = lambda **kw: {gen.sample_next(logits, 1.0, generator=g, **kw) for _ in range(300)}  # noqa: E731
    assert draws() == {0, 1, 2, 3, 4}
    assert draws(top_k=2) == {1, 2}
    assert draws(top_p=0.5) == {1, 2}  # 0.4 < 0.5, 0.4 + 0.3 reaches it
    assert draws(top_p=0.4) == {1}
    assert draws(top_k=1, top_p=1.0) == {1}
    assert {gen.sample_next(logits, 0.01, generator=g) for _ in range(100)} == {1}  # cold: nearly greedy


# ---- Hugging Face import against transformers' generate ----


def hf_model(transformers, kind: str):
    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=127,
        pad_token_id=0,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(intermediate_size=96, **common)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(intermediate_size=96, head_dim=32, tie_word_embeddings=True, **common)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "gpt_oss":  # sinks, a window of 5 on layer 0, YaRN over 16 original positions, biased experts
        config = transformers.GptOssConfig(
            intermediate_size=32,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            layer_types=None,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            **common,
        )
        config._attn_implementation = "eager"
        cls = transformers.GptOssForCausalLM
    elif kind == "qwen3_5":  # a gated DeltaNet layer, then a gated attention layer
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config = Qwen3_5TextConfig(
            intermediate_size=96,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            full_attention_interval=2,
            **common,
        )
        cls = Qwen3_5ForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=96,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            **common,
        )
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    randomize(model, seed=4)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "gpt_oss", "qwen3_5"])
def test_greedy_from_imported_hf_model_equals_transformers_generate(gen, tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    hf = hf_model(transformers, kind)
    hf.save_pretrained(tmp_path / "hf")
    spec, sd, args, where = gen.read_weights(tmp_path / "hf")
    model = gen.build_model(spec, args, sd, "cpu")
    prompt = [1, *tokens(7, seed=3)[0].tolist()]
    ours = gen.generate(model, prompt, 30, eos_id=127)
    with torch.no_grad():
        # The attention mask is given: inferred from pad_token_id, it would hide a prompt token 0.
        theirs = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=30,
            eos_token_id=127,
            pad_token_id=0,
        )[0, len(prompt) :]
    theirs = theirs.tolist()
    assert ours == theirs
    assert len(ours) == 30 and len(set(ours)) > 5  # not a degenerate repetition


# ---- the command line ----


@pytest.fixture(scope="module")
def debug_checkpoints(tmp_path_factory):
    """The recipe's model (llama3 debugmodel, the tokenizer's vocabulary, 64 positions) as a step-0
    folder and as its Hugging Face export; a small Qwen3 one (another model) in a folder of step-N
    folders; an empty folder."""
    tmp = tmp_path_factory.mktemp("debug")
    args = LLAMA.args_for_training("debugmodel", 4096, 64)
    model = LLAMA.model_cls(args)  # on the CPU with default init (init_weights takes seconds), then randomized
    randomize(model, seed=8)
    sd = model.state_dict()
    write_dcp_model(tmp / "step-0", sd, LLAMA, args, "debugmodel")
    save_hf(tmp / "hf", sd, LLAMA.hf, args, torch.float32)
    write_dcp_model(
        tmp / "qwen" / "step-3", small_model("qwen3_tied").state_dict(), QWEN, SMALL["qwen3_tied"][1], "small"
    )
    (tmp / "empty").mkdir()
    return tmp, model.eval()


SAMPLING = [
    "--prompt",
    "def main(argv):\n",
    "--max_new_tokens",
    "12",
    "--temperature",
    "0.8",
    "--top_k",
    "50",
    "--top_p",
    "0.95",
    "--seed",
    "3",
]


def test_cli_prints_the_same_continuation_from_dcp_and_hf(gen, debug_checkpoints, capsys):
    tmp, model = debug_checkpoints
    tokenizer = Tokenizer(MODEL)

    def continuation(prompt: str, *args) -> str:
        new = gen.generate(model, tokenizer.encode(prompt, True, False), *args, eos_id=tokenizer.eos_id)
        return tokenizer.decode([t for t in new if t != tokenizer.eos_id]) + "\n"

    expected = continuation("def main(argv):\n", 12, 0.8, 50, 0.95, 3)
    for folder in ("step-0", "hf"):
        assert gen.main([*RECIPE, "--checkpoint", str(tmp / folder), *SAMPLING]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out == expected
    # Greedy is the default.
    assert gen.main([*RECIPE, "--checkpoint", str(tmp / "hf"), "--prompt", "x", "--max_new_tokens", "4"]) == 0
    assert capsys.readouterr().out == continuation("x", 4)


def test_cli_generates_from_a_published_qwen3_5_folder(gen, tmp_path, capsys, caplog):
    """The published Qwen3.5 layout as --checkpoint (Qwen3_5ForConditionalGeneration: model_type 'qwen3_5',
    the text model in text_config and under model.language_model., a vision tower beside it), which the
    trainer imports: read as the family of text_config's model_type, the model holds the weights written
    into its language model and gives transformers' text logits, and the command line prints the
    continuation of the model written."""
    pytest.importorskip("transformers")
    from helpers.hf import qwen3_5_multimodal_folder

    args = QWEN3_5.args_for_training("debugmodel", 4096, 64)  # the recipe's model under --model.name qwen3_5
    model = QWEN3_5.model_cls(args)
    randomize(model, seed=8)
    theirs = qwen3_5_multimodal_folder(tmp_path / "hf", args, model.state_dict())
    spec, sd, read_args, where = gen.read_weights(tmp_path / "hf")
    assert spec.name == "qwen3_5" and read_args == args and "Qwen3_5ForConditionalGeneration" in where
    loaded = gen.build_model(spec, read_args, sd, "cpu")
    x = tokens(16, vocab=4096)
    with torch.no_grad():
        ours, written = loaded(x), model.eval()(x)
        assert_close(ours, written)  # the norms' 1 + w form of the folder rounds them
        # Another implementation (transformers' chunked delta rule, its zero-centered norms): within 1e-4 of the
        # largest logit (measured: 1.2e-5).
        assert_close(theirs(input_ids=x).logits, ours, rtol=1e-4)
    tokenizer = Tokenizer(MODEL)
    new = gen.generate(model, tokenizer.encode("def main(argv):\n", True, False), 8, eos_id=tokenizer.eos_id)
    expected = tokenizer.decode([t for t in new if t != tokenizer.eos_id]) + "\n"
    prompt = ["--checkpoint", str(tmp_path / "hf"), "--prompt", "def main(argv):\n", "--max_new_tokens", "8"]
    assert gen.main([*RECIPE, "--model.name", "qwen3_5", *prompt]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == expected
    # No recipe and no --model.name: the folder's own model (the recipe's default family is llama3), the default
    # tokenizer; then the tokenizer written into the folder, which gives the same ids.
    assert gen.main(prompt) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == expected
    export_tokenizer(MODEL, tmp_path / "hf")
    assert gen.main([*prompt, "--model.tokenizer_path", str(tmp_path / "nowhere")]) == 2  # a named one is read
    assert "nowhere" in capsys.readouterr().err
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="generate"):
        assert gen.main(prompt) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == expected and f"tokenizer {tmp_path / 'hf'}" in caplog.text


def test_without_a_recipe_the_checkpoint_is_read_with_a_tokenizer_it_can_take(gen, debug_checkpoints, capsys):
    """No recipe: the checkpoint's own model (Qwen3 here, of 128 tokens), and the default tokenizer (4,096) is refused
    in one line, before decoding ids the model cannot give."""
    tmp, _ = debug_checkpoints
    assert gen.main(["--checkpoint", str(tmp / "qwen"), "--prompt", "x", "--max_new_tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1].startswith("error: the tokenizer") and "has 4096 tokens, more than the vocabulary of qwen3" in err[-1]
    )
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "x" * 300], "longer than the model's context of 64 tokens"),
        (
            ["--prompt", "def f", "--max_new_tokens", "62"],
            "plus --max_new_tokens 62 is 65 tokens, beyond the model's "
            "context of 64 tokens (its max_seq_len); ask for at most 61",
        ),
        # A folder of step-N folders: its newest.
        (
            ["--checkpoint", "{tmp}/qwen"],
            "holds qwen3 (dim 64, n_layers 2, n_heads 4, vocab_size 128) (step 0 of "
            "qwen3 'small' in {tmp}/qwen/step-3), but the recipe builds llama3 "
            "(dim 256, n_layers 6, n_heads 16, vocab_size 4096), flavor 'debugmodel' "
            "(another model family)",
        ),
        (
            ["--model.flavor", "10M"],
            "but the recipe builds llama3 (dim 320, n_layers 6, n_heads 8, vocab_size 4096), "
            "flavor '10M' (57 tensors differ, e.g. tok_embeddings.weight: checkpoint "
            "(4096, 256) vs recipe (4096, 320))",
        ),
        (["--checkpoint", "{tmp}/nope"], "checkpoint {tmp}/nope does not exist"),
        (["--checkpoint", "{tmp}/qwen/step-3/train_state.json"], "is a file"),
        (["--checkpoint", "{tmp}/empty"], "is neither a checkpoint"),
        (["--top_p", "0"], "--top_p must be in (0, 1], got 0.0"),
        (["--top_p", "1.5"], "--top_p must be in (0, 1], got 1.5"),
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or positive, got -1.0"),
        (["--temperature", "nan"], "--temperature must be 0 (greedy) or positive"),
        (["--top_k", "-2"], "--top_k must be 0"),
        (["--max_new_tokens", "0"], "--max_new_tokens must be 1 or more"),
        (["--max_new_tokens", "many"], "argument --max_new_tokens: invalid int value: 'many'"),
        (["--model.flavor", "huge"], "unknown model.flavor 'huge'"),
        (["--training.no_such_key", "1"], "no_such_key"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(gen, debug_checkpoints, capsys, argv, message):
    tmp, _ = debug_checkpoints
    defaults = {"--checkpoint": str(tmp / "step-0"), "--prompt": "def f", "--max_new_tokens": "4"}
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    for key, value in defaults.items():
        if key not in argv:
            argv += [key, value]
    assert gen.main([*RECIPE, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message.replace("{tmp}", str(tmp)) in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_script_as_a_command_exits_2_with_one_line(debug_checkpoints):
    tmp, _ = debug_checkpoints
    argv = [*RECIPE, "--checkpoint", str(tmp / "nope"), "--prompt", "x"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: checkpoint {tmp / 'nope'} does not exist; give a step-N "
        "checkpoint folder (e.g. outputs/checkpoint/step-200) or a Hugging "
        "Face folder (config.json + *.safetensors)"
    ]


# ---- a checkpoint saved under tensor parallel ----


@pytest.mark.slow
def test_tensor_parallel_checkpoint_generates_like_its_hf_export(gen, tmp_path, capsys):
    """A step of the Qwen3 debug model under TP 2 (weights saved as DTensor shards), saved as a
    step-1 folder and exported by the trainer as a Hugging Face folder (gathered to full tensors):
    both load to the same logits, and the command line prints from the step-1 folder what the
    export generates."""
    launch(
        {
            "tp": [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
                "--model.name",
                "qwen3",
                "--training.steps",
                "1",
                "--checkpoint.enable_checkpoint",
                "--checkpoint.last_save_in_hf",
            ]
        },
        2,
        tmp_path,
    )
    folder = tmp_path / "tp" / "checkpoint"
    spec, sd, args, where = gen.read_weights(folder / "step-1")
    _, hf_sd, hf_args, _ = gen.read_weights(folder / "step-1-hf")
    assert "step 1 of qwen3 'debugmodel'" in where and hf_args.max_seq_len == args.max_seq_len == 64
    ours, exported = gen.build_model(spec, args, sd, "cpu"), gen.build_model(spec, hf_args, hf_sd, "cpu")
    x = tokens(32, vocab=args.vocab_size)
    with torch.no_grad():
        assert torch.equal(ours(x), exported(x))
    assert gen.main([*RECIPE, "--model.name", "qwen3", "--checkpoint", str(folder / "step-1"), *SAMPLING]) == 0
    tokenizer = Tokenizer(MODEL)
    new = gen.generate(
        exported, tokenizer.encode("def main(argv):\n", True, False), 12, 0.8, 50, 0.95, 3, tokenizer.eos_id
    )
    assert capsys.readouterr().out == tokenizer.decode([t for t in new if t != tokenizer.eos_id]) + "\n"


def test_cpu_threads_leave_out_busy_cores_unless_omp_num_threads_says(gen, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(gen.os, "getloadavg", lambda: (6.2, 6.0, 6.0))  # six cores busy elsewhere
    assert gen.cpu_threads()[0] == 2
    monkeypatch.setattr(gen.os, "getloadavg", lambda: (30.0, 30.0, 30.0))  # an oversubscribed host
    assert gen.cpu_threads()[0] == 1
    monkeypatch.setattr(gen.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert gen.cpu_threads()[0] == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert gen.cpu_threads() == (3, "OMP_NUM_THREADS")
