"""What rollouts generated ahead hold (``rollout.max_staleness`` = N; docs/async.md).

The separate engine holds one policy version at a time: its served weights, the exact shadow
of its targets, the KV cache of the generation it runs. Nothing of it grows with N -- 0 bytes
per version in flight on the engine. What N multiplies sits in the host memory of the trainer's
world rank 0, which owns the engine's queue:

* the answered batches waiting for their step (at most N): the engine's responses as the client
  unpickles them, Python lists of token ids and log-probs (:data:`PY_BYTES_PER_TOKEN`);
* the sync records of the versions the engine has not applied yet (at most N, queued behind its
  generations): per version the low-rank factors ``U [m, r]`` of every target in the wire dtype
  and the trainable non-targets dense (library mode); with ``sync.mode=full`` every served
  weight in its own dtype; with ``sync.mode=delta`` their XOR, compressed -- at most that (its
  size depends on how many bits changed: docs/sync.md), which is what is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.memory.shapes import ModelShape

PY_BYTES_PER_TOKEN = 73.0
"""One response token as the engine clients hold it: a token id (a Python int, 28 B) and its
log-prob (a float, 24 B), each behind an 8 B list slot, and the lists' growth slack. Measured
(tests/unit/test_in_flight_memory.py): 74.8 B per token with 64-token responses, the
per-response part included, for either client."""
PY_BYTES_PER_RESPONSE = 120.0
"""Per response: its two list objects and the tuple that pairs them, the outer list's slot."""
WIRE_BYTES = {"fp32": 4, "bf16": 2}
PARAMS_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class InFlightBytes:
    """Host bytes on the trainer's world rank 0, per version in flight and for N of them."""

    max_staleness: int
    batch_bytes: float
    """One answered batch waiting for its step."""
    sync_bytes: float
    """One version's sync records waiting for the engine."""
    engine_bytes_per_version: float = 0.0
    """The engine holds one version whatever N."""

    @property
    def total_bytes(self) -> float:
        return self.max_staleness * (self.batch_bytes + self.sync_bytes)


def _target_factor_elements(shape: ModelShape, targets: tuple[str, ...], sketch_rank: int) -> int:
    """Elements of one version's low-rank factors ``U [out, r]`` (every target, every expert)."""
    total = 0
    for is_moe, count in shape.layer_kinds():
        layer = sum(t.out_features for t in shape.layer_targets(is_moe) if t.name in targets)
        if is_moe:
            experts = shape.mlp_targets(shape.moe.expert_ffn_hidden_size)
            layer += shape.moe.num_experts * sum(t.out_features for t in experts
                                                 if t.name in targets)
        total += count * layer
    return total * sketch_rank


def _target_parameters(shape: ModelShape, targets: tuple[str, ...]) -> int:
    total = 0
    for is_moe, count in shape.layer_kinds():
        layer = sum(t.out_features * t.in_features for t in shape.layer_targets(is_moe)
                    if t.name in targets)
        if is_moe:
            experts = shape.mlp_targets(shape.moe.expert_ffn_hidden_size)
            layer += shape.moe.num_experts * sum(t.out_features * t.in_features for t in experts
                                                 if t.name in targets)
        total += count * layer
    return total


def in_flight_bytes(shape: ModelShape, *, max_staleness: int, sequences: int,
                    response_tokens: int, sync_mode: str, wire_dtype: str, params_dtype: str,
                    targets: tuple[str, ...], sketch_rank: int,
                    dense_non_targets: bool) -> InFlightBytes:
    """What ``max_staleness`` versions in flight hold on world rank 0 (module docstring).

    Args:
        sequences: responses per step (rl.prompts_per_step x rl.samples_per_prompt).
        response_tokens: tokens per response (rl.sampling.max_new_tokens bounds it).
        sync_mode: ``low_rank``, ``delta`` or ``full`` (resolved).
        dense_non_targets: whether the non-targets train (library mode) and ship dense.
    """
    batch = sequences * (response_tokens * PY_BYTES_PER_TOKEN + PY_BYTES_PER_RESPONSE)
    if sync_mode in ("full", "delta"):
        # The served weights (a delta: their compressed XOR, at most as large).
        sync = PARAMS_BYTES[params_dtype] * shape.total_parameters()
    elif sync_mode == "low_rank":
        others = shape.total_parameters() - _target_parameters(shape, targets)
        sync = WIRE_BYTES[wire_dtype] * (_target_factor_elements(shape, targets, sketch_rank)
                                         + (others if dense_non_targets else 0))
    else:
        raise ValueError(f"sync_mode={sync_mode!r} is not low_rank, delta or full")
    return InFlightBytes(max_staleness=max_staleness, batch_bytes=batch, sync_bytes=sync)
