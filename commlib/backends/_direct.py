"""Large blocking calls run on the caller's own arrays, in one C call (``Direct`` in ``_direct.c``).

Above :data:`commlib.backends.mpi.PERSISTENT_MAX` a blocking call has no scratch buffers to copy through:
the messages read and write the caller's arrays. The generic path checks, posts and waits in Python, which
costs 5-10 us a call in a loop of 1 MiB calls (each transfer evicts the interpreter's working set). A
:class:`Direct` is a ``base.Resident`` in the same tables as the persistent operations (``Backend.sums``,
``Backend.residents``), so from a shape's second call on the group layer's ready path (the C front doors,
or their Python fallbacks) runs it: its ``go`` posts the messages and tests them without the GIL, in C.
Each rank makes its own (no MPI object behind one: nothing to keep in step).

The messages are point-to-point steps of commlib's own (:data:`OWN`; ``_direct.c``'s header says which and
why: MPICH's nonblocking collectives are slower than its blocking ones, and reduce with an unvectorized
loop), on a communicator that carries nothing else (:attr:`DirectCache.steps`). Every rank must run a call
the same way, so the backend sends every such call above the persistent size through a Direct, the
asynchronous ones included (:meth:`DirectCache.posted`: a :class:`Posted` handle), whatever its operation.
``COMMLIB_MPI_OWN_STEPS=0`` (the same on every rank) posts MPI's nonblocking collective instead.

Where the C module was not built, MPI's handles are not ints (MPICH's ABI), or numpy's layout is unknown,
:func:`DirectCache.make` returns None and the backend posts MPI's calls from Python.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from mpi4py import MPI

from commlib.backends import _native
from commlib.backends._mpi import _BLOCK_MAX, BLOCK_FROM, _abandoned, _lookup, _Ready, mpi_error
from commlib.backends._waker import blocker
from commlib.backends.base import SLOW_BYTES_PER_S, Resident, poll

__all__ = ["KINDS", "OWN", "Direct", "DirectCache", "Posted"]

#: the kinds of call a Direct posts (the order of ``_direct.c``'s enum)
KINDS = (
    *("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"),
    *("send", "recv"),
)


#: the kinds that run as point-to-point steps of their own (COMMLIB_MPI_OWN_STEPS=0: MPI's nonblocking
#: collectives instead; every rank must agree)
OWN = (
    frozenset()
    if os.environ.get("COMMLIB_MPI_OWN_STEPS", "1") == "0"
    else frozenset(
        ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
    )
)
#: all_reduce's sum of a received piece in C, by numpy dtype (the order of _direct.c's enum; others: MPI_Reduce_local)
_SUMS = {"f4": 1, "f8": 2, "c8": 1, "c16": 2, "i1": 3, "u1": 3, "i2": 4, "u2": 4, "i4": 5, "u4": 5, "i8": 6, "u8": 6}


def _handle(obj: Any) -> int:
    """An MPI object's handle as the C int MPICH's ABI passes (mpi4py may give it unsigned)."""
    h = MPI._handleof(obj) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


class Direct(_Ready):
    """A large blocking call of one kind, shape, dtype (and root) on the caller's arrays (a base.Resident)."""

    __slots__ = ("block", "c", "cache", "count", "dtype", "go", "key", "nbytes")
    send = recv = None  # no buffers of its own

    def __init__(self, c: Any, dtype: np.dtype, count: int, nbytes: int, block: bool) -> None:
        self.c, self.dtype, self.count, self.nbytes, self.block = c, dtype, count, nbytes, block
        self.go = c.go
        self.cache: Any = None  # its DirectCache (forget(key), as a PersistentCache has)
        self.key: tuple = ()

    def wait(self, timeout: float) -> bool:
        """Resident.wait: the call ``go`` left running (False: ``timeout`` passed; never run again).

        As :func:`commlib.backends._mpi.settle` waits: C's spin without the GIL while the data may be moving
        (where ranks may block), then :func:`poll` of the C test (naps, the watchdog)."""
        c = self.c
        timeout, busy = max(timeout - c.spent(), 0.0), self.nbytes / SLOW_BYTES_PER_S
        try:
            if self.block:
                spent = min(timeout, busy, _BLOCK_MAX)
                done = c.spin(spent)
                if done:
                    return True
                if done is not None:
                    timeout, busy = max(timeout - spent, 0.0), max(busy - spent, 0.0)
            if poll(c.test, timeout, busy):
                return True
        except BaseException:
            self._give_up()
            raise
        self._give_up()
        return False

    def finish(self, out: object) -> None:
        """Resident.finish: the result is already in the caller's arrays (a staged root list is filled now)."""
        self.c.finish()

    def _give_up(self) -> None:
        self.c.abandon()  # MPI may still use the arrays: the C object holds them, and this list holds it
        _abandoned.append(self)
        self._forget()


class Posted:
    """The handle of an asynchronous call a :class:`Direct` of its own runs (:meth:`DirectCache.posted`); once
    complete, the Direct goes back to its cache's spares."""

    __slots__ = ("cache", "d", "key")

    def __init__(self, d: Direct, cache: DirectCache, key: tuple) -> None:
        self.d: Direct | None = d  # None once complete (back among the spares)
        self.cache, self.key = cache, key

    def test(self) -> bool:
        if self.d is None:
            return True
        try:
            if not self.d.c.test():
                return False
        except MPI.Exception as e:
            self.d._give_up()
            raise mpi_error(e) from None
        self._end()
        return True

    def wait(self, timeout: float) -> bool:
        if self.d is None:
            return True
        try:
            if not self.d.wait(timeout):
                return False
        except MPI.Exception as e:
            raise mpi_error(e) from None
        self._end()
        return True

    def _end(self) -> None:
        d, self.d = self.d, None
        assert d is not None
        d.c.finish()
        spares = self.cache.spares.setdefault(self.key, [])
        if len(spares) < 4 and len(self.cache.spares) <= self.cache.limit:
            spares.append(d)

    def defer(self) -> bool:
        return False  # host memory: the caller waits


class DirectCache:
    """The Direct calls of one communicator by description, at most ``limit`` (the oldest go first), each
    also in the group layer's table (``sums`` or ``ready[kind]``) where the front doors look it up.

    ``steps``: where the :data:`OWN` kinds send their messages: (communicator, tag, whether each kind and step
    adds to the tag: on a communicator of their own) or None (no own steps: MPI's calls)."""

    def __init__(self, rank: int, size: int, sums: dict[tuple, Resident], ready: dict[str, dict[tuple, Resident]]):
        self.rank, self.size, self.sums, self.ready = rank, size, sums, ready
        self.ops: dict[tuple, Direct] = {}
        self.limit = 64
        self.steps: tuple[MPI.Intracomm, int, bool] | None = None
        self.spares: dict[tuple, list[Direct]] = {}  # Directs of asynchronous calls, idle (Posted._end)

    def get(self, key: tuple) -> Direct | None:
        return self.ops.get(key)

    def owns(self, kind: str) -> bool:
        """Whether this communicator's Directs of ``kind`` take the point-to-point steps of their own (broadcast:
        on 2 ranks only; on more, MPI's scatter and all-gather move less through the root)."""
        return kind in OWN and self.size > 1 and self.steps is not None and (kind != "broadcast" or self.size == 2)

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
        *,
        keep: bool = True,
        counts: tuple[int, ...] | None = None,
    ) -> Direct | None:
        """The Direct for ``key`` (a persistent operation's key: kind first), made now; None where it cannot be.

        ``root``: the root, or a send's or receive's peer (with its ``tag``); ``count``: MPI's count argument;
        ``in_len``/``out_len``: the bytes of the input and the output (a root list: all of it; none: 0);
        ``keep``: False for one asynchronous call (in no table). An uneven all_to_all (kind ``exchange``): its
        ``counts`` (send counts, then receive counts, in elements), in the messages of the Python path
        (``MpiBackend._pairwise``: ``comm`` and ``tag`` as given)."""
        if _native.Direct is None:
            return None
        kind = key[0]
        dtype: np.dtype = key[3] if kind in ("all_gather", "reduce_scatter", "all_to_all", "exchange") else key[2]
        nbytes = max(in_len, out_len)
        block = min(nbytes / SLOW_BYTES_PER_S, _BLOCK_MAX) if nbytes >= BLOCK_FROM > 0 and blocker() else 0.0
        op_handle = 0 if op is None else _handle(op)
        own, summed, tags = self.owns(kind) or kind == "exchange", 0, False
        if own and kind != "exchange":
            comm, tag, tags = self.steps  # type: ignore[misc]
            tag += 4 * KINDS.index(kind) if tags else 0
            summed = _SUMS.get(f"{dtype.kind}{dtype.itemsize}", 0) if op == MPI.SUM else 0
        c = _native.Direct(
            KINDS.index("all_to_all" if kind == "exchange" else kind), _handle(comm), _handle(mpi_type), op_handle,
            root, tag, self.rank, self.size, count, dtype, dtype.itemsize, in_len, out_len, block, own, summed, tags,
            counts,
        )  # fmt: skip
        lookup = _lookup(key)
        d = Direct(c, dtype, lookup[3] if lookup else count, nbytes, block > 0)
        if not keep:
            return d
        if len(self.ops) >= self.limit:
            self.forget(next(iter(self.ops)))
        self.ops[key] = d
        d.cache, d.key = self, key
        if lookup is not None:
            table, entry = lookup[0], lookup[1]
            (self.sums if table == "sums" else self.ready[table])[entry] = d
        return d

    def posted(self, key: tuple, inp: object, out: object, *args: Any) -> Posted | None:
        """An asynchronous call of ``key`` on ``inp`` and ``out``, started on a Direct of its own made from
        ``args`` (:meth:`make`'s after the key), where its kind takes the steps of its own (:meth:`owns`: as
        the blocking calls of the same size do); None where it does not (the caller posts MPI's call)."""
        if not self.owns(key[0]):
            return None
        spares = self.spares.get(key)
        d = spares.pop() if spares else self.make(key, *args, keep=False)
        if d is None:
            return None
        try:
            d.c.start(inp, out)
        except MPI.Exception as e:
            raise mpi_error(e) from None
        return Posted(d, self, key)

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
        self.spares.clear()
