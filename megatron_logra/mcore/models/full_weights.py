"""Full, layout-independent weights of a sharded model (to compare runs across layouts)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_logra.atomic_write import fsync_directory
from megatron_logra.mcore.models.moe import is_expert_name
from megatron_logra.mcore.models.sharding import gather_full, global_named_parameters, unwrap_model
from megatron_logra.mcore.process_groups import ParallelGroups


def gather_full_weights(
    model_chunks: Sequence[torch.nn.Module], groups: ParallelGroups
) -> dict[str, torch.Tensor]:
    """``{global name: full fp32 tensor on CPU}`` of the whole model, on every rank.

    Collective over the TP, expert-parallel and pipeline groups: every rank must call it.
    Routed experts split over EP are gathered under their global names. With tied embeddings
    the last pipeline stage's copy of the word embeddings (``output_layer.weight``) is left
    out, so the result has the same names for every pipeline layout.
    """
    stage: dict[str, torch.Tensor] = {}
    for chunk in model_chunks:
        tied = getattr(unwrap_model(chunk), "share_embeddings_and_output_weights", False)
        for name, param in global_named_parameters(chunk):
            full = gather_full(param, groups.tp, groups.tp_size).float().cpu()
            if name == "output_layer.weight" and tied:
                continue
            stage[name] = full
    if groups.ep_size > 1:
        experts = {name: t for name, t in stage.items() if is_expert_name(name)}
        shares: list[dict[str, torch.Tensor] | None] = [None] * groups.ep_size
        dist.all_gather_object(shares, experts, group=groups.ep)
        for share in shares:
            stage.update(share or {})
    if groups.pp_size == 1:
        return stage
    stages: list[dict[str, torch.Tensor] | None] = [None] * groups.pp_size
    dist.all_gather_object(stages, stage, group=groups.pp)
    weights: dict[str, torch.Tensor] = {}
    for entry in stages:
        weights.update(entry or {})
    return weights


def save_tensors_atomically(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """torch.save to a temporary file, fsync, then rename (and fsync the directory): never a
    half-written file at ``path``, also after a node crash."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as handle:
        torch.save(tensors, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)
