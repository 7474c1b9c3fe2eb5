"""commlib: collective communication for numpy, cupy and torch arrays.

``import commlib as dist`` is a drop-in for torch.distributed's functional API:
same names, arguments and defaults, in-place results, ``async_op=True`` returns
a :class:`Work`. Any call before :func:`init_process_group` joins the default
group from the launcher's environment (``mpiexec``, ``srun``, ``commlib.launch``).
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, ClassVar

from commlib import _barrier, _collectives, _composed, _objects, _p2p, backends, env
from commlib._barrier import *  # noqa: F403 - the calls: each module's __all__ is its public names
from commlib._collectives import *  # noqa: F403
from commlib._composed import *  # noqa: F403
from commlib._group import ProcessGroup, Work
from commlib._objects import *  # noqa: F403
from commlib._ops import ReduceOp
from commlib._p2p import *  # noqa: F403
from commlib._recovery import grow_group, shrink_group
from commlib._world import (
    GroupMember,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_initialized,
    is_torchelastic_launched,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
)
from commlib.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    DistBackendError,
    DistError,
    GroupBrokenError,
    RankFailedError,
)
from commlib.store import FileStore, PrefixStore, Store, TCPStore
from commlib.store._hash import HashStore

__version__ = "0.1.0"

__all__ = [  # the calls (each module's public names), then the rest
    *_barrier.__all__,
    *_collectives.__all__,
    *_composed.__all__,
    *_objects.__all__,
    *_p2p.__all__,
    "Backend",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "FileStore",
    "GroupBrokenError",
    "GroupMember",
    "HashStore",
    "PrefixStore",
    "ProcessGroup",
    "RankFailedError",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "default_pg_timeout",
    "destroy_process_group",
    "env",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "grow_group",
    "init_process_group",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "setting",
    "shrink_group",
]


def setting(name: str) -> Any:
    """The value of commlib's environment setting ``name`` (a ``COMMLIB_*`` or ``GLOBALVIEW_*`` variable) as the
    environment says now, parsed and checked (docs/reliability.md lists them all); ``KeyError`` for another name,
    ``ValueError`` naming the variable for a bad value."""
    from commlib._settings import current

    return current(name)


def is_available() -> bool:
    """True: commlib is always usable (at worst as a single process)."""
    return True


def is_mpi_available() -> bool:
    """True when mpi4py and an MPI library can be loaded."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def is_nccl_available() -> bool:
    """True when the nccl backend can run here: a usable GPU with cupy's NCCL, or the CPU emulator."""
    return is_backend_available(Backend.NCCL)


def is_gloo_available() -> bool:
    """torch's name: True when ``backend="gloo"`` can run here (commlib runs it on its mpi backend)."""
    return is_backend_available(Backend.GLOO)


#: torch's default timeout for a process group other than nccl's (30 minutes); commlib's for the mpi backend.
default_pg_timeout = timedelta(seconds=backends.DEFAULT_TIMEOUT)

#: torch's store and network failures (``DistStoreError``: a store's wait timed out; ``DistNetworkError``: a
#: peer or store unreachable). commlib raises :class:`CommError` for both (a timeout: ``CommTimeoutError``), so
#: a torch script's ``except dist.DistStoreError`` clause catches them, as ``DistError`` catches every failure.
DistStoreError = DistNetworkError = CommError


class Backend(str):
    """torch's ``Backend``: the names ``init_process_group`` takes, as constants (``Backend.GLOO == "gloo"``).

    ``Backend(name)`` gives the lower-case name, as torch's does. commlib runs ``"gloo"`` on its mpi backend;
    :func:`get_backend` then says ``"gloo"``, as torch's does. ``backend_list`` holds the names commlib's
    ``init_process_group`` runs, then those given to :meth:`register_backend`.
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"

    backend_list: ClassVar[list[str]] = [GLOO, NCCL, MPI]

    def __new__(cls, name: str) -> str:  # type: ignore[misc]
        if not isinstance(name, str):
            raise ValueError(f"Backend: the name must be a str, got {name!r}")
        return name.lower()

    @classmethod
    def register_backend(
        cls, name: str, func: Any, extended_api: bool = False, devices: str | list[str] | None = None
    ) -> None:
        """torch's hook for a third-party backend: ``init_process_group(backend=name)`` then runs it.

        ``func(store, rank, world_size, timeout)`` (torch's creator signature; ``timeout`` a timedelta) makes a
        commlib backend (a ``commlib.backends.base.Backend``) from the job's store; a torch ``ProcessGroup``
        is refused when ``init_process_group`` calls it, saying so (run those through ``torch.distributed``).
        ``Backend.NAME`` and ``backend_list`` learn ``name``. commlib's own names cannot be registered.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"Backend.register_backend: name must be a non-empty str, got {name!r}")
        if not callable(func):
            raise TypeError(f"Backend.register_backend: func must be callable (the backend's creator), got {func!r}")
        try:
            backends.register(name, functools.partial(_created, name.lower(), func))
        except ValueError as e:
            raise ValueError(f"Backend.register_backend: {e}") from None
        if not hasattr(cls, name.upper()):
            setattr(cls, name.upper(), name.lower())
        if name.lower() not in cls.backend_list:
            cls.backend_list.append(name.lower())


def _created(name: str, func: Any, place: backends.Place) -> Any:
    """A registered creator's backend for ``place`` (see :meth:`Backend.register_backend`)."""
    from commlib.backends.base import Backend as Engine

    made = func(place.store, place.rank, place.size, timedelta(seconds=place.timeout))
    if not isinstance(made, Engine):
        raise TypeError(
            f"init_process_group: backend {name!r}'s creator returned {type(made).__name__}, not a commlib backend "
            "(commlib.backends.base.Backend); a torch ProcessGroup runs through torch.distributed, not commlib"
        )
    return made


def is_backend_available(backend: str) -> bool:
    """True when ``init_process_group(backend)`` can run here: ``"mpi"`` (also ``"gloo"``, ``"cpu"``)
    always, ``"nccl"`` when a GPU (or the emulator) is usable, a registered backend; False for another name."""
    spec = backends.find(backend)
    return spec is not None and spec.unavailable() is None


def _register_with_torch() -> None:
    """Register the "commlib" torch.distributed backend when torch is already imported (never imports torch)."""
    import sys

    if "torch" in sys.modules:
        from commlib import torch_backend

        torch_backend.register()


_register_with_torch()
