"""Bytes on the wire of low-rank and full policy sync (payload only; a record's header adds a few
hundred bytes). Pure Python, like the memory estimator, so it runs where torch does not."""

from __future__ import annotations

from megatron_logra.memory.shapes import ModelShape

WIRE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2}


def sync_bytes(shape: tuple[int, int], sketch_rank: int | None, wire_dtype: str) -> int:
    """Bytes to sync one update of a weight ``[m, n]``: the factor ``[m, sketch_rank]`` (low
    rank), or the whole weight for ``sketch_rank=None`` (full sync)."""
    if wire_dtype not in WIRE_BYTES:
        raise ValueError(f"wire_dtype {wire_dtype!r} is not one of {sorted(WIRE_BYTES)}")
    rows, cols = shape
    width = cols if sketch_rank is None else sketch_rank
    return rows * width * WIRE_BYTES[wire_dtype]


def model_sync_bytes(
    model: ModelShape, *, sketch_rank: int, wire_dtype: str, non_targets_train: bool
) -> dict[str, int]:
    """Bytes per update for a whole model (TP = 1 shapes, vocabulary padded for tp = 1).

    ``non_targets_train``: library mode, where Megatron's Adam trains embeddings, norms and
    biases, which then ship dense every update; in paper mode they are frozen and ship nothing.
    """
    targets = [(t.out_features, t.in_features) for t in model.targets()]
    low_rank = model.num_layers * sum(sync_bytes(s, sketch_rank, wire_dtype) for s in targets)
    dense_targets = model.num_layers * sum(sync_bytes(s, None, wire_dtype) for s in targets)
    target_params = model.num_layers * sum(m * n for m, n in targets)
    non_targets = (model.total_parameters() - target_params) * WIRE_BYTES[wire_dtype]
    shipped_non_targets = non_targets if non_targets_train else 0
    return {
        "targets_low_rank": low_rank,
        "targets_full": dense_targets,
        "non_targets_dense": shipped_non_targets,
        "low_rank_total": low_rank + shipped_non_targets,
        "full_total": dense_targets + non_targets,
    }


def engine_shadow_bytes(model: ModelShape, *, engine_tp: int, served_dtype: str) -> dict[str, int]:
    """Bytes one engine rank's shadow holds for the targets when it keeps only its TP shard of
    them: their fp32 masters over ``engine_tp``, and (an engine serving bf16) the served cast of
    that shard beside them; an fp32 engine serves the masters themselves. The non-targets are
    what the engine serves anyway (its model's own shard, or vLLM's)."""
    if engine_tp < 1 or model.num_query_groups % engine_tp:
        raise ValueError(f"engine_tp={engine_tp} must be >= 1 and divide the model's "
                         f"{model.num_query_groups} query groups (an engine shards whole groups)")
    target_params = model.num_layers * sum(t.out_features * t.in_features for t in model.targets())
    masters = 4 * target_params // engine_tp
    served = 0 if served_dtype == "fp32" else WIRE_BYTES[served_dtype] * target_params // engine_tp
    return {"masters": masters, "served_copy": served, "total": masters + served}
