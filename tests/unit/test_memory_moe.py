"""The whole-model memory estimate of an MoE GPT (no torch beyond loading a config): the
config's experts reach the shape, the persistent state is the dense part plus the experts'
(memory/experts.py) split over EP, and what is not modelled or not built is refused by name.
Its agreement with measured steps is tests/unit/test_estimate_vs_measured_moe.py."""

from __future__ import annotations

import pytest

from megatron_logra.config import load_config
from megatron_logra.memory.estimate import (
    KLProbe,
    dense_adam_memory,
    estimate_all,
    logra_memory,
    lora_memory,
    stage_parameters,
)
from megatron_logra.memory.experts import expert_shape_of, expert_state_bytes
from megatron_logra.memory.shapes import Layout, ModelShape, MoESpec, shape_from_model_config

MOE = MoESpec(num_experts=8, topk=2, expert_ffn_hidden_size=48, shared_expert_ffn_hidden_size=32,
              layer_freq=2)
SHAPE = ModelShape(name="tiny-moe", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                   num_attention_heads=4, num_query_groups=2, head_dim=16, vocab_size=256,
                   make_vocab_size_divisible_by=1, moe=MOE)
BUILT = Layout(seq_length=128, attention="sdpa", recompute="none", dp=2)


def test_an_moe_config_reaches_the_estimators_shape():
    cfg = load_config(None, [
        "model.num_layers=4", "model.num_moe_experts=8", "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=48", "model.moe_shared_expert_ffn_hidden_size=32",
        "model.moe_layer_freq=2", "model.add_bias_linear=false"]).resolved(1)
    shape = shape_from_model_config(cfg.model, vocab_size=100)
    assert shape.moe == MOE
    assert shape.layer_kinds() == ((False, 2), (True, 2))


def test_parameters_count_attention_router_shared_and_every_expert_once():
    h = 64
    attention = (64 + 2 * 32) * h + h * 64
    dense_mlp = 2 * 128 * h + h * 128
    shared = 2 * 32 * h + h * 32
    expert = 2 * 48 * h + h * 48
    norms = 2 * h
    layers = (2 * (attention + dense_mlp + norms)
              + 2 * (attention + shared + 8 * h + 8 * expert + norms))
    assert SHAPE.total_parameters() == layers + 2 * 256 * h + h  # untied embeddings, final norm
    # The stage's non-expert parameters plus the experts' are the whole model (tp = pp = 1).
    params = stage_parameters(SHAPE, Layout())
    assert params.targets + params.non_targets + expert_shape_of(SHAPE).total_parameters() == (
        SHAPE.total_parameters())


@pytest.mark.parametrize("ep", [1, 2])
def test_persistent_state_is_the_dense_part_plus_the_experts_split_over_ep(ep):
    layout = Layout(seq_length=128, attention="sdpa", recompute="none", dp=2, ep=ep)
    dense = stage_parameters(SHAPE, layout)
    experts = expert_state_bytes(expert_shape_of(SHAPE), method="dense_adam", ep=ep,
                                 expert_dp=2 // ep, precision="fp32")
    adam = dense_adam_memory(SHAPE, layout, precision="fp32")
    non_expert = dense.targets + dense.non_targets
    assert adam.weights == 4 * non_expert + experts["weights"]
    assert adam.optimizer_state == 8 * non_expert / 2 + experts["optimizer_state"]
    logra = logra_memory(SHAPE, layout, precision="fp32")
    assert logra.projections > expert_state_bytes(
        expert_shape_of(SHAPE), method="logra", ep=ep, expert_dp=2 // ep,
        precision="fp32")["projections"] > 0


def test_the_routed_copies_raise_the_activations_with_top_k():
    wider = ModelShape(**{**SHAPE.__dict__, "moe": MoESpec(**{**MOE.__dict__, "topk": 4})})
    base = dense_adam_memory(SHAPE, BUILT, precision="fp32")
    more = dense_adam_memory(wider, BUILT, precision="fp32")
    assert more.persistent == base.persistent
    assert more.activations + more.temporaries > base.activations + base.temporaries


@pytest.mark.parametrize(
    ("estimate", "message"),
    [
        (lambda: lora_memory(SHAPE, BUILT, precision="fp32"), "LoRA is refused for MoE"),
        (lambda: logra_memory(SHAPE, BUILT, precision="fp32", non_targets="frozen",
                              paper_mode=True), "paper mode .* is not modelled for experts"),
        (lambda: logra_memory(SHAPE, BUILT, precision="bf16_remainder"),
         "precision='bf16_remainder' is not estimated for experts"),
        (lambda: logra_memory(SHAPE, BUILT, precision="fp32", kl_probe=KLProbe(1, 64)),
         "KL probe's forward-mode pass through an MoE layer is not modelled"),
        (lambda: dense_adam_memory(SHAPE, Layout(seq_length=128, dp=2), precision="fp32"),
         "set Layout.attention"),
        (lambda: dense_adam_memory(SHAPE, Layout(seq_length=128, pp=2, attention="sdpa"),
                                   precision="fp32"), "pipeline stages with experts are not"),
        (lambda: Layout(dp=2, ep=4), "Layout.ep=4 must divide Layout.dp=2"),
        (lambda: dense_adam_memory(SHAPE, Layout(dp=3, ep=3, attention="sdpa"),
                                   precision="fp32"), "num_experts=8 is not divisible by ep=3"),
    ],
)
def test_what_is_not_modelled_or_not_built_is_refused_by_name(estimate, message):
    with pytest.raises(ValueError, match=message):
        estimate()


def test_estimate_all_leaves_lora_out_of_an_moe_model():
    assert sorted(estimate_all(SHAPE, BUILT)) == ["dense_adam", "logra"]
