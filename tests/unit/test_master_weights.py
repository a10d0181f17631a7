"""Row-sharded fp32 masters and the DP-sharded sketch layout (single process, no collectives)."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.master_weights import RowShardedMaster
from megatron_logra.row_sharding import RowShard
from megatron_logra.sketch import apply_low_rank_update_
from megatron_logra.sketch_buffer import FlatSketchBuffer, SketchSlot

BF16_EPS = 2.0**-8
"""bf16 keeps 8 significant bits: relative spacing 2^-8 at the top of a binade."""


def test_row_shard_ranges_partition_every_block_among_dp_ranks():
    shard = RowShard(rows=24, stride=2, dp_size=3, dp_rank=0)
    assert shard.block_rows == 12 and shard.chunk_rows == 4 and shard.owned_rows == 8
    covered = sorted(r for d in range(3) for lo, hi in shard.ranges(d) for r in range(lo, hi))
    assert covered == list(range(24))
    assert shard.ranges(1) == ((4, 8), (16, 20))


def test_row_shard_refuses_uneven_split_naming_the_fix():
    with pytest.raises(ValueError, match="divisible by the data-parallel size"):
        RowShard(rows=10, stride=2, dp_size=2, dp_rank=0)


def _slots() -> list[SketchSlot]:
    return [
        SketchSlot("decoder.layers.0.mlp.linear_fc1", rows=16, sketch_rank=4, tp_partial=False,
                   stride=2),
        SketchSlot("decoder.layers.0.self_attention.linear_qkv", rows=12, sketch_rank=4,
                   tp_partial=False),
        SketchSlot("decoder.layers.0.mlp.linear_fc2", rows=8, sketch_rank=4, tp_partial=True),
    ]


@pytest.mark.parametrize("dp_size", [2, 4])
def test_sharded_layout_accumulates_exactly_what_the_replicated_layout_does(dp_size):
    """Every row lands in exactly one piece, and the owned view of each DP rank holds that
    rank's rows (block by block) with the values the replicated buffer holds for them."""
    generator = torch.Generator().manual_seed(0)
    replicated = FlatSketchBuffer(_slots(), device="cpu", dtype=torch.float64)
    sharded = [
        FlatSketchBuffer(_slots(), device="cpu", dtype=torch.float64, dp_size=dp_size, dp_rank=d)
        for d in range(dp_size)
    ]
    for slot in _slots():
        grad_output = torch.randn(10, slot.rows, generator=generator, dtype=torch.float64)
        projected = torch.randn(10, slot.sketch_rank, generator=generator, dtype=torch.float64)
        replicated.accumulate_(slot.layer_key, grad_output, projected)
        for buffer in sharded:
            buffer.accumulate_(slot.layer_key, grad_output, projected)
    for d, buffer in enumerate(sharded):
        assert buffer.data.numel() == replicated.data.numel()
        for slot in _slots():
            rows = [r for lo, hi in buffer.shards[slot.layer_key].ranges() for r in range(lo, hi)]
            assert torch.equal(buffer.owned_view(slot.layer_key),
                               replicated.view(slot.layer_key)[rows]), (d, slot.layer_key)
            covered = sorted(r for p in buffer.pieces(slot.layer_key)
                             for r in range(p.row_start, p.row_end))
            assert covered == list(range(slot.rows))


def test_sharded_owned_segments_are_contiguous_per_region_and_hold_owned_views():
    buffer = FlatSketchBuffer(_slots(), device="cpu", dp_size=2, dp_rank=1)
    segments = buffer.owned_segments()
    assert len(segments) == 2  # complete region, partial region
    for segment in segments:
        segment.fill_(7.0)
    for slot in _slots():
        assert bool((buffer.owned_view(slot.layer_key) == 7.0).all())
    assert float(buffer.data.sum()) == 7.0 * sum(s.numel() for s in segments)


def test_bf16_weight_keeps_updates_of_1e4_relative_size_through_the_fp32_master():
    """The reason masters exist: 100 updates of 1e-4 relative size move a bf16 weight by ~1%
    through the master, while merging them into the bf16 weight directly loses all of them."""
    generator = torch.Generator().manual_seed(1)
    rows, cols, sketch_rank, steps, relative_step = 8, 32, 4, 100, 1e-4
    start = torch.randn(rows, cols, generator=generator).to(torch.bfloat16)
    reference = start.float().clone()
    naive = start.clone()
    weight = start.clone()
    master = RowShardedMaster(weight, RowShard(rows, 1, 1, 0))
    projection = torch.randn(sketch_rank, cols, generator=generator) / sketch_rank**0.5
    direction = torch.randn(rows, sketch_rank, generator=generator)
    # lr such that every step changes the weight by exactly 1e-4 of its norm.
    lr = relative_step * float(start.float().norm() / (direction @ projection).norm())
    for _ in range(steps):
        apply_low_rank_update_(reference, direction, projection, lr=lr)
        naive -= (lr * direction @ projection).to(torch.bfloat16)
        master.apply_update_(direction, projection, lr=lr, weight_decay=0.0)
        master.publish_(weight, dp_group=None)
    moved = (reference - start.float()).norm() / start.float().norm()
    assert 0.5e-2 < float(moved) < 2e-2
    # Through the master the bf16 weight is the fp32 trajectory rounded once.
    assert torch.equal(weight, reference.to(torch.bfloat16))
    # Merged into bf16 directly, nearly every element never changed.
    unchanged = float((naive == start).float().mean())
    assert unchanged > 0.9
    assert float((weight.float() - reference).abs().max()) <= BF16_EPS * float(
        reference.abs().max()
    )
