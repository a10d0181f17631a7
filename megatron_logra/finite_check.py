"""One decision on every rank: are all of a step's checked quantities finite?

A LoGRA step writes into the weights only after every rank has seen a finite proposal. Each rank
holds a different part of it (its TP shard, its pipeline stage's layers, its DP-owned rows), so a
rank that found a NaN must stop the others too: a rank that went on alone would apply its half
of an update (and then wait forever in a collective the stopped rank never joins). The checks
are therefore flags, one per named stage, reduced with MIN over every group given (the
model-parallel group and the data-parallel group together span all ranks of a replica set).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist


def local_finite(tensors: Iterable[torch.Tensor] = (), scalars: Iterable[float] = ()) -> bool:
    """Whether every entry of ``tensors`` and every number in ``scalars`` is finite (this rank)."""
    return all(math.isfinite(float(value)) for value in scalars) and all(
        bool(torch.isfinite(tensor).all()) for tensor in tensors
    )


def agreed_flags(
    flags: Mapping[str, bool],
    groups: Sequence[dist.ProcessGroup | None],
    device: torch.device,
) -> dict[str, bool]:
    """``flags`` AND-ed over every rank of ``groups`` (one MIN all-reduce per group).

    Every rank must pass the same stage names in the same order (the flags travel as one
    tensor). A group of one rank, or no initialised process group, is skipped.
    """
    names = list(flags)
    values = torch.tensor([1.0 if flags[name] else 0.0 for name in names],
                          dtype=torch.float32, device=device)
    if dist.is_available() and dist.is_initialized():
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    return {name: bool(value >= 1.0) for name, value in zip(names, values.tolist(), strict=True)}
