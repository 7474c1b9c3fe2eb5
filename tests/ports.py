"""A TCP port for a test's server to listen on, chosen so that no outgoing connection can take it first
(:func:`commlib._sockets.free_port`, which the benchmarks use too)."""

from __future__ import annotations

from commlib._sockets import free_port

__all__ = ["free_port"]
