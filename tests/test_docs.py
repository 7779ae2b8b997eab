"""The docs: their commands, links, paths and wording.

- The commands in README.md and docs/*.md train past their recipe's LR warmup. The trainer warns when
  lr_scheduler.warmup_steps is not below training.steps (the learning rate then warms up for the whole
  run and never decays), so a command the docs show must not do that: every `run_train.sh` or
  `-m torchtitan.train` command, in a fenced block or an inline code span, is read for its recipe
  (CONFIG_FILE=... or --job.config_file, by default train_configs/debug_model.toml), its --training.steps
  and its --lr_scheduler.warmup_steps. No training: the recipes are only parsed.
- Every relative link of README.md, CONTRIBUTING.md and docs/*.md names a file that exists, and its
  #anchor a heading of that file (GitHub's heading slugs).
- Every repository path (torchtitan/..., tests/..., scripts/..., train_configs/..., docs/...) the pages
  mention exists, and so does every module (`torchtitan.x.y`) and every file named in their code.
- The guides (README.md and docs/*.md but benchmarks.md) hold no date, no issue number and no lab-notebook
  narration ("this session", "while other jobs ..."): measured figures, with their date, belong in
  docs/benchmarks.md, whose tables carry command, commit, machine and date on every row.
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


# --- links, anchors, paths and modules -----------------------------------------------------------

PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
GUIDES = [REPO / "README.md", *(p for p in sorted((REPO / "docs").glob("*.md")) if p.name != "benchmarks.md")]
BENCHMARKS = REPO / "docs" / "benchmarks.md"
# Paths a page names that are not in this repository, each with the reason.
NOT_HERE = {
    "tests/assets/c4_test": "the reference torchtitan's sample, which data.md says to copy from a checkout",
}
# Files a page asks the reader to write, or that a run or a script writes.
WRITTEN = {"my_flavors.py", "my_model.py", "sitecustomize.py", "best.toml", "config.toml"}
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REPO_PATH = re.compile(r"(?<![\w./~-])((?:torchtitan|tests|scripts|train_configs|docs|\.ci)/[\w./-]*)")
TEST_ID = re.compile(r"(?<![\w./~-])(tests/[\w./-]+\.py)::(\w+)")
FILE_IN_CODE = re.compile(r"(?<![\w./~<{-])([\w-]+(?:/[\w.-]+)*\.(?:py|toml|sh))\b(?![/\w])")
MODULE = re.compile(r"(?<![\w.])torchtitan(?:\.\w+)+")


def prose_and_code(text: str) -> tuple[str, str]:
    """(prose, code) of a markdown page: the prose with fenced blocks and inline code spans blanked (line
    structure kept), and the code: the fenced lines and the spans, one per line."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            prose.append("")
        elif fenced:
            code.append(line)
            prose.append("")
        else:
            prose.append(line)
    joined = "\n".join(prose)
    code += re.findall(r"`([^`]+)`", joined)
    return re.sub(r"`[^`]+`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), joined), "\n".join(code)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (a link's text, code without backticks) in lower case,
    everything but letters, digits, underscores, hyphens and spaces removed, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    return anchors_of(page.read_text())


def anchors_of(text: str) -> frozenset[str]:
    """The anchors of a page's headings (outside fenced blocks); a repeated slug gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            out.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return frozenset(out)


def broken_links(page: Path, text: str | None = None) -> list[str]:
    text = page.read_text() if text is None else text
    prose, _ = prose_and_code(text)
    bad = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        where = f"{page.relative_to(REPO)}: ({target})"
        if file and not path.exists():
            bad.append(f"{where}: no file {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
        elif anchor and path.suffix != ".md":
            bad.append(f"{where}: an anchor into a file that is not markdown")
        elif anchor and anchor not in (anchors(path) if file else anchors_of(text)):
            bad.append(f"{where}: no heading of {path.relative_to(REPO)} has the anchor #{anchor}")
    return bad


def test_every_relative_link_and_anchor_resolves():
    bad = [problem for page in PAGES for problem in broken_links(page)]
    assert not bad, "\n".join(bad)


@cache
def repo_files() -> tuple[str, ...]:
    """The repository's files that the docs may name (posix paths from the root)."""
    files = [p for p in REPO.iterdir() if p.is_file()]
    for top in ("torchtitan", "tests", "scripts", "train_configs", "docs", "assets", ".ci"):
        files += [p for p in (REPO / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return tuple(p.relative_to(REPO).as_posix() for p in files)


def defines(source: str, name: str) -> bool:
    """Whether a module's source defines or imports `name` at some level."""
    return (
        re.search(
            rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b"
            rf"|^\s*{name}\s*(?::[^\n=]*)?="
            rf"|^[^#\n]*\bimport\b[^\n#]*\b{name}\b"
            rf"|^\s+{name},?\s*(?:#.*)?$",
            source,
            re.M,
        )
        is not None
    )


def module_problem(dotted: str) -> str | None:
    """None if `torchtitan.a.b[.name]` is a package, a module, or a name a module defines; else why not."""
    parts, path = dotted.split("."), REPO
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
            continue
        if (path / f"{part}.py").is_file():
            module, rest = path / f"{part}.py", parts[i + 1 :]
        else:
            module, rest = path / "__init__.py", parts[i:]
        break
    else:
        return None
    if not rest:
        return None
    if not module.is_file():
        return f"no module {'.'.join(parts[: len(parts) - len(rest)])}"
    if not defines(module.read_text(), rest[0]):
        return f"{module.relative_to(REPO)} defines no {rest[0]}"
    return None


def missing_paths(page: Path, text: str | None = None) -> list[str]:
    text = page.read_text() if text is None else text
    _, code = prose_and_code(text)
    files = repo_files()
    names = {f.rsplit("/", 1)[-1] for f in files}
    bad = []
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".-")
        if text[m.end() : m.end() + 1] in ("*", "<", "{") or path in NOT_HERE:
            continue  # a pattern (scripts/benchmark*.py, torchtitan/models/<family>/), or named on purpose
        if not (REPO / path).exists():
            bad.append(f"{page.relative_to(REPO)}: {path} does not exist")
    for test_file, test in TEST_ID.findall(text):
        source = REPO / test_file
        if source.is_file() and not re.search(rf"^\s*def {test}\b", source.read_text(), re.M):
            bad.append(f"{page.relative_to(REPO)}: {test_file} has no test {test}")
    for m in FILE_IN_CODE.finditer(code):
        path = m.group(1)
        if path.rsplit("/", 1)[-1] in WRITTEN or REPO_PATH.fullmatch(path):
            continue  # the reader's or a run's own file; a path from the root is checked above
        if "/" in path:
            found = any(f == path or f.endswith("/" + path) for f in files)
        else:
            found = path in names
        if not found:
            bad.append(f"{page.relative_to(REPO)}: `{path}`: no such file in the repository")
    for m in MODULE.finditer(code):
        problem = module_problem(m.group(0))
        if problem:
            bad.append(f"{page.relative_to(REPO)}: `{m.group(0)}`: {problem}")
    return bad


def test_every_path_and_module_the_docs_name_exists():
    bad = [problem for page in PAGES for problem in missing_paths(page)]
    assert not bad, "\n".join(bad)


# --- the guides: no dates, no issue numbers; benchmarks.md: provenance on every row ---------------

MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December"
    "|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
DATE = re.compile(
    rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b"  # 2026-12-04
    rf"|\b(?:{MONTHS})\.?,?\s+(?:\d{{1,2}},?\s+)?\d{{4}}\b"  # December 2026, Dec 4, 2026
    rf"|\b\d{{1,2}}\s+(?:{MONTHS})\.?\s+\d{{4}}\b"  # 4 December 2026
    rf"|\b(?i:early|mid|late)-\d{{4}}\b"  # mid-2025
)
ISSUE = re.compile(r"(?i:\b(?:issues?|PRs?|pull requests?)\s*#?\d+)|(?<![\w&/#])#\d+\b")
# A lab notebook's phrases: when and how a figure was taken belongs beside it in docs/benchmarks.md.
NARRATION = re.compile(r"(?i:\bthis session\b|\bwe (?:found|measured)\b|\bwhile other jobs\b|\bno GPU was lent\b)")


def test_the_guides_hold_no_date_no_issue_number_and_no_narration():
    bad = []
    for page in GUIDES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for m in (*DATE.finditer(line), *ISSUE.finditer(line), *NARRATION.finditer(line)):
                bad.append(f"{page.relative_to(REPO)}:{number}: {m.group(0)!r}")
    assert not bad, "dates, issue numbers and narration belong in docs/benchmarks.md or the git log:\n" + "\n".join(bad)


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header cells, rows of cells) of each table of a page (outside fenced blocks)."""
    tables, block, fenced = [], [], False
    for line in [*text.splitlines(), ""]:
        if FENCE.match(line):
            fenced = not fenced
        if not fenced and line.startswith("|"):
            block.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
            continue
        if len(block) >= 2:
            tables.append((block[0], block[2:]))
        block = []
    return tables


def test_every_benchmark_row_carries_command_commit_machine_and_date():
    tables = markdown_tables(BENCHMARKS.read_text())
    assert len(tables) > 10, "docs/benchmarks.md holds almost no table: is the scan broken?"
    bad = []
    for header, rows in tables:
        if header[-4:] != ["command", "commit", "machine", "date"]:
            bad.append(f"table {header[:3]}...: its last columns are not command, commit, machine, date")
            continue
        for row in rows:
            where = f"table {header[0]!r}, row {row[:2]}"
            if len(row) != len(header):
                bad.append(f"{where}: {len(row)} cells for {len(header)} columns")
                continue
            command, commit, machine, date = row[-4:]
            if not command or not machine:
                bad.append(f"{where}: no command or no machine")
            if not re.fullmatch(r"[0-9a-f]{7,40}|unknown", commit):
                bad.append(f"{where}: commit {commit!r} is not a short hash")
            if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
                bad.append(f"{where}: date {date!r} is not YYYY-MM-DD")
    assert not bad, "\n".join(bad)


def builtin_families() -> list[str]:
    """The names in the registry's _BUILTIN table, read from its source (no torch import)."""
    source = (REPO / "torchtitan" / "models" / "registry.py").read_text()
    table = re.search(r"^_BUILTIN\b[^=]*=\s*\{(.*?)^\}", source, re.M | re.S)
    assert table, "torchtitan/models/registry.py has no _BUILTIN table"
    return re.findall(r"^\s*\"(\w+)\"\s*:", table.group(1), re.M)


def test_the_readme_names_every_family_under_what_works():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## What works", 1)[1].split("\n## ", 1)[0]
    families = builtin_families()
    assert len(families) >= 5, families
    missing = [name for name in families if f"`{name}`" not in section]
    assert not missing, f"README.md's 'What works' does not name the families {missing} (as `name`)"


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Context parallel: ring and Ulysses", "context-parallel-ring-and-ulysses"),
        ("run_train.sh", "run_trainsh"),
        ("Qwen3.5 (gated DeltaNet hybrid)", "qwen35-gated-deltanet-hybrid"),
        ("`[memory_estimation]`", "memory_estimation"),
        ("Mixture of experts (Qwen3-MoE) and expert parallel", "mixture-of-experts-qwen3-moe-and-expert-parallel"),
        ("Lanes: each rank reads only its share", "lanes-each-rank-reads-only-its-share"),
    ],
)
def test_slug_follows_githubs_rule(heading, anchor):
    assert slug(heading) == anchor


def test_the_checks_catch_what_they_are_for():
    """A missing file, a wrong anchor, a stale path, module, file or test, a date and an issue number are
    each found; a good link, path and module are not."""
    page = REPO / "docs" / "probe.md"
    links = (
        "# Title\n\n[a](performance.md#no-such-heading) [b](missing.md) [c](#title) [d](#nope) "
        "[e](benchmarks.md#training-runs) [f](https://example.com/x.md)\n"
    )
    assert [problem.split(": ", 2)[1] for problem in broken_links(page, links)] == [
        "(performance.md#no-such-heading)",
        "(missing.md)",
        "(#nope)",
    ]
    paths = (
        "torchtitan/components/data.py and scripts/plan.py; `torchtitan.components.no_such_module`, "
        "`torchtitan.models.registry.no_such_name`, `torchtitan.models.registry.register_flavor`, "
        "`common/no_such_file.py`, `common/delta_rule.py`, `my_flavors.py`, "
        "tests/test_docs.py::test_no_such_test, tests/test_docs.py::test_slug_follows_githubs_rule\n"
    )
    problems = missing_paths(page, paths)
    assert len(problems) == 5, problems
    for stale in ("components/data.py", "no_such_module", "no_such_name", "no_such_file.py", "test_no_such_test"):
        assert any(stale in problem for problem in problems), (stale, problems)
    assert DATE.search("measured on 2026-12-04") and DATE.search("in December 2026") and DATE.search("mid-2025")
    assert not DATE.search("seq 2048, 16384 tokens, Qwen3.5-35B-A3B")
    assert ISSUE.search("(issue 35)") and ISSUE.search("see #12") and ISSUE.search("PR 7")
    assert not ISSUE.search("[x](#layouts), rank 0, `--top 20`")
    assert NARRATION.search("measured while other jobs ran") and NARRATION.search("in this session we found")


def readme_commands() -> dict[str, str]:
    """The README's commands in its first fenced block, by the comment line above each."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    commands, comment = {}, ""
    for line in block.splitlines():
        if line.startswith("#"):
            comment = line
        elif line.strip():
            commands[comment] = line.strip()
    return commands


def test_the_readme_test_command_is_what_ci_runs_and_the_quick_check_is_a_marker_expression():
    setup = "bash scripts/setup.sh && source .venv/bin/activate && "
    commands = list(readme_commands().values())
    assert commands[1] == setup + "bash scripts/check.sh", commands
    assert commands[2] == setup + 'python -m pytest -q -m "not slow"', commands
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh\n" in ci and 'bash scripts/check.sh "$@"\n' in ci
    check = (REPO / "scripts" / "check.sh").read_text()
    assert 'python -m pytest -q -ra -m "not slow" "$@"' in check and 'python -m pytest -q -ra -m slow "$@"' in check
