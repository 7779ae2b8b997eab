"""The layers of torchtitan/models and who may import what:
- nothing outside a family's folder and the registry names a model family: the trainer, the
  components, the parallelisms, the scripts and the tests (other than tests/models/, which test the
  families themselves) reach a model only through its spec;
- torchtitan/models/common (the spec, shared layers, decoder, MoE block, init, HF helpers, TP plan)
  sits below torchtitan/distributed: it imports no family, no registry and nothing of distributed/;
- torchtitan/distributed imports nothing of models/ but models/common;
- outside models/, no `isinstance` test against a class of models/ (a family's own classes would
  slip through it): such questions go to the spec."""

import ast
import re
from pathlib import Path

from helpers.paths import REPO

MODELS = REPO / "torchtitan" / "models"


def families() -> list[str]:
    return sorted(p.name for p in MODELS.iterdir() if (p / "__init__.py").is_file() and p.name != "common")


def sources(root: Path = REPO) -> list[Path]:
    return [p for p in sorted(root.glob("**/*.py")) if ".venv" not in p.parts and "outputs" not in p.parts]


def imported_modules(path: Path) -> set[str]:
    """Every torchtitan module `path` imports (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("torchtitan")}


def family_references(text: str, family: str) -> list[str]:
    """Lines that import the family: `torchtitan.models.<family>` in any form (import, from-import,
    a string given to importlib), or `from torchtitan.models import <family>`."""
    dotted = re.compile(rf"\btorchtitan\.models\.{family}\b")
    from_import = re.compile(rf"^\s*from\s+torchtitan\.models\s+import\s+.*\b{family}\b", re.M)
    lines = [line for line in text.splitlines() if dotted.search(line)]
    return lines + [m.group(0) for m in from_import.finditer(text)]


def allowed(path: Path, family: str) -> bool:
    rel = path.relative_to(REPO)
    return (
        rel.parts[:3] == ("torchtitan", "models", family)
        or rel == Path("torchtitan/models/registry.py")
        or rel.parts[:2] == ("tests", "models")
    )


def test_the_scanner_finds_every_form_of_import():
    text = (
        "import torchtitan.models.fam.model as m\n"
        "from torchtitan.models.fam import build_spec\n"
        "from torchtitan.models import fam\n"
        "importlib.import_module('torchtitan.models.fam.args')\n"
        "from torchtitan.models.family2 import x\n"  # another name: not a reference
    )
    assert len(family_references(text, "fam")) == 4


def test_no_family_is_imported_outside_its_folder_and_the_registry():
    assert {"llama3", "qwen3"} <= set(families())
    offenders = []
    for path in sources():
        text = path.read_text(encoding="utf-8")
        for family in families():
            if not allowed(path, family):
                offenders += [f"{path.relative_to(REPO)}: {line.strip()}" for line in family_references(text, family)]
    assert not offenders, "model families imported outside their folder and the registry:\n" + "\n".join(offenders)


def test_families_do_not_import_each_other():
    for family in families():
        for path in (MODELS / family).glob("**/*.py"):
            text = path.read_text(encoding="utf-8")
            others = [f for f in families() if f != family and family_references(text, f)]
            assert not others, f"{path.relative_to(REPO)} imports {others}"


def test_common_sits_below_distributed_and_the_families():
    offenders = []
    for path in sources(MODELS / "common"):
        bad = [
            m
            for m in imported_modules(path)
            if m.startswith(("torchtitan.distributed", "torchtitan.models.registry"))
            or any(m.startswith(f"torchtitan.models.{f}") for f in families())
        ]
        offenders += [f"{path.relative_to(REPO)}: {m}" for m in sorted(bad)]
    assert not offenders, "torchtitan/models/common imports from above it:\n" + "\n".join(offenders)


def test_distributed_imports_only_models_common():
    offenders = []
    for path in sources(REPO / "torchtitan" / "distributed"):
        bad = [
            m
            for m in imported_modules(path)
            if m.startswith("torchtitan.models") and not m.startswith("torchtitan.models.common")
        ]
        offenders += [f"{path.relative_to(REPO)}: {m}" for m in sorted(bad)]
    assert not offenders, "torchtitan/distributed imports models/ outside models/common:\n" + "\n".join(offenders)


def isinstance_on_model_classes(path: Path) -> list[str]:
    """`isinstance(x, C)` calls in `path` where C was imported from torchtitan.models."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    model_names = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchtitan.models")
        for a in node.names
    }
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            used = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & model_names
            calls += [f"{path}:{node.lineno}: isinstance on {sorted(used)}"] if used else []
    return calls


def test_the_scanners_find_what_they_look_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from torchtitan.models.common.moe import MoE as M\nimport torchtitan.distributed.grad_norm\n"
        "def f(x):\n    from torchtitan.models.fam import model\n    return isinstance(x, (int, M))\n"
    )
    assert {
        "torchtitan.models.common.moe.MoE",
        "torchtitan.distributed.grad_norm",
        "torchtitan.models.fam.model",
    } <= imported_modules(probe)
    assert len(isinstance_on_model_classes(probe)) == 1


def test_no_isinstance_on_model_classes_outside_models():
    offenders = [
        call
        for path in sources()
        if "models" not in path.relative_to(REPO).parts[:2]
        for call in isinstance_on_model_classes(path)
    ]
    assert not offenders, "outside models/, ask the spec instead:\n" + "\n".join(offenders)
