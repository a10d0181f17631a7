"""Bad input never reaches a run and never ends in a traceback: every numeric field refuses NaN
and infinity, values outside their meaningful range are refused naming the field (and the
layer), YAML and override syntax errors name the file or override and the line, and the CLI turns
all of it into exit code 2. A property-based test feeds the parser arbitrary overrides."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_logra.cli import main as cli_main
from megatron_logra.config import Config, config_from_dict, load_config


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """``(dotted key, annotation)`` of every leaf field of the schema."""
    hints = typing.get_type_hints(cls)
    out = []
    for item in dataclasses.fields(cls):
        if item.name == "provided":
            continue
        annotation = hints[item.name]
        key = f"{prefix}{item.name}"
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            out += _leaves(annotation, f"{key}.")
        else:
            out.append((key, annotation))
    return out


def _numeric(annotation: typing.Any) -> type | None:
    options = typing.get_args(annotation) or (annotation,)
    for kind in (float, int):
        if kind in options:
            return kind
    return None


NUMERIC_KEYS = [(key, _numeric(a)) for key, a in _leaves(Config) if _numeric(a) is not None]
ALL_KEYS = [key for key, _ in _leaves(Config)]


def _raises_naming(fragments: list[str], fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    for fragment in fragments:
        assert re.search(re.escape(fragment), str(info.value)), (fragment, str(info.value))
    return str(info.value)


def test_the_schema_has_numeric_fields_to_check():
    # Guards the parametrisation below against an empty list after a schema change.
    assert len(NUMERIC_KEYS) > 60


# YAML's own spellings and the plain strings Python's float() reads.
@pytest.mark.parametrize("value", [".nan", "-.inf", "inf"])
@pytest.mark.parametrize("key, kind", NUMERIC_KEYS)
def test_every_numeric_field_refuses_nan_and_infinity_naming_the_field(key, kind, value):
    expected = "finite" if kind is float else "integer"
    _raises_naming([key, expected], load_config, None, [f"{key}={value}"])


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["optimizer.lr=inf"], ["optimizer.lr", "finite"]),
        (["optimizer.weight_decay=nan"], ["optimizer.weight_decay", "finite"]),
        (["optimizer.clip_grad=nan"], ["optimizer.clip_grad", "finite"]),
        (["logra.eps=nan"], ["logra.eps", "finite"]),
        (["logra.mode=paper", "logra.update_ratio=nan"], ["logra.update_ratio", "finite"]),
        (["rl.sampling.temperature=nan"], ["rl.sampling.temperature", "finite"]),
        (["logra.kl_control.temperature=nan"], ["logra.kl_control.temperature", "finite"]),
        (["logra.update_ratio=1.5"], ["logra.update_ratio=1.5", "< 1"]),
        (["optimizer.name=logra", "model.hidden_size=128", "logra.sketch_rank=100000"],
         ["logra.sketch_rank=100000", "linear_qkv", "input width 128", "<= 128"]),
        (["optimizer.name=logra", "model.ffn_hidden_size=32", "logra.sketch_rank=48",
          "logra.targets=linear_fc2"], ["logra.sketch_rank=48", "linear_fc2", "32"]),
        (["optimizer.name=lora", "lora.lora_rank=65"], ["lora.lora_rank=65", "64"]),
    ],
)
def test_out_of_range_values_are_refused_naming_field_value_and_fix(overrides, fragments):
    _raises_naming(fragments, load_config, None, overrides)


def test_rl_refuses_max_new_tokens_that_leave_no_room_and_other_commands_carry_them():
    def rl_run():
        return load_config(None, ["rl.sampling.max_new_tokens=64"], command="rl").resolved(1, "rl")

    _raises_naming(["rl.sampling.max_new_tokens=64", "model.seq_length=64"], rl_run)
    load_config(None, ["rl.sampling.max_new_tokens=64"], command="sft").resolved(1, "sft")


def test_identity_sketches_and_dense_runs_are_not_bound_by_the_sketch_rank():
    load_config(None, ["optimizer.name=logra", "logra.distribution=identity",
                       "logra.sketch_rank=100000"])
    load_config(None, ["optimizer.name=adam", "logra.sketch_rank=100000"])


def test_a_corrupt_yaml_file_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_size: 64\n  heads: [4\noptimizer:\n  lr: 1\n")
    message = _raises_naming([str(path), "not valid YAML", "line"], load_config, path)
    assert re.search(r"line [45]", message), message


def test_a_malformed_override_value_names_the_override():
    _raises_naming(["logra.targets=[linear_qkv", "not valid YAML", "column"],
                   load_config, None, ["logra.targets=[linear_qkv"])


@pytest.mark.parametrize(
    "write, fragment",
    [(lambda p: p.write_text("model: {hidden_size: [1, 2\n"), "not valid YAML"),
     (lambda p: p.write_bytes(b"\xff\xfe\x00model"), "UTF-8"),
     (lambda p: p.write_text("optimizer:\n  lr: .nan\n"), "optimizer.lr")],
)
def test_the_cli_turns_bad_files_into_exit_code_2_with_a_message(tmp_path, capsys, write,
                                                                  fragment):
    path = tmp_path / "cfg.yaml"
    write(path)
    assert cli_main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and fragment in err and "Traceback" not in err


def test_the_cli_turns_a_malformed_override_into_exit_code_2(capsys):
    assert cli_main(["train", "configs/demo_cpu.yaml", "logra.targets=[linear_qkv"]) == 2
    assert "logra.targets=[linear_qkv" in capsys.readouterr().err


_KEY = st.one_of(
    st.sampled_from(ALL_KEYS),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.", min_size=0, max_size=24),
)
_VALUE = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["nan", ".inf", "-1", "0", "1e309", "[", "]", "{a: 1", "null", "true",
                     "[linear_qkv", "'", '"x', "!!python/object:os.system", "0x10", "1_000",
                     "- a", ": b", "&a *a"]),
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_KEY, _VALUE, st.booleans()), max_size=4),
       st.sampled_from(["train", "sft", "rl"]), st.integers(min_value=1, max_value=8))
def test_no_override_ends_in_anything_but_a_config_or_a_value_error(items, command, world):
    overrides = [f"{key}={value}" if has_equals else key for key, value, has_equals in items]
    try:
        load_config(None, overrides, command=command).resolved(world, command)
    except ValueError:
        pass


_YAML_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                         st.floats(allow_nan=True, allow_infinity=True))
_YAML_TREE = st.recursive(
    _YAML_SCALAR,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.one_of(st.sampled_from(["model", "rl", "loss", "lr", "name",
                                                   "kl_control", "sampling", "tp"]),
                                  st.text(max_size=6)), children, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["model", "parallel", "optimizer", "logra", "rl",
                                        "train", "data", "run", "checkpoint", "bogus"]),
                       _YAML_TREE, max_size=4))
def test_no_yaml_document_ends_in_anything_but_a_config_or_a_value_error(data):
    try:
        config_from_dict(data)
    except ValueError:
        pass
