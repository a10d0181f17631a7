"""Ports for a later bind lie outside the kernel's ephemeral range, which numbers the outgoing
connections that could otherwise take them first."""

from __future__ import annotations

import socket

from megatron_logra import local_ports


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    first = local_ports._ephemeral_first()
    for _ in range(20):
        port = local_ports.free_port()
        assert local_ports.LOWEST_PORT <= port < first
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    try:
        # A range of the held port and one other: never the held one (the other, or a port of
        # the kernel's choosing should the other be taken too).
        monkeypatch.setattr(local_ports, "LOWEST_PORT", port - 1)
        monkeypatch.setattr(local_ports, "_ephemeral_first", lambda: port + 1)
        assert port not in {local_ports.free_port() for _ in range(20)}
    finally:
        held.close()
