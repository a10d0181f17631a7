"""The data section (data.prompt, keys, split files) validates without side effects, and several
config files are laid over each other key by key."""

from __future__ import annotations

import re

import pytest
import yaml

from megatron_logra.config import load_config

PROMPTS = ["data.tokenizer=tok"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.prompt.system_prompt=Be brief."],
     "data.prompt.system_prompt='Be brief.' needs data.prompt.chat_template=true"),
    (["data.prompt.template_kwargs.enable_thinking=false"],
     "data.prompt.template_kwargs={'enable_thinking': False} needs data.prompt.chat_template=true"),
    (["data.prompt.user_template=Solve it."],
     "data.prompt.user_template='Solve it.' has no {prompt} for the row's prompt"),
    (["data.train_file=train.csv"], "data.train_file='train.csv' is not a problem file"),
    (["data.answer_key=reward_model."], "data.answer_key='reward_model.' is not a key"),
    (["data.prompt.template_kwargs=[1]"], "data.prompt.template_kwargs=[1] must be a mapping"),
])
def test_data_settings_that_cannot_act_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config("configs/demo_rl_cpu.yaml", [*PROMPTS, *overrides], command="rl")


def test_a_chat_template_needs_the_models_tokenizer_for_prompt_data_only():
    with pytest.raises(ValueError, match=re.escape(
            "data.prompt.chat_template=true applies a Hugging Face tokenizer's chat template; "
            "set data.tokenizer")):
        load_config("configs/demo_rl_cpu.yaml", ["data.prompt.chat_template=true"], command="rl")
    # A preset carries its rl and data.prompt sections into `train` (corpus), where they do not
    # act, as rl's sections do not.
    assert load_config("configs/qwen2.5-7b.yaml").data.prompt.chat_template


def test_template_kwargs_take_a_mapping_or_one_entry_per_dotted_key():
    cfg = load_config("configs/demo_rl_cpu.yaml", [
        *PROMPTS, "data.prompt.chat_template=true", "data.prompt.template_kwargs={a: 1}",
        "data.prompt.template_kwargs.enable_thinking=false"], command="rl")
    assert cfg.data.prompt.template_kwargs == {"a": 1, "enable_thinking": False}


def test_later_config_files_override_earlier_ones_key_by_key(tmp_path):
    # A converted model's model.yaml after a preset: its architecture and checkpoint win, the
    # preset keeps what model.yaml does not set (seq_length, attention, recompute, the rest).
    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text(yaml.safe_dump({"model": {
        "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 256, "vocab_size": 400, "params_dtype": "fp32",
        "init_checkpoint": "/ckpt/model"}}))
    cfg = load_config(["configs/qwen2.5-7b.yaml", model_yaml],
                      ["logra.master_weights=auto", "logra.sketch_rank=16",
                       "model.seq_length=1024"])
    preset = load_config("configs/qwen2.5-7b.yaml")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.vocab_size,
            cfg.model.init_checkpoint) == (2, 128, 400, "/ckpt/model")
    assert (cfg.model.attention, cfg.model.recompute, cfg.model.rotary_base) == (
        preset.model.attention, preset.model.recompute, preset.model.rotary_base)
    assert cfg.model.seq_length == 1024  # the overrides come last
    # The preset's rl section rides along in a train run; rl itself refuses the short window.
    with pytest.raises(ValueError, match="rl.sampling.max_new_tokens=3072 leaves no room"):
        cfg.resolved(8, "rl")
    assert cfg.rl == preset.rl and cfg.data == preset.data and cfg.parallel == preset.parallel
    assert "model.init_checkpoint" in cfg.provided and "rl.prompts_per_step" in cfg.provided
