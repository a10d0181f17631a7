"""Exact accounting of persistent training state on this rank, by category.

Persistent state is what lives between steps: weights (LoRA adapters apart), gradient buffers,
optimizer state (moments, fp32 master copies or their int16 remainders), and for LoGRA the
sketch buffer and the cached projections; LoGRA's host-offloaded masters are counted apart. Activations are
not counted here (they are freed by the end of a step).

Every tensor is counted by its underlying storage, once, in the first category that claims it:
DDP grad buffers are counted once however many ``main_grad`` views point into them, and a
distributed-optimizer "master" that is a view of the parameter buffer is not counted twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer

from megatron_logra.atomic_write import write_atomically
from megatron_logra.mcore.optimizer.logra import LoGRAOptimizer
from megatron_logra.mcore.peft.lora import lora_adapters
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.mcore.training.setup import TrainingSetup

CATEGORIES: tuple[str, ...] = (
    "weights", "adapters", "grads", "optimizer_state", "sketches", "projections",
    "host_optimizer_state",
)
"""The last one is in host memory beside the device (logra.master_weights=host); on CPU runs
the two are the same memory, and the category still says which would be offloaded."""
DEVICE_CATEGORIES: tuple[str, ...] = CATEGORIES[:-1]


class _StorageLedger:
    def __init__(self) -> None:
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self._seen: set[tuple[str, int]] = set()

    def add(self, category: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for tensor in tensors:
            if tensor is None or not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key in self._seen:
                continue
            self._seen.add(key)
            self.totals[category] += storage.nbytes()


def _sub_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def persistent_state_bytes(setup: TrainingSetup) -> dict[str, int]:
    """Bytes per category on this rank (call after the first step: Adam allocates lazily)."""
    ledger = _StorageLedger()
    params = [p for chunk in setup.model_chunks for p in chunk.parameters()]
    # LoRA's trainable adapters, apart from the frozen base weights they sit on.
    ledger.add("adapters", (p for a in lora_adapters(setup.model_chunks) for p in (a.a, a.b)))
    ledger.add("weights", params)
    for chunk in setup.model_chunks:
        # DistributedDataParallel.buffers is its list of grad buffers (it shadows Module.buffers).
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            ledger.add("grads", [buffer.grad_data])
    ledger.add("grads", (getattr(p, "main_grad", None) for p in params))
    ledger.add("grads", (p.grad for p in params))
    for optimizer in _sub_optimizers(setup.optimizer):
        if isinstance(optimizer, LoGRAOptimizer):
            ledger.add("optimizer_state", optimizer.direction.state_tensors().values())
            ledger.add("optimizer_state",
                       (t for m in optimizer.masters.values() for t in m.device_tensors()))
            ledger.add("host_optimizer_state",
                       (t for m in optimizer.masters.values() for t in m.host_tensors()))
            ledger.add("sketches", [optimizer.sketches.data])
            ledger.add(
                "projections", (optimizer.projection_of(t) for t in optimizer.targets)
            )
            continue
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            continue
        # Parameters the inner torch optimizer steps: the model's own (already counted) or
        # fp32 master copies (distributed / mixed-precision optimizers).
        ledger.add(
            "optimizer_state", (p for group in inner.param_groups for p in group["params"])
        )
        for state in inner.state.values():
            ledger.add("optimizer_state", (v for v in state.values() if torch.is_tensor(v)))
    return dict(ledger.totals)


def gather_state_bytes(setup: TrainingSetup, groups: ParallelGroups) -> list[dict[str, int]]:
    """Every rank's :func:`persistent_state_bytes`, in world-rank order (collective)."""
    everyone: list[dict[str, int] | None] = [None] * groups.world_size
    dist.all_gather_object(everyone, persistent_state_bytes(setup))
    return [entry or {} for entry in everyone]


def state_bytes_totals(per_rank: list[dict[str, int]]) -> dict[str, int]:
    """Bytes over all ranks: ``state_bytes`` on the devices, ``host_state_bytes`` beside them."""
    host = sum(r.get(k, 0) for r in per_rank for k in CATEGORIES if k not in DEVICE_CATEGORIES)
    device = sum(r.get(k, 0) for r in per_rank for k in DEVICE_CATEGORIES)
    return {"state_bytes": device, "host_state_bytes": host}


def write_state_bytes(per_rank: list[dict[str, int]], method: str, path: Path) -> None:
    """The per-rank accounting and its sum over ranks as JSON, replaced atomically."""
    data = {"method": method, "per_rank": per_rank,
            "total": {k: sum(r.get(k, 0) for r in per_rank) for k in per_rank[0]}}
    write_atomically(path, json.dumps(data, indent=2) + "\n")
