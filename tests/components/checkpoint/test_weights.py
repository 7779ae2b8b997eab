"""Model weights of step-N folders outside training (weights.py); its streaming conversions are
tested through scripts/convert_checkpoint.py (tests/scripts/test_convert_checkpoint.py)."""

import json
from dataclasses import asdict

import pytest
import torch

from torchtitan.components.checkpoint import read_dcp_model, write_dcp_model
from torchtitan.config import UserError
from torchtitan.models.registry import get_model_spec

from helpers.tiny_models import materialized, small_llama3_args

SPEC = get_model_spec("llama3")


def test_dcp_model_round_trip_and_errors(tmp_path):
    args = small_llama3_args()
    sd = materialized(SPEC.model_cls, args).state_dict()
    write_dcp_model(tmp_path / "step-0", sd, SPEC, args, flavor="tiny")
    state = json.loads((tmp_path / "step-0" / "train_state.json").read_text())
    assert (state["format_version"], state["step"], state["model_only"], state["dtype"]) == (2, 0, True, "float32")
    assert state["model"] == {"name": "llama3", "flavor": "tiny", "args": asdict(args)}
    back, back_args, _ = read_dcp_model(tmp_path / "step-0", SPEC)
    assert back_args == args
    for k in sd:
        assert torch.equal(back[k], sd[k]), k

    (tmp_path / "step-0" / ".metadata").unlink()
    with pytest.raises(UserError, match="not a complete checkpoint"):
        read_dcp_model(tmp_path / "step-0", SPEC)
