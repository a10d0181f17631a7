"""Configuration: YAML and overrides are parsed to typed values, and every invalid setting fails
with a ValueError that names the field and the offending value."""

from __future__ import annotations

import re

import pytest

from megatron_logra.config import (
    TARGET_NAMES,
    Config,
    config_from_dict,
    load_config,
    parse_override,
)


def _raises_naming(fragments: list[str], fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert re.search(re.escape(fragment), message), (fragment, message)
    return message


# --------------------------------------------------------------------------- parsing


def test_defaults_validate():
    Config().validate()


def test_integer_override_parses_to_int():
    cfg = load_config(None, ["model.hidden_size=128", "model.ffn_hidden_size=512"])
    assert cfg.model.hidden_size == 128 and type(cfg.model.hidden_size) is int


def test_integral_float_override_parses_to_int():
    assert load_config(None, ["model.hidden_size=128.0"]).model.hidden_size == 128


@pytest.mark.parametrize("text, value", [("0.002", 0.002), ("1.0e-3", 1e-3), ("2", 2.0)])
def test_float_override_parses_to_float(text, value):
    cfg = load_config(None, [f"optimizer.lr={text}"])
    assert cfg.optimizer.lr == value and type(cfg.optimizer.lr) is float


def test_exponent_float_override_without_decimal_point_parses_to_float():
    # "1e-3" is how learning rates are written on command lines; YAML 1.1 loaders read it as a
    # string, so the config layer has to accept it as a number.
    assert load_config(None, ["optimizer.lr=1e-3"]).optimizer.lr == 1e-3


def test_exponent_float_in_yaml_file_without_decimal_point_parses_to_float(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("optimizer:\n  lr: 3e-4\n")
    assert load_config(path).optimizer.lr == 3e-4


@pytest.mark.parametrize("text, value", [("true", True), ("false", False)])
def test_bool_override_parses_to_bool(text, value):
    assert load_config(None, [f"logra.refresh={text}"]).logra.refresh is value


def test_comma_list_override_parses_to_target_list():
    cfg = load_config(None, ["logra.targets=linear_qkv, linear_fc2"])
    assert cfg.logra.targets == ["linear_qkv", "linear_fc2"]


def test_yaml_list_override_parses_to_target_list():
    cfg = load_config(None, ["logra.targets=[linear_proj, linear_fc1]"])
    assert cfg.logra.targets == ["linear_proj", "linear_fc1"]


def test_null_override_clears_optional_field():
    cfg = load_config(None, ["model.num_query_groups=2", "model.num_query_groups=null"])
    assert cfg.model.num_query_groups is None


def test_later_override_wins():
    assert load_config(None, ["train.steps=3", "train.steps=5"]).train.steps == 5


def test_parse_override_splits_dotted_key_and_yaml_value():
    assert parse_override("optimizer.clip_grad=0.5") == (("optimizer", "clip_grad"), 0.5)
    assert parse_override("run.dir=a=b") == (("run", "dir"), "a=b")
    assert parse_override("rl.loss.grpo.clip_low=0.3") == (("rl", "loss", "grpo", "clip_low"), 0.3)


def test_load_config_reads_yaml_file_and_applies_overrides_on_top(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "model:\n  hidden_size: 32\n  num_attention_heads: 2\n"
        "optimizer:\n  name: logra\n  lr: 0.005\n"
        "logra:\n  sketch_rank: 8\n  targets: [linear_qkv, linear_fc1]\n"
        "parallel:\n  sp: false\n"
        "train: null\n"
    )
    cfg = load_config(path, ["logra.sketch_rank=4"])
    assert cfg.model.hidden_size == 32
    assert cfg.model.num_attention_heads == 2
    assert cfg.optimizer.name == "logra"
    assert cfg.optimizer.lr == 0.005
    assert cfg.logra.targets == ["linear_qkv", "linear_fc1"]
    assert cfg.logra.sketch_rank == 4
    assert cfg.train.steps == Config().train.steps


def test_to_dict_round_trips_through_config_from_dict():
    cfg = load_config(None, ["parallel.tp=2", "logra.targets=linear_fc2", "optimizer.lr=0.5"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_resolved_fills_dp_from_world_size_without_changing_original():
    cfg = load_config(None, ["parallel.tp=2", "train.global_batch_size=16",
                             "train.micro_batch_size=2"])
    resolved = cfg.resolved(world_size=8)
    assert resolved.parallel.dp == 4
    assert resolved.num_microbatches == 16 // (2 * 4)
    assert cfg.parallel.dp is None


def test_resolved_accepts_matching_explicit_dp():
    assert load_config(None, ["parallel.dp=2"]).resolved(world_size=2).parallel.dp == 2


def test_num_microbatches_of_unresolved_config_raises_runtime_error():
    with pytest.raises(RuntimeError, match="resolved"):
        _ = Config().num_microbatches


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        # unknown section / key
        (["modle.hidden_size=3"], ["'modle'", "modle.hidden_size"]),
        (["model.hidden=3"], ["model.hidden"]),
        # wrong types
        (["model.hidden_size=abc"], ["model.hidden_size='abc'", "integer"]),
        (["model.hidden_size=true"], ["model.hidden_size=True", "integer"]),
        (["model.hidden_size=64.5"], ["model.hidden_size=64.5", "integer"]),
        (["parallel.sp=1"], ["parallel.sp=1", "true or false"]),
        (["optimizer.lr=fast"], ["optimizer.lr='fast'", "number"]),
        (["optimizer.lr=true"], ["optimizer.lr=True", "number"]),
        (["data.dir=3"], ["data.dir=3", "string"]),
        (["logra.targets=3"], ["logra.targets=3", "list"]),
        (["logra.targets=[1]"], ["logra.targets[0]=1", "string"]),
        # bad choices
        (["model.normalization=BatchNorm"], ["model.normalization='BatchNorm'"]),
        (["model.activation=relu"], ["model.activation='relu'"]),
        (["model.position_embedding=alibi"], ["model.position_embedding='alibi'"]),
        (["model.params_dtype=fp16"], ["model.params_dtype='fp16'"]),
        (["model.params_dtype=bf16", "logra.master_weights=none"],
         ["logra.master_weights=none", "model.params_dtype=bf16"]),
        (["logra.master_weights=dp_sharded"], ["logra.master_weights=dp_sharded", "fp32"]),
        (["logra.master_weights=remainder"], ["logra.master_weights=remainder", "fp32"]),
        (["logra.master_weights=host"], ["logra.master_weights=host", "fp32"]),
        (["model.params_dtype=bf16", "logra.merge_chunk_mib=8"],
         ["logra.merge_chunk_mib=8.0", "logra.master_weights=host"]),
        (["model.params_dtype=bf16", "logra.master_weights=host", "logra.merge_chunk_mib=0"],
         ["logra.merge_chunk_mib=0.0", "> 0"]),
        (["parallel.device=tpu"], ["parallel.device='tpu'"]),
        (["model.attention=flash"], ["model.attention='flash'"]),
        (["model.recompute=all"], ["model.recompute='all'"]),
        (["model.recompute=full", "model.recompute_method=even"],
         ["model.recompute_method='even'"]),
        (["model.recompute=full", "model.recompute_num_layers=0"],
         ["model.recompute_num_layers=0", "> 0"]),
        # a recompute key that cannot act is refused
        (["model.recompute_method=block"], ["model.recompute_method='block'", "recompute=full"]),
        (["model.recompute=selective", "model.recompute_num_layers=1"],
         ["model.recompute_num_layers=1", "recompute=full"]),
        (["model.recompute=full", "model.recompute_num_layers=2", "parallel.pp=2"],
         ["model.recompute_num_layers=2", "1 layer(s) of a pipeline stage"]),
        (["optimizer.name=logra", "logra.kl_control.enabled=true", "model.attention=te"],
         ["logra.kl_control.enabled=true", "model.attention=te"]),
        (["optimizer.name=adagrad"], ["optimizer.name='adagrad'"]),
        (["optimizer.lr_decay_style=step"], ["optimizer.lr_decay_style='step'"]),
        (["logra.mode=rpga"], ["logra.mode='rpga'"]),
        (["logra.update_factor_dtype=fp16"], ["logra.update_factor_dtype='fp16'"]),
        (["logra.update_ratio=0"], ["logra.update_ratio=0.0", "> 0"]),
        (["logra.kl_control.enabled=true"], ["logra.kl_control.enabled=true", "optimizer.name=logra"]),
        (["logra.kl_control.schedule_steps=1"], ["logra.kl_control.schedule_steps=1"]),
        (["logra.kl_control.temperature=0"], ["logra.kl_control.temperature=0.0"]),
        (["logra.distribution=uniform"], ["logra.distribution='uniform'"]),
        (["logra.direction=adamw"], ["logra.direction='adamw'"]),
        (["logra.native_optimizer=logra"], ["logra.native_optimizer='logra'"]),
        (["logra.targets=linear_qkv,lm_head"], ["logra.targets", "'lm_head'"]),
        (["logra.targets=linear_qkv,linear_qkv"], ["logra.targets", "duplicates"]),
        (["logra.targets="], ["logra.targets is empty"]),
        # non-positive / out of range
        (["model.hidden_size=0"], ["model.hidden_size=0", "> 0"]),
        (["model.num_layers=-2"], ["model.num_layers=-2", "> 0"]),
        (["model.init_method_std=0"], ["model.init_method_std=0.0", "> 0"]),
        (["model.num_query_groups=0"], ["model.num_query_groups=0", "> 0"]),
        (["parallel.tp=0"], ["parallel.tp=0", "> 0"]),
        (["parallel.dp=0"], ["parallel.dp=0", "> 0"]),
        (["train.steps=-1"], ["train.steps=-1", "> 0"]),
        (["train.micro_batch_size=0"], ["train.micro_batch_size=0", "> 0"]),
        (["train.seed=-1"], ["train.seed=-1", ">= 0"]),
        (["optimizer.lr=0"], ["optimizer.lr=0.0", "> 0"]),
        (["optimizer.weight_decay=-0.1"], ["optimizer.weight_decay=-0.1", ">= 0"]),
        (["optimizer.clip_grad=-1"], ["optimizer.clip_grad=-1.0", ">= 0"]),
        (["optimizer.adam_beta2=1"], ["optimizer.adam_beta2=1.0", "[0, 1)"]),
        (["optimizer.lr=0.01", "optimizer.min_lr=0.1"], ["optimizer.min_lr=0.1",
                                                         "optimizer.lr=0.01"]),
        (["logra.sketch_rank=0"], ["logra.sketch_rank=0", "> 0"]),
        (["logra.seed=-3"], ["logra.seed=-3", ">= 0"]),
        (["logra.beta2=1.0"], ["logra.beta2=1.0", "[0, 1)"]),
        (["logra.eps=0"], ["logra.eps=0.0", "> 0"]),
        (["data.dir="], ["data.dir is empty"]),
        (["data.format=prompts", "data.tokenizer="], ["data.tokenizer is empty"]),
        (["data.tokenizer=/tok"], ["data.tokenizer='/tok'", "data.format=prompts"]),
        (["model.vocab_size=0"], ["model.vocab_size=0", "> 0"]),
        (["run.dir="], ["run.dir is empty"]),
        # model shape
        (["model.hidden_size=60", "model.num_attention_heads=8"],
         ["model.hidden_size=60", "model.num_attention_heads=8"]),
        (["model.num_query_groups=3"], ["model.num_attention_heads=4", "model.num_query_groups=3"]),
        # layout
        (["parallel.pp=4"], ["model.num_layers=2", "parallel.pp * parallel.vpp = 4"]),
        (["parallel.vpp=2"], ["parallel.vpp=2", "parallel.pp > 1"]),
        (["parallel.sp=true"], ["parallel.sp=true", "parallel.tp"]),
        (["parallel.tp=8"], ["model.num_attention_heads=4", "parallel.tp=8"]),
        (["parallel.tp=4", "model.num_query_groups=2"],
         ["model.num_query_groups=2", "parallel.tp=4"]),
        (["parallel.tp=4", "model.ffn_hidden_size=250"],
         ["model.ffn_hidden_size=250", "parallel.tp=4"]),
        (["parallel.tp=4", "model.make_vocab_size_divisible_by=130"],
         ["model.make_vocab_size_divisible_by=130", "parallel.tp=4"]),
        (["parallel.tp=2", "parallel.sp=true", "model.seq_length=63"],
         ["model.seq_length=63", "parallel.tp=2"]),
    ],
)
def test_invalid_setting_raises_value_error_naming_field_and_value(overrides, fragments):
    _raises_naming(fragments, load_config, None, overrides)


def test_sequence_length_not_divisible_by_tp_is_fine_without_sequence_parallelism():
    load_config(None, ["parallel.tp=2", "model.seq_length=63"])


@pytest.mark.parametrize(
    "text, fragment",
    [("model.hidden_size", "model.hidden_size"), ("hidden_size=3", "hidden_size"),
     ("a.b.c=1", "a.b.c"), (".x=1", ".x")],
)
def test_malformed_override_raises_value_error_naming_it(text, fragment):
    _raises_naming([fragment], parse_override, text)


def test_non_mapping_section_raises_value_error_naming_it():
    _raises_naming(["'model'", "3"], config_from_dict, {"model": 3})


def test_missing_config_file_raises_value_error_naming_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    _raises_naming([str(missing)], load_config, missing)


def test_non_mapping_config_file_raises_value_error_naming_path(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    _raises_naming([str(path), "mapping"], load_config, path)


def test_world_size_not_divisible_by_model_parallel_size_raises_value_error():
    cfg = load_config(None, ["parallel.tp=2"])
    _raises_naming(["world size 3", "parallel.tp * parallel.cp * parallel.pp = 2"], cfg.resolved, 3)


def test_explicit_dp_mismatching_world_size_raises_value_error():
    cfg = load_config(None, ["parallel.dp=4"])
    _raises_naming(["parallel.dp=4", "world size 2", "dp=2"], cfg.resolved, 2)


@pytest.mark.parametrize(
    "gbs, mbs, world, fragment",
    [(8, 3, 1, "3 * 1"), (8, 4, 4, "4 * 4"), (6, 1, 4, "1 * 4")],
)
def test_global_batch_not_multiple_of_micro_batch_times_dp_raises_value_error(
    gbs, mbs, world, fragment
):
    cfg = load_config(None, [f"train.global_batch_size={gbs}", f"train.micro_batch_size={mbs}"])
    _raises_naming([f"train.global_batch_size={gbs}", fragment], cfg.resolved, world)


def test_target_names_are_the_four_megatron_linears():
    assert TARGET_NAMES == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
