"""Generate text from a trained model, with a KV cache.

    python scripts/generate.py --job.config_file train_configs/debug_model.toml \\
        --checkpoint outputs/checkpoint/step-200 --prompt "def main(" --max_new_tokens 64 \\
        [--temperature 0.8 --top_k 50 --top_p 0.95 --seed 0] [--model.flavor ... and other config overrides]

--checkpoint is one of our step-N folders (saved under any parallel layout: DCP stores full tensors by
name; a folder of step-N folders means its newest) or a Hugging Face folder (config.json +
*.safetensors, as checkpoint.last_save_in_hf or transformers' save_pretrained write it). The recipe
and its overrides name the model (model.name, model.flavor) and the tokenizer (model.tokenizer_path);
the checkpoint must hold that model (same family and tensor shapes). With none of --job.config_file,
--model.name and --model.flavor, the model is the checkpoint's own, whatever its family; and a Hugging
Face folder that holds a tokenizer gives it, unless --model.tokenizer_path names one. The model runs with the
checkpoint's own hyper-parameters (rotary theta, norm eps, routing, ...), and its context is the
checkpoint's max_seq_len (ours: the training seq_len; Hugging Face: max_position_embeddings).

The prompt is encoded with BOS in front; generation stops after --max_new_tokens tokens or at EOS.
--temperature 0 (the default) is greedy; otherwise tokens are drawn from softmax(logits / T), kept to
the --top_k most likely (0: all) and then to the smallest set of most likely tokens whose probability
reaches --top_p, with a torch.Generator seeded by --seed (on the CPU, so the same seed draws the same
tokens on any device). One process, on CUDA if available, else on the CPU. The continuation goes to
stdout, logs to stderr; mistakes are reported in one line on stderr with exit status 2.
"""

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from a checkout

import torch  # noqa: E402
from torch import nn  # noqa: E402

from torchtitan.components.checkpoint import (  # noqa: E402
    HF_CONFIG,
    STATE_FILE,
    complete_checkpoints,
    dcp_model_name,
    load_hf,
    meta_shapes,
    read_dcp_model,
    read_hf_config,
)
from torchtitan.components.tokenizer import Tokenizer  # noqa: E402
from torchtitan.config import load_config  # noqa: E402
from torchtitan.config.errors import ArgumentParser, UserError, run_main  # noqa: E402
from torchtitan.distributed.dtypes import DTYPES  # noqa: E402
from torchtitan.distributed.process_group import device_type  # noqa: E402
from torchtitan.models.common.layers import kv_caches  # noqa: E402
from torchtitan.models.common.moe import overrides_from_config as moe_overrides  # noqa: E402
from torchtitan.models.common.spec import ModelSpec  # noqa: E402
from torchtitan.models.registry import (  # noqa: E402
    get_model_args,
    get_model_spec,
    import_custom_module,
    spec_for_hf_config,
)

logger = logging.getLogger("generate")


# ---- weights ----


def read_weights(path: str | Path) -> tuple[ModelSpec, dict[str, torch.Tensor], object, str]:
    """(family, state dict in our names, the checkpoint's args, a description) of a step-N folder, a
    folder of step-N folders (its newest) or a Hugging Face folder. Tensors come from DCP data files
    or safetensors only, read with the trainer's checks."""
    folder = Path(path)
    if not folder.exists():
        raise UserError(
            f"checkpoint {folder} does not exist; give a step-N checkpoint folder (e.g. outputs/checkpoint/step-200) "
            "or a Hugging Face folder (config.json + *.safetensors)"
        )
    if not folder.is_dir():
        raise UserError(f"checkpoint {folder} is a file; give a step-N checkpoint folder or a Hugging Face folder")
    if (folder / HF_CONFIG).is_file():
        config = read_hf_config(folder)
        spec = spec_for_hf_config(config, str(folder / HF_CONFIG))
        sd, args = load_hf(folder, spec.hf)
        what = f"Hugging Face {'/'.join(config.get('architectures') or [config.get('model_type', '?')])} in {folder}"
        return spec, sd, args, what
    if not (folder / STATE_FILE).is_file():
        steps = complete_checkpoints(str(folder))
        if not steps:
            raise UserError(
                f"{folder} is neither a checkpoint (step-N folder with {STATE_FILE}), nor a folder of "
                f"step-N checkpoints, nor a Hugging Face folder ({HF_CONFIG} + *.safetensors)"
            )
        folder = folder / f"step-{steps[-1]}"
    spec = get_model_spec(dcp_model_name(folder))
    sd, args, train_state = read_dcp_model(folder, spec)
    flavor = train_state.get("model", {}).get("flavor", "?")
    return spec, sd, args, f"step {train_state.get('step', '?')} of {spec.name} {flavor!r} in {folder}"


def describe(name: str, args) -> str:
    """A model's family and sizes, in one phrase."""
    sizes = [
        f"{field} {getattr(args, field)}"
        for field in ("dim", "n_layers", "n_heads", "vocab_size")
        if hasattr(args, field)
    ]
    moe = getattr(args, "moe", None)
    if moe is not None:
        sizes.append(f"{moe.num_experts} experts")
    return f"{name} ({', '.join(sizes)})"


def check_same_model(spec: ModelSpec, args, where: str, want_spec: ModelSpec, want_args, want: str) -> None:
    """UserError unless the checkpoint's model (spec, args) has the family and tensor shapes of the one
    the recipe builds (want_spec, want_args; `want` describes it)."""
    problem = None
    if spec.name != want_spec.name:
        problem = "another model family"
    else:
        found, expected = meta_shapes(spec, args), meta_shapes(want_spec, want_args)
        diffs = [
            f"{k}: checkpoint {found.get(k, 'absent')} vs recipe {expected.get(k, 'absent')}"
            for k in {**expected, **found}
            if found.get(k) != expected.get(k)
        ]
        if diffs:
            problem = f"{len(diffs)} tensors differ, e.g. {diffs[0]}"
    if problem is not None:
        raise UserError(
            f"the checkpoint holds {describe(spec.name, args)} ({where}), but the recipe builds {want} "
            f"({problem}); choose the recipe, --model.name and --model.flavor it was trained with"
        )


def build_model(
    spec: ModelSpec, args, sd: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The model with these weights, in eval mode, parameters in `dtype`."""
    # Built on the device, not on meta + init_weights: the constructor computes the buffers (rotary
    # tables, ...) and its default parameter init is cheap (init_weights' truncated normals take
    # seconds even for the debug model); every parameter is overwritten next.
    with torch.device(device):
        model = spec.model_cls(args)
    model.load_state_dict(sd, strict=True)
    if dtype != torch.float32:
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model.eval()


# ---- decoding ----


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """The next token from one position's logits [vocab]: the argmax at temperature 0; otherwise a
    draw from softmax(logits / temperature) over the top_k most likely tokens (0: all), then over the
    smallest set of most likely tokens whose probability reaches top_p."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float().cpu() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # A token stays if the tokens more likely than it have less than top_p together.
        sorted_probs[sorted_probs.cumsum(0) - sorted_probs >= top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    use_cache: bool = True,
) -> list[int]:
    """The tokens following `prompt` (EOS included when drawn), at most max_new_tokens of them. With
    the cache (only for a family whose spec says kv_cache), the prompt runs once and then each new
    token alone; without it, the whole sequence runs again for every token."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([prompt], device=device)
    cache = kv_caches(model, len(prompt) + max_new_tokens) if use_cache else None
    logits = model(tokens, cache=cache, start_pos=0) if use_cache else model(tokens)
    out: list[int] = []
    while True:
        token = sample_next(logits[0, -1], temperature, top_k, top_p, generator)
        out.append(token)
        if token == eos_id or len(out) == max_new_tokens:
            return out
        new = torch.tensor([[token]], device=device)
        if use_cache:
            logits = model(new, cache=cache, start_pos=len(prompt) + len(out) - 1)
        else:
            tokens = torch.cat([tokens, new], dim=1)
            logits = model(tokens)


# ---- command line ----


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options, and the rest: the job config's (--job.config_file, --model.flavor, ...)."""
    parser = ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        epilog="Any other option is a job config option, as in training (--job.config_file, --model.name, ...).",
    )
    parser.add_argument("--checkpoint", required=True, help="step-N folder or Hugging Face folder")
    parser.add_argument("--prompt", required=True, help="the text to continue (encoded with BOS in front)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0, help="sample among this many most likely tokens (0: all)")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling, in (0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of the parameters")
    parser.add_argument("--no_kv_cache", action="store_true", help="run the whole sequence for every token")
    opts, rest = parser.parse_known_args(argv)
    if opts.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be 1 or more, got {opts.max_new_tokens}")
    if not (math.isfinite(opts.temperature) and opts.temperature >= 0):
        raise UserError(f"--temperature must be 0 (greedy) or positive, got {opts.temperature}")
    if opts.top_k < 0:
        raise UserError(f"--top_k must be 0 (all tokens) or positive, got {opts.top_k}")
    if not 0 < opts.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1], got {opts.top_p}")
    if not 0 <= opts.seed < 2**64:  # what torch.Generator.manual_seed takes
        raise UserError(f"--seed must be in [0, 2**64), got {opts.seed}")
    return opts, rest


def cpu_threads() -> tuple[int, str]:
    """The trainer's rule for one process (torchtitan.launch): OMP_NUM_THREADS when set; otherwise
    torch's default (a thread per core), less the cores other processes keep busy (the 1-minute load
    average): a thread more than the free cores waits for the others at every matmul, which on a
    loaded host made generation slower than one thread by an order of magnitude."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        return int(threads), "OMP_NUM_THREADS"
    default = torch.get_num_threads()
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    free = max(1, min(default, default - busy))
    return free, f"{default} core(s), about {busy} busy with other processes (OMP_NUM_THREADS sets it)"


def named_on_the_command_line(config_argv: list[str], *keys: str) -> bool:
    """Whether the command line gives any of these options (--key value or --key=value)."""
    return any(arg.split("=", 1)[0] in keys for arg in config_argv)


def run(opts: argparse.Namespace, config_argv: list[str]) -> str:
    """The continuation of opts.prompt."""
    cfg = load_config(config_argv)
    import_custom_module(cfg.experimental.custom_import)
    model_named = named_on_the_command_line(config_argv, "--job.config_file", "--model.name", "--model.flavor")
    tokenizer_path = cfg.model.tokenizer_path
    hf_folder = (Path(opts.checkpoint) / HF_CONFIG).is_file()
    if (
        hf_folder
        and not named_on_the_command_line(config_argv, "--job.config_file", "--model.tokenizer_path")
        and any((Path(opts.checkpoint) / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))
    ):
        tokenizer_path = opts.checkpoint
    tokenizer = Tokenizer(tokenizer_path)
    if model_named:
        want_spec = get_model_spec(cfg.model.name)
        flavor_args = get_model_args(cfg.model.name, cfg.model.flavor)
        overrides = moe_overrides(cfg.moe) if getattr(flavor_args, "moe", None) is not None else None
        want_args = want_spec.args_for_training(cfg.model.flavor, tokenizer.vocab_size, cfg.training.seq_len, overrides)

    spec, sd, args, where = read_weights(opts.checkpoint)
    if model_named:
        check_same_model(
            spec,
            args,
            where,
            want_spec,
            want_args,
            f"{describe(want_spec.name, want_args)}, flavor {cfg.model.flavor!r}",
        )
    else:
        logger.info(
            f"the checkpoint's own model, {describe(spec.name, args)} (--model.name, --model.flavor or a "
            f"recipe would name the one to check it against); tokenizer {tokenizer_path}"
        )
    if tokenizer.vocab_size > args.vocab_size:
        raise UserError(
            f"the tokenizer {tokenizer_path} has {tokenizer.vocab_size} tokens, more than the vocabulary of "
            f"{describe(spec.name, args)} ({where}); give the tokenizer it was trained with: --model.tokenizer_path"
        )
    prompt = tokenizer.encode(opts.prompt, bos=True, eos=False)
    context = args.max_seq_len
    if len(prompt) > context:
        raise UserError(
            f"the prompt is {len(prompt)} tokens long (BOS included), longer than the model's context of {context} "
            "tokens (its max_seq_len); shorten it"
        )
    if len(prompt) + opts.max_new_tokens > context:
        raise UserError(
            f"the prompt ({len(prompt)} tokens, BOS included) plus --max_new_tokens {opts.max_new_tokens} is "
            f"{len(prompt) + opts.max_new_tokens} tokens, beyond the model's context of {context} tokens (its "
            f"max_seq_len); ask for at most {context - len(prompt)} new tokens"
        )

    device = torch.device(device_type())
    if device.type == "cpu":
        threads, why = cpu_threads()
        torch.set_num_threads(threads)
        logger.info(f"{threads} CPU thread(s): {why}")
    logger.info(f"loading {where} on {device.type} in {opts.dtype}")
    model = build_model(spec, args, sd, device, DTYPES[opts.dtype])
    del sd
    start = time.perf_counter()
    use_cache = spec.kv_cache and not opts.no_kv_cache
    new = generate(
        model,
        prompt,
        opts.max_new_tokens,
        opts.temperature,
        opts.top_k,
        opts.top_p,
        opts.seed,
        tokenizer.eos_id,
        use_cache=use_cache,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stop = "EOS" if new[-1] == tokenizer.eos_id else "max_new_tokens"
    logger.info(
        f"{len(new)} tokens after a {len(prompt)}-token prompt in {seconds:.2f}s "
        f"({len(new) / seconds:.1f} tokens/s, {'with' if use_cache else 'without'} KV cache); "
        f"stopped at {stop}"
    )
    return tokenizer.decode([t for t in new if t != tokenizer.eos_id])


def _main(argv: list[str]) -> None:
    opts, rest = parse_args(argv)
    text = run(opts, rest)
    print(text, flush=True)


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr
    )
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
