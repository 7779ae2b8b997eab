import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchtitan.config import (
    HelpRequested,
    JobConfig,
    UserError,
    config_to_dict,
    config_to_toml,
    load_config,
    validate,
)
from torchtitan.config.job_config import NOT_IMPLEMENTED_KEYS


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return str(path)


def load_recipe(path, *cli):
    return load_config(["--job.config_file", str(path), *cli])


def error_of(argv):
    with pytest.raises(UserError) as info:
        load_config(argv)
    return str(info.value)


# --- defaults, precedence, CLI forms -------------------------------------------------------


def test_defaults():
    cfg = load_config([])
    assert cfg == JobConfig()
    assert cfg.training.steps == 10000
    assert cfg.optimizer.name == "AdamW"
    assert cfg.job.config_file is None


def test_recipe_overrides_defaults(tmp_path):
    path = write(tmp_path / "r.toml", "[training]\nsteps = 7\n[optimizer]\nlr = 1\n")
    cfg = load_recipe(path)
    assert cfg.training.steps == 7
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # int widened
    assert cfg.training.seq_len == 2048  # untouched keys keep their defaults
    assert cfg.job.config_file == path


def test_cli_overrides_recipe(tmp_path):
    path = write(tmp_path / "r.toml", "[training]\nsteps = 7\nseq_len = 64\n")
    cfg = load_recipe(path, "--training.steps", "9")
    assert cfg.training.steps == 9
    assert cfg.training.seq_len == 64


def test_cli_space_and_equals_forms_and_dashes():
    cfg = load_config(["--training.steps", "5", "--training.seq_len=32", "--training.local-batch-size", "4"])
    assert (cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size) == (5, 32, 4)


def test_cli_negative_int_value():
    cfg = load_config(["--training.global_batch_size", "-1", "--training.local_batch_size", "2"])
    assert cfg.training.global_batch_size == -1


def test_cli_last_override_wins():
    assert load_config(["--training.steps", "5", "--training.steps=6"]).training.steps == 6


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.deterministic"], True),
        (["--training.deterministic", "true"], True),
        (["--training.deterministic", "YES"], True),
        (["--training.deterministic=1"], True),
        (["--training.deterministic", "false"], False),
        (["--training.deterministic=false"], False),
        (["--training.deterministic", "No"], False),
        (["--training.deterministic", "0"], False),
        (["--training.deterministic", "--training.no-deterministic"], False),
        (["--training.deterministic", "--training.no_deterministic"], False),
    ],
)
def test_cli_bool_forms(argv, expected):
    assert load_config(argv).training.deterministic is expected


def test_cli_bare_bool_followed_by_another_option():
    cfg = load_config(["--metrics.enable_tensorboard", "--training.steps", "3"])
    assert cfg.metrics.enable_tensorboard is True
    assert cfg.training.steps == 3


def test_cli_bad_bool_word():
    assert "expected a boolean" in error_of(["--training.deterministic=maybe"])


def test_cli_negated_flag_takes_no_value():
    assert "takes no value" in error_of(["--training.no-deterministic=true"])


def test_list_key_comma_parsing():
    assert load_config(["--model.converters", ""]).model.converters == []
    assert load_config(["--model.converters="]).model.converters == []
    assert load_config(["--model.converters", "float8"]).model.converters == ["float8"]
    assert load_config(["--float8.filter_fqns", "output, layers.0"]).float8.filter_fqns == ["output", "layers.0"]
    assert "unknown converter 'mx'" in error_of(["--model.converters", "float8, mx"])


@pytest.mark.parametrize("word", ["none", "null", "None", "NULL"])
def test_cli_optional_none(tmp_path, word):
    path = write(tmp_path / "r.toml", "[lr_scheduler]\ndecay_ratio = 0.5\n")
    assert load_recipe(path).lr_scheduler.decay_ratio == 0.5
    assert load_recipe(path, "--lr_scheduler.decay_ratio", word).lr_scheduler.decay_ratio is None


def test_cli_optional_value():
    assert load_config(["--lr_scheduler.decay_ratio", "0.25"]).lr_scheduler.decay_ratio == 0.25


def test_literal_choice_rejected_lists_choices(tmp_path):
    msg = error_of(["--optimizer.name", "sgd"])
    assert "optimizer.name" in msg and "'AdamW'" in msg and "'Adam'" in msg and "'sgd'" in msg
    path = write(tmp_path / "r.toml", '[lr_scheduler]\ndecay_type = "step"\n')
    with pytest.raises(UserError, match=r"'linear', 'sqrt', 'cosine'.*'step'"):
        load_recipe(path)


def test_literal_choice_accepted():
    assert load_config(["--optimizer.implementation", "for-loop"]).optimizer.implementation == "for-loop"


def test_cli_value_missing():
    assert "needs a value" in error_of(["--training.steps"])


@pytest.mark.parametrize("arg", ["steps", "-x", "--", "--training", "--a.b.c"])
def test_cli_malformed_argument(arg):
    with pytest.raises(UserError, match="--section.key"):
        load_config([arg])


# --- inheritance -----------------------------------------------------------------------------


def test_inheritance_section_wise_merge(tmp_path):
    write(tmp_path / "base.toml", "[training]\nsteps = 100\nseq_len = 128\n[optimizer]\nlr = 0.5\n")
    child = write(tmp_path / "child.toml", '[job]\nbase_config = "base.toml"\n[training]\nsteps = 3\n')
    cfg = load_recipe(child)
    assert cfg.training.steps == 3  # child wins
    assert cfg.training.seq_len == 128  # rest of the base's section kept
    assert cfg.optimizer.lr == 0.5
    assert cfg.job.config_file == child
    assert cfg.job.base_config == "base.toml"


def test_inheritance_nested_relative_paths(tmp_path):
    write(tmp_path / "a" / "b" / "root.toml", "[training]\nseq_len = 16\nsteps = 1\n")
    write(tmp_path / "a" / "mid.toml", '[job]\nbase_config = "b/root.toml"\n[training]\nsteps = 2\n')
    leaf = write(tmp_path / "c" / "leaf.toml", '[job]\nbase_config = "../a/mid.toml"\n')
    cfg = load_recipe(leaf)
    assert (cfg.training.seq_len, cfg.training.steps) == (16, 2)
    assert cfg.job.base_config == "../a/mid.toml"


def test_inheritance_cycle(tmp_path):
    write(tmp_path / "a.toml", '[job]\nbase_config = "b.toml"\n')
    write(tmp_path / "b.toml", '[job]\nbase_config = "a.toml"\n')
    with pytest.raises(UserError, match="cycle"):
        load_recipe(tmp_path / "a.toml")


def test_inheritance_self_cycle(tmp_path):
    write(tmp_path / "a.toml", '[job]\nbase_config = "a.toml"\n')
    with pytest.raises(UserError, match="cycle"):
        load_recipe(tmp_path / "a.toml")


def test_inheritance_missing_base(tmp_path):
    child = write(tmp_path / "child.toml", '[job]\nbase_config = "nope.toml"\n')
    msg = str(pytest.raises(UserError, load_recipe, child).value)
    assert "nope.toml" in msg and "not found" in msg and "child.toml" in msg


def test_base_config_rejected_on_cli():
    assert "inside a recipe" in error_of(["--job.base_config", "x.toml"])


def test_config_file_rejected_inside_recipe(tmp_path):
    path = write(tmp_path / "r.toml", '[job]\nconfig_file = "other.toml"\n')
    with pytest.raises(UserError, match="--job.config_file"):
        load_recipe(path)


def test_error_names_base_file_for_its_keys(tmp_path):
    write(tmp_path / "base.toml", '[training]\nsteps = "ten"\n')
    child = write(tmp_path / "child.toml", '[job]\nbase_config = "base.toml"\n')
    with pytest.raises(UserError, match="base.toml"):
        load_recipe(child)


# --- unknown names ---------------------------------------------------------------------------


def test_unknown_key_in_toml(tmp_path):
    path = write(tmp_path / "recipe.toml", "[training]\nstpes = 3\n")
    msg = str(pytest.raises(UserError, load_recipe, path).value)
    assert "'training.stpes'" in msg and "recipe.toml" in msg and "did you mean 'training.steps'" in msg


def test_unknown_key_in_wrong_section_points_to_home(tmp_path):
    path = write(tmp_path / "recipe.toml", "[training]\nlr = 3\n")
    with pytest.raises(UserError, match=r"did you mean 'optimizer\.lr'"):
        load_recipe(path)


@pytest.mark.parametrize(
    "given, meant",
    [
        ("optimizer.learning_rate", "optimizer.lr"),  # another trainer's word for the key: not 'optimizer.name'
        ("training.learning_rate", "optimizer.lr"),  # ... in the wrong section too
        ("training.max_steps", "training.steps"),
        ("training.batch_size", "training.local_batch_size"),
        ("lr_scheduler.warmup", "lr_scheduler.warmup_steps"),  # a word of the key
        ("training.stepz", "training.steps"),  # spelling still counts
    ],
)
def test_a_suggestion_weighs_the_words_of_the_key(given, meant):
    with pytest.raises(UserError) as e:
        load_config([f"--{given}", "1"])
    assert str(e.value).endswith(f"did you mean '--{meant}'?"), str(e.value)


def test_unknown_section_in_toml(tmp_path):
    path = write(tmp_path / "recipe.toml", "[trainig]\nsteps = 3\n")
    msg = str(pytest.raises(UserError, load_recipe, path).value)
    assert "'[trainig]'" in msg and "recipe.toml" in msg and "did you mean '[training]'" in msg


def test_key_outside_section_in_toml(tmp_path):
    path = write(tmp_path / "recipe.toml", "steps = 3\n")
    with pytest.raises(UserError, match=r"outside any \[section\].*training\.steps"):
        load_recipe(path)


def test_unknown_key_on_cli():
    msg = error_of(["--training.stpes", "3"])
    assert "training.stpes" in msg and "command line" in msg and "did you mean '--training.steps'" in msg


def test_unknown_section_on_cli():
    msg = error_of(["--trainig.steps", "3"])
    assert "'trainig'" in msg and "did you mean '--training.steps'" in msg


def test_unknown_checkpoint_key_suggests_the_known_key(tmp_path):
    path = write(tmp_path / "recipe.toml", "[checkpoint]\nenable_checkpointt = false\n")
    with pytest.raises(UserError, match=r"did you mean 'checkpoint\.enable_checkpoint'"):
        load_recipe(path)


# --- types -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "toml, key, expected, shown",
    [
        ('steps = "ten"', "training.steps", "an integer", "'ten'"),
        ("steps = true", "training.steps", "an integer", "true"),
        ("steps = 1.5", "training.steps", "an integer", "1.5"),
        ('max_norm = "1"', "training.max_norm", "a number", "'1'"),
        ("max_norm = false", "training.max_norm", "a number", "false"),
        ("deterministic = 1", "training.deterministic", "a boolean", "1"),
        ("dataset_path = 3", "training.dataset_path", "a string", "3"),
        ("compile = 0", "training.compile", "a boolean", "0"),
    ],
)
def test_wrong_type_in_toml(tmp_path, toml, key, expected, shown):
    path = write(tmp_path / "recipe.toml", f"[training]\n{toml}\n")
    msg = str(pytest.raises(UserError, load_recipe, path).value)
    assert msg.startswith(f"{key}: expected {expected}")
    assert f"got {shown}" in msg and "recipe.toml" in msg


def test_wrong_list_type_in_toml(tmp_path):
    path = write(tmp_path / "recipe.toml", "[model]\nconverters = [1]\n")
    with pytest.raises(UserError, match="model.converters: expected a list of strings"):
        load_recipe(path)


def test_section_must_be_table(tmp_path):
    path = write(tmp_path / "recipe.toml", "training = 3\n")
    with pytest.raises(UserError, match=r"\[training\] table"):
        load_recipe(path)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.steps", "ten"], "training.steps: expected an integer, got 'ten' (from the command line)"),
        (["--training.steps", "1.5"], "training.steps: expected an integer, got '1.5'"),
        (["--optimizer.lr", "fast"], "optimizer.lr: expected a number, got 'fast'"),
        (["--lr_scheduler.decay_ratio", "x"], "lr_scheduler.decay_ratio: expected a number or none, got 'x'"),
        (["--parallelism.tensor_parallel_degree", "two"], "parallelism.tensor_parallel_degree: expected an integer"),
    ],
)
def test_wrong_type_on_cli(argv, expected):
    assert expected in error_of(argv)


# --- not-implemented keys ----------------------------------------------------------------------------


def test_not_implemented_keys_inert_accepted(tmp_path):
    path = write(
        tmp_path / "recipe.toml",
        """
        [job]
        print_args = false
        [metrics]
        save_for_all_ranks = false
        [parallelism]
        enable_compiled_autograd = false
        tensor_parallel_degree = 1
        pipeline_parallel_schedule = "1F1B"
        [activation_checkpoint]
        mode = "none"
        """,
    )
    cfg = load_recipe(path, "--training.compile", "false", "--job.no-print_args")
    assert not hasattr(cfg.metrics, "save_for_all_ranks")  # not-implemented values are validated, not stored
    assert cfg == dataclasses.replace(JobConfig(), job=dataclasses.replace(JobConfig().job, config_file=path))


def test_not_implemented_key_active_rejected_in_toml(tmp_path):
    path = write(tmp_path / "recipe.toml", "[memory_estimation]\nenabled = true\ndisable_fake_mode = true\n")
    msg = str(pytest.raises(UserError, load_recipe, path).value)
    assert msg.startswith("memory_estimation.disable_fake_mode = true")
    assert "not supported yet: the estimate is computed from the model spec" in msg
    assert "Remove it or set it to false." in msg


# --- [validation] ------------------------------------------------------------------------------


def test_validation_section_loads_with_the_reference_keys(tmp_path):
    path = write(
        tmp_path / "recipe.toml",
        """
        [validation]
        enabled = true
        dataset = "local"
        dataset_path = "held_out.jsonl"
        local_batch_size = 4
        seq_len = 1024
        freq = 100
        steps = 20
        """,
    )
    v = load_recipe(path, "--training.seq_len", "2048").validation
    assert (v.enabled, v.dataset, v.dataset_path, v.local_batch_size, v.seq_len, v.freq, v.steps) == (
        True,
        "local",
        "held_out.jsonl",
        4,
        1024,
        100,
        20,
    )
    d = JobConfig().validation
    assert (d.enabled, d.dataset, d.local_batch_size, d.seq_len, d.freq, d.steps) == (
        False,
        "python_stdlib_test",
        8,
        -1,
        500,
        -1,
    )
    # The resolved config (config.toml) loads back.
    again = write(tmp_path / "config.toml", config_to_toml(load_recipe(path, "--training.seq_len", "2048")))
    assert load_recipe(again).validation == v


def test_disabled_validation_loads_with_any_dataset(tmp_path):
    # A reference recipe names its own set while validation is off.
    path = write(tmp_path / "recipe.toml", '[validation]\nenabled = false\ndataset = "c4_validation"\nfreq = 0\n')
    assert load_recipe(path).validation.dataset == "c4_validation"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--validation.freq", "0"], "validation.freq must be a positive integer, got 0"),
        (["--validation.local_batch_size", "0"], "validation.local_batch_size must be a positive integer"),
        (["--validation.steps", "0"], "validation.steps must be -1 (one pass over the validation set) or a positive"),
        (["--validation.dataset", "c4_validation"], "validation.dataset = 'c4_validation' is not available here"),
        (["--validation.dataset", "local"], 'validation.dataset = "local" needs validation.dataset_path'),
        (["--validation.dataset_path", "x.jsonl"], "validation.dataset_path = 'x.jsonl' is set but"),
        (["--validation.seq_len", "4096"], "validation.seq_len = 4096 exceeds training.seq_len = 2048"),
        (
            ["--validation.seq_len", "1024", "--parallelism.context_parallel_degree", "2"],
            "must equal training.seq_len = 2048 with context parallel",
        ),
        (
            ["--validation.seq_len", "1001", "--parallelism.tensor_parallel_degree", "2"],
            "validation.seq_len = 1001 must be divisible by parallelism.tensor_parallel_degree = 2",
        ),
        (
            [
                "--validation.local_batch_size",
                "3",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_microbatch_size",
                "2",
            ],
            "validation.local_batch_size = 3 is not a multiple of parallelism.pipeline_parallel_microbatch_size = 2",
        ),
    ],
)
def test_validation_values_are_checked_when_enabled(argv, expected):
    assert expected in error_of(["--training.seq_len", "2048", "--validation.enabled", *argv])
    load_config(["--training.seq_len", "2048", *argv])  # disabled: not checked


def test_not_implemented_key_specific_reason():
    msg = error_of(["--parallelism.enable_compiled_autograd"])
    assert "compiled autograd is not supported" in msg


def test_nested_list_from_recipe_and_command_line(tmp_path):
    parts = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    path = write(
        tmp_path / "recipe.toml",
        f"[parallelism]\npipeline_parallel_degree = 2\nmodule_fqns_per_model_part = {parts!r}\n",
    )
    assert load_recipe(path).parallelism.module_fqns_per_model_part == parts
    cli = load_config(
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.module_fqns_per_model_part",
            "tok_embeddings, layers.0; layers.1,norm,output",
        ]
    )
    assert cli.parallelism.module_fqns_per_model_part == parts
    assert "module_fqns_per_model_part = [['tok_embeddings', 'layers.0'], ['layers.1', 'norm', 'output']]" in (
        config_to_toml(cli).replace('"', "'")
    )
    bad = write(tmp_path / "bad.toml", '[parallelism]\nmodule_fqns_per_model_part = ["layers.0"]\n')
    with pytest.raises(UserError, match="module_fqns_per_model_part: expected a list of lists of strings"):
        load_recipe(bad)


def test_not_implemented_key_str_rejected():
    msg = error_of(["--experimental.custom_args_module", "my.module"])
    assert 'experimental.custom_args_module = "my.module"' in msg and 'set it to ""' in msg


def test_not_implemented_key_cli_can_switch_off_recipe_value(tmp_path):
    path = write(tmp_path / "recipe.toml", "[training]\ngc_debug = true\n")
    with pytest.raises(UserError, match="training.gc_debug"):
        load_recipe(path)
    load_recipe(path, "--training.no-gc_debug")


@pytest.mark.parametrize("option, ok", [("op", True), ("3", True), ("0", False), ("-1", False), ("every", False)])
def test_selective_ac_option(option, ok):
    argv = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", option]
    if ok:
        assert load_config(argv).activation_checkpoint.selective_ac_option == option
    else:
        assert "selective_ac_option must be a positive integer" in error_of(argv)


# --- value checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--training.local_batch_size", "0"], "training.local_batch_size"),
        (["--training.seq_len", "-3"], "training.seq_len"),
        (["--training.steps", "0"], "training.steps"),
        (["--metrics.log_freq", "0"], "metrics.log_freq"),
        (["--training.gc_freq", "0"], "training.gc_freq"),
        (["--comm.init_timeout_seconds", "0"], "comm.init_timeout_seconds"),
        (["--training.global_batch_size", "0"], "training.global_batch_size"),
        (["--training.global_batch_size", "-2"], "training.global_batch_size"),
        (["--parallelism.data_parallel_replicate_degree", "0"], "parallelism.data_parallel_replicate_degree"),
        (["--parallelism.data_parallel_shard_degree", "0"], "parallelism.data_parallel_shard_degree"),
        (["--parallelism.data_parallel_shard_degree", "-2"], "parallelism.data_parallel_shard_degree"),
        (["--optimizer.lr", "0"], "optimizer.lr"),
        (["--optimizer.lr", "nan"], "optimizer.lr"),
        (["--optimizer.eps", "0"], "optimizer.eps"),
        (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay"),
        (["--optimizer.beta1", "1"], "optimizer.beta1"),
        (["--optimizer.beta1", "-0.1"], "optimizer.beta1"),
        (["--optimizer.beta2", "1.5"], "optimizer.beta2"),
        (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps"),
        (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio"),
        (["--lr_scheduler.decay_ratio", "-0.1"], "lr_scheduler.decay_ratio"),
        (["--lr_scheduler.min_lr_factor", "1.1"], "lr_scheduler.min_lr_factor"),
        (["--lr_scheduler.min_lr_factor", "-0.1"], "lr_scheduler.min_lr_factor"),
        (["--training.max_norm", "-1"], "training.max_norm"),
        (["--metrics.device_peak_tflops", "-1"], "metrics.device_peak_tflops"),
        (["--training.dataset", "local"], "training.dataset_path"),
        (["--training.dataset", "huggingface"], "training.dataset_path"),
        (["--training.dataset_path", "data.jsonl"], 'training.dataset = "local"'),
    ],
)
def test_validate_rejects(argv, key):
    msg = error_of(argv)
    assert key in msg
    bad = argv[-1]
    assert bad in msg or str(float(bad)) in msg  # the bad value is shown


@pytest.mark.parametrize(
    "argv",
    [
        ["--training.global_batch_size", "16"],
        ["--parallelism.data_parallel_shard_degree", "2"],
        ["--optimizer.beta1", "0", "--optimizer.weight_decay", "0", "--training.max_norm", "0"],
        ["--lr_scheduler.decay_ratio", "0", "--lr_scheduler.min_lr_factor", "1", "--lr_scheduler.warmup_steps", "0"],
        ["--lr_scheduler.decay_ratio", "1"],
        ["--training.dataset", "local", "--training.dataset_path", "d"],
        ["--training.dataset", "huggingface", "--training.dataset_path", "d"],
    ],
)
def test_validate_accepts_boundaries(argv):
    load_config(argv)


def test_validate_direct_lists_every_problem():
    cfg = JobConfig()
    validate(cfg)
    bad = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, steps=0, seq_len=0))
    msg = str(pytest.raises(UserError, validate, bad).value)
    assert "training.steps" in msg and "training.seq_len" in msg


# --- files -----------------------------------------------------------------------------------


def test_missing_recipe_file(tmp_path):
    path = tmp_path / "absent.toml"
    msg = str(pytest.raises(UserError, load_recipe, path).value)
    assert str(path) in msg and "not found" in msg


def test_recipe_is_a_folder(tmp_path):
    with pytest.raises(UserError, match="is a folder"):
        load_recipe(tmp_path)


def test_malformed_toml(tmp_path):
    path = write(tmp_path / "bad.toml", "[training]\nsteps = = 3\n")
    msg = str(pytest.raises(UserError, load_recipe, path).value)
    assert path in msg and "line 2" in msg


def test_non_utf8_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(b'[job]\ndescription = "\xff"\n')
    with pytest.raises(UserError, match="bad.toml"):
        load_recipe(path)


# --- help, output, schema --------------------------------------------------------------------


def _shown(value):
    return "unset" if value is None else json.dumps(value)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_field_with_default(flag):
    with pytest.raises(HelpRequested) as info:
        load_config(["--training.steps", "3", flag])
    assert not isinstance(info.value, UserError)
    lines = info.value.text.splitlines()
    cfg = JobConfig()
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            line = next(x for x in lines if x.strip().startswith(f"--{section.name}.{f.name} "))
            assert f"default: {_shown(getattr(obj, f.name))})" in line
    planned = info.value.text.split("Planned keys")[1]
    assert "inert value" in planned
    for section, keys in NOT_IMPLEMENTED_KEYS.items():
        for key in keys:
            assert f"--{section}.{key} = " in planned


def test_help_wins_over_bad_arguments():
    with pytest.raises(HelpRequested):
        load_config(["--nonsense.key", "--help"])


def test_config_to_toml_round_trip(tmp_path):
    write(tmp_path / "base.toml", "[training]\nseq_len = 64\n")
    recipe = write(tmp_path / "r.toml", '[job]\nbase_config = "base.toml"\n')
    cfg = load_recipe(
        recipe,
        "--job.description",
        'quote " backslash \\ tab \t newline \n del \x7f unicode é',
        "--optimizer.lr",
        "3e-05",
        "--lr_scheduler.decay_ratio",
        "0.1",
        "--training.dataset",
        "local",
        "--training.dataset_path",
        "C:\\data\\x.jsonl",
        "--training.deterministic",
        "--metrics.device_peak_tflops",
        "989.5",
    )
    text = config_to_toml(cfg)
    assert "# config_file = " in text and "# base_config = " in text
    assert "# decay_ratio" not in text and "decay_ratio = 0.1" in text
    out = tmp_path / "elsewhere" / "resolved.toml"
    write(out, text)
    again = load_recipe(out)
    expected = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=str(out), base_config=None))
    assert again == expected


def test_config_to_toml_unset_values_are_comments():
    text = config_to_toml(JobConfig())
    assert "# decay_ratio = (unset)" in text and "# dataset_path = (unset)" in text
    sections = [line for line in text.splitlines() if line.startswith("[")]
    assert sections == [f"[{f.name}]" for f in dataclasses.fields(JobConfig)]


def test_config_to_dict():
    d = config_to_dict(JobConfig())
    assert d["training"]["steps"] == 10000
    assert d["job"]["config_file"] is None


def test_dataclasses_are_frozen():
    cfg = load_config([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.steps = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training = None


@pytest.mark.multiprocess
def test_import_does_not_import_torch():
    code = "import sys, torchtitan.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_dataset_path_rules():
    assert "needs training.dataset_path" in error_of(["--training.dataset", "local"])
    assert "does not read it" in error_of(["--training.dataset_path", "/tmp/x.jsonl"])
    tokens = ["--training.dataset", "tokens", "--training.dataset_path", "/tmp/t"]
    assert "a token folder has nothing to tokenize" in error_of([*tokens, "--training.data_workers", "1"])
    assert "data_workers must be 0" in error_of(["--training.data_workers", "-1"])


def test_hf_assets_path_is_the_initial_hf_weights_folder_or_refused(tmp_path):
    cfg = load_config(["--model.hf_assets_path", str(tmp_path), "--checkpoint.initial_load_in_hf"])
    assert cfg.checkpoint.initial_load_path == str(tmp_path)
    # The resolved config (as written to config.toml) loads again.
    again = tmp_path / "config.toml"
    again.write_text(config_to_toml(cfg))
    assert load_config(["--job.config_file", str(again)]).checkpoint.initial_load_path == str(tmp_path)
    assert "model.hf_assets_path = " in error_of(["--model.hf_assets_path", str(tmp_path)])
    assert "would be unused" in error_of(["--model.hf_assets_path", str(tmp_path)])


def test_only_switched_off_sections_accept_any_value():
    from torchtitan.config.job_config import ANY

    for section, keys in NOT_IMPLEMENTED_KEYS.items():
        if any(v is ANY for v in keys.values()):
            assert keys.get("enabled") is False, (
                f"[{section}] accepts any value but has no not-implemented enabled = false"
            )


def test_a_mixture_whose_schedule_would_not_repeat_soon_is_refused():
    from torchtitan.config.entries import parse_mix

    # The source of global sample k is the schedule's pattern at k mod T, T the weights' common denominator.
    weights, specs = parse_mix(["0.123456:a", "0.876544:b"], "training.dataset_mix")
    assert sum(weights) == 1 and specs == ["a", "b"]
    with pytest.raises(UserError, match=r"repeat only every 10,000,000 samples .*round the weights to fewer digits"):
        parse_mix(["0.1234567:a", "0.8765433:b"], "training.dataset_mix")


@pytest.mark.parametrize("key", ["init_timeout_seconds", "train_timeout_seconds"])
@pytest.mark.parametrize("value", ["-5", "0"])
def test_comm_timeouts_must_be_positive(key, value):
    # A negative one used to pass preflight and kill every rank at the first step (gloo: "Invalid timeout");
    # 0 times every collective out at once.
    default = getattr(JobConfig().comm, key)
    assert error_of([f"--comm.{key}", value]) == (
        f"invalid config: comm.{key} must be a positive number of seconds, got {value}; set it to 1 or more "
        f"(default {default})"
    )
    assert getattr(load_config([f"--comm.{key}", "1"]).comm, key) == 1


def test_comm_trace_buf_size_is_0_or_more():
    assert "comm.trace_buf_size must be 0 (flight recorder off) or more entries, got -1" in error_of(
        ["--comm.trace_buf_size", "-1"]
    )
    assert load_config(["--comm.trace_buf_size", "0"]).comm.trace_buf_size == 0


@pytest.mark.multiprocess
def test_a_negative_comm_timeout_is_refused_before_launch(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.preflight", "--comm.train_timeout_seconds", "-5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: invalid config: comm.train_timeout_seconds must be a positive number of "
        "seconds, got -5; set it to 1 or more (default 100)"
    )


# --- each section checks itself; [training] and [validation] share their rules ---------------


def test_each_section_reports_its_own_problems():
    import torchtitan.config as jc

    assert jc.Training(local_batch_size=0).check() == [
        "training.local_batch_size must be a positive integer, got 0; set it to 1 or more"
    ]
    assert jc.Optimizer(lr=0.0).check() == ["optimizer.lr must be greater than 0, got 0.0"]
    assert jc.Optimizer(lr=float("nan")).check() == ["optimizer.lr must be greater than 0, got nan"]
    assert jc.LRScheduler(min_lr_factor=2.0).check() == ["lr_scheduler.min_lr_factor must be in [0, 1], got 2.0"]
    assert jc.Parallelism(tensor_parallel_degree=0).check() == [
        "parallelism.tensor_parallel_degree must be 1 or more, got 0"
    ]
    assert jc.Checkpoint(interval=0).check() == ["checkpoint.interval must be a positive integer, got 0"]
    assert jc.Metrics(log_freq=0).check() == ["metrics.log_freq must be a positive integer, got 0; set it to 1 or more"]
    assert jc.Comm(trace_buf_size=-1).check() == [
        "comm.trace_buf_size must be 0 (flight recorder off) or more entries, got -1"
    ]
    assert jc.Job(stop_signals=["SIGKILL"]).check()[0].startswith("job.stop_signals: 'SIGKILL' is not a signal")
    assert jc.Model(converters=["int4"]).check() == [
        "model.converters: unknown converter 'int4'; the only one is 'float8'"
    ]
    assert jc.MoE(top_k=0).check() == ["moe.top_k must be 1 or more, got 0"]
    assert jc.Profiling(profile_freq=0).check() == ["profiling.profile_freq must be a positive integer, got 0"]
    assert jc.Float8(precompute_float8_dynamic_scale_for_fsdp=True).check() == [
        "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather = true"
    ]
    assert (
        jc.ActivationCheckpoint(mode="selective", selective_ac_option="0")
        .check()[0]
        .startswith("activation_checkpoint.selective_ac_option must be a positive integer")
    )
    # Every section's defaults pass its own rules; validation's only apply once enabled.
    for f in dataclasses.fields(JobConfig):
        assert getattr(getattr(JobConfig(), f.name), "check", list)() == [], f.name
    assert jc.Validation(local_batch_size=0, freq=0).check() == []
    assert len(jc.Validation(enabled=True, local_batch_size=0, freq=0).check()) == 2


def test_a_section_check_reads_no_other_section():
    import torchtitan.config as jc

    # Rules spanning sections (microbatches, context-parallel seq_len) wait for the whole config.
    assert jc.Training(local_batch_size=3, seq_len=102).check() == []
    assert "training.local_batch_size = 3 is not a multiple of" in error_of(
        [
            "--training.local_batch_size",
            "3",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ]
    )


@pytest.mark.parametrize("section", ["training", "validation"])
def test_training_and_validation_share_their_data_rules(section):
    import torchtitan.config as jc

    cls = {"training": jc.Training, "validation": jc.Validation}[section]
    on = {"enabled": True} if section == "validation" else {}
    mixed = cls(dataset_mix=["1:data/web"], dataset_path="data/x", **on).check()
    assert mixed == [
        f"{section}.dataset_mix is set, so {section}.dataset ({cls().dataset!r}) and "
        f"{section}.dataset_path ('data/x') are not used; remove them (a mixture names every source itself)"
    ]
    assert cls(dataset="local", **on).check() == [
        f'{section}.dataset = "local" needs {section}.dataset_path; set it to the data file or folder '
        "(.jsonl, .json, .txt, their .gz/.zst, .parquet, Arrow)"
    ]
    assert cls(dataset="python_stdlib", dataset_path="x.jsonl", **on).check() == [
        f"{section}.dataset_path = 'x.jsonl' is set but {section}.dataset = \"python_stdlib\" does not read it; "
        f'set {section}.dataset = "local" (or "huggingface") to read it, or remove dataset_path'
    ]
    assert cls(local_batch_size=0, **on).check() == [
        f"{section}.local_batch_size must be a positive integer, got 0; set it to 1 or more"
    ]
    # The same rules, raised before launch with everything else.
    flags = ["--validation.enabled"] if section == "validation" else []
    message = error_of(
        [
            *flags,
            f"--{section}.dataset_mix",
            "1:data/web",
            f"--{section}.dataset_path",
            "data/x",
            f"--{section}.local_batch_size",
            "3",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ]
    )
    assert f"{section}.dataset_mix is set, so {section}.dataset" in message
    assert (
        f"{section}.local_batch_size = 3 is not a multiple of parallelism.pipeline_parallel_microbatch_size = 2"
        in message
    )


def test_a_zero_pipeline_microbatch_is_reported_not_divided_by():
    message = error_of(
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "0"]
    )
    assert message == "invalid config: parallelism.pipeline_parallel_microbatch_size must be 1 or more, got 0"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--metrics.straggler_windows", str(10**30)],
            "metrics.straggler_windows = 1000000000000000000000000000000 does not fit a 64-bit integer",
        ),
        (["--training.seed", str(-(2**70))], "training.seed = -1180591620717411303424 does not fit a 64-bit integer"),
        (["--comm.data_timeout_seconds", str(10**12)], "comm.data_timeout_seconds = 1000000000000 is more than a year"),
        (["--job.stop_grace_seconds", str(400 * 24 * 3600)], "job.stop_grace_seconds = 34560000 is more than a year"),
    ],
)
def test_numbers_that_would_overflow_after_launch_are_refused(argv, message):
    """Values past what the libraries that get them take (a deque's length, a C timeout, Python's timedelta) were
    accepted and overflowed once the job had started; every integer key must fit 64 bits and every *_seconds key a
    year, whatever the section."""
    assert message in error_of(argv)


def test_the_largest_numbers_that_fit_load(tmp_path):
    cfg = load_config(["--metrics.straggler_windows", str(2**63 - 1), "--comm.data_timeout_seconds", str(365 * 86400)])
    assert (cfg.metrics.straggler_windows, cfg.comm.data_timeout_seconds) == (2**63 - 1, 365 * 86400)
