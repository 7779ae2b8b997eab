"""The package's layers import only downward, and nothing in it imports in a circle.

    config < models/common < families < models/registry < distributed < components
           < preflight, planner < train < launch

Every import statement of every module counts, function-level ones included: a function-level
import still ties the two modules together, it only hides the tie until the function runs.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan"

# Layer of each part of the package, bottom first; a module may import its own layer and those below.
LAYERS = [
    ("config",),
    ("models.common",),
    ("models.*",),  # the families: any other folder of models/
    ("models.registry", "models"),
    ("distributed",),
    ("components",),
    ("preflight", "planner"),
    ("train",),
    ("launch",),
]


def layer_of(module: str) -> int | None:
    """The layer of `torchtitan.X...`, by its longest matching prefix; None for torchtitan itself."""
    name = module.removeprefix("torchtitan").removeprefix(".")
    if not name:
        return None
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix.endswith(".*"):
                parent = prefix[:-2]
                if name.startswith(parent + ".") and name.count(".") >= parent.count(".") + 1:
                    length = len(parent) + 1  # weaker than any named prefix of the same parent
                else:
                    continue
            elif name == prefix or name.startswith(prefix + "."):
                length = len(prefix) + 2
            else:
                continue
            if length > best_len:
                best, best_len = index, length
    return best


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path) -> list[tuple[str, int]]:
    """(module imported, line) of every import in the file under `root` (the package folder), relative
    imports resolved; `from a.b import c` counts as a.b.c when that is a module, else a.b."""
    package = module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                as_file = root.parent / Path(*sub.split("."))
                found.append((sub if as_file.with_suffix(".py").exists() or as_file.is_dir() else base, node.lineno))
    return [(name, line) for name, line in found if name == root.name or name.startswith(root.name + ".")]


def graph(root: Path) -> dict[str, list[tuple[str, int]]]:
    return {module_name(path, root): imports(path, root) for path in sorted(root.rglob("*.py"))}


def upward_imports(edges: dict) -> list[str]:
    problems = []
    for module, targets in edges.items():
        mine = layer_of(module)
        for target, line in targets:
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                problems.append(f"{module}:{line} imports {target} (layer {LAYERS[theirs]} above {LAYERS[mine]})")
    return problems


def circles(edges: dict) -> list[list[str]]:
    """The import circles: strongly connected groups of two or more modules (Tarjan's algorithm). A
    module's implicit import of its own package's __init__ is left out: Python runs it first anyway."""
    adjacent = {
        m: sorted({t for t, _ in targets if t in edges and t != m and not m.startswith(t + ".")})
        for m, targets in edges.items()
    }
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in adjacent[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(adjacent):
        if v not in index:
            visit(v)
    return groups


# Known exceptions to the two rules: none left. A ratchet: a new upward import or circle fails, and
# so does an entry here that no longer exists, so that the lists only shrink.
KNOWN_UPWARD: set = set()
KNOWN_CIRCLES: list = []


def upward_pairs(edges: dict) -> set[tuple[str, str]]:
    return {(problem.split(":")[0], problem.split(" imports ")[1].split(" ")[0]) for problem in upward_imports(edges)}


def test_every_module_has_a_layer():
    assert [m for m in graph(PACKAGE) if m != "torchtitan" and layer_of(m) is None] == []


def test_layers_import_only_downward():
    assert upward_pairs(graph(PACKAGE)) == KNOWN_UPWARD


def test_no_import_circle():
    assert circles(graph(PACKAGE)) == KNOWN_CIRCLES


@pytest.fixture
def planted(tmp_path):
    """A copy of the package to plant bad imports in."""
    import shutil

    copy = tmp_path / "torchtitan"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_a_planted_upward_import_is_found(planted):
    path = planted / "distributed" / "grad_norm.py"
    path.write_text(path.read_text() + "\n\ndef late():\n    from torchtitan.train import Trainer  # noqa\n")
    problems = sorted(set(upward_imports(graph(planted))) - set(upward_imports(graph(PACKAGE))))
    assert (
        len(problems) == 1
        and problems[0].startswith("torchtitan.distributed.grad_norm:")
        and "torchtitan.train" in problems[0]
    )


def test_a_planted_circle_is_found(planted):
    (planted / "components" / "ping.py").write_text("from torchtitan.components import pong\n")
    (planted / "components" / "pong.py").write_text("def f():\n    from . import ping\n")
    new = [c for c in circles(graph(planted)) if c not in circles(graph(PACKAGE))]
    assert new == [["torchtitan.components.ping", "torchtitan.components.pong"]]
