"""Sparse-delta sync (megatron_logra.sync.delta): XOR of bit patterns, zstd, a digest per tensor.

The engine's shadow fed deltas through the wire serves the trainer's weights bit for bit (bf16
and fp32, whole and as a TP shard, and an fp32 master of a shadowed target); a corrupt, repeated
or out-of-order delta is refused naming the tensor and changes nothing. The real optimizers and
engines are in tests/distributed/test_separate_engine.py and test_vllm_sync.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_logra.bf16_remainder import round_to_bf16
from megatron_logra.sync.delta import delta_buckets, xor_bits
from megatron_logra.sync.records import full_sync_buckets
from megatron_logra.sync.shadow import EngineShadow
from megatron_logra.sync.shard import megatron_tp_shard
from megatron_logra.sync.wire import decode, encode

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
NORM = "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
ROWS, COLS, STEPS = 32, 24, 6
# Relative step of the simulated optimizer: at 1e-3 a few percent of bf16 entries flip per step
# (an RL-sized update), so the delta is sparse but not empty.
RELATIVE_STEP = 1e-3
BUCKET_BYTES = 1024  # small: the two tensors travel in separate buckets


def _weights(dtype: torch.dtype, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {FC1: torch.randn(ROWS, COLS, generator=generator).to(dtype),
            NORM: torch.ones(ROWS, dtype=dtype)}


def _step(weights: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """An Adam-like dense step computed in fp32 and rounded to the weights' dtype."""
    return {name: (w.float() * (1 + RELATIVE_STEP * torch.randn(w.shape, generator=generator))
                   ).to(w.dtype) for name, w in weights.items()}


def _full_sync(engine: EngineShadow, weights: dict[str, torch.Tensor]) -> None:
    for bucket in full_sync_buckets(weights, update_count=0, bucket_bytes=BUCKET_BYTES):
        engine.apply(decode(encode(bucket, wire_dtype="fp32")))


def _ship(engine: EngineShadow, new, old, counts, update: int) -> list[bytes]:
    payloads = [encode(b, wire_dtype="fp32") for b in delta_buckets(
        new, old, counts, update_count=update, bucket_bytes=BUCKET_BYTES)]
    for payload in payloads:
        engine.apply(decode(payload))
    return payloads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delta_synced_engine_serves_the_trainers_weights_bit_for_bit_whole_and_tp_sharded(dtype):
    generator = torch.Generator().manual_seed(0)
    weights = _weights(dtype, generator)
    whole = EngineShadow([], served_dtype=dtype)
    # Engine TP rank 1 of 2 keeps fc1's [gate_1; up_1] rows (stride 2), the norm whole.
    shard = megatron_tp_shard((ROWS, COLS), 0, 2, 1, 2)
    sharded = EngineShadow([], served_dtype=dtype, shards={FC1: shard})
    for engine in (whole, sharded):
        _full_sync(engine, weights)
    counts = dict.fromkeys(weights, 0)
    changed = []
    for update in range(1, STEPS + 1):
        new = _step(weights, generator)
        for engine in (whole, sharded):
            _ship(engine, new, weights, counts, update)
        changed.append(int(torch.count_nonzero(xor_bits(new[FC1], weights[FC1]))))
        weights, counts = new, dict.fromkeys(new, update)
        for name, tensor in weights.items():
            assert torch.equal(whole.served[name], tensor)
        assert torch.equal(sharded.served[FC1], shard.take(weights[FC1]))
    assert all(0 < c for c in changed)  # every step changed something
    if dtype == torch.bfloat16:  # sparse: most bf16 entries keep their bits in a step
        assert max(changed) < ROWS * COLS / 2


def test_delta_of_a_shadowed_targets_fp32_master_keeps_its_bf16_served_cast_exact():
    generator = torch.Generator().manual_seed(1)
    master = torch.randn(ROWS, COLS, generator=generator)
    engine = EngineShadow([FC1], served_dtype=torch.bfloat16)
    _full_sync(engine, {FC1: master})
    for update in range(1, STEPS + 1):
        new = master * (1 + RELATIVE_STEP * torch.randn(master.shape, generator=generator))
        _ship(engine, {FC1: new}, {FC1: master}, {FC1: update - 1}, update)
        master = new
        assert torch.equal(engine.masters[FC1], master)
        assert torch.equal(engine.served[FC1], round_to_bf16(master))
    # The served bf16 weight is not what the engine holds of a shadowed target: refused.
    served_delta = delta_buckets({FC1: round_to_bf16(new * 1.01)}, {FC1: round_to_bf16(new)},
                                 {FC1: STEPS}, update_count=STEPS + 1, bucket_bytes=BUCKET_BYTES)
    with pytest.raises(RuntimeError, match="the trainer must XOR the master"):
        engine.apply(decode(encode(served_delta[0], wire_dtype="fp32")))


def _engine_after_one_delta():
    generator = torch.Generator().manual_seed(2)
    weights = _weights(torch.bfloat16, generator)
    engine = EngineShadow([], served_dtype=torch.bfloat16)
    _full_sync(engine, weights)
    new = _step(weights, generator)
    first = _ship(engine, new, weights, dict.fromkeys(weights, 0), 1)
    return engine, new, first, generator


def _refusal(engine: EngineShadow, payload: bytes) -> str:
    before = {n: t.clone() for n, t in engine.served.items()}
    counts = dict(engine.counts)
    with pytest.raises(RuntimeError) as error:
        engine.apply(decode(payload))
    assert engine.counts == counts
    assert all(torch.equal(before[n], t) for n, t in engine.served.items())  # nothing changed
    return str(error.value)


def test_a_corrupt_delta_is_refused_naming_the_layer_and_changes_nothing():
    engine, weights, _, generator = _engine_after_one_delta()
    (bucket, *_) = delta_buckets(_step(weights, generator), weights, dict.fromkeys(weights, 1),
                                 update_count=2, bucket_bytes=BUCKET_BYTES)
    delta = bucket.tensors[FC1]
    # A flipped byte inside the compressed frame, and a frame whose bytes are intact but whose
    # digest does not match them (a delta meant for another tensor).
    frame = bytearray(delta.frame)
    frame[len(frame) // 2] ^= 0xFF
    for bad in (dataclasses.replace(delta, frame=bytes(frame)),
                dataclasses.replace(delta, digest="0" * len(delta.digest))):
        corrupt = dataclasses.replace(bucket, tensors={**bucket.tensors, FC1: bad})
        message = _refusal(engine, encode(corrupt, wire_dtype="fp32"))
        assert f"refusing delta of {FC1}" in message
        assert "corrupt" in message or "checksum" in message


def test_a_repeated_or_out_of_order_delta_is_refused_naming_the_layer_and_changes_nothing():
    engine, weights, first, generator = _engine_after_one_delta()
    repeated = next(p for p in first if FC1 in decode(p).tensors)
    message = _refusal(engine, repeated)
    assert f"refusing delta of {FC1} to update 1" in message and "(repeated)" in message
    # Update 3's delta against update 2, which the engine never received (it holds 1).
    later = _step(weights, generator)
    ahead = delta_buckets(_step(later, generator), later, dict.fromkeys(later, 2),
                          update_count=3, bucket_bytes=BUCKET_BYTES)
    message = _refusal(engine, encode(ahead[0], wire_dtype="fp32"))
    assert "against update 2, the engine holds update 1 (out of order)" in message


def test_unchanged_tensors_travel_not_at_all():
    generator = torch.Generator().manual_seed(3)
    weights = _weights(torch.bfloat16, generator)
    new = {FC1: _step(weights, generator)[FC1], NORM: weights[NORM].clone()}
    buckets = delta_buckets(new, weights, dict.fromkeys(weights, 0), update_count=1,
                            bucket_bytes=BUCKET_BYTES)
    assert [list(b.tensors) for b in buckets] == [[FC1]]
    assert delta_buckets(weights, weights, dict.fromkeys(weights, 0), update_count=1,
                         bucket_bytes=BUCKET_BYTES) == []
