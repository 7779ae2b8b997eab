"""Parameter groups (optimizer.param_groups; norms and biases undecayed) are decided by parameter name,
so every layout trains the same groups:
- with an lr multiplier on the embedding (the first group), one of 2 on layer 1 without decay, FSDP 2
  gives the single process's losses within 1e-5;
- its FSDP 2 save at step 3, resumed in one process (other groups: one per semantic group and mesh,
  other shards), continues the single process's losses and learning rates (the resume used to give every
  group the first group's learning rate);
- Qwen3's tied-embedding flavor with the embedding undecayed and a multiplier on the output layer's
  name (the same Parameter): PP 2, whose last stage holds a copy named output.weight only, matches its
  single process.
"""

import pytest

from helpers.launch import FP32_TOL, PP2, SAVE3, launch

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

GROUPS = ["--optimizer.param_groups", "tok_embeddings lr_mult=0.5,layers\\.1\\. lr_mult=2 weight_decay=0"]
# The tied flavor at half the learning rate, as in test_data_parallel_parity (its gradient norm swings at 2e-3).
TIED = [
    "--model.name",
    "qwen3",
    "--model.flavor",
    "debugmodel_tied",
    "--optimizer.lr",
    "1e-3",
    "--optimizer.no-weight_decay_embeddings",
    "--optimizer.param_groups",
    "^output\\. lr_mult=0.5",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("param_groups")
    results = launch({"fsdp2": GROUPS + SAVE3, "tied_pp2": TIED + PP2}, 2, tmp)
    copy = {"copy": [str(tmp / "fsdp2" / "checkpoint" / "step-3"), str(tmp / "resumed" / "checkpoint" / "step-3")]}
    results.update(launch({"single": GROUPS, "copy": copy, "resumed": GROUPS + SAVE3, "tied_single": TIED}, 1, tmp))
    return results


def check_close(ref: list[dict], got: list[dict]):
    assert [r["step"] for r in ref[-len(got) :]] == [g["step"] for g in got]
    for r, g in zip(ref[-len(got) :], got):
        assert g["loss"] == pytest.approx(r["loss"], rel=FP32_TOL), g["step"]
        assert g["lr"] == pytest.approx(r["lr"], rel=1e-12), g["step"]


def test_groups_under_fsdp2_match_one_process(runs):
    assert len(runs["single"]) == 6
    check_close(runs["single"], runs["fsdp2"])


def test_fsdp2_save_resumes_in_one_process_with_each_groups_lr(runs):
    assert [r["step"] for r in runs["resumed"]] == [4, 5, 6]
    check_close(runs["single"], runs["resumed"])


def test_tied_embedding_groups_under_pp2_match_one_process(runs):
    check_close(runs["tied_single"], runs["tied_pp2"])
