"""An engine rank's TP-shard shadow (megatron_logra.sync.shard): fed the full-tensor records a
full shadow is fed, it holds 1/TP of the targets' bytes (replicated tensors whole) and serves
exactly the full shadow's slice, bit for bit, whether a trainer piece lies inside the shard
(trainer TP >= engine TP) or the shard holds part of it (a TP=1 trainer's whole weights, DP row
chunks of [gate; up] that cross the engine's shards). The full shadow equals the trainer's
weights (tests/unit/test_sync.py, tests/distributed/test_sync_replay.py), so this is the
trainer's bits too."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.row_sharding import RowShard
from megatron_logra.sync.records import (
    DenseUpdate,
    FactorPiece,
    FullSyncBucket,
    LowRankUpdate,
    full_sync_buckets,
)
from megatron_logra.sync.shadow import EngineShadow
from megatron_logra.sync.shard import TensorShard, megatron_tp_shard
from megatron_logra.sync.wire import decode, encode

SKETCH_RANK, SEED, NUM_UPDATES = 4, 11, 6
# name -> (full shape, Megatron's partition dim, partition stride): a layer's four targets as
# Megatron shards them (qkv by whole query groups, fc1 as [gate_t; up_t], the row-parallel
# proj / fc2 by input columns), a vocab-parallel embedding and a replicated norm (dense).
TENSORS = {
    "decoder.layers.0.self_attention.linear_qkv.weight": ((48, 24), 0, 1),
    "decoder.layers.0.self_attention.linear_proj.weight": ((24, 24), 1, 1),
    "decoder.layers.0.mlp.linear_fc1.weight": ((64, 24), 0, 2),
    "decoder.layers.0.mlp.linear_fc2.weight": ((24, 32), 1, 1),
    "embedding.word_embeddings.weight": ((40, 24), 0, 1),
    "decoder.final_layernorm.weight": ((24,), None, 1),
}
TARGETS = [name for name in TENSORS if ".linear_" in name]
# The trainer layouts whose pieces travel, one per update in turn.
TRAINER_LAYOUTS = ("tp1", "tp2", "dp2", "tp4")


def _pieces(name: str, layout: str, generator: torch.Generator) -> list[FactorPiece]:
    (rows, cols), dim, stride = TENSORS[name]
    if layout == "dp2":  # DP-sharded masters: each rank's row chunk of every stride block
        shards = [RowShard(rows=rows, stride=stride, dp_size=2, dp_rank=d) for d in range(2)]
        return [FactorPiece(s.ranges(), 0, cols, torch.randn(s.owned_rows, SKETCH_RANK,
                                                              generator=generator))
                for s in shards]
    tp = {"tp1": 1, "tp2": 2, "tp4": 4}[layout]
    factor = torch.randn(rows, SKETCH_RANK, generator=generator)  # row-parallel: replicated
    pieces = []
    for rank in range(tp):
        shard = megatron_tp_shard((rows, cols), dim, stride, rank, tp)
        col_lo, col_hi = shard.columns(cols)
        if dim == 0:
            factor = torch.randn(shard.num_rows(), SKETCH_RANK, generator=generator)
        pieces.append(FactorPiece(shard.row_ranges, col_lo, col_hi, factor.clone()))
    return pieces


def _update(name: str, count: int, layout: str, generator: torch.Generator) -> LowRankUpdate:
    return LowRankUpdate(
        layer_key=name.removesuffix(".weight"), update_count=count, seed=SEED,
        projection_count=count - 1, distribution="rademacher", sketch_rank=SKETCH_RANK,
        in_features=TENSORS[name][0][1], projection_dtype="float32", lr=1e-2 * (1 + 0.1 * count),
        weight_decay=0.1, pieces=tuple(_pieces(name, layout, generator)))


def _stream() -> list[bytes]:
    """A full sync, then NUM_UPDATES updates of every target (and dense non-targets)."""
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=generator) for name, (shape, _, _) in
             TENSORS.items()}
    stream = [encode(b, wire_dtype="fp32")
              for b in full_sync_buckets(state, update_count=0, bucket_bytes=2048)]
    for count in range(1, NUM_UPDATES + 1):
        layout = TRAINER_LAYOUTS[(count - 1) % len(TRAINER_LAYOUTS)]
        stream += [encode(_update(name, count, layout, generator), wire_dtype="fp32")
                   for name in TARGETS]
        stream += [encode(DenseUpdate(name, count, torch.randn(TENSORS[name][0],
                                                               generator=generator)),
                          wire_dtype="fp32")
                   for name in TENSORS if name not in TARGETS]
    return stream


def _shards(tp_rank: int, tp_size: int) -> dict[str, TensorShard]:
    return {name: megatron_tp_shard(shape, dim, stride, tp_rank, tp_size)
            for name, (shape, dim, stride) in TENSORS.items()}


def _fed(stream: list[bytes], served_dtype: torch.dtype, shards=None) -> EngineShadow:
    shadow = EngineShadow(TARGETS, served_dtype=served_dtype, shards=shards)
    for payload in stream:
        shadow.apply(decode(payload))
    return shadow


@pytest.mark.parametrize("served_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("engine_tp", [2, 4])
def test_tp_shard_shadow_serves_the_full_shadows_slice_bit_for_bit_for_every_trainer_layout(
        engine_tp, served_dtype):
    stream = _stream()
    full = _fed(stream, served_dtype)
    for rank in range(engine_tp):
        shards = _shards(rank, engine_tp)
        shadow = _fed(stream, served_dtype, shards)
        assert shadow.counts == full.counts
        for name, tensor in full.served.items():
            assert torch.equal(shadow.served[name], shards[name].take(tensor)), (rank, name)
        for name in TARGETS:
            assert torch.equal(shadow.masters[name], shards[name].take(full.masters[name]))
    # Not the trivial equality: every target moved away from the full sync's value.
    start = _fed([p for p in stream if isinstance(decode(p), FullSyncBucket)], served_dtype)
    assert all(not torch.equal(start.masters[n], full.masters[n]) for n in TARGETS)


def test_tp_shard_shadow_holds_one_tp_th_of_the_targets_and_the_replicated_tensors_whole():
    stream, engine_tp = _stream(), 4
    full = _fed(stream, torch.bfloat16)
    replicated = full.served["decoder.final_layernorm.weight"].nbytes
    shadows = [_fed(stream, torch.bfloat16, _shards(r, engine_tp)) for r in range(engine_tp)]
    for shadow in shadows:
        assert (sum(t.nbytes for t in shadow.masters.values()) * engine_tp
                == sum(t.nbytes for t in full.masters.values()))
        assert (shadow.nbytes() - replicated) * engine_tp == full.nbytes() - replicated


def test_megatron_tp_shard_takes_the_rows_and_columns_megatron_slices():
    full = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6)
    # fc1 at TP=2, stride 2: rank 1 holds [gate_1; up_1] = rows 16-31 and 48-63.
    fc1 = megatron_tp_shard((64, 6), 0, 2, 1, 2)
    assert fc1.row_ranges == ((16, 32), (48, 64))
    assert torch.equal(fc1.take(full), torch.cat([full[16:32], full[48:64]]))
    proj = megatron_tp_shard((64, 6), 1, 1, 2, 3)  # row-parallel: a column range
    assert torch.equal(proj.take(full), full[:, 4:6])
    with pytest.raises(ValueError, match="does not split into 4 shards with stride 2"):
        megatron_tp_shard((12, 6), 0, 2, 0, 4)


def test_every_engine_rank_refuses_a_full_sync_tensor_of_another_shape_alike():
    """A shard's own fit is rank-dependent: fc2 sent with 24 of its 32 input columns fits engine
    TP rank 0's columns 0-15 but not rank 1's 16-31, so rank 0 alone took the full sync. Told
    its model's shapes, every rank refuses it with the same message, drops the partial full
    sync and keeps what it held."""
    fc2 = "decoder.layers.0.mlp.linear_fc2.weight"
    generator = torch.Generator().manual_seed(1)
    state = {name: torch.randn(shape, generator=generator) for name, (shape, _, _) in
             TENSORS.items()}
    good = [encode(b, wire_dtype="fp32")
            for b in full_sync_buckets(state, update_count=0, bucket_bytes=2048)]
    narrow = full_sync_buckets({**state, fc2: state[fc2][:, :24]}, update_count=3,
                               bucket_bytes=2048)
    assert len(narrow) > 2 and fc2 not in narrow[0].tensors  # refused after a taken bucket

    def fed(stream: list[bytes], rank: int, model_shapes) -> tuple[EngineShadow, str | None]:
        shadow = EngineShadow(TARGETS, served_dtype=torch.float32, shards=_shards(rank, 2),
                              model_shapes=model_shapes)
        for payload in good:
            shadow.apply(decode(payload))
        try:
            for payload in stream:
                shadow.apply(decode(payload))
        except RuntimeError as error:
            return shadow, str(error)
        return shadow, None

    stream = [encode(b, wire_dtype="fp32") for b in narrow]
    shard_fit = [fed(stream, rank, None)[1] for rank in range(2)]
    assert shard_fit[0] is None and "does not fit the full tensor (24, 24)" in shard_fit[1]
    model_shapes = {name: shape for name, (shape, _, _) in TENSORS.items()}
    refusals = []
    for rank in range(2):
        shadow, message = fed(stream, rank, model_shapes)
        refusals.append(message)
        assert shadow.counts == dict.fromkeys(TENSORS, 0)  # what it held before
        assert torch.equal(shadow.served[fc2], _shards(rank, 2)[fc2].take(state[fc2]))
        for payload in good:  # the dropped partial sync does not block the next full sync
            shadow.apply(decode(payload))
    assert refusals[0] == refusals[1]
    assert f"{fc2} has shape (24, 24), the engine's model (24, 32)" in refusals[0]
    assert "the partial full sync was dropped" in refusals[0]
    unknown = full_sync_buckets({**state, "extra.weight": torch.zeros(2)}, update_count=1,
                                bucket_bytes=1 << 20)
    assert "extra.weight is not a weight of the engine's model" in fed(
        [encode(b, wire_dtype="fp32") for b in unknown], 0, model_shapes)[1]
