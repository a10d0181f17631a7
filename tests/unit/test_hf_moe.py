"""Qwen3 / Qwen3-MoE / Qwen2-MoE config.json mapping (no weights): the routing claim the
conversion rests on, the fields it derives, and what it refuses. The weights and logits are
tests/e2e/test_hf_conversion_moe.py."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.config import ModelConfig
from megatron_logra.mcore.conversion import (
    architecture_from_hf_config,
    hf_config_from_model_config,
    model_config_from_hf,
)

ROUTING_WEIGHT_TOL = 1e-15
"""float64: the two formulas differ only in the order of a few exp and sum operations."""
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 120, "hidden_size": 32,
             "intermediate_size": 64, "moe_intermediate_size": 24, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
             "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu",
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def test_softmax_top_k_renormalised_equals_top_k_then_softmax():
    """Qwen3-MoE's router (softmax over all experts, top k, divided by their sum) and
    Megatron's default (top k of the logits, softmax over them) pick the same experts with the
    same weights."""
    logits = torch.randn(4096, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    k = 8
    probs = torch.softmax(logits, dim=-1)
    hf_weights, hf_index = torch.topk(probs, k, dim=-1)
    hf_weights = hf_weights / hf_weights.sum(dim=-1, keepdim=True)
    top_logits, megatron_index = torch.topk(logits, k, dim=-1)
    megatron_weights = torch.softmax(top_logits, dim=-1)
    assert torch.equal(hf_index, megatron_index)
    assert float((hf_weights - megatron_weights).abs().max()) <= ROUTING_WEIGHT_TOL


def test_qwen3_moe_config_maps_to_qk_norms_and_experts():
    arch = architecture_from_hf_config(QWEN3_MOE)
    model = model_config_from_hf(arch, params_dtype="fp32")
    assert (model.qk_layernorm, model.num_moe_experts, model.moe_router_topk,
            model.moe_ffn_hidden_size, model.moe_layer_freq) == (True, 4, 2, 24, 1)
    names = arch.hf_names()
    assert "model.layers.1.self_attn.q_norm.weight" in names
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" not in names
    dense = architecture_from_hf_config({**QWEN3_MOE, "model_type": "qwen3"})
    assert dense.qk_norm and dense.moe is None
    assert model_config_from_hf(dense, params_dtype="fp32").num_moe_experts is None


def test_qwen2_moe_maps_to_pre_softmax_routing_and_a_gated_shared_expert():
    config = {**QWEN3_MOE, "model_type": "qwen2_moe", "norm_topk_prob": False,
              "shared_expert_intermediate_size": 40}
    config.pop("head_dim")
    arch = architecture_from_hf_config(config)
    model = model_config_from_hf(arch, params_dtype="fp32")
    assert (model.qk_layernorm, model.add_qkv_bias, model.moe_router_pre_softmax,
            model.moe_shared_expert_ffn_hidden_size, model.moe_shared_expert_gate) == (
        False, True, True, 40, True)
    assert "model.layers.0.mlp.shared_expert_gate.weight" in arch.hf_names()
    # Renormalised top-k (norm_topk_prob=true) is Megatron's default router in either family.
    assert not model_config_from_hf(architecture_from_hf_config(
        {**config, "norm_topk_prob": True}), params_dtype="fp32").moe_router_pre_softmax


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
        ({"head_dim": 16}, "head_dim=16 differs"),
    ],
)
def test_what_megatron_would_not_reproduce_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        architecture_from_hf_config({**QWEN3_MOE, **change})


def test_no_config_json_is_derived_for_q_k_norms_or_experts():
    for model in (ModelConfig(qk_layernorm=True), ModelConfig(num_moe_experts=4)):
        with pytest.raises(ValueError, match="pass the Qwen3 / Qwen3-MoE config.json"):
            hf_config_from_model_config(model, vocab_size=100, dtype=torch.float32)
