"""The estimator's routed-expert terms (megatron_logra/memory/experts.py).

What the built optimizer holds per expert is checked against ``state_bytes.json`` of real runs
in tests/e2e/test_moe.py; here: the Megatron-scale table of docs/moe.md, the config mapping and
the refusals.
"""

from __future__ import annotations

import pytest

from megatron_logra.config import load_config
from megatron_logra.memory.experts import (
    EXPERT_PRESETS,
    ExpertShape,
    expert_shape_from_model_config,
    expert_state_bytes,
)
from megatron_logra.memory.shapes import GIB
from tests.torchrun import REPO

A3B = EXPERT_PRESETS["qwen3-30b-a3b"]
# docs/moe.md quotes its table to 0.1 GiB.
DOC_TABLE_GIB_TOL = 0.05


def _gib(breakdown: dict[str, float]) -> float:
    return sum(breakdown.values()) / GIB


def test_a3b_experts_hold_29b_parameters():
    # 48 layers x 128 experts x (fc1 [1536, 2048] + fc2 [2048, 768]).
    assert A3B.total_parameters() == 48 * 128 * (1536 * 2048 + 2048 * 768)
    assert round(A3B.total_parameters() / 1e9, 2) == 28.99


@pytest.mark.parametrize(("expert_dp", "adam_gib", "logra_gib", "lora_gib"),
                         [(1, 60.75, 18.20, 8.07), (2, 40.50, 18.20, 7.63)])
def test_a3b_expert_state_per_gpu_at_ep8_is_the_docs_table(expert_dp, adam_gib, logra_gib,
                                                          lora_gib):
    adam = expert_state_bytes(A3B, method="dense_adam", ep=8, expert_dp=expert_dp)
    logra = expert_state_bytes(A3B, method="logra", precision="fp32", ep=8, expert_dp=expert_dp)
    lora = expert_state_bytes(A3B, method="lora", ep=8, expert_dp=expert_dp, lora_rank=16)
    assert abs(_gib(adam) - adam_gib) < DOC_TABLE_GIB_TOL
    assert abs(_gib(logra) - logra_gib) < DOC_TABLE_GIB_TOL
    assert abs(_gib(lora) - lora_gib) < DOC_TABLE_GIB_TOL
    # Dense Adam's optimizer state is sharded over expert-DP; LoGRA's fp32 weights are not.
    assert adam["optimizer_state"] == 3 * 4 * A3B.total_parameters() / 8 / expert_dp
    assert logra["weights"] == 4 * A3B.total_parameters() / 8


def test_expert_tp_splits_every_expert_state_in_two():
    split = expert_state_bytes(A3B, method="logra", precision="fp32", ep=8, expert_tp=2)
    whole = expert_state_bytes(A3B, method="logra", precision="fp32", ep=8)
    assert split["weights"] == whole["weights"] / 2
    # fc1's rows and fc2's columns split; fc2's rows and fc1's columns do not.
    assert whole["sketches"] / 2 < split["sketches"] < whole["sketches"]


def test_expert_shape_counts_only_the_moe_layers():
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", [
        "parallel.tp=1", "model.num_layers=4", "model.num_moe_experts=4", "model.moe_layer_freq=2",
        "model.moe_ffn_hidden_size=32"])
    shape = expert_shape_from_model_config(cfg.model)
    assert (shape.moe_layers, shape.num_experts, shape.expert_ffn_hidden_size) == (2, 4, 32)


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="ep=3 must divide"):
        expert_state_bytes(A3B, method="logra", precision="fp32", ep=3)
    with pytest.raises(ValueError, match="method='sgd'"):
        expert_state_bytes(A3B, method="sgd")
    with pytest.raises(ValueError, match="precision='bf16_remainder'"):
        expert_state_bytes(A3B, method="logra", precision="bf16_remainder")
    with pytest.raises(ValueError, match="ExpertShape.num_experts"):
        ExpertShape(name="x", moe_layers=1, hidden_size=8, num_experts=0,
                    expert_ffn_hidden_size=8)
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", [])
    with pytest.raises(ValueError, match="model.num_moe_experts is unset"):
        expert_shape_from_model_config(cfg.model)
