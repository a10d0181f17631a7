"""Full, layout-independent weights of a sharded model (to compare runs across layouts)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_logra.mcore.parallel import ParallelGroups
from megatron_logra.mcore.sharding import gather_full, global_named_parameters


def gather_full_weights(
    model_chunks: Sequence[torch.nn.Module], groups: ParallelGroups
) -> dict[str, torch.Tensor]:
    """``{global name: full fp32 tensor on CPU}`` on every rank of this rank's TP group.

    Collective over the TP group: every rank must call it.
    """
    if groups.pp_size != 1:
        raise NotImplementedError("gathering full weights across pipeline stages needs PP support")
    weights: dict[str, torch.Tensor] = {}
    for chunk in model_chunks:
        for name, param in global_named_parameters(chunk):
            weights[name] = gather_full(param, groups.tp, groups.tp_size).float().cpu()
    return weights


def save_tensors_atomically(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """torch.save to a temporary file, then rename: never a half-written file at ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    torch.save(tensors, tmp)
    os.replace(tmp, path)
