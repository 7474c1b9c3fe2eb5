"""The job's store for diagnostics: where ranks say where they wait and which rank failed.

MPI and NCCL cannot say which peer is missing, so commlib keeps a small key-value store per job for that:
the launcher's (``COMMLIB_MONITOR_STORE=host:port``, set by ``commlib.launch``), the rendezvous store the job
already shares (torchrun, ``env://``), else one that world rank 0 serves, its address sent to the others once
at initialisation (cost: well under a millisecond). The store is an aid: a request that fails gives the store
up for good (:func:`request` returns None), so a slow or vanished store never stalls a rank twice.
``COMMLIB_MONITOR=0`` turns it off. Requests may come from several threads (a caller's and torch's progress
thread): one at a time.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import threading
from typing import Any

import numpy as np

from commlib._diagnostics import flight as _flight
from commlib._settings import value as setting
from commlib.backends._call import Call
from commlib.errors import CommError

__all__ = ["attach", "dead", "local_ip", "read", "request", "setup", "store"]

_STORE_TIMEOUT = 1.0  # the store is an aid: a slow or vanished store must not stall a rank for long
_PAYLOAD = 256


class _State:
    def __init__(self) -> None:
        self.address: tuple[str, int, str] | None = None  # host, port, token
        self.client: Any = None
        self.dead: str | None = "no job store yet (no world was made)"  # why there is no store to use
        self.server: Any = None  # the StoreServer when this process serves it (world rank 0)
        self.lock = threading.Lock()


_state = _State()


def setup(backend: Any, timeout: float, store: Any = None) -> bool:
    """At world creation, on every rank: find the job's store (the launcher's, the rendezvous ``store`` the job
    already shares, or one world rank 0 serves). False: there is none (one rank, or ``COMMLIB_MONITOR=0``)."""
    job = setting("COMMLIB_JOB_ID")
    if _state.server is not None:  # the last world's (world rank 0 served it): a new world, a new store
        with contextlib.suppress(Exception):
            _state.server.stop()
        _state.server = None
    if _state.client is not None:
        with contextlib.suppress(Exception):
            _state.client.close()  # (a prefix store over the job's store leaves that store open)
    _state.address, _state.client, _state.dead = None, None, None
    if not setting("COMMLIB_MONITOR") or backend.size == 1:
        _state.dead = "no job store (COMMLIB_MONITOR=0, or one rank)"
        _flight.set_job(backend.rank, backend.size, job or str(os.getpid()))
        return False
    given = setting("COMMLIB_MONITOR_STORE")
    if given:
        host, _, port = given.rpartition(":")
        _state.address = (host, int(port), setting("COMMLIB_MONITOR_TOKEN"))
    elif store is not None:
        from commlib.store import PrefixStore

        _state.client = PrefixStore("monitor", store)  # the prefix store never closes the store
    else:
        job = _serve_and_share(backend, timeout) or job
    _flight.set_job(backend.rank, backend.size, job or "unknown")
    return True


def attach(store: Any) -> bool:
    """A newcomer to a running job (``commlib.grow_group``): the job's store, found as its members found it (the
    launcher's, or the job's rendezvous ``store`` under the same prefix). False: there is none."""
    _state.address, _state.client, _state.dead = None, None, None
    given = setting("COMMLIB_MONITOR_STORE")
    if not setting("COMMLIB_MONITOR"):
        _state.dead = "no job store (COMMLIB_MONITOR=0)"
    elif given:
        host, _, port = given.rpartition(":")
        _state.address = (host, int(port), setting("COMMLIB_MONITOR_TOKEN"))
    elif store is not None:
        from commlib.store import PrefixStore

        _state.client = PrefixStore("monitor", store)
    else:
        _state.dead = "no job store to find the running job through"
    return _state.dead is None


def store() -> Any:
    """The job's store itself (connected), for a caller that waits on its keys; None when there is none."""
    with _state.lock:
        return _client()


def _serve_and_share(backend: Any, timeout: float) -> str:
    """World rank 0 serves a store; its address, token and a job id reach the others by one broadcast."""
    buf = np.zeros(_PAYLOAD, np.uint8)
    if backend.rank == 0:
        text = ""
        try:
            text = _serve()
        except OSError as e:
            print(f"commlib: no job monitor store ({e}); timeouts will not name the missing ranks", file=sys.stderr)
        raw = text.encode()[:_PAYLOAD]
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    if not backend.start(Call("broadcast", buf.dtype, buf.size, root=0), buf, buf, 0).wait(timeout):
        return ""
    fields = buf.tobytes().rstrip(b"\0").decode().split()
    if len(fields) == 4:
        _state.address = (fields[0], int(fields[1]), fields[2])
        return fields[3]
    _state.dead = "world rank 0 could not serve a job store"
    return ""


def _serve() -> str:
    from commlib.store._server import StoreServer
    from commlib.store._wire import Limits

    token = secrets.token_hex(16)
    _state.server = StoreServer("0.0.0.0", 0, token.encode(), Limits(), None)
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        host = "127.0.0.1"
    return f"{host} {_state.server.port} {token} {os.getpid()}"


def _client() -> Any:
    """The store client, connected on first use; None once the store proved unusable."""
    if _state.client is None and _state.dead is None:
        if _state.address is None:
            _state.dead = "no job store (COMMLIB_MONITOR=0, or it could not be started)"
            return None
        from commlib.store import TCPStore

        host, port, token = _state.address
        try:
            _state.client = TCPStore(host, port, timeout=_STORE_TIMEOUT, token=token or None)
        except CommError as e:
            _give_up(f"the job store at {host}:{port} is unreachable ({e})")
    return _state.client


def _give_up(why: str) -> None:
    _state.dead = why
    if _state.client is not None:
        with contextlib.suppress(CommError):
            _state.client.close()
    _state.client = None


def request(method: str, *args: Any) -> Any:
    """One store request (``set``, ``compare_set``, ``add``, ...); None when it failed (the store is then given
    up: it must not stall every later wait)."""
    with _state.lock:
        client = _client()
        if client is None:
            return None
        try:
            return getattr(client, method)(*args)
        except (CommError, OSError, ValueError) as e:
            host, port, _ = _state.address or ("?", 0, "")
            _give_up(f"the job store at {host}:{port} stopped answering ({type(e).__name__}: {e})")
            return None


def read(key: str) -> str | None:
    """The value at ``key``, or None when there is none (or no store): never waits for it."""
    missing = "\x00missing"
    raw = request("compare_set", key, missing, missing)
    if raw is None:
        return None
    text = raw.decode(errors="replace")
    return None if text == missing else text


def dead() -> str | None:
    """Why there is no store to use (None: there is one, as far as anyone knows)."""
    return _state.dead


def local_ip() -> str:
    """This host's address as the other ranks reach it: the local end of the route to the job's store (its host
    reaches every rank's), else the host name's address."""
    host = _state.address[0] if _state.address is not None else None
    store = _state.client
    while host is None and store is not None:  # a prefix store over the job's rendezvous store
        host, store = getattr(store, "_host", None), getattr(store, "_store", None)
    if host:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # a datagram socket's connect sends nothing: it only picks the route
            return str(probe.getsockname()[0])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
