"""The model registry seen from outside the package: a flavor added with register_flavor is found
wherever flavors are looked up (get_model_args, spec.flavors, preflight, a trainer run and its resume),
conflicting registrations are refused with one clear message, and a refused registration in the
module named by experimental.custom_import ends the trainer with one line and exit status 2."""

import dataclasses
import os
import runpy
import subprocess
import sys
import textwrap

import pytest

from torchtitan.config import UserError
from torchtitan.models import registry
from torchtitan.models.registry import (
    get_model_args,
    get_model_spec,
    import_custom_module,
    register_flavor,
    register_model,
)

from helpers.launch import debug_config, read_metrics
from helpers.paths import REPO, TINY

# The docs/models.md example: a llama3 small enough to train in seconds on a CPU.
MY_FLAVORS = """\
import dataclasses

from torchtitan.models.registry import get_model_args, register_flavor

register_flavor(
    "llama3",
    "tiny",
    dataclasses.replace(get_model_args("llama3", "debugmodel"), dim=128, n_layers=2, n_heads=4),
)
"""


@pytest.fixture(autouse=True)
def own_registry(monkeypatch):
    """Each test starts from the built-in families alone (the registry is global to the pytest
    process: other test modules register their own), and what it registers is gone after it."""
    monkeypatch.setattr(registry, "_REGISTERED", {})
    monkeypatch.setattr(registry, "_ADDED_FLAVORS", {})
    monkeypatch.setattr(registry, "_WITH_ADDED", {})


def tiny_args():
    return dataclasses.replace(get_model_args("llama3", "debugmodel"), dim=128, n_layers=2, n_heads=4)


def test_a_registered_flavor_is_found_wherever_flavors_are_looked_up():
    from torchtitan.preflight import preflight

    register_flavor("llama3", "tiny", tiny_args())
    assert get_model_args("llama3", "tiny") == tiny_args()
    for _ in range(2):  # the registry keeps it: every lookup sees it
        spec = get_model_spec("llama3")
        assert spec.flavors["tiny"] == tiny_args()
        assert spec.flavors["debugmodel"].dim == 256  # the family's own flavors are still there
    assert spec.args_for_training("tiny", 4096, 64).n_layers == 2
    assert "tiny" not in registry._own_spec("llama3").flavors  # the family's table is not edited
    result = preflight(debug_config("--model.flavor", "tiny"), world_size=1)
    assert result.spec.flavors["tiny"] == tiny_args()


def test_the_same_flavor_again_is_fine_a_different_one_is_refused(tmp_path):
    module = tmp_path / "my_flavors.py"
    module.write_text(MY_FLAVORS)
    runpy.run_path(str(module))
    runpy.run_path(str(module))  # a module imported twice registers equal args again
    assert get_model_args("llama3", "tiny") == tiny_args()
    with pytest.raises(
        UserError,
        match=r"register_flavor\('llama3', 'tiny', \.\.\.\): model 'llama3' already has a "
        r"flavor 'tiny' with other args \(dim 128 -> 64\); choose another flavor name",
    ):
        register_flavor("llama3", "tiny", dataclasses.replace(tiny_args(), dim=64))
    # A built-in flavor is not redefined, but naming it with its own args is harmless.
    with pytest.raises(UserError, match="already has a flavor 'debugmodel' with other args"):
        register_flavor("llama3", "debugmodel", tiny_args())
    register_flavor("llama3", "debugmodel", get_model_args("llama3", "debugmodel"))


def test_bad_registrations_are_refused_with_the_fix():
    with pytest.raises(
        UserError,
        match=r"register_flavor: unknown model 'llama4'; registered models: deepseek_v3, gpt_oss, llama3, qwen3.* "
        r"\(a family of your own must be registered with register_model first\)",
    ):
        register_flavor("llama4", "tiny", tiny_args())
    with pytest.raises(
        UserError,
        match=r"args must be a torchtitan\.models\.qwen3\.args\.ModelArgs \(the args_cls of "
        r"model 'qwen3'\), got a torchtitan\.models\.llama3\.args\.ModelArgs",
    ):
        register_flavor("qwen3", "tiny", tiny_args())
    with pytest.raises(UserError, match="args must be"):
        register_flavor("llama3", "tiny", {"dim": 128})
    with pytest.raises(UserError, match="the flavor name must be a non-empty string"):
        register_flavor("llama3", "", tiny_args())
    assert "tiny" not in get_model_spec("llama3").flavors and "tiny" not in get_model_spec("qwen3").flavors


def test_a_duplicate_model_name_is_refused_and_points_at_register_flavor():
    spec = get_model_spec("llama3")
    with pytest.raises(
        UserError,
        match=r"register_model: a model named 'llama3' is built into torchtitan; give yours "
        r"another name .* call register_flavor\('llama3', FLAVOR_NAME, args\)",
    ):
        register_model(dataclasses.replace(spec, flavors={**spec.flavors, "tiny": tiny_args()}))
    fork = dataclasses.replace(spec, name="llama3_fork")
    register_model(fork)
    register_model(fork)  # the same spec again: a module imported twice
    with pytest.raises(UserError, match="a model named 'llama3_fork' is already registered by another spec"):
        register_model(dataclasses.replace(fork, cp_attention=None))


def test_a_registered_family_takes_flavors_too():
    fork = dataclasses.replace(get_model_spec("llama3"), name="llama3_fork")
    register_model(fork)
    register_flavor("llama3_fork", "tiny", tiny_args())
    assert get_model_spec("llama3_fork").flavors["tiny"] == tiny_args()
    assert "tiny" not in get_model_spec("llama3").flavors
    register_model(fork)  # re-registering the spec as first given still counts as the same


def test_an_unknown_flavor_says_how_to_add_one():
    with pytest.raises(
        UserError,
        match=r"unknown model.flavor 'tiny' for model 'llama3'; available flavors: "
        r"debugmodel, .*; to add one, call torchtitan\.models\.registry\.register_flavor"
        r"\('llama3', 'tiny', args\) in a module named by experimental\.custom_import",
    ):
        get_model_args("llama3", "tiny")


def test_a_user_error_raised_by_the_custom_module_reaches_the_caller_unchanged(tmp_path):
    module = tmp_path / "dup_family.py"
    module.write_text(
        "import dataclasses\nfrom torchtitan.models.registry import get_model_spec, register_model\n"
        "register_model(dataclasses.replace(get_model_spec('qwen3'), name='llama3'))\n"
    )
    with pytest.raises(UserError, match="^register_model: a model named 'llama3' is built into torchtitan"):
        import_custom_module(str(module))
    assert "torchtitan_custom_dup_family" not in sys.modules  # not half-imported: a retry imports it again


# --- the trainer, as a user runs it ------------------------------------------------------------------

TRAIN = [sys.executable, "-m", "torchtitan.train", *TINY, "--training.local_batch_size", "8"]


def train(cwd, *extra):
    return subprocess.run([*TRAIN, *extra], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_trainer_trains_and_resumes_a_flavor_added_by_custom_import(tmp_path):
    assert f"```python\n{MY_FLAVORS}```" in (REPO / "docs" / "models.md").read_text()  # the documented example
    (tmp_path / "my_flavors.py").write_text(MY_FLAVORS)
    # As in docs/models.md: the file named relative to the working directory.
    job = [
        "--experimental.custom_import",
        "my_flavors.py",
        "--model.flavor",
        "tiny",
        "--job.dump_folder",
        "out",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "2",
        "--checkpoint.no-last_save_model_only",
    ]
    first = train(tmp_path, *job, "--training.steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "training llama3 tiny: " in first.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2]
    # The resumed run rebuilds the flavor's args from the same module and checks the checkpoint against them.
    resumed = train(tmp_path, *job, "--training.steps", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from " in resumed.stderr and "(step 2)" in resumed.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3]


def test_a_duplicate_model_in_the_custom_module_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "my_family.py").write_text(
        textwrap.dedent("""\
        import dataclasses
        from torchtitan.models.registry import get_model_spec, register_model
        spec = get_model_spec("llama3")
        register_model(dataclasses.replace(spec, flavors={**spec.flavors, "tiny": spec.flavors["debugmodel"]}))
    """)
    )
    proc = train(
        tmp_path,
        "--experimental.custom_import",
        "my_family.py",
        "--model.flavor",
        "tiny",
        "--job.dump_folder",
        "out",
        "--training.steps",
        "2",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "register_model" in line]
    assert errors == [
        "error: register_model: a model named 'llama3' is built into torchtitan; give yours another name "
        "(dataclasses.replace(spec, name='llama3_custom')), or, to add a size to 'llama3', call "
        "register_flavor('llama3', FLAVOR_NAME, args) instead (see docs/models.md)"
    ]


def test_help_and_docs_name_every_shipped_family(monkeypatch):
    """--help lists the families from the registry (a family added to it appears there without an edit);
    docs/models.md and the README's tour must name each, and a family added later fails this test
    until they do."""
    from torchtitan.config.manager import help_text

    shipped = registry.builtin_model_names()
    assert {"llama3", "qwen3", "deepseek_v3"} <= set(shipped)
    for command in (
        ["./run_train.sh", "--help"],
        [sys.executable, "-m", "torchtitan.train", "--help"],
        [sys.executable, "-m", "torchtitan.preflight", "--help"],
    ):
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        shown = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120).stdout
        lines = shown.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("  --model.name "))
        assert lines[at + 2] == f"      Shipped: {', '.join(shipped)}.", (command, lines[at : at + 3])
    monkeypatch.setitem(registry._BUILTIN, "later_family", "torchtitan.models.later_family")
    # Its spec as if its module had been imported (flavors are listed under model.flavor).
    monkeypatch.setitem(
        registry._BUILT, "later_family", dataclasses.replace(registry.get_model_spec("llama3"), name="later_family")
    )
    shown = registry.help_with_families(help_text())
    assert "later_family." in shown and "      later_family: debugmodel, " in shown
    monkeypatch.delitem(registry._BUILTIN, "later_family")
    monkeypatch.delitem(registry._BUILT, "later_family")
    docs = (REPO / "docs" / "models.md").read_text()
    families = docs.split("## Families and flavors", 1)[1].split("\n- ", 1)[0]
    readme = (REPO / "README.md").read_text()
    for name in shipped:
        assert f"`{name}`" in families, f"docs/models.md's Families and flavors does not name {name}"
        assert f"{name}/" in readme, f"the README's tour of torchtitan/models does not name {name}/"
