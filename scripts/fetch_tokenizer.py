"""Fetch a model's tokenizer files from the Hugging Face hub into assets/, for model.tokenizer_path.

Usage: python scripts/fetch_tokenizer.py REPO_ID [--out DIR] [--token TOKEN] [--revision REV] [--original]

    python scripts/fetch_tokenizer.py meta-llama/Llama-3.1-8B --token hf_...
    python scripts/fetch_tokenizer.py Qwen/Qwen3-8B

writes tokenizer.json, tokenizer_config.json and (where the repository has it) special_tokens_map.json
to DIR (default: assets/tokenizer/<model name>), and with --original also original/tokenizer.model
(Llama's tiktoken file, loadable on its own). The folder is then checked by loading it as training
would, and the line to put in a recipe is printed: model.tokenizer_path = "DIR".

Gated repositories (meta-llama/*) need their license accepted on the hub and a token: --token, the
HF_TOKEN variable or `hf auth login`. Needs huggingface_hub (pip install huggingface_hub, or
pip install -e '.[tokenizers]'). Exit status: 0 fetched; 2 a problem, said in one line on stderr
(no network, gated or missing repository, missing file, huggingface_hub not installed, a DIR that
cannot be written: checked before anything is downloaded).
"""

import argparse
import os
import socket
import sys
import urllib.parse
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from torchtitan.config.errors import ArgumentParser, UserError, check_output_path, run_main  # noqa: E402

REQUIRED = ["tokenizer.json", "tokenizer_config.json"]
OPTIONAL = ["special_tokens_map.json"]  # Llama 3 and Qwen3 ship it; BOS/EOS are in tokenizer_config.json too
ORIGINAL = "original/tokenizer.model"


class FetchError(Exception):
    """A problem worth one line to the user."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repo_id", help="hub repository, e.g. meta-llama/Llama-3.1-8B or Qwen/Qwen3-8B")
    parser.add_argument("--out", type=Path, help="folder to write (default: assets/tokenizer/<model name>)")
    parser.add_argument(
        "--token", help="Hugging Face access token for gated repositories (default: HF_TOKEN or the saved login)"
    )
    parser.add_argument("--revision", help="branch, tag or commit (default: main)")
    parser.add_argument("--original", action="store_true", help=f"also fetch {ORIGINAL} (Llama's tiktoken BPE file)")
    parser.add_argument("--endpoint", default=None, help="hub address (default: HF_ENDPOINT or huggingface.co)")
    return parser.parse_args(argv)


def fetch(
    repo_id: str,
    out: Path,
    token: str | None = None,
    revision: str | None = None,
    original: bool = False,
    endpoint: str | None = None,
) -> list[str]:
    """Download the tokenizer files of `repo_id` into `out`; the files written. Raises FetchError."""
    try:
        from huggingface_hub import errors as hub_errors, hf_hub_download
    except ImportError:
        raise FetchError(
            "huggingface_hub is not installed: pip install huggingface_hub (or pip install -e '.[tokenizers]')"
        ) from None
    where = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    # huggingface_hub retries an unreachable hub for about 25 s; a direct probe says it at once.
    why = _unreachable(where)
    if why:
        raise FetchError(_offline(repo_id, out, where, why))
    wanted = [(name, True) for name in REQUIRED] + [(name, False) for name in OPTIONAL]
    if original:
        wanted.append((ORIGINAL, True))
    written = []
    for name, required in wanted:
        try:
            hf_hub_download(repo_id, name, revision=revision, token=token, local_dir=out, endpoint=endpoint)
        except hub_errors.GatedRepoError:
            raise FetchError(
                f"{repo_id} is gated: accept its license on {where}/{repo_id} with your account, then pass "
                f"--token (or set HF_TOKEN, or run `hf auth login`)"
            ) from None
        except hub_errors.RepositoryNotFoundError:
            raise FetchError(
                f"no repository {repo_id} on {where} (or it is private and no token with access was given): check "
                f"the id, or pass --token"
            ) from None
        except hub_errors.RevisionNotFoundError:
            raise FetchError(f"{repo_id} has no revision {revision!r}: check --revision") from None
        except (hub_errors.RemoteEntryNotFoundError, hub_errors.EntryNotFoundError) as e:
            if isinstance(e, hub_errors.LocalEntryNotFoundError):  # not reachable and not cached
                raise FetchError(_offline(repo_id, out, where)) from None
            if required:
                raise FetchError(
                    f"{repo_id} has no {name}; it is not a Hugging Face tokenizer of a kind this trainer reads "
                    f"(tokenizer.json with tokenizer_config.json){'; drop --original' if name == ORIGINAL else ''}"
                ) from None
            continue  # an optional file
        except hub_errors.OfflineModeIsEnabled:
            raise FetchError(_offline(repo_id, out, where, "HF_HUB_OFFLINE is set")) from None
        except hub_errors.HfHubHTTPError as e:
            raise FetchError(f"{where} refused {repo_id}/{name}: {str(e).splitlines()[0]}") from None
        except OSError as e:
            if isinstance(e, (PermissionError, IsADirectoryError, FileExistsError)):
                raise FetchError(f"cannot write {out / name}: {e}") from None
            raise FetchError(_offline(repo_id, out, where, str(e).splitlines()[0] if str(e) else "")) from None
        except Exception as e:  # connection errors of the HTTP client, whichever it is
            if "connect" in type(e).__name__.lower() or "timeout" in type(e).__name__.lower():
                raise FetchError(_offline(repo_id, out, where, type(e).__name__)) from None
            raise
        written.append(name)
    return written


_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _unreachable(url: str, timeout: float = 5.0) -> str | None:
    """Why a TCP connection to the hub at `url` does not open; None when it does, or when it cannot
    be told directly (behind a proxy, or in HF_HUB_OFFLINE mode, which huggingface_hub reports)."""
    if any(os.environ.get(v) for v in _PROXY_VARIABLES) or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return None
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        return f"{url!r} is not an address"
    try:
        socket.create_connection(
            (parts.hostname, parts.port or (80 if parts.scheme == "http" else 443)), timeout=timeout
        ).close()
    except OSError as e:
        return str(e) or type(e).__name__
    return None


def _offline(repo_id: str, out: Path, where: str, why: str = "") -> str:
    return (
        f"cannot reach {where} to fetch {repo_id}{' (' + why + ')' if why else ''}: connect to the network and "
        f"retry, or copy tokenizer.json and tokenizer_config.json from a machine that has them into {out}"
    )


def _main(argv: list[str]) -> None:
    args = parse_args(argv)
    out = args.out or REPO_ROOT / "assets" / "tokenizer" / args.repo_id.rstrip("/").split("/")[-1]
    check_output_path(out, "--out", existing="write_into")
    try:
        written = fetch(args.repo_id, out, args.token, args.revision, args.original, args.endpoint)
    except FetchError as e:
        raise UserError(str(e)) from None
    from torchtitan.components.tokenizer import Tokenizer

    try:
        loaded = [Tokenizer(out)] + ([Tokenizer(out / ORIGINAL)] if args.original else [])
    except UserError as e:
        raise UserError(f"fetched {', '.join(written)} into {out}, but they do not load: {e}") from None
    print(f"fetched {', '.join(written)} from {args.repo_id} into {out}")
    for tok, path in zip(loaded, [out, out / ORIGINAL]):
        bos = "none" if tok.bos_id is None else tok.bos_id
        print(
            f'  {tok.kind}: {tok.vocab_size:,} tokens, BOS {bos}, EOS {tok.eos_id}  ->  model.tokenizer_path = "{path}"'
        )


def main(argv: list[str]) -> int:
    """The exit status: 0 fetched, 2 a problem (one line on stderr)."""
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
