"""Where an engine replays the trainer's low-rank merges, and whether that replay is exact.

The shadow's replay is bit-exact because it calls the trainer's merge function on blocks of the
trainer's shapes with the same inputs (docs/sync.md, "What is exact"). That argument holds on
the same kind of device only: an fp32 GEMM on a GPU (cuBLAS) and on a CPU (MKL / OpenBLAS) sums
the r products of an entry in different orders and rounds differently. So:

* the trainer names the device kind it merges on (``cpu`` or ``cuda``) when the engine starts;
* each engine rank replays on a device of that kind when it has one (its own GPU), the shadow
  staying in host memory (a merge moves one block there and back, as the trainer's ``host``
  master mode does), and on the CPU otherwise;
* an engine that replays on another kind cannot be exact: ``sync.mode=low_rank`` is refused at
  start and ``sync.mode=auto`` ships sparse deltas instead (:mod:`megatron_logra.sync.delta`:
  XOR of bit patterns, exact on any device), so the weight check keeps its meaning (a mismatch
  is a fault, never device rounding) instead of forcing a full refit at every check.

Two GPUs of different models (or cuBLAS versions) are the same kind here; whether their merges
agree is what the weight check (and ``tools/gpu_check.py``'s ``sync_megatron`` section) shows.
"""

from __future__ import annotations

import torch

DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda")


def replay_device(merge_device: str, engine_device: torch.device) -> torch.device:
    """The device an engine rank replays merges on: its own device if that is the trainer's kind
    (``merge_device``), else the CPU."""
    if merge_device not in DEVICE_KINDS:
        raise ValueError(f"merge device {merge_device!r} is not one of {DEVICE_KINDS}")
    return engine_device if engine_device.type == merge_device else torch.device("cpu")


def low_rank_replay_problem(merge_device: str, engine_replay_device: str) -> str | None:
    """Why low-rank replay on ``engine_replay_device`` would not reproduce a trainer that merges
    on ``merge_device`` bit for bit, or None when it does."""
    if merge_device == engine_replay_device:
        return None
    return (f"the trainer merges LoGRA updates on {merge_device}, the rollout engine can replay "
            f"them only on {engine_replay_device}: fp32 GEMMs on the two round differently, so "
            "the engine's weights would drift from the trainer's")
