"""A free TCP port on 127.0.0.1 for a rendezvous that another process binds later.

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from its ephemeral range, the
same range it numbers outgoing connections from. Released and bound again a few seconds later by
another process (a rollout engine's rank 0 after importing Megatron and building its model),
such a port can meanwhile have become the local end of one of the many connections gloo and the
rendezvous stores open -- "Address already in use" (a rollout engine's start failed so in the
suite on a 2-core machine, 2026-12-04). :func:`free_port` picks ports below the ephemeral range
instead, which the kernel never assigns on its own, and checks that nobody holds one now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_FIRST = 32768  # Linux's default range starts here
LOWEST_PORT = 10000
"""Below this lie well-known and commonly configured service ports."""
_ATTEMPTS = 200


def _ephemeral_first() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_FIRST


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and outside the kernel's ephemeral range (any free
    port when that range leaves no room below it)."""
    first = _ephemeral_first()
    if first > LOWEST_PORT + 1:
        rng = random.SystemRandom()
        for _ in range(_ATTEMPTS):
            port = rng.randrange(LOWEST_PORT, first)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
