"""The mpi backend's parts: MPI datatypes and ops for each dtype, request handles, and persistent operations.

MPI has no float16/bfloat16 arithmetic: those are reduced in a float32 scratch buffer and
rounded once (moved as 16-bit words otherwise). AVG is SUM followed by one division (integers: NCCL's, truncating
toward zero).
"""

from __future__ import annotations

import atexit
import math
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from commlib._ops import ReduceOp
from commlib.arrays import LOW_PRECISION, bfloat16
from commlib.backends._native import Runner as _Runner
from commlib.backends._native import _pack, _spread
from commlib.backends._waker import blocker
from commlib.backends.base import SLOW_BYTES_PER_S, Resident, poll
from commlib.errors import TransportError

__all__ = [
    "MOVE_TYPE",
    "PIECE_BYTES",
    "REDUCTIONS",
    "Persistent",
    "PersistentCache",
    "Pieces",
    "Recv",
    "Req",
    "Requests",
    "average",
    "pieces",
    "settle",
]

#: A large in-place reduction runs as pieces of this many bytes, one after the other (COMMLIB_MPI_PIECE_BYTES;
#: 0: never). MPICH reduces a buffer far larger than the cache 1.3-3x slower in one call than in 2 MiB
#: pieces (docs/benchmarks.md, "Large all_reduce").
PIECE_BYTES = int(os.environ.get("COMMLIB_MPI_PIECE_BYTES", str(2 << 20)))
#: A wait for this many bytes or more blocks in MPI itself (:mod:`commlib.backends._waker`) while its
#: data may be moving: MPI progresses a transfer faster in its own loop than under repeated tests
#: (COMMLIB_MPI_BLOCK_FROM; 0: never).
BLOCK_FROM = int(os.environ.get("COMMLIB_MPI_BLOCK_FROM", str(64 << 10)))
_BLOCK_MAX = 0.25  # seconds at most in the blocking phase (then poll(): naps and the watchdog)

MOVE_TYPE = {
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint64): MPI.UINT64_T,
    np.dtype(np.float16): MPI.UINT16_T,
    bfloat16: MPI.UINT16_T,
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
    np.dtype(np.bool_): MPI.C_BOOL,
}
_OP = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVG: MPI.SUM,
    ReduceOp.PRODUCT: MPI.PROD,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.BAND: MPI.BAND,
    ReduceOp.BOR: MPI.BOR,
    ReduceOp.BXOR: MPI.BXOR,
}
# MPI reduces C_BOOL only with logical ops; these give torch's results on bool tensors.
_BOOL_OP = {
    ReduceOp.SUM: MPI.LOR,
    ReduceOp.MAX: MPI.LOR,
    ReduceOp.BOR: MPI.LOR,
    ReduceOp.PRODUCT: MPI.LAND,
    ReduceOp.MIN: MPI.LAND,
    ReduceOp.BAND: MPI.LAND,
    ReduceOp.BXOR: MPI.LXOR,
}
F32 = np.dtype(np.float32)
_FAST_POLLS = range(256)


def _reduction(dtype: np.dtype, op: ReduceOp) -> tuple[MPI.Datatype, MPI.Op]:
    if dtype == np.bool_:
        return MPI.C_BOOL, _BOOL_OP.get(op, MPI.OP_NULL)  # AVG on bool is refused before this
    if dtype in LOW_PRECISION:
        return MPI.FLOAT, _OP[op]
    return MOVE_TYPE[dtype], _OP[op]


#: (dtype, op) -> (MPI datatype, MPI op) of the reduction, computed once: one dict hit on the hot path.
REDUCTIONS = {(d, op): _reduction(d, op) for d in MOVE_TYPE for op in ReduceOp}


def average(buf: np.ndarray, n: int) -> None:
    """buf /= n in place, as NCCL's AVG: complex numbers component by component (a real division); integers
    divided exactly, truncating toward zero (C's division: -7 / 2 == -3), never through a float."""
    if buf.dtype.kind in "iu":
        _divide_integers(buf, n)
        return
    flat = buf.view(buf.real.dtype) if buf.dtype.kind == "c" else buf
    np.divide(flat, n, out=flat)


def _divide_integers(buf: np.ndarray, n: int) -> None:
    """buf //= n truncating toward zero, in place: the remainder (C's, the dividend's sign) is taken off first,
    so the floor division that follows is exact. A divisor the dtype cannot hold is a wider integer."""
    info = np.iinfo(buf.dtype)
    divisor = buf.dtype.type(n) if n <= info.max else (np.uint64(n) if info.min == 0 else np.int64(n))
    if info.min < 0:
        np.subtract(buf, np.fmod(buf, divisor), out=buf, casting="same_kind")
    np.floor_divide(buf, divisor, out=buf, casting="same_kind")


def mpi_error(e: MPI.Exception) -> TransportError:
    return TransportError(f"MPI reported an error: {e.Get_error_string()}")


def settle(req: MPI.Request, timeout: float, abandoned: list, nbytes: int = 0) -> bool:
    """Wait for ``req`` with a deadline: tight polls first (small messages finish in a few), then :func:`poll`.

    A request that times out or is interrupted (e.g. the watchdog reports a failed peer) is put in
    ``abandoned`` with what it references, since MPI may still write into its buffers.
    """
    test = req.Test
    busy = nbytes / SLOW_BYTES_PER_S
    try:
        if nbytes >= BLOCK_FROM > 0 and (block := blocker()) is not None:
            spent = min(timeout, busy, _BLOCK_MAX)
            done = block(req, spent)
            if done:
                return True
            if done is not None:  # it blocked for ``spent`` seconds (a little more): no clock read when done
                timeout, busy = max(timeout - spent, 0.0), max(busy - spent, 0.0)
        for _ in _FAST_POLLS:
            if test():
                return True
        if poll(test, timeout, busy):
            return True
    except MPI.Exception as e:
        raise mpi_error(e) from None
    except BaseException:
        abandoned.append(req)
        raise
    abandoned.append(req)
    return False


class Req:
    """A handle over one MPI request."""

    __slots__ = ("keep", "req")
    status: MPI.Status | None = None  # where a receive's test leaves who sent (Recv)

    def __init__(self, req: MPI.Request, keep: object = None) -> None:
        self.req = req
        self.keep = keep  # the buffers MPI reads or writes until completion (mpi4py does not hold them all)

    def test(self) -> bool:
        return _tested(self.req.Test, self.status)

    def wait(self, timeout: float) -> bool:
        return settle(self.req, timeout, _abandoned, _nbytes(self.keep))

    def defer(self) -> bool:
        return False  # host memory: the caller waits


_abandoned: list = []  # requests of handles whose wait gave up (kept referenced for good)


def _tested(test: Callable[[Any], bool], arg: Any) -> bool:
    """``test(arg)`` (an MPI test), MPI's exceptions as commlib's."""
    try:
        return test(arg)
    except MPI.Exception as e:
        raise mpi_error(e) from None


def _nbytes(keep: object) -> int:
    """Bytes of the buffers a request keeps (an array, or a tuple of arrays and Nones)."""
    if isinstance(keep, np.ndarray):
        return keep.nbytes
    n = 0
    if isinstance(keep, tuple):
        for a in keep:  # a loop, not sum() over a generator: 0.2 us less on every large wait
            if isinstance(a, np.ndarray):
                n += a.nbytes
    return n


class Requests:
    """A handle over several MPI requests (e.g. an uneven all-to-all's sends and receives): done when all are."""

    __slots__ = ("keep", "nbytes", "reqs")

    def __init__(self, reqs: list[MPI.Request], keep: object = None, nbytes: int | None = None) -> None:
        self.reqs = reqs
        self.keep = keep  # the buffers MPI reads or writes until completion
        self.nbytes = _nbytes(keep) if nbytes is None else nbytes  # their size

    def test(self) -> bool:
        return _tested(MPI.Request.Testall, self.reqs)

    def wait(self, timeout: float) -> bool:
        """Each request in turn, in MPI's own wait where it is large (:func:`settle`); one deadline for all."""
        reqs, nbytes = self.reqs, self.nbytes
        if nbytes < 4 * BLOCK_FROM or not BLOCK_FROM:  # small messages: done within a few tests
            test = self.test
            for _ in _FAST_POLLS:
                if test():
                    return True
        deadline = time.monotonic() + timeout
        for req in reqs:
            if req == MPI.REQUEST_NULL:  # completed by an earlier test (a null request would block a Waitany)
                continue
            if not settle(req, max(deadline - time.monotonic(), 0.0), _abandoned, nbytes):
                _abandoned.append(self)  # MPI may still write into the buffers of the other requests
                return False
        return True

    def defer(self) -> bool:
        return False  # host memory: the caller waits


class Recv(Req):
    """A receive handle that remembers who sent (for ``recv(src=None)``)."""

    __slots__ = ("status",)

    def __init__(self, req: MPI.Request, status: MPI.Status, keep: object = None) -> None:
        super().__init__(req, keep)
        self.status = status

    def wait(self, timeout: float) -> bool:
        return self.test() or poll(self.test, timeout)

    @property
    def source(self) -> int:
        assert self.status is not None
        return self.status.Get_source()


def pieces(buf: np.ndarray) -> list[np.ndarray] | None:
    """``buf`` as consecutive views of :data:`PIECE_BYTES` each, or None when it is small (or not contiguous)."""
    if not PIECE_BYTES or buf.nbytes < 4 * PIECE_BYTES or not buf.flags.c_contiguous:
        return None
    flat, step = buf.reshape(-1), max(PIECE_BYTES // buf.itemsize, 1)
    return [flat[i : i + step] for i in range(0, flat.size, step)]


class Pieces:
    """A handle over one operation done as a sequence of pieces: ``post(piece)`` starts each when the one before ends.

    Only one piece is in flight at a time (several at once are no faster: MPI progresses them in turn).
    ``finish(piece)``, if given, runs on each piece once it is complete (after the next one is
    posted), while the piece is still in the cache: e.g. AVG's division.
    """

    __slots__ = ("finish", "index", "parts", "post", "req")

    def __init__(
        self,
        post: Callable[[np.ndarray], MPI.Request],
        parts: list[np.ndarray],
        finish: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        self.post, self.parts, self.index, self.finish = post, parts, 0, finish
        self.req = post(parts[0])

    def _next(self) -> bool:
        """The piece in flight completed: post the next one; True when that was the last."""
        done = self.parts[self.index]
        self.index += 1
        last = self.index == len(self.parts)
        if not last:
            self.req = self.post(self.parts[self.index])
        if self.finish is not None:
            self.finish(done)
        return last

    def test(self) -> bool:
        if self.index == len(self.parts):
            return True
        try:
            while self.req.Test():
                if self._next():
                    return True
        except MPI.Exception as e:
            raise mpi_error(e) from None
        return False

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.index < len(self.parts):
            if not settle(self.req, max(deadline - time.monotonic(), 0.0), _abandoned, self.parts[self.index].nbytes):
                _abandoned.append(self.parts)  # MPI may still write into the piece in flight
                return False
            try:
                self._next()
            except MPI.Exception as e:
                raise mpi_error(e) from None
        return True

    def defer(self) -> bool:
        return False  # host memory: the caller waits


class _Ready:
    """What :class:`Persistent` and :class:`Exchange` share as a ``base.Resident``: one run is :attr:`go`,
    then, if it returned False, :meth:`wait` and :meth:`finish`.

    ``go`` is :meth:`_go` in Python, or the same steps in C (``commlib.backends._ready``, set by
    :meth:`PersistentCache.add` where that module was built and ``COMMLIB_NATIVE`` is not ``0``).
    """

    __slots__ = ()
    send: np.ndarray | None
    recv: np.ndarray | None
    cache: PersistentCache | None
    key: tuple
    start: Callable[[], object]  # start one run
    test: Callable[[], bool]  # whether the run is complete

    def wait(self, timeout: float) -> bool:
        raise NotImplementedError

    def _go(self, inp: np.ndarray | list[np.ndarray] | None, out: object) -> bool:
        """Copy ``inp`` into ``send``, start, test; True: complete, the result in ``out``; False: still running.

        ``inp`` may be a list of arrays (scatter's root list: packed in rank order), and so may ``out``
        (gather's root list: filled in rank order)."""
        if inp is not None and (send := self.send) is not None:
            if type(inp) is list:
                _pack(inp, send)
            else:
                send[...] = inp
        self.start()
        test = self.test
        for _ in _FAST_POLLS:  # settle()'s first phase: most small calls end here
            if test():
                self.finish(out)
                return True
        return False

    def finish(self, out: object) -> None:
        """Resident.finish: ``out[...] = recv`` (out or recv None: nothing to store; a list: in rank order)."""
        if out is not None and self.recv is not None:
            if type(out) is list:
                _spread(out, self.recv)
            else:
                out[...] = self.recv  # type: ignore[index]

    @staticmethod
    def error(exc: BaseException) -> BaseException:
        """Resident.error: MPI's exceptions as commlib's."""
        return mpi_error(exc) if isinstance(exc, MPI.Exception) else exc

    def run(self, inp: np.ndarray | None, out: np.ndarray | None, timeout: float) -> bool:
        """Copy ``inp`` in, run the operation once (False: ``timeout`` passed), copy the result out to ``out``.

        An operation that timed out leaves its cache: it may still be running, so it is never started again.
        """
        try:
            if self.go(inp, out):  # type: ignore[attr-defined]
                return True
            if not self.wait(timeout):
                return False
        except MPI.Exception as e:
            raise mpi_error(e) from None
        self.finish(out)
        return True

    def _forget(self) -> None:
        if self.cache is not None:
            self.cache.forget(self.key)


class Persistent(_Ready):
    """One persistent collective, send or receive over scratch buffers: load the input, start, settle, store.

    ``send`` is what a run reads (None: the rank contributes nothing, e.g. a non-root of
    broadcast), ``recv`` what it writes (None: no output here). ``divide`` (AVG) divides the
    result once before it is stored; float16/bfloat16 scratch is float32, so the store is the
    one rounding.
    """

    __slots__ = ("buf", "cache", "count", "divide", "dtype", "go", "key", "recv", "req", "send", "start", "test")

    def __init__(
        self, req: MPI.Prequest, send: np.ndarray | None = None, recv: np.ndarray | None = None, divide: int = 0
    ) -> None:
        self.req, self.send, self.recv, self.divide = req, send, recv, divide
        self.cache: PersistentCache | None = None  # set by PersistentCache.add
        self.key: tuple = ()
        self.buf = recv if recv is not None else send  # an in-place all_reduce's one buffer
        self.start, self.test = req.Start, req.Test
        self.go: Callable[[np.ndarray | None, object], bool] = self._go
        self.dtype: np.dtype | None = None  # the callers' (set by PersistentCache.add; the scratch may be wider)
        self.count = 0

    def wait(self, timeout: float) -> bool:
        """Resident.wait: the run started by :attr:`go`, after its tests (False: timed out, never run again)."""
        if settle(self.req, timeout, _abandoned):
            return True
        self._forget()
        return False

    def finish(self, out: object) -> None:
        if out is not None and self.recv is not None and self.divide:
            average(self.recv, self.divide)
        super().finish(out)

    def free(self) -> None:
        """Free the MPI request (it must not be running)."""
        self.req.Free()

    def native(self) -> Callable[[np.ndarray | None, object], bool] | None:
        """The C runner of this operation (None: the Python :meth:`_go` it is)."""
        if _Runner is None or self.divide:
            return None
        raw = all(b is None or b.dtype == self.dtype for b in (self.send, self.recv))
        return _Runner([self.req.handle], self.send, self.recv, None, None, raw).go


class Exchange(_Ready):
    """A small uneven all-to-all over scratch buffers of its own (a base.Resident): persistent receives from
    and sends to every other rank, and this rank's own block copied between the two buffers.

    Point to point only, so each rank creates and evicts its own (no step to keep with other ranks).
    """

    __slots__ = ("buf", "cache", "count", "dtype", "go", "key", "own", "recv", "reqs", "send")

    def __init__(self, reqs: list[MPI.Prequest], send: np.ndarray, recv: np.ndarray, own: tuple) -> None:
        self.reqs, self.send, self.recv, self.buf = reqs, send, recv, recv
        self.own = own  # (this rank's block in recv, its block in send): views of the scratch buffers
        self.cache: PersistentCache | None = None  # set by PersistentCache.add
        self.key: tuple = ()
        self.go: Callable[[np.ndarray | None, object], bool] = self._go
        self.dtype: np.dtype | None = None
        self.count = 0

    def start(self) -> None:
        MPI.Prequest.Startall(self.reqs)
        mine, theirs = self.own
        mine[...] = theirs

    def test(self) -> bool:
        return MPI.Request.Testall(self.reqs)

    def wait(self, timeout: float) -> bool:
        """Resident.wait: False when ``timeout`` passed (the exchange may still run: never started again)."""
        try:
            if poll(self.test, timeout):
                return True
        except BaseException:
            self._forget()
            raise
        self._forget()
        return False

    def free(self) -> None:
        for req in self.reqs:
            req.Free()

    def native(self) -> Callable[[np.ndarray | None, object], bool] | None:
        """The C runner of this exchange (None: the Python :meth:`_go` it is)."""
        if _Runner is None:
            return None
        send, recv = self.send, self.recv
        assert send is not None and recv is not None
        return _Runner([r.handle for r in self.reqs], send, recv, *self.own, send.dtype == recv.dtype == self.dtype).go


_P = TypeVar("_P", Persistent, Exchange)


class PersistentCache:
    """The persistent operations of one communicator, by description, at most ``limit`` (the oldest go first).

    Keys describe the call (kind, shapes, dtype, op or root), never a buffer's address: every
    rank makes the same calls in the same order, so every rank creates (and evicts) the same
    persistent operations at the same points. That matters: creating one is collective in MPI.
    """

    def __init__(self, limit: int = 64, ready: dict[str, dict[tuple, Resident]] | None = None) -> None:
        self.limit = limit
        self.ops: dict[tuple, Persistent | Exchange] = {}
        #: the in-place SUM all_reduces among ``ops``, by (shape, dtype): see ``Backend.sums``
        self.sums: dict[tuple, Resident] = {}
        #: broadcasts, SUM reduces, all_gathers, SUM reduce_scatters, all_to_alls, gathers, scatters, the
        #: barrier, sends and receives among ``ops``: see ``Backend.residents`` (``ready``: another cache's
        #: tables, shared)
        self.ready: dict[str, dict[tuple, Resident]] = {k: {} for k in _READY} if ready is None else ready
        self.seen: set[tuple] = set()  # see again()
        _caches.add(self)

    def again(self, key: tuple) -> bool:
        """Whether ``key`` was asked about before, remembering it: for operations each rank makes on its own
        (sends, receives, uneven exchanges), only a second sighting earns a persistent one, so that a tag or
        split sizes new at every call never churn the cache."""
        seen = self.seen
        if key in seen:
            return True
        if len(seen) >= 16 * self.limit:
            seen.clear()
        seen.add(key)
        return False

    def add(self, key: tuple, op: _P) -> _P:
        """Keep ``op`` under ``key``, freeing the oldest operation when the cache is full."""
        if len(self.ops) >= self.limit:
            self._drop(next(iter(self.ops))).free()
        self.ops[key] = op
        op.cache, op.key = self, key
        lookup = _lookup(key)
        if lookup is not None:
            table, entry, op.dtype, op.count = lookup
            (self.sums if table == "sums" else self.ready[table])[entry] = op
        op.go = op.native() or op.go
        return op

    def _drop(self, key: tuple) -> Persistent | Exchange:
        op = self.ops.pop(key)
        lookup = _lookup(key)
        if lookup is not None:
            table = self.sums if lookup[0] == "sums" else self.ready[lookup[0]]
            if table.get(lookup[1]) is op:
                del table[lookup[1]]
        return op

    def forget(self, key: tuple) -> None:
        """Drop an operation that may still be running (after a timeout): never start or free it again."""
        if key in self.ops:
            _abandoned.append(self._drop(key))

    def close(self) -> None:
        """Free every operation (none may be running: the group layer waits for its calls)."""
        for op in self.ops.values():
            op.free()
        self.ops.clear()
        self.seen.clear()
        self.sums.clear()
        for table in self.ready.values():  # shared tables: everything goes when the backend closes
            table.clear()


def _lookup(key: tuple) -> tuple[str, tuple, np.dtype | None, int] | None:
    """Where the group layer finds the operation of ``key`` (Backend.sums / residents): (table, entry, the
    callers' dtype, their element count for the flight recorder); None: only through Backend.fused."""
    kind = key[0]
    if kind == "all_reduce" and key[3] is ReduceOp.SUM:  # (kind, shape, dtype, op)
        return "sums", (key[1], key[2]), key[2], math.prod(key[1])
    if kind == "broadcast":  # (kind, shape, dtype, root)
        return "broadcast", key[1:], key[2], math.prod(key[1])
    if kind == "reduce" and key[3] is ReduceOp.SUM:  # (kind, shape, dtype, op, root)
        return "reduce", (key[1], key[2], key[4]), key[2], math.prod(key[1])
    if kind == "all_gather" and key[1] is not None:  # (kind, input shape, output shape, dtype); None: in place
        return "all_gather", (key[1], key[3], key[2], key[3]), key[3], math.prod(key[1])
    if kind == "reduce_scatter" and key[4] is ReduceOp.SUM:  # (kind, input shape, output shape, dtype, op)
        return "reduce_scatter", (key[1], key[3], key[2], key[3]), key[3], math.prod(key[1])
    if kind == "all_to_all":  # (kind, input shape, output shape, dtype): equal splits only
        return "all_to_all", (key[1], key[3], key[2], key[3]), key[3], math.prod(key[1])
    if kind in ("gather", "scatter"):  # (kind, chunk shape, dtype, root)
        return kind, key[1:], key[2], math.prod(key[1])
    if kind == "barrier":
        return "barrier", (), None, 0
    if kind == "exchange":  # (kind, input shape, output shape, dtype, send counts, receive counts): uneven
        srow, rrow = math.prod(key[1][1:]), math.prod(key[2][1:])  # the callers' split sizes count rows
        splits = (tuple(c // srow for c in key[4]), tuple(c // rrow for c in key[5]))
        return "all_to_all_v", (key[1], key[3], key[2], key[3], splits), key[3], math.prod(key[1])
    if kind in ("send", "recv"):  # (kind, shape, dtype, peer, tag)
        return kind, key[1:], key[2], math.prod(key[1])
    return None


#: the tables of Backend.residents
_READY = (
    *("broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "barrier"),
    *("all_to_all_v", "send", "recv"),
)


_caches: weakref.WeakSet[PersistentCache] = weakref.WeakSet()


@atexit.register  # registered after mpi4py's own exit handler, so it runs first: before MPI_Finalize
def _free_at_exit() -> None:
    if not MPI.Is_finalized():
        for cache in list(_caches):
            cache.close()
