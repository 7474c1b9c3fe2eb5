"""Large blocking calls posted on the caller's own arrays, in one C call (``Direct`` in ``_direct.c``).

Above :data:`commlib.backends.mpi.PERSISTENT_MAX` a blocking call has no scratch buffers to copy through:
MPI reads and writes the caller's arrays. The generic path checks, posts and waits in Python, which costs
5-10 us a call in a loop of 1 MiB calls (each transfer evicts the interpreter's working set). A
:class:`Direct` is a ``base.Resident`` in the same tables as the persistent operations (``Backend.sums``,
``Backend.residents``), so from a shape's second call on the group layer's ready path (the C front doors,
or their Python fallbacks) runs it: its ``go`` posts MPI's nonblocking call on the arrays and tests it
without the GIL, in C. Each rank makes its own (no MPI object behind one: nothing to keep in step).

Where the C module was not built, MPI's handles are not ints (MPICH's ABI), or numpy's layout is unknown,
:func:`DirectCache.make` returns None and the backend posts from Python as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from commlib.backends import _native
from commlib.backends._mpi import _BLOCK_MAX, BLOCK_FROM, _abandoned, _lookup, _Ready, settle
from commlib.backends._waker import blocker
from commlib.backends.base import SLOW_BYTES_PER_S, Resident

__all__ = ["KINDS", "Direct", "DirectCache"]

#: the kinds of call a Direct posts (the order of ``_direct.c``'s enum)
KINDS = (
    *("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"),
    *("send", "recv"),
)


def _handle(obj: Any) -> int:
    """An MPI object's handle as the C int MPICH's ABI passes (mpi4py may give it unsigned)."""
    h = MPI._handleof(obj) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


class Direct(_Ready):
    """A large blocking call of one kind, shape, dtype (and root) on the caller's arrays (a base.Resident)."""

    __slots__ = ("c", "cache", "count", "dtype", "go", "key", "nbytes")
    send = recv = None  # no buffers of its own

    def __init__(self, c: Any, dtype: np.dtype, count: int, nbytes: int) -> None:
        self.c, self.dtype, self.count, self.nbytes = c, dtype, count, nbytes
        self.go = c.go
        self.cache: Any = None  # its DirectCache (forget(key), as a PersistentCache has)
        self.key: tuple = ()

    def wait(self, timeout: float) -> bool:
        """Resident.wait: the call ``go`` left running (False: ``timeout`` passed; never run again)."""
        try:
            done = settle(self.c.request(), max(timeout - self.c.spent(), 0.0), _abandoned, self.nbytes)
        except BaseException:
            self._give_up()
            raise
        if not done:
            self._give_up()
        return done

    def finish(self, out: object) -> None:
        """Resident.finish: the result is already in the caller's arrays (a staged root list is filled now)."""
        self.c.finish()

    def _give_up(self) -> None:
        self.c.abandon()  # MPI may still use the arrays: the C object holds them, and this list holds it
        _abandoned.append(self)
        self._forget()


class DirectCache:
    """The Direct calls of one communicator by description, at most ``limit`` (the oldest go first), each
    also in the group layer's table (``sums`` or ``ready[kind]``) where the front doors look it up."""

    def __init__(self, rank: int, size: int, sums: dict[tuple, Resident], ready: dict[str, dict[tuple, Resident]]):
        self.rank, self.size, self.sums, self.ready = rank, size, sums, ready
        self.ops: dict[tuple, Direct] = {}
        self.limit = 64

    def get(self, key: tuple) -> Direct | None:
        return self.ops.get(key)

    def make(
        self,
        key: tuple,
        comm: MPI.Intracomm,
        mpi_type: MPI.Datatype,
        op: MPI.Op | None,
        root: int,
        count: int,
        in_len: int,
        out_len: int,
        tag: int = 0,
    ) -> Direct | None:
        """The Direct for ``key`` (a persistent operation's key: kind first), made now; None where it cannot be.

        ``root``: the root, or a send's or receive's peer (with its ``tag``); ``count``: MPI's count argument;
        ``in_len``/``out_len``: the bytes of the input and the output (a root list: all of it; none: 0)."""
        if _native.Direct is None:
            return None
        dtype: np.dtype = key[3] if key[0] in ("all_gather", "reduce_scatter", "all_to_all") else key[2]
        nbytes = max(in_len, out_len)
        block = min(nbytes / SLOW_BYTES_PER_S, _BLOCK_MAX) if nbytes >= BLOCK_FROM > 0 and blocker() else 0.0
        op_handle = 0 if op is None else _handle(op)
        c = _native.Direct(
            KINDS.index(key[0]), _handle(comm), _handle(mpi_type), op_handle, root, tag, self.rank, self.size,
            count, dtype, dtype.itemsize, in_len, out_len, block,
        )  # fmt: skip
        lookup = _lookup(key)
        d = Direct(c, dtype, lookup[3] if lookup else count, nbytes)
        if len(self.ops) >= self.limit:
            self.forget(next(iter(self.ops)))
        self.ops[key] = d
        d.cache, d.key = self, key
        if lookup is not None:
            table, entry = lookup[0], lookup[1]
            (self.sums if table == "sums" else self.ready[table])[entry] = d
        return d

    def forget(self, key: tuple) -> None:
        """Drop the Direct of ``key`` from here and from its table (it may still be running: the caller keeps it)."""
        d = self.ops.pop(key, None)
        lookup = _lookup(key)
        if d is not None and lookup is not None:
            table = self.sums if lookup[0] == "sums" else self.ready[lookup[0]]
            if table.get(lookup[1]) is d:
                del table[lookup[1]]

    def close(self) -> None:
        self.ops.clear()  # the tables are the persistent cache's, cleared with it
