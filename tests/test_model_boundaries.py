"""Nothing outside a family's folder and the registry names a model family: the trainer, the
components, the parallelisms, the scripts and the tests (other than tests/models/, which test the
families themselves) reach a model only through its spec."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "torchtitan" / "models"


def families() -> list[str]:
    return sorted(p.name for p in MODELS.iterdir() if (p / "__init__.py").is_file())


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
    for path in sorted(REPO.glob("**/*.py")):
        if ".venv" in path.parts or "outputs" in path.parts:
            continue
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
