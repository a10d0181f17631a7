"""Low-rank policy sync (megatron_logra.sync): the engine's shadow replays the trainer's merges
bit for bit, refuses out-of-order updates, and the wire, checksum and byte counts say what they
claim. The trainer here is the optimizer's own merge code on plain tensors (fp32 weights, and
bf16 weights with fp32 masters sharded by rows over two simulated DP ranks); the real
LoGRAOptimizer's records are replayed in tests/distributed/test_sync_replay.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_logra.bf16_remainder import round_to_bf16
from megatron_logra.master_weights import RowShardedMaster
from megatron_logra.memory.shapes import preset
from megatron_logra.projection import generate_projection, projection_key
from megatron_logra.row_sharding import RowShard
from megatron_logra.sketch import apply_low_rank_update_
from megatron_logra.sync.checksum import mismatched_weights, weight_checksum, weight_checksums
from megatron_logra.sync.records import (
    DenseUpdate,
    FactorPiece,
    LowRankUpdate,
    combine_rank_records,
    full_sync_buckets,
)
from megatron_logra.sync.shadow import EngineShadow
from megatron_logra.sync.sizes import model_sync_bytes, sync_bytes
from megatron_logra.sync.wire import decode, encode
from tests.torchrun import REPO, torchrun_env

KEY = "decoder.layers.0.mlp.linear_fc1"
NAME = f"{KEY}.weight"
ROWS, COLS, SKETCH_RANK, SEED = 16, 24, 4, 7
NUM_UPDATES = 20
# Bucket small enough that the two parameters of the tests travel in separate buckets.
SMALL_BUCKET_BYTES = 256


def _projection(update_count: int, dtype: torch.dtype) -> torch.Tensor:
    key = projection_key(SEED, update_count - 1, KEY)
    proj = generate_projection(key, SKETCH_RANK, 0, COLS, "rademacher")
    return proj.to(dtype).float()  # as LoGRAOptimizer._projection for its compute dtype


def _record(update_count: int, pieces, *, lr: float, weight_decay: float,
            projection_dtype: str = "float32") -> LowRankUpdate:
    return LowRankUpdate(
        layer_key=KEY, update_count=update_count, seed=SEED, projection_count=update_count - 1,
        distribution="rademacher", sketch_rank=SKETCH_RANK, in_features=COLS,
        projection_dtype=projection_dtype, lr=lr, weight_decay=weight_decay,
        pieces=tuple(pieces),
    )


def _engine(weights: dict[str, torch.Tensor], served_dtype: torch.dtype) -> EngineShadow:
    engine = EngineShadow([NAME], served_dtype=served_dtype)
    for bucket in full_sync_buckets(weights, update_count=0, bucket_bytes=SMALL_BUCKET_BYTES):
        engine.apply(decode(encode(bucket, wire_dtype="fp32")))
    return engine


def _step_sizes(update: int) -> tuple[float, float]:
    # A changing lr (as a schedule) so the scalars on the wire matter; decay as library mode.
    return 1e-2 * (1.0 + 0.05 * update), 0.1


def test_shadow_equals_fp32_trainer_weights_bit_for_bit_over_20_updates():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(ROWS, COLS, generator=generator)
    bias = torch.randn(ROWS, generator=generator)
    engine = _engine({NAME: weight, "bias": bias}, torch.float32)
    for update in range(1, NUM_UPDATES + 1):
        lr, wd = _step_sizes(update)
        factor = torch.randn(ROWS, SKETCH_RANK, generator=generator)
        apply_low_rank_update_(weight, factor, _projection(update, torch.float32), lr=lr,
                               weight_decay=wd)
        bias.add_(torch.randn(ROWS, generator=generator), alpha=1e-3)
        record = _record(update, [FactorPiece(((0, ROWS),), 0, COLS, factor.clone())], lr=lr,
                         weight_decay=wd)
        engine.apply(decode(encode(record, wire_dtype="fp32")))
        engine.apply(decode(encode(DenseUpdate("bias", update, bias.clone()), wire_dtype="fp32")))
    assert torch.equal(engine.served[NAME], weight)
    assert torch.equal(engine.served["bias"], bias)
    assert not mismatched_weights(weight_checksums([(NAME, weight), ("bias", bias)]),
                                  engine.checksums())


def test_shadow_equals_bf16_trainer_weights_with_row_sharded_masters_over_20_updates():
    """Two DP ranks own stride-2 row chunks of a gated fc1 ([gate; up]); bf16 weights, bf16
    factors on the wire (the paper mode's rounded factor, lr = 1)."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(ROWS, COLS, generator=generator).to(torch.bfloat16)
    shards = [RowShard(rows=ROWS, stride=2, dp_size=2, dp_rank=d) for d in range(2)]
    masters = [RowShardedMaster(weight, shard) for shard in shards]
    full_master = weight.float()
    engine = _engine({NAME: full_master}, torch.bfloat16)
    for update in range(1, NUM_UPDATES + 1):
        per_rank = []
        for shard, master in zip(shards, masters, strict=True):
            factor = (1e-2 * torch.randn(shard.owned_rows, SKETCH_RANK, generator=generator))
            factor = factor.to(torch.bfloat16).float()
            master.apply_update_(factor, _projection(update, torch.bfloat16), lr=1.0,
                                 weight_decay=0.0)
            piece = FactorPiece(shard.ranges(), 0, COLS, factor)
            per_rank.append([_record(update, [piece], lr=1.0, weight_decay=0.0,
                                     projection_dtype="bfloat16")])
            # What RowShardedMaster.publish_ all-gathers: each rank's rows, cast to bf16.
            start = 0
            for lo, hi in shard.ranges():
                weight[lo:hi] = master.master_OI[start : start + hi - lo].to(torch.bfloat16)
                start += hi - lo
        (record,) = combine_rank_records(per_rank)
        engine.apply(decode(encode(record, wire_dtype="bf16")))
    assert torch.equal(engine.served[NAME], weight)
    assert engine.served[NAME].dtype == torch.bfloat16


def test_shadow_refuses_repeated_and_out_of_order_updates_naming_layer_and_counts():
    engine = _engine({NAME: torch.zeros(ROWS, COLS), "bias": torch.zeros(ROWS)}, torch.float32)
    piece = FactorPiece(((0, ROWS),), 0, COLS, torch.ones(ROWS, SKETCH_RANK))
    engine.apply(_record(1, [piece], lr=1.0, weight_decay=0.0))
    before = engine.masters[NAME].clone()
    with pytest.raises(RuntimeError, match=rf"{KEY}: expected update_count 2, got 1 \(repeated"):
        engine.apply(_record(1, [piece], lr=1.0, weight_decay=0.0))
    with pytest.raises(RuntimeError, match=rf"{KEY}: expected update_count 2, got 4 \(a gap"):
        engine.apply(_record(4, [piece], lr=1.0, weight_decay=0.0))
    outside = FactorPiece(((0, ROWS // 2), (ROWS, ROWS + ROWS // 2)), 0, COLS,
                          torch.ones(ROWS, SKETCH_RANK))
    with pytest.raises(RuntimeError, match="outside the shadow"):
        engine.apply(_record(2, [piece, outside], lr=1.0, weight_decay=0.0))
    engine.apply(DenseUpdate("bias", 2, torch.ones(ROWS)))
    with pytest.raises(RuntimeError, match="got update_count 2, it already holds update 2"):
        engine.apply(DenseUpdate("bias", 2, torch.ones(ROWS)))
    assert torch.equal(engine.masters[NAME], before)


def test_a_record_of_an_unknown_projection_distribution_is_refused_whole_at_decode():
    """Every engine rank decodes the whole record, but regenerates A only for the pieces its
    shard holds: an unknown distribution refused there would be refused by some ranks only."""
    piece = FactorPiece(((0, ROWS),), 0, COLS, torch.ones(ROWS, SKETCH_RANK))
    record = _record(1, [piece], lr=1.0, weight_decay=0.0)
    payload = encode(record, wire_dtype="fp32").replace(b'"rademacher"', b'"rademachex"')
    with pytest.raises(ValueError, match=f"{KEY}: projection distribution 'rademachex'"):
        decode(payload)


def test_combining_rank_records_keeps_one_copy_of_replicated_pieces():
    factor = torch.ones(ROWS, SKETCH_RANK)
    replica = [_record(1, [FactorPiece(((0, ROWS),), 0, COLS, factor)], lr=1.0, weight_decay=0.0)]
    (record,) = combine_rank_records([replica, replica])
    assert len(record.pieces) == 1
    other = [_record(1, [FactorPiece(((0, ROWS),), 0, COLS, 2 * factor)], lr=1.0,
                     weight_decay=0.0)]
    with pytest.raises(ValueError, match="replicas of .* differ"):
        combine_rank_records([replica, other])


def test_full_sync_buckets_out_of_order_are_refused():
    buckets = full_sync_buckets({NAME: torch.zeros(ROWS, COLS), "bias": torch.zeros(ROWS)},
                                update_count=3, bucket_bytes=SMALL_BUCKET_BYTES)
    assert len(buckets) == 2
    engine = EngineShadow([NAME], served_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="bucket 1 of 2 .* out of order"):
        engine.apply(buckets[1])


def test_bf16_wire_refuses_a_factor_it_would_round():
    factor = torch.full((ROWS, SKETCH_RANK), 1.0 + 2.0**-12)  # not representable in bf16
    record = _record(1, [FactorPiece(((0, ROWS),), 0, COLS, factor)], lr=1.0, weight_decay=0.0)
    with pytest.raises(ValueError, match="not exact in wire_dtype=bf16"):
        encode(record, wire_dtype="bf16")


def test_wire_round_trip_keeps_factor_and_scalars_bit_for_bit():
    factor = torch.randn(ROWS, SKETCH_RANK, generator=torch.Generator().manual_seed(2))
    record = _record(1, [FactorPiece(((0, ROWS),), 0, COLS, factor)], lr=0.1 / 3.0,
                     weight_decay=1e-3 / 7.0)
    back = decode(encode(record, wire_dtype="fp32"))
    assert (back.lr, back.weight_decay) == (record.lr, record.weight_decay)
    assert torch.equal(back.pieces[0].factor_OR, factor)


def test_checksum_detects_a_one_ulp_change():
    weight = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))
    changed = weight.clone()
    changed[5, 7] = torch.nextafter(changed[5, 7], torch.tensor(float("inf")))
    assert weight_checksum(weight) == weight_checksum(weight.clone())
    assert weight_checksum(changed) != weight_checksum(weight)
    bf16 = weight.to(torch.bfloat16)
    bumped = bf16.clone()
    bumped[0, 0] = torch.nextafter(bumped[0, 0], torch.tensor(float("inf"),
                                                               dtype=torch.bfloat16))
    assert weight_checksum(bumped) != weight_checksum(bf16)


def test_sync_bytes_of_low_rank_factor_and_full_weight():
    assert sync_bytes((3584, 18944), 256, "bf16") == 3584 * 256 * 2
    assert sync_bytes((3584, 18944), None, "bf16") == 3584 * 18944 * 2
    assert sync_bytes((3584, 18944), 256, "fp32") == 2 * sync_bytes((3584, 18944), 256, "bf16")


def test_paper_mode_ships_only_factors_and_library_mode_adds_dense_non_targets():
    shape = preset("qwen2.5-7b")
    paper = model_sync_bytes(shape, sketch_rank=256, wire_dtype="bf16", non_targets_train=False)
    library = model_sync_bytes(shape, sketch_rank=256, wire_dtype="bf16", non_targets_train=True)
    assert paper["low_rank_total"] == paper["targets_low_rank"]
    assert library["low_rank_total"] - paper["low_rank_total"] == library["non_targets_dense"]
    assert paper["full_total"] == shape.total_parameters() * 2


def test_sync_bytes_tool_reports_paper_and_library_ratios_for_the_7b_config():
    result = subprocess.run(
        [sys.executable, "tools/sync_bytes.py", "configs/qwen2.5-7b.yaml"], cwd=REPO,
        env=torchrun_env(), capture_output=True, text=True, timeout=60, check=True,
    )
    bf16_row = next(line for line in result.stdout.splitlines() if "| bf16 |" in line)
    assert bf16_row.rstrip(" |").endswith("| 21.4 | 5.3")
    # The engine's shadow per rank: the targets' fp32 masters (26.10 GB at TP=1) over the
    # engine's TP size, plus their bf16 cast for a bf16 engine.
    shadow_rows = [line for line in result.stdout.splitlines() if line.startswith("| qwen2.5-7b |")]
    assert shadow_rows[0] == "| qwen2.5-7b | 1 | 26.10 GB | 39.15 GB |"
    assert shadow_rows[2] == "| qwen2.5-7b | 4 | 6.53 GB | 9.79 GB |"


def test_bf16_served_weights_round_exact_ties_as_the_trainer_masters_do():
    # fp32 values exactly halfway between two bf16 neighbours (low 16 bits 0x8000): torch's cast
    # rounds them to even, the trainer's masters (round_to_bf16) away from zero.
    low_bits = torch.full((ROWS, COLS), 0x8000, dtype=torch.int32)
    high_bits = torch.arange(ROWS * COLS, dtype=torch.int32).reshape(ROWS, COLS) + 0x3F80
    ties = ((high_bits << 16) | low_bits).view(torch.float32)
    assert not torch.equal(ties.to(torch.bfloat16), round_to_bf16(ties))  # the cases differ
    engine = _engine({NAME: ties}, torch.bfloat16)
    assert torch.equal(engine.served[NAME], round_to_bf16(ties))
