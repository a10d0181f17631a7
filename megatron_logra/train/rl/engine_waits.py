"""The trainer ranks' waits on world rank 0 while it talks to a separate rollout engine.

World rank 0 owns the engine; while it starts it, runs a generation, ships a sync or reads the
engine's checksums, every other rank waits for the result. One collective for that wait would be
bounded by the process group's timeout (``parallel.collective_timeout_s``), unrelated to how
long the engine may legitimately take (``rollout.start_timeout_s`` for its start,
``rollout.request_timeout_s`` per request; a full sync is many requests): a slow start would
kill the run as if a rank had died. Here rank 0 runs the engine call in a thread and, until it
returns, broadcasts a heartbeat every ``heartbeat_s`` (well inside the group's timeout); the
other ranks wait from heartbeat to heartbeat. So the wait lasts exactly as long as rank 0's own
call, which the engine's timeouts bound (every engine request has one and raises past it), and
a rank 0 that dies or hangs outside the engine is still found within the collective timeout.

The waits run over a gloo group of their own (CPU objects, also beside an NCCL world: no
second NCCL communicator runs concurrently with an engine's NCCL sync channel).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# The most time between two heartbeats; a quarter of the group's timeout when that is shorter.
HEARTBEAT_MAX_S = 10.0
_WAITING = "waiting"


class EngineWaits:
    """Collective over the trainer world: :meth:`run` calls a function on world rank 0 and
    hands its result (or its error) to every rank, however long it takes.

    Args:
        timeout_s: the waits group's timeout (``parallel.collective_timeout_s``): how long a
            rank waits for the next heartbeat before it concludes that rank 0 died.
        group: the group to wait over (default: a new gloo group of the whole world with
            ``timeout_s``; creating it is collective).
    """

    def __init__(self, timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
        self.timeout_s = timeout_s
        self.heartbeat_s = min(HEARTBEAT_MAX_S, timeout_s / 4)
        self.group = group if group is not None else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def run(self, call: Callable[[], Any], what: str) -> Any:
        """``call()`` on world rank 0, its result on every rank. An exception on rank 0 is
        raised on every rank as a RuntimeError naming ``what`` and the cause."""
        box: list[Any] = [None]
        if dist.get_rank(dist.group.WORLD) == 0:
            box[0] = self._call_with_heartbeats(call, what)
            dist.broadcast_object_list(box, src=0, group=self.group)
        else:
            while True:
                dist.broadcast_object_list(box, src=0, group=self.group)
                if box[0] != _WAITING:
                    break
        status, value = box[0]
        if status != "ok":
            raise RuntimeError(f"{what} failed on rank 0: {value}")
        return value

    def _call_with_heartbeats(self, call: Callable[[], Any], what: str) -> tuple[str, Any]:
        outcome: list[tuple[str, Any]] = []
        # A CUDA device is chosen per thread: the call runs on this rank's.
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def work() -> None:
            if device is not None:
                torch.cuda.set_device(device)
            try:
                outcome.append(("ok", call()))
            except Exception as error:  # noqa: BLE001 -- re-raised on every rank by run()
                outcome.append(("error", f"{type(error).__name__}: {error}"))

        thread = threading.Thread(target=work, name=f"rank 0: {what}", daemon=True)
        thread.start()
        while True:
            thread.join(self.heartbeat_s)
            if not thread.is_alive():
                return outcome[0]
            dist.broadcast_object_list([_WAITING], src=0, group=self.group)
