"""A checkpoint's model against the run's: every model field that changes what the model
computes is compared (a field added later reads as its default from a checkpoint written before
it existed), and a real difference is refused by name; the other fields may differ."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_logra.config import load_config
from megatron_logra.config.model import (
    MODEL_FIELDS_ACTING_WITH,
    MODEL_FUNCTION_FIELDS,
    MODEL_RUNTIME_FIELDS,
    ModelConfig,
)
from megatron_logra.mcore.checkpointing.checkpoint import _check_model_matches

DENSE = ["model.num_query_groups=2"]
MOE = ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=64",
       "model.moe_shared_expert_ffn_hidden_size=64"]
# A value other than the base run's for every field that decides what the model computes (the
# base: the default model, with DENSE or MOE), each a valid config.
OTHER_VALUE: dict[str, tuple[list[str], str]] = {
    "num_layers": (DENSE, "model.num_layers=4"),
    "hidden_size": (DENSE, "model.hidden_size=128"),
    "num_attention_heads": (DENSE, "model.num_attention_heads=8"),
    "num_query_groups": (DENSE, "model.num_query_groups=4"),
    "ffn_hidden_size": (DENSE, "model.ffn_hidden_size=512"),
    "normalization": (DENSE, "model.normalization=RMSNorm"),
    "activation": (DENSE, "model.activation=swiglu"),
    "position_embedding": (DENSE, "model.position_embedding=learned_absolute"),
    "rotary_base": (DENSE, "model.rotary_base=1000000"),
    "add_bias_linear": (DENSE, "model.add_bias_linear=false"),
    "add_qkv_bias": (DENSE, "model.add_qkv_bias=true"),
    "qk_layernorm": (DENSE, "model.qk_layernorm=true"),
    "untie_embeddings": (DENSE, "model.untie_embeddings=false"),
    "layernorm_epsilon": (DENSE, "model.layernorm_epsilon=1e-6"),
    "make_vocab_size_divisible_by": (DENSE, "model.make_vocab_size_divisible_by=64"),
    "params_dtype": (DENSE, "model.params_dtype=bf16"),
    "num_moe_experts": (MOE, "model.num_moe_experts=8"),
    "moe_router_topk": (MOE, "model.moe_router_topk=1"),
    "moe_ffn_hidden_size": (MOE, "model.moe_ffn_hidden_size=128"),
    "moe_shared_expert_ffn_hidden_size": (MOE, "model.moe_shared_expert_ffn_hidden_size=128"),
    "moe_router_pre_softmax": (MOE, "model.moe_router_pre_softmax=true"),
    "moe_shared_expert_gate": (MOE, "model.moe_shared_expert_gate=true"),
    "moe_layer_freq": (MOE, "model.moe_layer_freq=2"),
}


def _resolved(overrides: list[str]):
    return load_config(None, overrides).resolved(1)


def _check(saved_cfg, run_cfg, *, drop: str | None = None) -> None:
    saved = saved_cfg.to_dict()
    if drop is not None:
        del saved["model"][drop]  # as a checkpoint written before the field existed
    _check_model_matches(saved, run_cfg, Path("ckpt"), check_optimizer=False)


def test_every_model_field_is_either_compared_or_said_why_not():
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not set(MODEL_FUNCTION_FIELDS) & set(MODEL_RUNTIME_FIELDS)
    assert set(MODEL_FUNCTION_FIELDS) | set(MODEL_RUNTIME_FIELDS) == fields
    assert set(MODEL_FIELDS_ACTING_WITH) <= set(MODEL_FUNCTION_FIELDS)


@pytest.mark.parametrize("name", [*MODEL_FUNCTION_FIELDS])
def test_a_checkpoint_of_another_model_is_refused_naming_the_field(name):
    if name == "seq_length":  # compared only as the learned position table's rows
        base, other = ["model.position_embedding=learned_absolute"], "model.seq_length=128"
    else:
        base, other = OTHER_VALUE[name]
    saved, run = _resolved(base), _resolved([*base, other])
    message = (f"model.{name}: checkpoint {getattr(saved.model, name)!r} vs run "
               f"{getattr(run.model, name)!r}")
    with pytest.raises(ValueError, match=f"different model.*{message.replace('.', '[.]')}"):
        _check(saved, run)


def test_a_field_that_does_not_act_in_either_model_may_differ():
    # rope: the sequence length is no tensor's shape; learned positions: no rotary base.
    _check(_resolved(["model.seq_length=64"]), _resolved(["model.seq_length=128"]))
    learned = ["model.position_embedding=learned_absolute"]
    _check(_resolved([*learned, "model.rotary_base=10000"]),
           _resolved([*learned, "model.rotary_base=500000"]))


@pytest.mark.parametrize("override", ["model.init_method_std=0.01", "model.attention=local",
                                      "model.recompute=selective"])
def test_a_runtime_field_may_differ(override):
    _check(_resolved([]), _resolved([override]))


@pytest.mark.parametrize("name", ["qk_layernorm", "rotary_base", "layernorm_epsilon",
                                  "moe_router_pre_softmax"])
def test_a_checkpoint_without_a_later_field_matches_a_run_with_its_default(name):
    base = MOE if name.startswith("moe_") else []
    cfg = _resolved(base)
    _check(cfg, cfg, drop=name)


def test_a_checkpoint_without_q_k_norms_is_refused_for_a_run_with_them():
    old, run = _resolved([]), _resolved(["model.qk_layernorm=true"])
    with pytest.raises(ValueError, match="model.qk_layernorm: checkpoint False vs run True"):
        _check(old, run, drop="qk_layernorm")
