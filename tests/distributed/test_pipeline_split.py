"""Fast checks of pipeline stage splitting, placement and config errors (no processes launched)."""

import pytest
import torch

from torchtitan.config import load_config
from torchtitan.config.errors import UserError
from torchtitan.distributed.pipeline_parallel import (
    build_pipeline_schedule,
    build_stage_model,
    last_stage_rank,
    num_microbatches,
    parts_from_split_points,
    resolve_num_stages,
    schedule_style,
    split_module_names,
    stage_ids_for_rank,
    stage_modules,
)
from torchtitan.models.common.spec import PipelineLayout
from torchtitan.models.registry import get_model_spec

SPEC = get_model_spec("llama3")
Transformer = SPEC.model_cls
ARGS = SPEC.args_cls(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)
LAYOUT = SPEC.pipeline


def layers(parts):
    return [[n for n in p if n.startswith("layers.")] for p in parts]


def test_even_split():
    parts = split_module_names(LAYOUT, 4, 2)
    assert parts == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]


def test_one_stage_holds_everything():
    assert split_module_names(LAYOUT, 3, 1, first_less=1, last_less=1) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]
    ]


def test_uneven_split_gives_leftovers_after_the_first_stage():
    assert [len(p) for p in layers(split_module_names(LAYOUT, 6, 4))] == [1, 2, 2, 1]


def test_first_and_last_less():
    # 8 layers + 1 + 1 slots over 5 stages: 2 slots each, the first and last give one to embedding / output.
    assert [len(p) for p in layers(split_module_names(LAYOUT, 8, 5, first_less=1, last_less=1))] == [1, 2, 2, 2, 1]
    assert [
        len(p) for p in layers(split_module_names(LAYOUT, 8, 4, layers_per_stage=3, first_less=2, last_less=2))
    ] == [1, 3, 3, 1]


def test_every_layer_once_in_order():
    parts = split_module_names(LAYOUT, 13, 4, first_less=1)
    flat = [n for p in layers(parts) for n in p]
    assert flat == [f"layers.{i}" for i in range(13)]


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            dict(n_layers=4, num_stages=3, layers_per_stage=2),
            r"pipeline_parallel_layers_per_stage = 2 x 3 stages != model n_layers = 4",
        ),
        (dict(n_layers=2, num_stages=5), r"cannot split model n_layers = 2 into 5 pipeline stages"),
        (dict(n_layers=1, num_stages=2, first_less=3), r"layers per stage would be \[-1, 2\]"),
    ],
)
def test_split_errors(kwargs, pattern):
    with pytest.raises(UserError, match=pattern):
        split_module_names(LAYOUT, **kwargs)


def test_negative_stage_reductions_are_refused_by_the_config():
    with pytest.raises(UserError, match=r"pipeline_parallel_last_stage_less_layers must be 0 or more"):
        load_config(["--parallelism.pipeline_parallel_last_stage_less_layers", "-1"])
    with pytest.raises(ValueError):
        split_module_names(LAYOUT, n_layers=4, num_stages=2, last_less=-1)


def test_a_family_with_other_module_names_splits_by_its_layout():
    layout = PipelineLayout(before=("wte",), after=("ln_f", "lm_head"))
    assert split_module_names(layout, 4, 2) == [
        ["wte", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "ln_f", "lm_head"],
    ]
    assert parts_from_split_points(layout, 4, ["layers.3"])[1] == ["layers.3", "ln_f", "lm_head"]
    with pytest.raises(UserError, match=r"unknown module names \['tok_embeddings'\]"):
        split_module_names(layout, 4, 2, module_fqns_per_model_part=[["tok_embeddings", "layers.0"], ["layers.1"]])


def test_shared_weights_across_stages_are_found_with_each_stage_name():
    from torchtitan.distributed.pipeline_parallel import shared_weights, stage_ids_for_rank, stage_rank

    with torch.device("meta"):
        model = Transformer(ARGS)
    parts = split_module_names(LAYOUT, 4, 2)
    assert shared_weights(model, parts) == []  # untied
    model.output.weight = model.tok_embeddings.weight
    assert shared_weights(model, parts) == [{0: "tok_embeddings.weight", 1: "output.weight"}]
    assert shared_weights(model, split_module_names(LAYOUT, 4, 1)) == []  # one stage holds both
    assert shared_weights(model, split_module_names(LAYOUT, 4, 4)) == [{0: "tok_embeddings.weight", 3: "output.weight"}]
    # stage_rank inverts the placement of both styles.
    for style, stages in (("loop", 8), ("v", 4)):
        for rank in range(2 if style == "v" else 4):
            pp = 2 if style == "v" else 4
            assert all(stage_rank(s, pp, style) == rank for s in stage_ids_for_rank(rank, pp, stages, style))


def test_a_borrowed_module_is_copied_to_the_stage_that_reads_it_under_its_own_name():
    # DeepSeek-V3's multi-token prediction (last stage) embeds further tokens with the input embedding.
    import dataclasses

    from torchtitan.distributed.pipeline_parallel import shared_weights

    spec = get_model_spec("deepseek_v3")
    layout = spec.pipeline
    for depth in (0, 2):
        args = dataclasses.replace(spec.args_for_training("debugmodel", 4096, 32), mtp_depth=depth)
        with torch.device("meta"):
            model = spec.model_cls(args)
        parts = split_module_names(layout, args.n_layers, 2)
        first, last = (build_stage_model(model, layout, part) for part in parts)
        assert first.borrowed == frozenset() and first.tok_embeddings is not None
        if depth == 0:  # no reader: no copy
            assert last.borrowed == frozenset() and last.tok_embeddings is None
            assert shared_weights(model, parts, layout) == []
            continue
        assert last.borrowed == {"tok_embeddings"} and last.tok_embeddings is not None
        assert shared_weights(model, parts, layout) == [{0: "tok_embeddings.weight", 1: "tok_embeddings.weight"}]
        assert shared_weights(model, split_module_names(layout, args.n_layers, 1), layout) == []


def test_explicit_parts_override_and_are_checked():
    parts = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]]
    assert split_module_names(LAYOUT, 4, 2, module_fqns_per_model_part=parts) == parts
    with pytest.raises(UserError, match=r"has 2 model parts but the pipeline has 4 stages"):
        split_module_names(LAYOUT, 4, 4, module_fqns_per_model_part=parts)
    with pytest.raises(UserError, match=r"missing \['layers.3'\]"):
        split_module_names(
            LAYOUT, 4, 2, module_fqns_per_model_part=[parts[0], ["layers.1", "layers.2", "norm", "output"]]
        )
    with pytest.raises(UserError, match=r"unknown module names \['layers.9'\]"):
        split_module_names(LAYOUT, 4, 2, module_fqns_per_model_part=[parts[0], parts[1] + ["layers.9"]])
    with pytest.raises(UserError, match=r"model order"):
        swapped = [["tok_embeddings", "layers.1"], ["layers.0"] + parts[1][1:]]
        split_module_names(LAYOUT, 4, 2, module_fqns_per_model_part=swapped)


def test_stage_model_keeps_full_model_names_and_values():
    with torch.device("meta"):
        meta = Transformer(ARGS)
    full = Transformer(ARGS)
    full.init_weights(seed=0)
    ref = dict(full.named_parameters())
    seen = []
    for names in split_module_names(LAYOUT, 4, 4, first_less=0):
        stage = build_stage_model(meta, LAYOUT, names)
        stage.to_empty(device="cpu")
        stage.init_weights(seed=0)
        for n, p in stage.named_parameters():
            assert torch.equal(p, ref[n]), n
            seen.append(n)
    assert sorted(seen) == sorted(ref)
    # The meta model itself is untouched (each stage is a copy).
    assert len(meta.layers) == 4 and meta.output is not None


def test_stage_forward_chains_to_full_forward():
    full = Transformer(ARGS)
    full.init_weights(seed=0)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    h = tokens
    for names in split_module_names(LAYOUT, 4, 3):
        stage = build_stage_model(lambda: Transformer(ARGS), LAYOUT, names)
        stage.init_weights(seed=0)
        h = stage(h)
    torch.testing.assert_close(h, full(tokens), rtol=0, atol=0)


def test_placement():
    assert stage_ids_for_rank(1, 2, 4, "loop") == [1, 3]
    assert stage_ids_for_rank(0, 2, 2, "loop") == [0]
    assert stage_ids_for_rank(0, 2, 4, "v") == [0, 3]
    assert stage_ids_for_rank(1, 2, 4, "v") == [1, 2]
    assert schedule_style("ZBVZeroBubble") == "v" and schedule_style("dualpipev") == "v"
    assert schedule_style("Interleaved1F1B") == "loop"
    assert last_stage_rank(2, 4, "v") == 0 and last_stage_rank(4, 8, "loop") == 3
    with pytest.raises(UserError, match=r"2 stages per rank"):
        stage_ids_for_rank(0, 2, 6, "v")
    with pytest.raises(UserError, match=r"cannot be spread evenly"):
        stage_ids_for_rank(0, 2, 3, "loop")


def test_num_stages():
    assert resolve_num_stages(4, 2, "1F1B") == 2
    assert resolve_num_stages(4, 2, "Interleaved1F1B") == 4
    assert resolve_num_stages(8, 2, "Interleaved1F1B", layers_per_stage=2) == 4
    assert resolve_num_stages(6, 2, "LoopedBFS", layers_per_stage=2, first_less=1, last_less=1) == 4
    with pytest.raises(UserError, match=r"pipeline_parallel_layers_per_stage = 3 does not divide"):
        resolve_num_stages(8, 2, "Interleaved1F1B", layers_per_stage=3)
    with pytest.raises(UserError, match=r"gives 4 stages, which schedule '1F1B' cannot place"):
        resolve_num_stages(8, 2, "1F1B", layers_per_stage=2)
    with pytest.raises(UserError, match=r"pipeline_parallel_schedule = 'Bogus'"):
        resolve_num_stages(4, 2, "Bogus")


def test_microbatch_errors():
    assert num_microbatches(8, 2) == 4
    with pytest.raises(ValueError, match=r"microbatch size 3 does not divide the local batch 8"):
        num_microbatches(8, 3)


class _FakeStage:
    """Enough of a PipelineStage for the checks that run before a schedule is built."""

    def __init__(self, num_stages, group_size=2):
        self.num_stages, self.group_size = num_stages, group_size


def test_too_few_microbatches():
    with pytest.raises(UserError, match=r"'1F1B' needs at least as many microbatches as stages: got 1 microbatches"):
        build_pipeline_schedule([_FakeStage(2)], "1F1B", 1, loss_fn=None)
    with pytest.raises(UserError, match=r"'DualPipeV' needs at least as many microbatches as stages"):
        build_pipeline_schedule([_FakeStage(4), _FakeStage(4)], "DualPipeV", 3, loss_fn=None)
    with pytest.raises(UserError, match=r"runs one stage per rank"):
        build_pipeline_schedule([_FakeStage(4), _FakeStage(4)], "GPipe", 4, loss_fn=None)


def test_split_points_become_model_parts():
    assert parts_from_split_points(LAYOUT, 4, ["layers.2"]) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "output"],
    ]
    assert [p[0] for p in parts_from_split_points(LAYOUT, 4, ["layers.1", "layers.3"])] == [
        "tok_embeddings",
        "layers.1",
        "layers.3",
    ]
    with pytest.raises(UserError, match=r"unknown module names \['layer.2'\]"):
        parts_from_split_points(LAYOUT, 4, ["layer.2"])
    with pytest.raises(UserError, match=r"in model order"):
        parts_from_split_points(LAYOUT, 4, ["layers.3", "layers.1"])
    with pytest.raises(UserError, match=r"not the first module"):
        parts_from_split_points(LAYOUT, 4, ["tok_embeddings"])


def test_stage_modules_from_config():
    def stages(*argv):
        cfg = load_config(["--parallelism.pipeline_parallel_degree", "2", *argv])
        return stage_modules(LAYOUT, 6, 2, cfg.parallelism)

    explicit = stages(
        "--parallelism.module_fqns_per_model_part",
        "tok_embeddings,layers.0;layers.1,layers.2,layers.3,layers.4,layers.5,norm,output",
    )
    assert [len(p) for p in explicit] == [2, 7]
    assert stages("--parallelism.pipeline_parallel_split_points", "layers.4")[1] == [
        "layers.4",
        "layers.5",
        "norm",
        "output",
    ]
    # Four parts for a schedule with two stages per rank; two parts for 1F1B.
    assert (
        len(
            stages(
                "--parallelism.pipeline_parallel_split_points",
                "layers.1,layers.3,layers.5",
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
            )
        )
        == 4
    )
    with pytest.raises(UserError, match=r"pipeline_parallel_split_points gives 3 stages, which schedule '1F1B'"):
        stages("--parallelism.pipeline_parallel_split_points", "layers.2,layers.4")
    # The default: layers spread over one stage per rank.
    assert [len(p) for p in stages()] == [4, 5]
    with pytest.raises(UserError, match=r"both split the pipeline"):
        load_config(
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_split_points",
                "layers.2",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "2",
            ]
        )
