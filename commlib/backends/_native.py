"""commlib's C module for MPI (``commlib/backends/_ready.c``), set up once with the MPI library mpi4py loaded.

:data:`Runner` runs a ready (persistent) operation in one C call; :data:`spin` tests a request in a loop
without the GIL until it completes or a deadline passes; :data:`Direct` posts a large blocking call on the
caller's arrays and tests it so, in one C call. They are None where the module was not built (no C
compiler at install), cannot find MPI's functions, or ``COMMLIB_NATIVE=0`` (Direct also where MPI's
handles are not ints, as in MPICH's ABI): the same work then runs in Python
(:class:`commlib.backends._mpi.Persistent`'s own ``go``, :class:`commlib.backends._waker.Waker`, the
backend's nonblocking calls).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from commlib._environment import native
from commlib.arrays._layout import struct_offsets

__all__ = ["Direct", "Runner", "spin"]


def _spread(outs: list[np.ndarray], whole: np.ndarray) -> None:
    """``outs[i][...] = `` the i-th of ``len(outs)`` equal chunks of ``whole`` (gather's root list)."""
    rows = whole.reshape((len(outs), *outs[0].shape))
    for i, a in enumerate(outs):  # indexing: iterating over a numpy array costs ~4x more
        a[...] = rows[i]


def _pack(ins: list[np.ndarray], whole: np.ndarray) -> None:
    """The i-th of ``len(ins)`` equal chunks of ``whole`` ``= ins[i]`` (scatter's root list)."""
    rows = whole.reshape((len(ins), *ins[0].shape))
    for i, a in enumerate(ins):
        rows[i] = a


def _module() -> Any:
    """commlib.backends._ready, set up; None where it cannot serve (see the module docstring)."""
    if not native():
        return None
    try:
        import ctypes
        import importlib

        _ready = importlib.import_module("commlib.backends._ready")  # built or not: no static import

        lib = ctypes.CDLL(MPI.__file__)  # finds MPI's functions in the MPI library mpi4py links

        def address(name: str) -> int | None:
            return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value

        names = ("MPI_Start", "MPI_Startall", "MPI_Test", "MPI_Testall")
        sizes = (MPI._sizeof(MPI.Request), MPI._sizeof(MPI.Status))
        sample = MPI.Request()
        offset = MPI._addressof(sample) - id(sample)  # where a Request object keeps its handle
        _ready.setup(*(address(n) for n in names), *sizes, MPI.Exception, _spread, _pack, MPI.Request, offset)
        layout = struct_offsets()  # where numpy keeps an array's fields, checked: copies read them directly
        if layout is not None:
            _ready.setup_array(np.ndarray, *layout)
    except (ImportError, OSError, AttributeError, ValueError, TypeError):
        return None
    global Direct
    try:  # Direct posts MPI's nonblocking collectives itself: MPICH's ABI (int handles) and numpy's layout known
        posts = tuple(address(f"MPI_I{n}") for n in _POSTS)
        helpers = (address("MPI_Reduce_local"), address("MPI_Get_count"))
        _ready.setup_direct(posts, helpers, int(MPI.IN_PLACE), MPI._sizeof(MPI.Comm), MPI.ERR_TRUNCATE)
        same = MPI._sizeof(MPI.Comm) == MPI._sizeof(MPI.Datatype) == MPI._sizeof(MPI.Op)
        Direct = _ready.Direct if same and layout is not None else None
    except (AttributeError, ValueError, TypeError):
        Direct = None
    return _ready


#: the nonblocking collectives Direct posts, in the order of commlib.backends._direct.KINDS (MPI_I...)
_POSTS = (
    *("allreduce", "bcast", "reduce", "allgather", "reduce_scatter_block", "alltoall", "gather", "scatter"),
    *("send", "recv"),
)
#: ``Direct(kind, comm, dtype, op, root, tag, rank, size, count, descr, itemsize, in_len, out_len, block, own=0,
#: sum=0, tags=0)``: a large blocking call posted on the caller's arrays (see commlib.backends._direct); None
#: where it cannot serve
Direct: Any = None


_ready = _module()
#: ``Runner(handles, send, recv, own_dst=None, own_src=None, raw=False, tests=256).go(inp, out) -> bool``
Runner: Any = None if _ready is None else _ready.Runner
#: ``spin(request, seconds) -> bool | None``: True done, False time is up, None another thread spins
spin: Any = None if _ready is None else _ready.spin
