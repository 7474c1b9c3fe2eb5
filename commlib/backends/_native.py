"""commlib's C module for MPI (``commlib/backends/_ready.c``, ``_steps.c``), set up once with the MPI library
mpi4py loaded.

:data:`Steps` is the C executor of a plan (:mod:`commlib.backends._plans`); :data:`spin` tests a request in a
loop without the GIL until it completes or a deadline passes. Both are None where the module was not built
(no C compiler or numpy headers at install), MPI's handles are not ints (MPICH's ABI), MPI lacks a function
it needs, or ``COMMLIB_NATIVE=0``: the same plans then run in Python (:class:`commlib.backends._steps.Steps`)
and waits use :class:`commlib.backends._waker.Waker`.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from commlib._settings import value as setting

__all__ = ["Steps", "module", "spin"]

#: the functions the C module calls, in setup()'s order
_FUNCTIONS = (
    *("MPI_Start", "MPI_Test", "MPI_Send_init", "MPI_Recv_init", "MPI_Isend_c", "MPI_Irecv_c"),
    *("MPI_Get_count_c", "MPI_Request_free"),
)


def _module() -> Any:
    """commlib.backends._ready, set up; None where it cannot serve (see the module docstring)."""
    if not setting("COMMLIB_NATIVE"):
        return None
    try:
        import ctypes
        import importlib

        ready = importlib.import_module("commlib.backends._ready")  # built or not: no static import
        lib = ctypes.CDLL(MPI.__file__)  # finds MPI's functions in the MPI library mpi4py links
        addresses = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _FUNCTIONS)
        sample = MPI.Request()
        offset = MPI._addressof(sample) - id(sample)  # where a Request object keeps its handle
        sizes = (MPI._sizeof(MPI.Request), MPI._sizeof(MPI.Status), MPI._sizeof(MPI.Comm))
        ready.setup(addresses, *sizes, handle(MPI.BYTE), MPI.Exception, MPI.Request, offset)
    except (ImportError, OSError, AttributeError, ValueError, TypeError):
        return None
    return ready


def handle(obj: Any) -> int:
    """An MPI object's handle as the C int MPICH's ABI passes (mpi4py may give it unsigned)."""
    h = MPI._handleof(obj) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


module = _module()
#: ``Steps(plan, comm, small, tag, dtype, op, count, reducer, mismatch, block, stamps)``: the C executor
Steps: Any = None if module is None else module.Steps
#: ``spin(request, seconds) -> bool | None``: True done, False time is up, None another thread spins
spin: Any = None if module is None else module.spin
