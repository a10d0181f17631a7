"""MoE settings: what is accepted, and each refusal names the field, the value and the fix."""

from __future__ import annotations

import pytest

from megatron_logra.config import load_config

MOE = ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=32", "model.add_bias_linear=false"]


def _resolved(*overrides: str, world: int = 2):
    return load_config(None, list(overrides)).resolved(world)


def test_an_moe_model_with_expert_parallelism_resolves():
    cfg = _resolved(*MOE, "parallel.ep=2")
    assert (cfg.model.num_moe_experts, cfg.parallel.ep, cfg.parallel.dp) == (4, 2, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.ep=2"], "parallel.ep=2 splits experts, but the model has none"),
        (["model.moe_router_topk=4"], "model.moe_router_topk=4 only acts in an MoE model"),
        ([*MOE, "parallel.ep=3"], "parallel.ep=3 must divide model.num_moe_experts=4"),
        (["model.num_moe_experts=2", "model.moe_router_topk=3"],
         "model.moe_router_topk=3 exceeds model.num_moe_experts=2"),
        ([*MOE, "parallel.tp=2"], "needs parallel.sp=true"),
        ([*MOE, "optimizer.name=lora"], "optimizer.name=lora does not adapt experts"),
        ([*MOE, "model.moe_token_dispatcher=flex"], "model.moe_token_dispatcher='flex'"),
        (["model.moe_router_pre_softmax=true"],
         "model.moe_router_pre_softmax=True only acts in an MoE model"),
        ([*MOE, "model.moe_shared_expert_gate=true"],
         "model.moe_shared_expert_gate=true gates a shared expert, but there is none"),
    ],
)
def test_moe_settings_that_cannot_act_are_refused_with_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _resolved(*overrides)


@pytest.mark.parametrize("engine", ["megatron", "vllm"])
def test_an_moe_model_with_a_separate_rollout_engine_is_refused_up_front(engine):
    """The engine copied parallel.ep into its one data-parallel rank and policy sync refused the
    expert targets by name only once the run had started: refused at the config instead."""
    with pytest.raises(ValueError, match="model.num_moe_experts=4 with rollout.placement="
                                         "separate.*use rollout.placement=colocated"):
        load_config(None, [*MOE, "model.activation=swiglu", "model.normalization=RMSNorm",
                           "rollout.placement=separate", f"rollout.engine={engine}"],
                    command="rl").resolved(2, "rl")


def test_ep_must_divide_the_data_parallel_size():
    with pytest.raises(ValueError, match="must divide the data-parallel size 1"):
        _resolved(*MOE, "parallel.ep=2", world=1)
