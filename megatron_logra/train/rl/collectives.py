"""The two data-parallel collectives of an RL step, with explicit process groups."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_logra.mcore import ParallelGroups


def gather_dp(values: list[Any], groups: ParallelGroups) -> list[Any]:
    """Concatenate every DP rank's list, in DP-rank order (= global index order)."""
    gathered: list[list[Any] | None] = [None] * groups.dp_size
    dist.all_gather_object(gathered, values, group=groups.dp)
    return [item for part in gathered for item in (part or [])]


def replica_sum(values: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Sum over the data-parallel replicas of quantities held by the last pipeline stage (the
    same on every TP rank): TP rank 0 of the last stage contributes, summed over the world."""
    total = values.clone().to(torch.float64)
    if not (groups.is_last_stage() and groups.tp_rank == 0):
        total.zero_()
    dist.all_reduce(total)
    return total
