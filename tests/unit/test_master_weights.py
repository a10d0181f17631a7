"""Row-sharded exact masters (fp32 on the device, int16 remainders, fp32 on the host) and the
DP-sharded sketch layout (single process, no collectives)."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.bf16_remainder import round_to_bf16
from megatron_logra.master_weights import (
    MERGE_ROW_ALIGNMENT,
    HostMaster,
    RemainderMaster,
    RowShardedMaster,
    master_weights_mode,
)
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


def _three_masters(weight_rows: int = 16, cols: int = 24, *,
                   host_chunk_rows: int = MERGE_ROW_ALIGNMENT):
    """One bf16 start weight, three copies, one master store each (two stride blocks)."""
    generator = torch.Generator().manual_seed(2)
    start = torch.randn(weight_rows, cols, generator=generator).to(torch.bfloat16)
    shard = RowShard(weight_rows, stride=2, dp_size=1, dp_rank=0)
    weights = [start.clone() for _ in range(3)]
    masters = [RowShardedMaster(weights[0], shard), RemainderMaster(weights[1], shard),
               HostMaster(weights[2], shard, chunk_rows=host_chunk_rows)]
    return weights, masters, generator


def test_remainder_and_host_masters_give_the_dp_sharded_weights_bit_for_bit():
    """30 merges with weight decay, each of ~1e-3 relative size: the three stores hold the same
    fp32 masters and write the same bf16 weights after every merge. Two stride blocks of 197 rows:
    the host store merges each in an aligned chunk of 192 rows and one of 5, which does not divide
    the block and leaves a row outside every 4-row GEMM block, as the one-call merge does."""
    rows = 2 * (MERGE_ROW_ALIGNMENT + 5)
    weights, masters, generator = _three_masters(weight_rows=rows)
    assert len(masters[2]._chunks(weights[2])) == 4
    sketch_rank = 4
    for _ in range(30):
        direction = torch.randn(rows, sketch_rank, generator=generator)
        projection = torch.randn(sketch_rank, 24, generator=generator) / sketch_rank**0.5
        for weight, master in zip(weights, masters, strict=True):
            master.merge_(weight, direction, projection, lr=1e-3, weight_decay=0.1,
                          dp_group=None)
        assert torch.equal(weights[1], weights[0]) and torch.equal(weights[2], weights[0])
        want = masters[0].fp32_rows().view(torch.int32)
        for master in masters[1:]:
            assert torch.equal(master.fp32_rows().view(torch.int32), want)
    assert not torch.equal(weights[0], _three_masters(weight_rows=rows)[0][0])
    assert torch.equal(weights[0], round_to_bf16(masters[0].fp32_rows()))


def test_host_chunks_must_be_whole_multiples_of_the_merge_row_alignment():
    weight = torch.zeros(16, 24, dtype=torch.bfloat16)
    shard = RowShard(16, stride=2, dp_size=1, dp_rank=0)
    with pytest.raises(ValueError, match="multiple of 192 rows"):
        HostMaster(weight, shard, chunk_rows=3)


def test_each_store_loads_the_fp32_rows_another_wrote():
    """What a checkpoint does between modes: fp32 rows out of one store, into another."""
    weights, masters, generator = _three_masters()
    direction = torch.randn(16, 4, generator=generator)
    projection = torch.randn(4, 24, generator=generator)
    masters[1].merge_(weights[1], direction, projection, lr=1e-2, weight_decay=0.0,
                      dp_group=None)
    saved = masters[1].fp32_rows().clone()
    for master in (masters[0], masters[2]):
        master.load_(saved)
        assert torch.equal(master.fp32_rows(), saved)
    fresh_weight = weights[0].clone()
    fresh = RemainderMaster(fresh_weight, masters[1].shard)
    fresh.load_(masters[0].fp32_rows())
    assert torch.equal(fresh.fp32_rows().view(torch.int32), saved.view(torch.int32))
    assert torch.equal(fresh_weight, weights[1])


def test_device_bytes_per_owned_element_are_4_2_and_0_by_store():
    _, masters, _ = _three_masters()
    owned = 16 * 24
    device = [sum(t.numel() * t.element_size() for t in m.device_tensors()) for m in masters]
    host = [sum(t.numel() * t.element_size() for t in m.host_tensors()) for m in masters]
    assert device == [4 * owned, 2 * owned, 0] and host == [0, 0, 4 * owned]


@pytest.mark.parametrize(("requested", "dtype", "name"), [
    ("auto", torch.float32, "none"), ("auto", torch.bfloat16, "dp_sharded"),
    ("remainder", torch.bfloat16, "remainder"), ("host", torch.bfloat16, "host"),
])
def test_master_mode_is_chosen_once_from_the_setting_and_the_weight_dtype(requested, dtype,
                                                                           name):
    assert master_weights_mode(requested, dtype, merge_chunk_mib=1.0).name == name


@pytest.mark.parametrize("requested", ["dp_sharded", "remainder", "host"])
def test_bf16_master_modes_refuse_fp32_weights_naming_the_fix(requested):
    with pytest.raises(ValueError, match="master_weights=none"):
        master_weights_mode(requested, torch.float32, merge_chunk_mib=1.0)


def test_every_store_yields_its_fp32_rows_in_the_same_row_blocks():
    """Paper mode's weight norm reads the masters block by block: in every store the blocks
    are the owned fp32 rows, bit for bit and in order, split at the same rows (3 rows per
    block, which does not divide a stride block's 8, so blocks end at piece boundaries)."""
    _, masters, generator = _three_masters()
    want = torch.randn(16, 24, generator=generator)  # fp32 rows no bf16 weight holds alone
    for master in masters:
        master.load_(want)
    shapes = [tuple(b.shape) for b in masters[0].fp32_row_blocks(3)]
    assert shapes == [(3, 24), (3, 24), (2, 24)] * 2
    for master in masters:
        blocks = list(master.fp32_row_blocks(3))
        assert [tuple(b.shape) for b in blocks] == shapes
        assert torch.equal(torch.cat(blocks).view(torch.int32), want.view(torch.int32))
