"""The flat sketch buffer (views, slot order, single-process reduction) and the direction rules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_logra.direction import (
    DirectionContext,
    RowAdamDirection,
    SgdDirection,
    make_direction_rule,
)
from megatron_logra.row_adam import row_adam_direction
from megatron_logra.sketch_buffer import FlatSketchBuffer, SketchSlot

# Slots given in mixed order: two complete (column-parallel) and two TP-partial (row-parallel).
SLOTS = (
    SketchSlot("decoder.layers.0.self_attention.linear_proj", rows=6, sketch_rank=4,
               tp_partial=True),
    SketchSlot("decoder.layers.0.self_attention.linear_qkv", rows=9, sketch_rank=4,
               tp_partial=False),
    SketchSlot("decoder.layers.0.mlp.linear_fc2", rows=6, sketch_rank=4, tp_partial=True),
    SketchSlot("decoder.layers.0.mlp.linear_fc1", rows=12, sketch_rank=4, tp_partial=False),
)
TOTAL_NUMEL = sum(slot.rows * slot.sketch_rank for slot in SLOTS)


def _filled_buffer(seed: int) -> FlatSketchBuffer:
    buffer = FlatSketchBuffer(SLOTS, device="cpu")
    buffer.data.copy_(torch.randn(TOTAL_NUMEL, generator=torch.Generator().manual_seed(seed)))
    return buffer


# --------------------------------------------------------------------------- FlatSketchBuffer


def test_buffer_is_one_fp32_tensor_holding_every_slot():
    buffer = FlatSketchBuffer(SLOTS, device="cpu")
    assert buffer.data.dtype == torch.float32
    assert buffer.data.shape == (TOTAL_NUMEL,)
    assert buffer.nbytes == 4 * TOTAL_NUMEL
    assert torch.equal(buffer.data, torch.zeros(TOTAL_NUMEL))


def test_float64_buffer_for_reference_computations_has_float64_views():
    buffer = FlatSketchBuffer(SLOTS, device="cpu", dtype=torch.float64)
    assert buffer.nbytes == 8 * TOTAL_NUMEL
    assert all(view.dtype == torch.float64 for _, view in buffer.owned_items())


def test_views_share_storage_with_flat_buffer_and_tile_it_without_overlap():
    buffer = FlatSketchBuffer(SLOTS, device="cpu")
    for index, (slot, view) in enumerate(buffer.owned_items()):
        assert view.shape == (slot.rows, slot.sketch_rank)
        assert view.untyped_storage().data_ptr() == buffer.data.untyped_storage().data_ptr()
        view.fill_(float(index + 1))
    # Every element of .data was written by exactly one view, in slot order.
    expected = torch.cat(
        [torch.full((slot.numel,), float(i + 1)) for i, slot in enumerate(buffer.slots)]
    )
    assert torch.equal(buffer.data, expected)


def test_writing_a_view_changes_the_flat_data():
    buffer = FlatSketchBuffer(SLOTS, device="cpu")
    key = "decoder.layers.0.mlp.linear_fc2"
    buffer.view(key)[2, 3] = 5.0
    offset = 0
    for slot in buffer.slots:
        if slot.layer_key == key:
            break
        offset += slot.numel
    assert buffer.data[offset + 2 * 4 + 3].item() == 5.0
    assert buffer.data.count_nonzero().item() == 1


def test_complete_slots_precede_tp_partial_slots_in_given_order():
    buffer = FlatSketchBuffer(SLOTS, device="cpu")
    assert [slot.layer_key for slot in buffer.slots] == [
        "decoder.layers.0.self_attention.linear_qkv",
        "decoder.layers.0.mlp.linear_fc1",
        "decoder.layers.0.self_attention.linear_proj",
        "decoder.layers.0.mlp.linear_fc2",
    ]
    assert buffer.partial_start == 9 * 4 + 12 * 4
    # The partial segment starts exactly where the first partial slot's view starts.
    first_partial = buffer.view("decoder.layers.0.self_attention.linear_proj")
    first_partial.fill_(1.0)
    assert buffer.data[: buffer.partial_start].count_nonzero().item() == 0
    assert buffer.data[buffer.partial_start].item() == 1.0


def test_duplicate_layer_keys_raise_value_error():
    with pytest.raises(ValueError, match="duplicate layer keys"):
        FlatSketchBuffer([SLOTS[0], SLOTS[1], SLOTS[0]], device="cpu")


def test_zero_clears_every_view():
    buffer = _filled_buffer(0)
    buffer.zero_()
    for _, view in buffer.owned_items():
        assert torch.equal(view, torch.zeros_like(view))


def test_reduce_without_process_group_issues_no_collective_and_keeps_data():
    assert not dist.is_initialized()
    buffer = _filled_buffer(1)
    before = buffer.data.clone()
    issued = buffer.reduce_(dp_group=None, tp_group=None, tp_dp_group=None, tp_size=1)
    assert issued == 0
    assert torch.equal(buffer.data, before)


# --------------------------------------------------------------------------- direction rules


def test_sgd_direction_leaves_sketches_bit_identical():
    buffer = _filled_buffer(2)
    before = buffer.data.clone()
    rule = SgdDirection()
    rule.apply_(buffer, DirectionContext(step=1))
    assert torch.equal(buffer.data, before)
    assert dict(rule.state_tensors()) == {}


def test_row_adam_direction_rule_equals_row_adam_direction_per_slot_over_steps():
    buffer = FlatSketchBuffer(SLOTS, device="cpu")
    rule = RowAdamDirection(buffer, beta2=0.9, eps=1e-6)
    reference_moments = {slot.layer_key: torch.zeros(slot.rows) for slot in SLOTS}
    for step in (1, 2, 3):
        buffer.data.copy_(
            torch.randn(TOTAL_NUMEL, generator=torch.Generator().manual_seed(10 + step))
        )
        expected = {
            slot.layer_key: row_adam_direction(
                view.clone(), reference_moments[slot.layer_key], step=step, beta2=0.9, eps=1e-6
            )
            for slot, view in buffer.owned_items()
        }
        rule.apply_(buffer, DirectionContext(step=step))
        for slot, view in buffer.owned_items():
            # Same function, same fp32 inputs and operation order: identical bits.
            assert torch.equal(view, expected[slot.layer_key])
            assert torch.equal(rule.moment(slot.layer_key), reference_moments[slot.layer_key])


def test_row_adam_moments_are_views_of_one_flat_state_tensor_in_slot_order():
    buffer = _filled_buffer(3)
    rule = RowAdamDirection(buffer, beta2=0.9, eps=1e-6)
    state = rule.state_tensors()["row_second_moment"]
    assert state.shape == (sum(slot.rows for slot in SLOTS),)
    rule.apply_(buffer, DirectionContext(step=1))
    assert torch.equal(
        state, torch.cat([rule.moment(slot.layer_key) for slot in buffer.slots])
    )
    for slot in buffer.slots:
        assert (
            rule.moment(slot.layer_key).untyped_storage().data_ptr()
            == state.untyped_storage().data_ptr()
        )


@pytest.mark.parametrize("beta2, eps", [(1.0, 1e-8), (-0.5, 1e-8), (0.9, 0.0), (0.9, -1e-8)])
def test_row_adam_rule_rejects_bad_hyperparameters(beta2, eps):
    with pytest.raises(ValueError, match="logra.beta2" if eps > 0 else "logra.eps"):
        RowAdamDirection(FlatSketchBuffer(SLOTS, device="cpu"), beta2=beta2, eps=eps)


def test_make_direction_rule_builds_named_rules_and_rejects_unknown_names():
    buffer = FlatSketchBuffer(SLOTS, device="cpu")
    assert isinstance(make_direction_rule("sgd", buffer, beta2=0.9, eps=1e-8), SgdDirection)
    assert isinstance(
        make_direction_rule("row_adam", buffer, beta2=0.9, eps=1e-8), RowAdamDirection
    )
    with pytest.raises(ValueError, match="logra.direction='adamw'"):
        make_direction_rule("adamw", buffer, beta2=0.9, eps=1e-8)
