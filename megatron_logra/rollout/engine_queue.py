"""Calls to a separate rollout engine in one order, from the process that owns it: made inline, or
by a thread of their own so that the engine generates while the trainer updates
(``rollout.max_staleness`` > 0, docs/async.md).

An engine serves one request at a time, in the order it receives them, so the order in which the
trainer submits generations and sync records *is* the engine's history: a generation submitted
after the records of policy version v and before those of v + 1 samples with version v. The
queue keeps that order and nothing else: it never reorders, merges or drops a call.

* :meth:`EngineQueue.submit` queues a call and returns its :class:`Ticket`; :meth:`EngineQueue.wait`
  blocks until that call has run and returns its result or raises its error.
* :meth:`EngineQueue.post` queues a call whose result nobody waits for (a sync record): its error
  is raised by the next :meth:`~EngineQueue.wait` (or by :meth:`~EngineQueue.drain`).
* The first call that fails fails every call after it: the engine's state is unknown (a refused
  record changed nothing, but the records after it would be refused as gaps), and the engine
  client has already stopped a dead or silent engine. Nothing waits forever: every engine call
  has the engine's own timeout (``rollout.request_timeout_s``; a dead process fails it at once),
  and a waiter also gives up when the call it waits behind has run for twice that long.

Inline (``background=False``), the calls run in the caller's thread, in order, when it waits for
one of them (a posted call: at once): exactly the synchronous loop, with the same accounting. In
the background, one daemon thread makes the calls; it is the only thread that touches the engine
until :meth:`EngineQueue.close`.

The queue also keeps the clock of the two sides: when the engine was busy (each call's start and
end, as its caller sees them) and how long the caller waited for it.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_logra.rollout.engine import EngineResponse, GenerationEngine
from megatron_logra.rollout.rpc import LIVENESS_POLL_S, EngineError

logger = logging.getLogger(__name__)

# A waiter gives up on a call that has run this many times the engine's request timeout (the
# engine client's own timeout fires at 1x; this only guards against a client without one).
_STUCK_CALL_FACTOR = 2.0
# close() waits this long for the running call before it closes the engine under it.
_CLOSE_WAIT_S = 5.0
# Busy intervals older than this are forgotten (the per-step accounting looks back one step).
_INTERVAL_MEMORY = 4096


@dataclass
class Ticket:
    """One queued call: its result or error once ``done`` is set."""

    op: str
    call: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    started: float | None = None
    finished: float | None = None

    @property
    def duration_s(self) -> float:
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started


class EngineQueue:
    """The calls of one process to one engine, in submission order.

    Args:
        engine: the started engine (the queue never starts it; :meth:`close` closes it).
        background: make the calls on a thread of the queue's own (else inline).
        request_timeout_s: the engine's own per-request timeout (``rollout.request_timeout_s``).
    """

    def __init__(self, engine: GenerationEngine, *, background: bool,
                 request_timeout_s: float) -> None:
        self.engine = engine
        self.background = background
        self.request_timeout_s = request_timeout_s
        self._failure: BaseException | None = None
        self._failure_seen = False
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._running: Ticket | None = None
        self.waited_s = 0.0
        """Total time callers spent waiting for the engine (inline calls included)."""
        self._pending: queue.SimpleQueue[Ticket | None] = queue.SimpleQueue()
        self._inline: collections.deque[Ticket] = collections.deque()  # not yet run (inline)
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._serve, name="rollout-engine-calls",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ calls

    def submit(self, op: str, *args: Any, **kwargs: Any) -> Ticket:
        """Queue ``engine.<op>(*args, **kwargs)``; never raises (errors come from :meth:`wait`),
        never waits."""
        return self._enqueue(Ticket(op, lambda: getattr(self.engine, op)(*args, **kwargs)))

    def post(self, op: str, *args: Any, **kwargs: Any) -> None:
        """Queue a call nobody waits for; inline it runs now (after the calls queued before it)
        and raises as a plain call would."""
        ticket = self.submit(op, *args, **kwargs)
        if not self.background:
            self.wait(ticket)

    def wait(self, ticket: Ticket) -> Any:
        """The call's result; its error, or the error of a call before it that failed."""
        start = time.perf_counter()
        try:
            if not self.background:
                while not ticket.done.is_set():
                    self._run(self._inline.popleft())
            while not ticket.done.wait(LIVENESS_POLL_S):
                self._check_progress(ticket)
        finally:
            self.waited_s += time.perf_counter() - start
        if ticket.error is not None:
            self._failure_seen = True
            raise ticket.error
        if self._failure is not None:
            # A posted call (a sync record) failed: the run cannot go on, say so at once.
            self._failure_seen = True
            raise self._failure
        return ticket.result

    def drain(self) -> None:
        """Wait for every queued call; raise the first failure (posted calls' included)."""
        self.wait(self._enqueue(Ticket("drain", lambda: None)))

    # ------------------------------------------------------------------ accounting

    def busy_s(self, since: float, until: float) -> float:
        """Seconds the engine spent in calls between ``since`` and ``until`` (perf_counter)."""
        with self._lock:
            intervals = list(self._intervals)
            running = self._running
        total = sum(max(0.0, min(end, until) - max(start, since)) for start, end in intervals)
        if running is not None and running.started is not None and running.finished is None:
            total += max(0.0, until - max(running.started, since))
        return total

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the thread (after the running call, or under it after a short wait: the engine's
        close then fails that call) and close the engine. Queued calls are dropped."""
        dropped = list(self._inline)
        self._inline.clear()
        if self._thread is not None:
            while True:
                try:
                    ticket = self._pending.get_nowait()
                except queue.Empty:
                    break
                if ticket is not None:
                    dropped.append(ticket)
            self._pending.put(None)
        for ticket in dropped:
            ticket.error = EngineError("the rollout engine was closed before this call")
            ticket.done.set()
        if dropped:
            logger.info("closing the rollout engine: %d queued call(s) dropped", len(dropped))
        if self._thread is not None:
            self._thread.join(_CLOSE_WAIT_S)
        if self._failure is not None and not self._failure_seen:
            logger.error("a rollout engine call failed and nothing waited for it: %s",
                         self._failure)
        self.engine.close()
        if self._thread is not None:
            self._thread.join(_CLOSE_WAIT_S)
            self._thread = None

    # ------------------------------------------------------------------ internals

    def _enqueue(self, ticket: Ticket) -> Ticket:
        if self.background:
            self._pending.put(ticket)
        else:
            self._inline.append(ticket)
        return ticket

    def _serve(self) -> None:
        while True:
            ticket = self._pending.get()
            if ticket is None:
                return
            self._run(ticket)

    def _run(self, ticket: Ticket) -> None:
        if self._failure is not None:
            ticket.error = EngineError(f"rollout engine {ticket.op}: not run, an earlier call "
                                       f"failed ({self._failure})")
            ticket.done.set()
            return
        with self._lock:
            self._running = ticket
        ticket.started = time.perf_counter()
        try:
            ticket.result = ticket.call()
        except BaseException as error:  # noqa: BLE001 -- handed to the waiter, never lost
            ticket.error = error
            self._failure = error
        ticket.finished = time.perf_counter()
        with self._lock:
            self._running = None
            self._intervals.append((ticket.started, ticket.finished))
            del self._intervals[:-_INTERVAL_MEMORY]
        ticket.done.set()

    def _check_progress(self, ticket: Ticket) -> None:
        if self._thread is not None and not self._thread.is_alive() and not ticket.done.is_set():
            raise RuntimeError(f"rollout engine {ticket.op}: the thread that calls the engine "
                               "has stopped")
        running = self._running
        if running is not None and running.started is not None and \
                time.perf_counter() - running.started > _STUCK_CALL_FACTOR * \
                self.request_timeout_s:
            raise EngineError(
                f"rollout engine {running.op}: no answer in {_STUCK_CALL_FACTOR:g}x "
                f"rollout.request_timeout_s={self.request_timeout_s:g} s, and the engine client "
                "did not time out; the run stops")


class QueuedEngine:
    """A :class:`GenerationEngine` whose calls go through an :class:`EngineQueue`: generations
    and weight reads wait for their result, sync records are posted (their errors arrive with
    the next wait). Given to the policy sync and to the evaluation in place of the engine."""

    def __init__(self, calls: EngineQueue) -> None:
        self.calls = calls

    @property
    def weight_layout(self) -> str:
        return self.calls.engine.weight_layout

    @property
    def replay_device(self) -> str:
        """Where the engine replays low-rank merges (fixed at its start)."""
        return self.calls.engine.replay_device

    @property
    def transport_stats(self) -> Any:
        return getattr(self.calls.engine, "transport_stats", None)

    def start(self) -> None:
        self.calls.engine.start()

    def generate(self, prompt_token_ids: list[list[int]], *, max_new_tokens: int,
                 temperature: float, top_p: float, seed: int,
                 stop_token_ids: list[int]) -> list[EngineResponse]:
        return self.calls.wait(self.calls.submit(
            "generate", prompt_token_ids, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=stop_token_ids))

    def apply_sync(self, payload: bytes) -> None:
        self.calls.post("apply_sync", payload)

    def weight_checksums(self) -> dict[str, str]:
        return self.calls.wait(self.calls.submit("weight_checksums"))

    def close(self) -> None:
        self.calls.close()
