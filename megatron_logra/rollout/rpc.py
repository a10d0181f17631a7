"""The request/reply channel to a rollout engine's processes, shared by both engine clients.

Both engines serve one message ``(op, body)`` at a time and answer ``("ok", result)`` or
``("error", message)`` (pickled plain values: the engine may run in another venv, so no classes
cross). The Megatron engine is reached over a local socket, vLLM over two pipes; either way a
:class:`~multiprocessing.connection.Connection` pair. What is common lives here once:

* nothing waits forever: every reply has a timeout, and while waiting the client looks at every
  engine process, so a dead one fails the call at once (naming it, its exit code and the tail of
  its log) instead of at the timeout;
* a timeout or a dead process kills the engine: a late reply would otherwise answer the next
  request;
* one error type, :class:`EngineError`.
"""

from __future__ import annotations

import pickle
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# How often the client looks at the engine processes while it waits for a reply (seconds).
LIVENESS_POLL_S = 0.5
_LOG_TAIL_CHARS = 4000
# A process whose end of the connection closed is normally exiting: this long to see its status.
_EXIT_GRACE_S = 5.0


def disable_nagle(conn: Connection) -> None:
    """TCP_NODELAY on a socket connection. ``Connection`` writes a message over 16 KiB as two
    sends (its length, then the bytes); with Nagle's algorithm the second waits for the peer's
    delayed ACK of the first, ~40 ms per message: measured 36 ms per sync record into the
    Megatron engine (docs/LOG.md, 2026-12-02)."""
    sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a dup of the fd
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()


class EngineError(RuntimeError):
    """A rollout engine failed, refused a request or did not answer in time."""


@dataclass
class EngineProcess:
    """One process of an engine: ``label`` names it in errors (``rank 0``, ``process``)."""

    label: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return ""


class EngineProcesses:
    """The processes of one engine: liveness checks and shutdown.

    Args:
        name: the engine in errors (``rollout engine``, ``vLLM engine``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.members: list[EngineProcess] = []

    def add(self, label: str, process: subprocess.Popen, log_path: Path) -> None:
        self.members.append(EngineProcess(label, process, Path(log_path)))

    def check_alive(self, doing: str, *, grace_s: float = 0.0) -> None:
        """Raise, after killing the rest, if any process has exited (or exits within
        ``grace_s``: a closed connection comes a moment before the exit status)."""
        deadline = time.monotonic() + grace_s
        while grace_s and time.monotonic() < deadline and all(
                m.process.poll() is None for m in self.members):
            time.sleep(0.05)
        for member in self.members:
            code = member.process.poll()
            if code is not None:
                tail = member.log_tail()
                self.stop(kill=True)
                raise EngineError(f"{self.name} {member.label} exited with code {code} while "
                                  f"{doing}; its log ({member.log_path}) ends:\n{tail}")

    def stop(self, *, kill: bool, timeout_s: float = 30.0) -> None:
        """Wait for every process to exit (killing it after ``timeout_s``), or kill at once."""
        for member in self.members:
            if kill and member.process.poll() is None:
                member.process.kill()
            try:
                member.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                member.process.kill()
                member.process.wait()
        self.members = []

    @property
    def logs(self) -> str:
        return ", ".join(str(m.log_path) for m in self.members) or "(no engine processes)"


class RpcClient:
    """Requests to an engine's serving process and its replies, with liveness and timeouts.

    Args:
        processes: the engine's processes (checked while waiting, killed on failure).
        requests, replies: the connection the engine reads requests from / writes replies to
            (one duplex connection may be both).
        timeout_knob: the config key that sets the default timeout, named in timeout errors.
    """

    def __init__(self, processes: EngineProcesses, requests: Connection, replies: Connection,
                 *, timeout_knob: str) -> None:
        self.processes = processes
        self.name = processes.name
        self._requests: Connection | None = requests
        self._replies = replies
        self.timeout_knob = timeout_knob

    @property
    def connected(self) -> bool:
        return self._requests is not None

    def call(self, op: str, body: Any, *, timeout_s: float,
             while_waiting: Callable[[], None] | None = None) -> Any:
        """Send ``(op, body)`` and return the engine's result. ``while_waiting`` runs between
        the send and the wait (a collective the engine joins while it serves ``op``)."""
        self.send(op, body)
        if while_waiting is not None:
            try:
                while_waiting()
            except Exception as error:
                self._check_alive(f"serving {op}")
                self._fail()
                raise EngineError(f"{self.name} {op}: {error}") from error
        return self.receive(op, timeout_s=timeout_s)

    def send(self, op: str, body: Any) -> None:
        if self._requests is None:
            raise EngineError(f"{self.name} {op}: the engine is not running (call start())")
        try:
            self._requests.send_bytes(pickle.dumps((op, body)))
        except OSError as error:
            self._check_alive(f"sending {op}")
            self._fail()
            raise EngineError(f"{self.name} {op}: the connection broke ({error})") from error

    def receive(self, op: str, *, timeout_s: float) -> Any:
        if self._requests is None:
            raise EngineError(f"{self.name} {op}: the engine is not running (call start())")
        deadline = time.monotonic() + timeout_s
        try:
            while not self._replies.poll(LIVENESS_POLL_S):
                self._check_alive(f"serving {op}")
                if time.monotonic() > deadline:
                    self._fail()
                    raise EngineError(
                        f"{self.name} {op}: no reply within {timeout_s:g} s ({self.timeout_knob});"
                        f" raise it or see the engine logs ({self.processes.logs}); the engine "
                        "was stopped")
            status, result = pickle.loads(self._replies.recv_bytes())
        except (EOFError, OSError) as error:
            self._check_alive(f"serving {op}", grace_s=_EXIT_GRACE_S)
            self._fail()
            raise EngineError(f"{self.name} {op}: the connection closed ({error!r})") from error
        if status != "ok":
            raise EngineError(f"{self.name} refused {op}: {result}")
        return result

    def disconnect(self) -> None:
        """Close the connections (the engine sees end of file); the processes are not waited."""
        for conn in {id(c): c for c in (self._requests, self._replies) if c is not None}.values():
            try:
                conn.close()
            except OSError:
                pass
        self._requests = None

    def _check_alive(self, doing: str, *, grace_s: float = 0.0) -> None:
        try:
            self.processes.check_alive(doing, grace_s=grace_s)
        except EngineError:
            self.disconnect()
            raise

    def _fail(self) -> None:
        """The engine's state is unknown (a late reply would answer the next request): stop."""
        self.disconnect()
        self.processes.stop(kill=True)
