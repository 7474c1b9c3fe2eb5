"""commlib's C module for MPI (``commlib/backends/_executor.c``, ``_steps.c``), set up once with the MPI library
mpi4py loaded.

:data:`Steps` is the C executor of a plan (:mod:`commlib.backends._plans`); None where the module was not built
(no C compiler or numpy headers at install), MPI's handles are not ints (MPICH's ABI), MPI lacks a function it
needs, its constants differ from Python's (a stale build), or ``COMMLIB_NATIVE=0``: the same plans then run in
Python (:class:`commlib.backends._steps.Steps`), exchanging the same messages.
"""

from __future__ import annotations

import warnings
from typing import Any

from mpi4py import MPI

from commlib._settings import value as setting
from commlib.backends import _plans, _stamp
from commlib.backends._call import OP_CODES

__all__ = ["Steps", "expected", "handle", "module"]

#: the functions the C module calls, in setup()'s order
_FUNCTIONS = (
    *("MPI_Start", "MPI_Test", "MPI_Send_init", "MPI_Recv_init", "MPI_Isend_c", "MPI_Irecv_c"),
    *("MPI_Get_count_c", "MPI_Request_free"),
)


def expected() -> dict[str, int]:
    """The numbers the C executor must share with Python (its ``CONSTANTS``)."""
    from commlib.backends._steps import TAG_SPAN

    ops = {op.name: code for op, code in OP_CODES.items()}
    codes = {"COPY": _plans.COPY_CODE, "REDUCE": _plans.REDUCE_CODE}
    return (
        {"STAMP": _stamp.SIZE, "TAG_SPAN": TAG_SPAN, "IN": _plans.IN, "OUT": _plans.OUT, "TMP": _plans.TMP}
        | codes
        | ops
    )


def _module() -> Any:
    """commlib.backends._executor, set up; None where it cannot serve (see the module docstring)."""
    if not setting("COMMLIB_NATIVE"):
        return None
    try:
        import ctypes
        import importlib

        c = importlib.import_module("commlib.backends._executor")  # built or not: no static import
        lib = ctypes.CDLL(MPI.__file__)  # finds MPI's functions in the MPI library mpi4py loads
        addresses = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _FUNCTIONS)
        sizes = (MPI._sizeof(MPI.Request), MPI._sizeof(MPI.Status), MPI._sizeof(MPI.Comm))
        c.setup(addresses, *sizes, handle(MPI.BYTE), MPI.Exception)
    except (ImportError, OSError, AttributeError, ValueError, TypeError):
        return None
    if expected() != c.CONSTANTS:
        differ = {k: (v, expected().get(k)) for k, v in c.CONSTANTS.items() if expected().get(k) != v}
        warnings.warn(
            f"commlib: the C executor's constants differ from Python's ({differ}: a stale build? pip install -e . "
            "again); running the Python executor",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    c.runs_init(int(setting("COMMLIB_FLIGHT_RECORDER_SIZE")))  # the runs go() completes (flight recorder)
    return c


def handle(obj: Any) -> int:
    """An MPI object's handle as the C int MPICH's ABI passes (mpi4py may give it unsigned)."""
    h = MPI._handleof(obj) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


module = _module()
#: ``Steps(plan, comm, small, tag, dtype, op, count, reducer, mismatch, block, stamps)``: the C executor
Steps: Any = None if module is None else module.Steps
