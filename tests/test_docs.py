"""The commands in README.md and docs/*.md train past their recipe's LR warmup.

The trainer warns when lr_scheduler.warmup_steps is not below training.steps (the learning rate then
warms up for the whole run and never decays), so a command the docs show must not do that: every
`run_train.sh` or `-m torchtitan.train` command, in a fenced block or an inline code span, is read for
its recipe (CONFIG_FILE=... or --job.config_file, by default train_configs/debug_model.toml), its
--training.steps and its --lr_scheduler.warmup_steps. No training: the recipes are only parsed.
"""

import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from torchtitan.config import load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DEFAULT_RECIPE = "train_configs/debug_model.toml"  # run_train.sh's CONFIG_FILE default
LAUNCHER = re.compile(r"run_train\.sh|-m\s+torchtitan\.train\b")


def snippets(text: str) -> list[str]:
    """The code of a markdown page: each line of a fenced block (backslash continuations joined) and
    each inline code span (which may run over a line break)."""
    out, prose, fenced, pending = [], [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced, pending = not fenced, ""
            prose.append("")
            continue
        if not fenced:
            prose.append(line)
            continue
        pending += line.strip() if pending else line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
        else:
            out.append(pending)
            pending = ""
    for paragraph in "\n".join(prose).split("\n\n"):
        out.extend(m.group(1) for m in re.finditer(r"`([^`]+)`", paragraph.replace("\n", " ")))
    return out


def option(tokens: list[str], key: str) -> str | None:
    """The value of --key given as `--key VALUE` or `--key=VALUE` (the last one wins), else None."""
    value = None
    for i, tok in enumerate(tokens):
        if tok == key and i + 1 < len(tokens):
            value = tokens[i + 1]
        elif tok.startswith(key + "="):
            value = tok.split("=", 1)[1]
    return value


def doc_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command, its tokens) for every launcher command of the docs, and every span of overrides
    alone that sets training.steps (`--training.steps 20`: advice to add to the page's commands)."""
    found = []
    for page in DOCS:
        for snippet in snippets(page.read_text()):
            overrides = snippet.lstrip().startswith("--") and "--training.steps" in snippet
            if not (LAUNCHER.search(snippet) or overrides):
                continue
            try:
                tokens = shlex.split(snippet, comments=True)
            except ValueError:  # not a command (prose with a stray quote)
                continue
            if overrides or any(LAUNCHER.search(tok) for tok in tokens) or "torchtitan.train" in tokens:
                found.append((str(page.relative_to(REPO)), snippet.strip(), tokens))
    return found


def recipe_of(tokens: list[str]) -> str:
    recipe = option(tokens, "--job.config_file")
    if recipe is None:
        env = [tok.split("=", 1)[1] for tok in tokens if tok.startswith("CONFIG_FILE=")]
        recipe = env[-1] if env else DEFAULT_RECIPE
    return recipe


@cache
def recipe_schedule(recipe: str) -> tuple[int, int]:
    """(training.steps, lr_scheduler.warmup_steps) of a recipe."""
    cfg = load_config(["--job.config_file", str(REPO / recipe)])
    return cfg.training.steps, cfg.lr_scheduler.warmup_steps


def test_the_docs_show_launcher_commands():
    commands = doc_commands()
    assert len(commands) > 20, "the scan of the docs found almost no run_train.sh command: is it broken?"
    assert any("--training.steps" in tokens for _, _, tokens in commands)


def test_every_command_trains_past_its_warmup():
    bad = []
    for page, command, tokens in doc_commands():
        recipe = recipe_of(tokens)
        if not (REPO / recipe).is_file():  # a recipe the page writes itself (best.toml): nothing to read
            continue
        steps, warmup = recipe_schedule(recipe)
        given_steps, given_warmup = option(tokens, "--training.steps"), option(tokens, "--lr_scheduler.warmup_steps")
        if given_steps is not None:
            if not given_steps.isdigit():  # a placeholder (N)
                continue
            steps = int(given_steps)
        if given_warmup is not None:
            if not given_warmup.isdigit():
                continue
            warmup = int(given_warmup)
        if steps <= warmup:
            bad.append(
                f"{page}: {command!r}: training.steps {steps} <= lr_scheduler.warmup_steps {warmup} "
                f"({recipe}); train longer or pass --lr_scheduler.warmup_steps below the steps"
            )
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "```bash\nNGPU=1 ./run_train.sh --training.steps 20 \\\n    --lr_scheduler.warmup_steps 2  # note\n```\n",
            ["NGPU=1 ./run_train.sh --training.steps 20 --lr_scheduler.warmup_steps 2  # note"],
        ),
        ("Run `./run_train.sh\n--training.steps 50` and `x`.\n", ["./run_train.sh --training.steps 50", "x"]),
    ],
)
def test_snippets_reads_fenced_blocks_and_inline_spans(text, expected):
    assert snippets(text) == expected
