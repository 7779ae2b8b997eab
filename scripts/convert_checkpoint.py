"""Convert model weights between our checkpoints (DCP step-N folders) and Hugging Face folders.

    python scripts/convert_checkpoint.py to-hf outputs/checkpoint/step-1000 hf-out [--dtype bfloat16] [--tokenizer PATH]
    python scripts/convert_checkpoint.py from-hf Llama-3.2-1B outputs/checkpoint/step-0 [--flavor-name 1B]

Any registered model family with a Hugging Face adapter: to-hf finds the family in the checkpoint's
train_state.json, from-hf by the `model_type` of the folder's config.json, its language model's in a
multimodal folder (text_config, as the trainer reads it: the published Qwen3.5 folders convert as
they are); a family registered outside torchtitan is found after `--custom-import MODULE`, as
experimental.custom_import.

One process, no process group, one tensor at a time: the peak memory is about one output file of
--max-shard-mb (to-hf) or one tensor (from-hf) above the interpreter, whatever the model's size.
to-hf reads only the model part of the checkpoint, never the optimizer. from-hf writes a model-only
step-0 checkpoint, a starting point for training (checkpoint.initial_load_path). The output folder
must not exist yet (or be empty) and be creatable: that is checked before anything is read. Mistakes
are reported in one line on stderr with exit status 2.
"""

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from a checkout

from torchtitan.components.checkpoint import (  # noqa: E402
    HF_CONFIG,
    dcp_model_name,
    dcp_to_hf,
    hf_to_dcp,
    read_hf_config,
)
from torchtitan.components.tokenizer import Tokenizer  # noqa: E402
from torchtitan.components.tokenizer_export import export_tokenizer  # noqa: E402
from torchtitan.config.errors import ArgumentParser, UserError, check_output_path, run_main  # noqa: E402
from torchtitan.distributed.dtypes import DTYPES  # noqa: E402
from torchtitan.models.registry import get_model_spec, import_custom_module, spec_for_hf_config  # noqa: E402


def to_hf(checkpoint_dir: str, output: str, dtype: str, max_shard_mb: int, tokenizer: str | None):
    name = dcp_model_name(checkpoint_dir)
    spec = get_model_spec(name)
    if spec.hf is None:
        raise UserError(f"model '{name}' has no Hugging Face adapter in its spec; it cannot be exported")
    if tokenizer is not None:
        Tokenizer(tokenizer)  # a bad path or file is reported before any weight is read
    train_state = dcp_to_hf(checkpoint_dir, output, spec, DTYPES[dtype], max_shard_mb * 2**20)
    architecture = read_hf_config(output)["architectures"][0]
    files = len(list(Path(output).glob("*.safetensors")))
    written = f", tokenizer: {', '.join(export_tokenizer(tokenizer, output))}" if tokenizer is not None else ""
    print(f"wrote {output}: {architecture}, step {train_state.get('step', '?')}, {files} file(s) in {dtype}{written}")


def from_hf(hf_folder: str, output: str, flavor: str):
    spec = spec_for_hf_config(read_hf_config(hf_folder), str(Path(hf_folder) / HF_CONFIG))
    count, _ = hf_to_dcp(hf_folder, output, spec, flavor)
    print(f"wrote {output}: model-only {spec.name} checkpoint, {count} tensors, flavor '{flavor}'")


def convert(argv: list[str]) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--custom-import", default="", help="module registering a model family (as experimental.custom_import)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("to-hf", help="step-N checkpoint folder -> Hugging Face folder")
    p.add_argument("checkpoint_dir")
    p.add_argument("output_dir")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the exported weights")
    p.add_argument(
        "--max-shard-mb",
        type=int,
        default=5120,
        help="the largest output file (one larger tensor gets a file of its own)",
    )
    p.add_argument(
        "--tokenizer",
        help="the run's model.tokenizer_path: written into the folder in Hugging Face form "
        "(tokenizer.json), so that AutoTokenizer loads it",
    )
    p = commands.add_parser("from-hf", help="Hugging Face folder -> model-only step checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("output_dir")
    p.add_argument("--flavor-name", default="custom", help="flavor recorded in train_state.json")
    opts = parser.parse_args(argv)
    # The converted folder is staged beside OUTPUT and renamed into place: its parent must be writable.
    check_output_path(opts.output_dir, "OUTPUT", existing="empty_folder")
    import_custom_module(opts.custom_import)
    if opts.command == "to-hf":
        if opts.max_shard_mb < 1:
            raise UserError(f"--max-shard-mb must be 1 or more, got {opts.max_shard_mb}")
        to_hf(opts.checkpoint_dir, opts.output_dir, opts.dtype, opts.max_shard_mb, opts.tokenizer)
    else:
        from_hf(opts.hf_dir, opts.output_dir, opts.flavor_name)


def main(argv: list[str]) -> int:
    """The exit status: 0, or 2 after a mistake (one line on stderr)."""
    return run_main(convert, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
