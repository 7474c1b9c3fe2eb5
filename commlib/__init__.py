"""commlib: collective communication for numpy, cupy and torch arrays.

``import commlib as dist`` is a drop-in for torch.distributed's functional API:
same names, arguments and defaults, in-place results, ``async_op=True`` returns
a :class:`Work`. Any call before :func:`init_process_group` joins the default
group from the launcher's environment (``mpiexec``, ``srun``, ``commlib.launch``).
"""

from __future__ import annotations

from datetime import timedelta

from commlib import env
from commlib._barrier import barrier, monitored_barrier
from commlib._collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    broadcast,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
)
from commlib._composed import all_to_all, all_to_all_single, gather, scatter
from commlib._group import ProcessGroup, Work
from commlib._objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from commlib._ops import ReduceOp
from commlib._p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from commlib._world import (
    DEFAULT_TIMEOUT,
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
)
from commlib.store import FileStore, PrefixStore, Store, TCPStore

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "DistBackendError",
    "DistError",
    "FileStore",
    "GroupBrokenError",
    "GroupMember",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "default_pg_timeout",
    "destroy_process_group",
    "env",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
]


def is_available() -> bool:
    """True: commlib is always usable (at worst as a single process)."""
    return True


def is_mpi_available() -> bool:
    """True when mpi4py and an MPI library can be loaded."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def is_nccl_available() -> bool:
    """True when the nccl backend can run here: a usable GPU with cupy's NCCL, or the CPU emulator."""
    from commlib._rendezvous import emulated
    from commlib.backends.nccl import nccl_unavailable_reason

    return emulated() or nccl_unavailable_reason() is None


def is_gloo_available() -> bool:
    """torch's name: True when ``backend="gloo"`` can run here (commlib runs it on its mpi backend)."""
    return is_backend_available(Backend.GLOO)


#: torch's default timeout for a process group other than nccl's (30 minutes); commlib's for the mpi backend.
default_pg_timeout = timedelta(seconds=DEFAULT_TIMEOUT["mpi"])


class Backend(str):
    """torch's ``Backend``: the names ``init_process_group`` takes, as constants (``Backend.GLOO == "gloo"``).

    ``Backend(name)`` gives the lower-case name, as torch's does; commlib runs ``"gloo"`` (and ``"cpu"``) on its
    mpi backend, so :func:`get_backend` then says ``"mpi"``.
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"

    def __new__(cls, name: str) -> str:  # type: ignore[misc]
        if not isinstance(name, str):
            raise ValueError(f"Backend: the name must be a str, got {name!r}")
        return name.lower()


def is_backend_available(backend: str) -> bool:
    """True when ``init_process_group(backend)`` can run here: ``"mpi"`` (also ``"gloo"``, ``"cpu"``)
    always, ``"nccl"`` when :func:`is_nccl_available`; False for any other name."""
    from commlib._world import _BACKEND_ALIASES

    name = _BACKEND_ALIASES.get(str(backend).lower())
    return is_nccl_available() if name == "nccl" else name is not None


def _register_with_torch() -> None:
    """Register the "commlib" torch.distributed backend when torch is already imported (never imports torch)."""
    import sys

    if "torch" in sys.modules:
        from commlib import torch_backend

        torch_backend.register()


_register_with_torch()
