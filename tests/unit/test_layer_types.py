"""Which layer types the product builds and sketches, and the refusals of the others on CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_logra.config import ModelConfig
from megatron_logra.mcore.models.gpt import gpt_layer_spec
from megatron_logra.mcore.models.moe import expert_index_offset
from megatron_logra.mcore.models.targets import SUPPORTED_LAYERS, check_supported_layer

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def _module(kind: str, **children: torch.nn.Module) -> torch.nn.Module:
    module = type(kind, (torch.nn.Module,), {})()
    for name, child in children.items():
        module.add_module(name, child)
    return module


def _layer(core_attention: str) -> torch.nn.Module:
    attention = _module("SelfAttention", core_attention=_module(core_attention))
    return _module("TransformerLayer", self_attention=attention, mlp=_module("MLP"))


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed here")
def test_te_attention_without_transformer_engine_raises_value_error_naming_field_and_fix():
    with pytest.raises(ValueError, match=r"model\.attention=te.*model\.attention=sdpa"):
        gpt_layer_spec(ModelConfig(attention="te"), sequence_parallel=False, layers_per_chunk=1)


@pytest.mark.parametrize("attention", sorted(SUPPORTED_LAYERS["self_attention.core_attention"]))
def test_layer_with_a_supported_core_attention_is_accepted(attention):
    check_supported_layer(_layer(attention), 0)


def test_layer_with_another_core_attention_is_refused_naming_the_layer_and_the_choices():
    with pytest.raises(TypeError, match=r"decoder\.layers\.3\.self_attention\.core_attention "
                                        r"is a FlashThing; LoGRA supports SDPAttention"):
        check_supported_layer(_layer("FlashThing"), 3)


def test_moe_layer_is_accepted_and_another_mlp_refused():
    layer = _layer("SDPAttention")
    layer.mlp = _module("MoELayer")
    check_supported_layer(layer, 0)
    layer.mlp = _module("TEFusedMLP")
    with pytest.raises(TypeError, match=r"decoder\.layers\.0\.mlp is a TEFusedMLP"):
        check_supported_layer(layer, 0)


def test_experts_other_than_sequential_mlp_are_refused():
    """Grouped-GEMM experts (TEGroupedMLP, GPU) have no per-expert linears to sketch yet."""
    with pytest.raises(TypeError, match="expected SequentialMLP experts, got TEGroupedMLP"):
        expert_index_offset(_module("TEGroupedMLP"))


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_cpu_layer_specs_build_the_chosen_core_attention(attention):
    spec = gpt_layer_spec(ModelConfig(attention=attention), sequence_parallel=False,
                          layers_per_chunk=1)
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.__name__ == {"sdpa": "SDPAttention", "local": "PackedDotProductAttention"}[attention]
