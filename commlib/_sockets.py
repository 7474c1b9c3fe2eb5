"""Socket helpers shared by the TCP store, the NCCL emulator's wire, the tests and the benchmarks."""

from __future__ import annotations

import os
import random
import socket

__all__ = ["free_port", "recv_exact"]


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (32768 when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now, below the ephemeral range, for a server another process starts later.

    A port from ``bind(0)`` lies inside the range every outgoing connection (MPI's, a store client's) takes its
    local port from, so one of them can hold it before the server listens (seen in CI as EADDRINUSE from
    torch's TCPStore). Below the range, only listeners take ports.
    """
    low = _ephemeral_low()
    pick = random.Random(os.getpid() * 1_000_003 + os.urandom(4)[0])
    for _ in range(200):
        port = pick.randrange(min(20000, low // 2), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: fall back on the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
