"""SIGTERM as a request to checkpoint and stop, agreed on by every rank.

Clusters preempt jobs with SIGTERM and a grace period. The handler only records the request;
the training loop asks, between steps, whether any rank received it (one tiny all-reduce), so
that all ranks stop after the same step, write one checkpoint together and exit cleanly.
"""

from __future__ import annotations

import logging
import os
import signal
import types
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

RECORD_DIR_ENV = "MEGATRON_LOGRA_PREEMPTION_RECORD_DIR"
"""Set by the launch scripts (launch/launch_args.sh): the directory where each worker records
that it saved a checkpoint after SIGTERM and stopped cleanly. torchrun exits 1 whenever it was
signalled, whatever its workers did; these records are how the script knows they all saved."""


def record_preempted_save(step: int) -> None:
    """Record (when a launch script asked for it) that this rank checkpointed step ``step``
    after SIGTERM and is about to exit cleanly. Call it last, after the process groups are
    down."""
    directory = os.environ.get(RECORD_DIR_ENV)
    if not directory:
        return
    rank = os.environ.get("RANK", "0")
    (Path(directory) / f"rank-{rank}.saved").write_text(f"{step}\n")


class PreemptionFlag:
    """Installs a SIGTERM handler for its lifetime (use as a context manager)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: object = None

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        del frame
        if not self.requested:
            logger.warning("received signal %d: will checkpoint and stop after this step", signum)
        self.requested = True

    def __enter__(self) -> PreemptionFlag:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]

    def agreed(self, device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
        """True on every rank if any rank of ``group`` was asked to stop (collective)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)
