"""The collectives of an RL step, with explicit process groups: three over data parallelism, one
over a replica's context-parallel ranks, maxima over the world, one that hands rank 0's result
(or its error) to every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_logra.mcore import ParallelGroups


def gather_dp(values: list[Any], groups: ParallelGroups) -> list[Any]:
    """Concatenate every DP rank's list, in DP-rank order (= global index order)."""
    gathered: list[list[Any] | None] = [None] * groups.dp_size
    dist.all_gather_object(gathered, values, group=groups.dp)
    return [item for part in gathered for item in (part or [])]


def gather_cp(value: Any, groups: ParallelGroups) -> list[Any]:
    """Every CP rank's ``value``, in CP-rank order (the ranks of one data-parallel replica)."""
    gathered: list[Any] = [None] * groups.cp_size
    dist.all_gather_object(gathered, value, group=groups.cp)
    return gathered


def replica_sum(values: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Sum over the data-parallel replicas of quantities held by the last pipeline stage (the
    same on every TP rank): TP rank 0 of the last stage contributes, summed over the world
    (under context parallelism every CP rank's own tokens, so their sums add up too)."""
    total = values.clone().to(torch.float64)
    if not (groups.is_last_stage() and groups.tp_rank == 0):
        total.zero_()
    dist.all_reduce(total)
    return total


def world_max(value: torch.Tensor) -> float:
    """The largest of every rank's ``value`` (a scalar), on every rank."""
    largest = value.detach().clone().to(torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return float(largest)


def replica_max(values: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """The largest of non-negative quantities held by the last pipeline stage, over the world
    (the other ranks contribute 0)."""
    top = values.clone().to(torch.float64)
    if not groups.is_last_stage():
        top.zero_()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return top


def from_world_rank0(call: Callable[[], Any], what: str) -> Any:
    """``call()`` on world rank 0 (the rank that owns a separate rollout engine), its result on
    every rank. An exception on rank 0 is raised on every rank, naming ``what`` and the cause,
    so that no rank waits in a later collective for a rank that failed."""
    box: list[Any] = [None]
    if dist.get_rank(dist.group.WORLD) == 0:
        try:
            box[0] = ("ok", call())
        except Exception as error:  # noqa: BLE001 -- re-raised below, on every rank
            box[0] = ("error", f"{type(error).__name__}: {error}")
    dist.broadcast_object_list(box, src=0, group=dist.group.WORLD)
    status, value = box[0]
    if status != "ok":
        raise RuntimeError(f"{what} failed on rank 0: {value}")
    return value
