"""The LoGRA optimizer's checkpoint: row moments and fp32 masters as reshardable ShardedTensors.

Every owned piece of a layer's rows is addressed by its place in the *full* (TP=1, DP=1) weight,
so a checkpoint written at one TP / PP / DP layout loads at another. Masters are written as fp32
rows whatever their store (``dp_sharded``, ``remainder``, ``host``: the remainder master is
recombined with its bf16 weight), so a checkpoint of one master mode loads into another; the
mode is therefore not part of the fingerprint (``none`` versus the others differs by
``model.params_dtype``, which the checkpoint's model check refuses to change). The update
count, the step-scale controller's state, the scheduler's param-group values and a fingerprint of
the settings the state only makes sense under are common (rank-independent) state. Projections
are never saved: they are regenerated from ``(seed, update_count, layer_key)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from megatron_logra.direction import RowAdamDirection
from megatron_logra.mcore.models.targets import SketchTarget

if TYPE_CHECKING:
    from megatron_logra.mcore.optimizer.logra import LoGRAOptimizer


def checkpoint_fingerprint(optimizer: LoGRAOptimizer) -> dict[str, Any]:
    """The settings a checkpoint's LoGRA state only makes sense under."""
    logra = optimizer.logra
    return {
        "mode": optimizer.mode.name,
        "seed": logra.seed,
        "distribution": logra.distribution,
        "sketch_rank": logra.sketch_rank,
        "direction": logra.direction,
        "refresh": logra.refresh,
        "targets": sorted(logra.targets),
        **optimizer.mode.fingerprint(),
    }


def check_compatible_fingerprint(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse LoGRA state saved under settings that change what that state means."""
    mismatched = {
        name: (saved.get(name), value) for name, value in current.items()
        if saved.get(name) != value
    }
    if mismatched:
        details = ", ".join(
            f"{name}: checkpoint {old!r} vs run {new!r}" for name, (old, new) in mismatched.items()
        )
        raise ValueError(
            f"the checkpoint's LoGRA state is incompatible with this run ({details}); resume "
            "with the settings the checkpoint was written with"
        )


def _row_fragments(optimizer: LoGRAOptimizer, target: SketchTarget) -> list[tuple[int, int, int]]:
    """``(block, fragment index, fragments)`` of each owned row piece in the full weight.

    The full (TP=1) weight's rows are ``stride`` blocks; a column-parallel TP shard owns
    slice ``t`` of every block, and each DP owner a ``1/dp`` chunk of that, so every piece
    is one uniform fragment of the global rows. Row-parallel shards hold all rows.
    """
    groups = optimizer.groups
    shard = optimizer.sketches.shards[target.layer_key]
    tp = groups.tp_size if target.parallel_kind == "column" else 1
    tp_rank = groups.tp_rank if target.parallel_kind == "column" else 0
    dp, dp_rank = shard.dp_size, shard.dp_rank
    return [
        (block, block * tp * dp + tp_rank * dp + dp_rank, shard.stride * tp * dp)
        for block in range(shard.stride)
    ]


def global_row_ranges(optimizer: LoGRAOptimizer, target: SketchTarget) -> tuple[tuple[int, int], ...]:
    """The rows of the full (TP=1) weight this rank's owned rows are, in their local order
    (policy sync ships factor rows at these global rows)."""
    chunk = optimizer.sketches.shards[target.layer_key].chunk_rows
    return tuple((index * chunk, (index + 1) * chunk)
                 for _, index, _ in _row_fragments(optimizer, target))


def row_moment(optimizer: LoGRAOptimizer, layer_key: str) -> torch.Tensor | None:
    """This rank's RowAdam moments of a layer (None for directions without row state)."""
    if isinstance(optimizer.direction, RowAdamDirection):
        return optimizer.direction.moment(layer_key)
    return None


def sharded_state_dict(optimizer: LoGRAOptimizer) -> dict[str, Any]:
    """Row moments and fp32 masters as ShardedTensors keyed by layer; common state beside."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    groups = optimizer.groups
    replicated_rows = not optimizer.sketches.sharded
    pieces: dict[str, Any] = {}
    for target in optimizer.targets:
        key, shard = target.layer_key, optimizer.sketches.shards[target.layer_key]
        row_part = target.parallel_kind == "row"
        # Copies of the same rows: row-parallel TP ranks hold the same rows; replicated
        # layouts hold them on every DP rank too -- for a routed expert, on every rank of its
        # expert-data-parallel group (the other DP ranks hold other experts, so the dense DP
        # rank would leave some experts with no replica 0). Only the all-zero replica is written.
        copy_rank = groups.expert_dp_rank if target.expert else groups.dp_rank
        replica = (
            groups.tp_rank if row_part else 0,
            copy_rank if replicated_rows else 0,
        )
        entries: dict[str, list[Any]] = {"moment": [], "master": []}
        moment_view = row_moment(optimizer, key)
        master = optimizer.masters.get(key)
        master_OI = master.fp32_rows() if master is not None else None
        for block, index, fragments in _row_fragments(optimizer, target):
            rows = slice(block * shard.chunk_rows, (block + 1) * shard.chunk_rows)
            if moment_view is not None:
                entries["moment"].append(ShardedTensor.from_rank_offsets(
                    f"logra.row_second_moment.{key}", moment_view[rows],
                    (0, index, fragments), replica_id=replica,
                ))
            if master is not None:
                column_axis = [(1, groups.tp_rank, groups.tp_size)] if row_part else []
                entries["master"].append(ShardedTensor.from_rank_offsets(
                    f"logra.master.{key}", master_OI[rows],
                    (0, index, fragments), *column_axis, replica_id=0,
                ))
        pieces[key] = entries
    step_scale = optimizer.step_scale
    return {
        "common": {
            "update_count": optimizer.update_count,
            "kl_controller": step_scale.state_dict() if step_scale is not None else None,
            "fingerprint": checkpoint_fingerprint(optimizer),
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
            ],
        },
        "row_pieces": pieces,
    }


def load_sharded_state(optimizer: LoGRAOptimizer, state_dict: dict[str, Any]) -> None:
    """Load what :func:`sharded_state_dict` described (after dist_checkpointing filled it)."""
    common = state_dict["common"]
    check_compatible_fingerprint(common["fingerprint"], checkpoint_fingerprint(optimizer))
    for target in optimizer.targets:
        key, shard = target.layer_key, optimizer.sketches.shards[target.layer_key]
        entries = state_dict["row_pieces"][key]
        moment = row_moment(optimizer, key)
        master = optimizer.masters.get(key)
        master_OI = master.fp32_rows().clone() if master is not None else None
        for block in range(shard.stride):
            rows = slice(block * shard.chunk_rows, (block + 1) * shard.chunk_rows)
            if moment is not None:
                moment[rows].copy_(entries["moment"][block])
            if master_OI is not None:
                master_OI[rows].copy_(entries["master"][block])
        if master is not None:
            master.load_(master_OI)
    optimizer.update_count = int(common["update_count"])
    if optimizer.step_scale is not None:
        if common.get("kl_controller") is None:
            raise ValueError(
                "this run uses logra.kl_control but the checkpoint has no KL controller "
                "state; resume without kl_control or from a checkpoint written with it"
            )
        optimizer.step_scale.load_state_dict(common["kl_controller"])
    for group, saved in zip(optimizer.param_groups, common["param_groups"], strict=True):
        group.update(saved)
    optimizer.refresh_projections()
