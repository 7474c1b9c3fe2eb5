"""Backends: the engines under commlib's narrow waist (``base.Backend`` is the contract), found by name in one
table, :data:`REGISTRY`.

A backend is one module and one line here. Its module provides ``world(place) -> Backend`` (the default group's
communicator: found from ``place`` and agreed among its ranks, or joined as a newcomer, see :class:`Place`) and
``unavailable() -> str | None`` (why it cannot run here); the line names it, its default timeout, and whether it
drives a device.
:func:`register` adds one at run time (``commlib.Backend.register_backend``). Nothing above this table branches
on a backend's name. Only the mpi backend's modules import mpi4py; only the nccl modules import cupy; the table
imports neither until a backend is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "REPORTED",
    "ALIASES",
    "DEFAULT_TIMEOUT",
    "REGISTRY",
    "Joining",
    "Place",
    "Spec",
    "choose",
    "find",
    "launched_world",
    "register",
    "unregister",
]

#: torch's default timeout of a process group other than nccl's (seconds)
DEFAULT_TIMEOUT = 1800.0


@dataclass(frozen=True, slots=True)
class Place:
    """Where a job's default group is made: this process's rank, the job's size, and how its ranks meet."""

    rank: int
    size: int
    local_rank: int
    timeout: float  #: seconds the setting-up may take
    meeting: Any  #: a ``base.Meeting``: the MPI world (an MPI launcher started the job) or the job's store
    store: Any = None  #: the job's store, where its ranks met through one (torchrun, env://, tcp://, file://)
    mpi: Any = None  #: the MPI world's backend, where an MPI launcher started the job
    join: Any = None  #: a newcomer to a running job (``commlib.grow_group``): a :class:`Joining`; ``store``: its keys


@dataclass(frozen=True, slots=True)
class Joining:
    """A newcomer's place in a growing world: the ``nth`` of ``newcomers`` (they join in that order), and the
    members' ``payload`` (``Backend.grow_payload``: a new communicator's unique id)."""

    nth: int
    newcomers: int
    payload: Any = None


@dataclass(frozen=True, slots=True)
class Spec:
    """A backend as ``init_process_group(backend=name)`` finds it."""

    name: str
    world: Callable[[Place], Any]  #: the default group's communicator (a ``base.Backend``), agreed by its ranks
    unavailable: Callable[[], str | None]  #: why it cannot run here (None: it can)
    timeout: float = DEFAULT_TIMEOUT  #: seconds a blocking call waits by default (torch's: 10 min for nccl)
    device: bool = False  #: drives GPUs: ``backend=None`` picks it where it is available


def _late(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported when first called (the table imports no engine)."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args)

    return call


REGISTRY: dict[str, Spec] = {
    "mpi": Spec("mpi", _late("commlib.backends.mpi", "world"), _late("commlib.backends.mpi", "unavailable")),
    "nccl": Spec(
        "nccl", _late("commlib.backends.nccl", "world"), _late("commlib.backends.nccl", "unavailable"), 600.0, True
    ),
}
#: other names ``init_process_group`` takes, as torch scripts spell them
ALIASES = {"gloo": "mpi", "cpu": "mpi"}
#: aliases ``get_backend()`` reports as given, as torch does (a script that asked for gloo checks for it)
REPORTED = frozenset({"gloo"})
_OWN = frozenset((*REGISTRY, *ALIASES))

#: ``launched_world(info, timeout, open_store)``: the MPI world of a job an MPI launcher started (mpiexec, srun,
#: commlib.launch; several nodes' worlds joined through the job's store), a backend the others meet over
launched_world: Callable[..., Any] = _late("commlib.backends._mpi_world", "launched")


def find(name: Any) -> Spec | None:
    """The backend ``name`` (case-insensitive, aliases included), or None."""
    if not isinstance(name, str):
        return None
    name = name.lower()
    return REGISTRY.get(ALIASES.get(name, name))


def choose(name: Any) -> Spec:
    """The backend ``init_process_group(backend=name)`` runs: None or ``"auto"``: a device backend where one is
    available, else ``"mpi"``; ``ValueError`` naming the choices for a name that is none of them."""
    if name is None or (isinstance(name, str) and name.lower() == "auto"):
        return next((s for s in REGISTRY.values() if s.device and s.unavailable() is None), REGISTRY["mpi"])
    spec = find(name)
    if spec is None:
        names = ", ".join(repr(n) for n in (*REGISTRY, *ALIASES, "auto"))
        raise ValueError(f"init_process_group: backend must be one of {names}, got {name!r}")
    return spec


def register(name: str, world: Callable[[Place], Any], timeout: float = DEFAULT_TIMEOUT) -> Spec:
    """Add (or replace) backend ``name`` (lower case), made by ``world(place)``; ``ValueError`` for one of
    commlib's own names."""
    key = name.lower()
    if key in _OWN:
        raise ValueError(f"{name!r} is one of commlib's own backends")
    REGISTRY[key] = spec = Spec(key, world, lambda: None, timeout)
    return spec


def unregister(name: str) -> None:
    """Remove a backend :func:`register` added (commlib's own stay)."""
    if name.lower() not in _OWN:
        REGISTRY.pop(name.lower(), None)
