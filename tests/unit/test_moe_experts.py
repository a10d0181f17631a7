"""Experts that received no token in a step: zero sketch, no direction, row moments unchanged
(issue 16 item 2), on the real sketch buffer and RowAdam rule the LoGRA optimizer uses."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.direction import DirectionContext, PaperRowAdamDirection, RowAdamDirection
from megatron_logra.mcore.optimizer.expert_state import (
    hold_idle_experts_,
    idle_experts,
    row_moments_of,
)
from megatron_logra.sketch_buffer import FlatSketchBuffer, SketchSlot

ROWS, SKETCH_RANK, TOKENS = 6, 4, 5


class _Target:
    """The two fields of a SketchTarget that the idle-expert rule reads."""

    def __init__(self, layer_key: str, expert: bool):
        self.layer_key, self.expert = layer_key, expert


KEYS = ("decoder.layers.0.mlp.experts.0.linear_fc1", "decoder.layers.0.mlp.experts.1.linear_fc1")
TARGETS = [_Target(KEYS[0], True), _Target(KEYS[1], True)]


def _step(buffer, rule, step, active, generator):
    buffer.zero_()
    for key in active:  # backward of an expert that got tokens; the others never accumulate
        buffer.accumulate_(key, torch.randn(TOKENS, ROWS, generator=generator),
                           torch.randn(TOKENS, SKETCH_RANK, generator=generator))
    buffer.reduce_(dp_group=None, tp_group=None, tp_dp_group=None, tp_size=1)
    idle = idle_experts(TARGETS, buffer)
    saved = row_moments_of(rule, idle)
    rule.apply_(buffer, DirectionContext(step=step))
    hold_idle_experts_(rule, buffer, saved, idle)
    return idle


@pytest.mark.parametrize("rule_class", [RowAdamDirection, PaperRowAdamDirection])
def test_an_expert_without_tokens_gets_no_direction_and_keeps_its_row_moments(rule_class):
    """Library and paper RowAdam alike (the paper's per-layer statistics, floor and norm
    restoration are each expert's own: an idle expert's zero sketch must not reach them)."""
    generator = torch.Generator().manual_seed(0)
    buffer = FlatSketchBuffer([SketchSlot(k, ROWS, SKETCH_RANK, False, expert=True)
                               for k in KEYS], device="cpu")
    rule = rule_class(buffer, beta2=0.95, eps=1e-8)
    assert _step(buffer, rule, 1, KEYS, generator) == []
    after_first = {k: rule.moment(k).clone() for k in KEYS}
    assert all(bool((m > 0).all()) for m in after_first.values())
    idle = _step(buffer, rule, 2, KEYS[:1], generator)
    assert idle == [KEYS[1]]
    assert buffer.received_tokens(KEYS[0]) == TOKENS and buffer.received_tokens(KEYS[1]) == 0
    assert torch.equal(rule.moment(KEYS[1]), after_first[KEYS[1]])  # not decayed by beta2
    assert not torch.equal(rule.moment(KEYS[0]), after_first[KEYS[0]])
    assert bool((buffer.owned_view(KEYS[1]) == 0).all())
    assert bool((buffer.owned_view(KEYS[0]) != 0).any())


def test_expert_slots_are_laid_out_after_the_dense_ones_and_sharded_over_expert_dp():
    """Sharded masters: dense rows are split over DP, an expert's over its expert-data-parallel
    group (here 2 ranks, or 1 at EP = DP, where each rank owns all rows of its experts); every
    owner's pieces tile the layer's rows once."""
    slots = [SketchSlot("e", ROWS, SKETCH_RANK, False, expert=True),
             SketchSlot("d", ROWS, SKETCH_RANK, False)]
    buffer = FlatSketchBuffer(slots, device="cpu")
    assert [s.layer_key for s in buffer.slots] == ["d", "e"]
    for expert_dp in (1, 2):
        owned = {"d": [], "e": []}
        for rank in range(2):
            sharded = FlatSketchBuffer(slots, device="cpu", dp_size=2, dp_rank=rank,
                                       expert_dp_size=expert_dp, expert_dp_rank=rank % expert_dp)
            assert sharded.owned_view("d").shape == (ROWS // 2, SKETCH_RANK)
            assert sharded.owned_view("e").shape == (ROWS // expert_dp, SKETCH_RANK)
            for key in owned:
                owned[key] += [r for lo, hi in sharded.shards[key].ranges() for r in range(lo, hi)]
            # The rows a backward accumulates cover the layer once, whoever owns them.
            pieces = sharded.pieces("e")
            assert sorted(r for p in pieces for r in range(p.row_start, p.row_end)) == list(
                range(ROWS))
        assert sorted(owned["d"]) == list(range(ROWS))
        assert sorted(owned["e"]) == sorted(list(range(ROWS)) * (2 // expert_dp))
    with pytest.raises(ValueError, match="shard both or neither"):
        FlatSketchBuffer(slots, device="cpu", expert_dp_size=2, expert_dp_rank=0)
