"""What a command derives from the config, once: rl's batch is its rollouts and its KL
temperature the sampling one; an explicit setting that disagrees is refused, never overwritten.
Also: nested keys, the command defaults, and the old flat keys naming their new place."""

from __future__ import annotations

import re

import pytest

from megatron_logra.config import COMMAND_DEFAULTS, load_config


def _raises_naming(fragments: list[str], fn, *args, **kwargs) -> None:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    for fragment in fragments:
        assert re.search(re.escape(fragment), str(info.value)), (fragment, str(info.value))


def test_rl_derives_the_global_batch_from_prompts_and_samples():
    cfg = load_config(None, ["rl.prompts_per_step=6", "rl.samples_per_prompt=2",
                             "train.micro_batch_size=3"], command="rl")
    assert cfg.resolved(1, "rl").train.global_batch_size == 12


def test_rl_refuses_an_explicit_global_batch_that_disagrees():
    cfg = load_config(None, ["rl.prompts_per_step=6", "train.global_batch_size=8"],
                      command="rl")
    _raises_naming(["train.global_batch_size=8", "rl.prompts_per_step", "= 6"],
                   cfg.resolved, 1, "rl")


def test_rl_accepts_an_explicit_global_batch_that_agrees():
    cfg = load_config(None, ["rl.prompts_per_step=8", "train.global_batch_size=8"],
                      command="rl")
    assert cfg.resolved(1, "rl").train.global_batch_size == 8


def test_supervised_keeps_its_own_global_batch():
    cfg = load_config(None, ["rl.prompts_per_step=6", "train.global_batch_size=8"])
    assert cfg.resolved(1, "train").train.global_batch_size == 8


def test_rl_kl_temperature_is_the_sampling_temperature():
    cfg = load_config(None, ["rl.sampling.temperature=0.7"], command="rl")
    assert cfg.logra.kl_control.temperature is None
    assert cfg.resolved(1, "rl").logra.kl_control.temperature == 0.7


def test_rl_refuses_a_kl_temperature_that_differs_from_the_sampling_one():
    cfg = load_config(None, ["rl.sampling.temperature=0.7",
                             "logra.kl_control.temperature=1.0"], command="rl")
    _raises_naming(["logra.kl_control.temperature=1.0", "rl.sampling.temperature=0.7"],
                   cfg.resolved, 1, "rl")


def test_supervised_kl_temperature_is_one_unless_set():
    assert load_config(None).resolved(1).logra.kl_control.temperature == 1.0
    cfg = load_config(None, ["logra.kl_control.temperature=0.5"])
    assert cfg.resolved(1).logra.kl_control.temperature == 0.5


def test_rl_refuses_the_supervised_mismatch_input():
    cfg = load_config(None, ["logra.kl_control.mismatch_input=1e-3"], command="rl")
    _raises_naming(["logra.kl_control.mismatch_input", "supervised"], cfg.resolved, 1, "rl")


def test_rl_refuses_virtual_pipeline_stages():
    cfg = load_config(None, ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"],
                      command="rl")
    _raises_naming(["parallel.vpp=2", "rollout engine"], cfg.resolved, 2, "rl")


def test_nested_override_reaches_its_section():
    cfg = load_config(None, ["rl.loss.name=grpo", "rl.samples_per_prompt=2",
                             "rl.loss.grpo.clip_low=0.3", "rl.reward.math_verify.num_workers=3"])
    assert cfg.rl.loss.name == "grpo" and cfg.rl.loss.grpo.clip_low == 0.3
    assert cfg.rl.reward.math_verify.num_workers == 3


def test_command_defaults_sit_between_the_file_and_the_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("data:\n  format: corpus\nrun:\n  save_model: false\n")
    assert COMMAND_DEFAULTS["sft"] == ("data.format=prompts", "run.save_model=true")
    cfg = load_config(path, command="sft")
    assert cfg.data.format == "prompts" and cfg.run.save_model is True
    assert load_config(path, ["run.save_model=false"], command="sft").run.save_model is False
    # rl saves its final policy too, unless told not to.
    assert load_config(path, command="rl").run.save_model is True
    assert load_config(path, ["run.save_model=false"], command="rl").run.save_model is False


def test_provided_keys_are_recorded_and_not_serialised(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("optimizer:\n  lr: 0.5\n")
    cfg = load_config(path, ["logra.kl_control.kl_budget=1e-3"])
    assert {"optimizer.lr", "logra.kl_control.kl_budget"} <= cfg.provided
    assert "provided" not in cfg.to_dict()


@pytest.mark.parametrize(
    "override, new_key",
    [("rl.max_new_tokens=4", "rl.sampling.max_new_tokens"),
     ("rl.eval_interval=3", "rl.eval.interval"),
     ("rl.clip_low=0.1", "rl.loss.grpo.clip_low"),
     ("rl.failure_reward=-1", "rl.advantages.paper.failure_reward"),
     ("kl_control.kl_budget=1e-3", "logra.kl_control.kl_budget"),
     ("lora.rank=4", "lora.lora_rank")],
)
def test_a_flat_key_of_the_old_layout_names_its_new_place(override, new_key):
    _raises_naming([override.split("=")[0], new_key], load_config, None, [override])


@pytest.mark.parametrize(
    "override, inner_key",
    [("logra.kl_control=true", "logra.kl_control.enabled"), ("rl.loss=grpo", "rl.loss.name"),
     ("rl.reward=math_verify", "rl.reward.name")],
)
def test_a_value_for_a_section_names_the_key_inside_it(override, inner_key):
    _raises_naming([override.split("=")[0], "mapping", inner_key], load_config, None, [override])
