"""Socket helpers shared by the TCP store and the NCCL emulator's wire."""

from __future__ import annotations

import socket

__all__ = ["recv_exact"]


def recv_exact(sock: socket.socket, n: int, closed: str = "connection closed by the other side") -> bytes:
    """Read exactly ``n`` bytes from ``sock``; ``ConnectionError(closed)`` if it ends first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(closed)
        got += k
    return bytes(buf)
