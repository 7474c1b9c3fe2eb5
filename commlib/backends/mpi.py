"""The ``mpi`` backend: host (numpy) buffers over mpi4py, every operation nonblocking.

Operations are posted with MPI's nonblocking calls (``Iallreduce`` ...) and
completed by polling ``Test`` against a deadline, so a collective can time out
without a helper thread on the hot path. MPI has no float16/bfloat16 type: those
are reduced in a float32 scratch buffer and rounded once; moved as 16-bit words
otherwise. AVG is SUM followed by one division on completion.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import zlib
from typing import Any

import numpy as np
from mpi4py import MPI

from commlib._ops import ReduceOp
from commlib.arrays import LOW_PRECISION, bfloat16
from commlib.backends.base import DONE, RESERVED_TAGS, Backend, Chained, Handle, poll
from commlib.errors import CommTimeoutError, TransportError

__all__ = ["MpiBackend", "world"]

#: Called as ``hook(kind, value)`` by the uncaught-exception hook before MPI_Abort (commlib's job
#: monitor adds one that tells the other ranks who failed); errors in it are ignored.
before_abort: list = []

_MOVE_TYPE = {
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
_F32 = np.dtype(np.float32)
_AVG = ReduceOp.AVG  # class attribute access on an Enum costs ~50 ns: keep members in globals
_IN_PLACE = MPI.IN_PLACE
_FAST_POLLS = range(256)
_BOOL = np.dtype(np.bool_)


def _average(buf: np.ndarray, n: int) -> None:
    """buf /= n in place; complex numbers component by component (a real division, as NCCL's AVG)."""
    flat = buf.view(buf.real.dtype) if buf.dtype.kind == "c" else buf
    np.divide(flat, n, out=flat)


def _mpi_error(e: MPI.Exception) -> TransportError:
    return TransportError(f"MPI reported an error: {e.Get_error_string()}")


class _Req:
    """A handle over one MPI request."""

    __slots__ = ("keep", "req")

    def __init__(self, req: MPI.Request, keep: object = None) -> None:
        self.req = req
        self.keep = keep  # the buffers MPI reads or writes until completion (mpi4py does not hold them all)

    def test(self) -> bool:
        try:
            return self.req.Test()
        except MPI.Exception as e:
            raise _mpi_error(e) from None

    def wait(self, timeout: float) -> bool:
        # The hot path of every blocking call: poll the bare request in a tight loop
        # first (a small all_reduce completes within a few polls), then hand over to
        # poll(), which adds the deadline and the back-off.
        test = self.req.Test
        try:
            for _ in _FAST_POLLS:
                if test():
                    return True
            return poll(test, timeout)
        except MPI.Exception as e:
            raise _mpi_error(e) from None

    def defer(self) -> bool:
        return False  # host memory: the caller waits


class _Reqs(_Req):
    """A handle over several MPI requests (p2p batches, composed operations)."""

    __slots__ = ()

    def test(self) -> bool:
        try:
            return MPI.Request.Testall(self.req)
        except MPI.Exception as e:
            raise _mpi_error(e) from None

    def wait(self, timeout: float) -> bool:
        return self.test() or poll(self.test, timeout)


class _Recv(_Req):
    """A receive handle that remembers who sent (for ``recv(src=None)``)."""

    __slots__ = ("status",)

    def __init__(self, req: MPI.Request, status: MPI.Status, keep: object = None) -> None:
        super().__init__(req, keep)
        self.status = status

    def test(self) -> bool:
        try:
            return self.req.Test(self.status)
        except MPI.Exception as e:
            raise _mpi_error(e) from None

    def wait(self, timeout: float) -> bool:
        return self.test() or poll(self.test, timeout)

    @property
    def source(self) -> int:
        return self.status.Get_source()


def _reduction(dtype: np.dtype, op: ReduceOp) -> tuple[MPI.Datatype, MPI.Op]:
    if dtype == _BOOL:
        return MPI.C_BOOL, _BOOL_OP.get(op, MPI.OP_NULL)  # AVG on bool is refused before this
    if dtype in LOW_PRECISION:
        return MPI.FLOAT, _OP[op]
    return _MOVE_TYPE[dtype], _OP[op]


# (dtype, op) -> (datatype, op), computed once: a dict hit is the cheapest lookup on the hot path.
_REDUCTIONS = {(d, op): _reduction(d, op) for d in _MOVE_TYPE for op in ReduceOp}


# The collectives that get a communicator of their own (all_reduce keeps the base one): see separate_kinds.
_KINDS = ("reduce", "reduce_scatter", "broadcast", "all_gather", "gather", "scatter", "all_to_all", "barrier")


class MpiBackend(Backend):
    """Moves host buffers between the ranks of one MPI communicator."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.max_tag = int(comm.Get_attr(MPI.TAG_UB)) - RESERVED_TAGS
        # COMMLIB_MPI_COMPOSED=1 routes all_to_all/gather/scatter through the send/recv
        # compositions of the Backend base class (what backends without native calls use), to test them.
        self.native = os.environ.get("COMMLIB_MPI_COMPOSED") != "1"
        self._abandoned: list[tuple[MPI.Request, np.ndarray]] = []
        # Every kind of collective on the base communicator until separate_kinds() gives each its own.
        self._dups: list[MPI.Comm] = []
        for kind in _KINDS:
            setattr(self, f"{kind}_comm", comm)

    def separate_kinds(self, timeout: float) -> None:
        """Give each kind of collective its own duplicate of the communicator (same ranks).

        MPI matches collectives by their order on a communicator, whatever their kind: a
        rank in all_gather while the others are in all_reduce would be paired with them and
        return garbage. On separate communicators such calls never match: every rank waits,
        and times out naming its own call (``COMMLIB_DEBUG=DETAIL`` lists them all at once).
        all_reduce and point-to-point keep the base communicator. Collective over it; no
        cost per call. ``COMMLIB_MPI_SEPARATE_KINDS=0`` turns it off.
        """
        if self.size == 1 or self._dups or os.environ.get("COMMLIB_MPI_SEPARATE_KINDS", "1") == "0":
            return
        pending = [self.comm.Idup() for _ in _KINDS]
        deadline = time.monotonic() + timeout
        for _, req in pending:
            if not _Req(req).wait(max(deadline - time.monotonic(), 0.0)):
                raise CommTimeoutError(f"not every rank set up the communicator within {timeout:g} s")
        self._dups = [comm for comm, _ in pending]
        for kind, comm in zip(_KINDS, self._dups, strict=True):
            setattr(self, f"{kind}_comm", comm)

    # -- reductions -------------------------------------------------------------
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> Handle:
        dtype = recvbuf.dtype
        t, mop = _REDUCTIONS[dtype, op]
        if sendbuf is recvbuf and op is not _AVG and dtype not in LOW_PRECISION:  # the common case, first
            return _Req(self.comm.Iallreduce(_IN_PLACE, [recvbuf, t], mop))
        if dtype in LOW_PRECISION:
            scratch = sendbuf.astype(_F32)
            req = self.comm.Iallreduce(MPI.IN_PLACE, [scratch, t], mop)
            return Chained(_Req(req, scratch), functools.partial(self._round, scratch, recvbuf, op))
        sb = MPI.IN_PLACE if sendbuf is recvbuf else [sendbuf, t]
        req = _Req(self.comm.Iallreduce(sb, [recvbuf, t], mop), (sendbuf, recvbuf))
        if op is ReduceOp.AVG:
            return Chained(req, functools.partial(_average, recvbuf, self.size))
        return req

    def all_reduce_wait(self, buf: np.ndarray, op: ReduceOp, timeout: float) -> bool:
        """Blocking in-place all_reduce: True once done, False if ``timeout`` passed first.

        The latency-critical path of ``commlib.all_reduce``: no handle object, the bare
        request polled in a tight loop. A timed-out request is kept referenced (MPI may
        still write into ``buf``) and the group layer fences the communicator off.
        """
        dtype = buf.dtype
        if op is _AVG or dtype in LOW_PRECISION:
            return self.all_reduce(buf, buf, op).wait(timeout)
        t, mop = _REDUCTIONS[dtype, op]
        req = self.comm.Iallreduce(_IN_PLACE, [buf, t], mop)
        test = req.Test
        try:
            for _ in _FAST_POLLS:
                if test():
                    return True
            if poll(test, timeout):
                return True
        except MPI.Exception as e:
            raise _mpi_error(e) from None
        except BaseException:  # e.g. the watchdog's: a peer failed; MPI may still write into buf
            self._abandoned.append((req, buf))
            raise
        self._abandoned.append((req, buf))
        return False

    def reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, root: int) -> Handle:
        dtype = recvbuf.dtype
        t, mop = _REDUCTIONS[dtype, op]
        mine = self.rank == root
        if dtype in LOW_PRECISION:
            scratch = sendbuf.astype(_F32)
            sb = MPI.IN_PLACE if mine else [scratch, t]
            req = _Req(self.reduce_comm.Ireduce(sb, [scratch, t], mop, root), scratch)
            return Chained(req, functools.partial(self._round, scratch, recvbuf, op)) if mine else req
        sb = MPI.IN_PLACE if mine and sendbuf is recvbuf else [sendbuf, t]
        req = _Req(self.reduce_comm.Ireduce(sb, [recvbuf, t], mop, root), (sendbuf, recvbuf))
        if op is ReduceOp.AVG and mine:
            return Chained(req, functools.partial(_average, recvbuf, self.size))
        return req

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> Handle:
        dtype = recvbuf.dtype
        t, mop = _REDUCTIONS[dtype, op]
        if dtype in LOW_PRECISION:
            send32, recv32 = sendbuf.astype(_F32), np.empty(recvbuf.shape, _F32)
            req = _Req(self.reduce_scatter_comm.Ireduce_scatter_block([send32, t], [recv32, t], mop), (send32, recv32))
            return Chained(req, functools.partial(self._round, recv32, recvbuf, op))
        req = _Req(self.reduce_scatter_comm.Ireduce_scatter_block([sendbuf, t], [recvbuf, t], mop), (sendbuf, recvbuf))
        if op is ReduceOp.AVG:
            return Chained(req, functools.partial(_average, recvbuf, self.size))
        return req

    def _round(self, scratch: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        if op is ReduceOp.AVG:
            scratch /= self.size
        out[...] = scratch.reshape(out.shape)  # the one rounding to float16/bfloat16

    # -- data movement ----------------------------------------------------------
    def broadcast(self, buf: np.ndarray, root: int) -> Handle:
        return _Req(self.broadcast_comm.Ibcast([buf, _MOVE_TYPE[buf.dtype]], root), buf)

    def all_gather(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray) -> Handle:
        t = _MOVE_TYPE[recvbuf.dtype]
        sb = MPI.IN_PLACE if sendbuf is None else [sendbuf, t]
        return _Req(self.all_gather_comm.Iallgather(sb, [recvbuf, t]), (sendbuf, recvbuf))

    def gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> Handle:
        if not self.native:
            return super().gather(sendbuf, recvbuf, root)
        t = _MOVE_TYPE[sendbuf.dtype]
        rb = [recvbuf, t] if recvbuf is not None else None
        return _Req(self.gather_comm.Igather([sendbuf, t], rb, root), (sendbuf, recvbuf))

    def scatter(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> Handle:
        if not self.native:
            return super().scatter(sendbuf, recvbuf, root)
        t = _MOVE_TYPE[recvbuf.dtype]
        sb = [sendbuf, t] if sendbuf is not None else None
        return _Req(self.scatter_comm.Iscatter(sb, [recvbuf, t], root), (sendbuf, recvbuf))

    def all_to_all(
        self, sendbuf: np.ndarray, send_counts: list[int], recvbuf: np.ndarray, recv_counts: list[int]
    ) -> Handle:
        """Uneven all-to-all: ``send_counts[i]`` elements go to rank i, in rank order."""
        if not self.native:
            return super().all_to_all(sendbuf, send_counts, recvbuf, recv_counts)
        t = _MOVE_TYPE[recvbuf.dtype]
        sd, rd = np.cumsum([0, *send_counts[:-1]]), np.cumsum([0, *recv_counts[:-1]])
        spec_s = [sendbuf, (list(send_counts), [int(x) for x in sd]), t]
        spec_r = [recvbuf, (list(recv_counts), [int(x) for x in rd]), t]
        return _Req(self.all_to_all_comm.Ialltoallv(spec_s, spec_r), (sendbuf, recvbuf))

    def send(self, buf: np.ndarray, peer: int, tag: int) -> Handle:
        return _Req(self.comm.Isend([buf, _MOVE_TYPE[buf.dtype]], peer, tag), buf)

    def recv(self, buf: np.ndarray, peer: int | None, tag: int) -> _Recv:
        src = MPI.ANY_SOURCE if peer is None else peer
        return _Recv(self.comm.Irecv([buf, _MOVE_TYPE[buf.dtype]], src, tag), MPI.Status(), buf)

    def barrier(self) -> Handle:
        return _Req(self.barrier_comm.Ibarrier()) if self.size > 1 else DONE

    # -- communicators ----------------------------------------------------------
    def split(self, ranks: list[int], timeout: float) -> MpiBackend | None:
        """Sub-communicator of ``ranks`` (in that order); collective over this communicator."""
        # A nonblocking barrier first, so a missing rank times out instead of hanging in Split.
        if not _Req(self.comm.Ibarrier()).wait(timeout):
            raise CommTimeoutError(f"not every rank called new_group within {timeout:.1f} s")
        member = self.rank in ranks
        sub = self.comm.Split(0 if member else MPI.UNDEFINED, ranks.index(self.rank) if member else 0)
        if not member:
            return None
        backend = MpiBackend(sub)
        backend.separate_kinds(timeout)
        return backend

    def create_group(self, ranks: list[int], timeout: float) -> MpiBackend:
        """Sub-communicator of ``ranks`` (in that order), made by its members alone (MPI_Comm_create_group)."""
        self.rendezvous(ranks, timeout)  # every member is here: Create_group, which cannot time out, will not wait
        tag = zlib.crc32(repr(ranks).encode()) % 32768  # tells concurrent creations over overlapping ranks apart
        backend = MpiBackend(self.comm.Create_group(self.comm.Get_group().Incl(ranks), tag))
        backend.separate_kinds(timeout)
        return backend

    def abort(self) -> None:
        """MPI cannot abort one communicator without killing the job; the group layer fences it off."""

    def close(self) -> None:
        """Free the communicator (not the world) and the per-kind duplicates."""
        for comm in self._dups:
            if comm != MPI.COMM_NULL:
                comm.Free()
        self._dups = []
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.comm != MPI.COMM_NULL:
            self.comm.Free()


def join_nodes(local: MpiBackend, node: int, nnodes: int, rank: int, store: Any, timeout: float) -> MpiBackend:
    """Join the MPI worlds of ``nnodes`` separately launched nodes into one communicator.

    Each node's ranks are one MPI world (one mpiexec per node, as ``commlib.launch``
    starts them). Node 0 opens an MPI port and publishes it in ``store``; the others
    connect to it one at a time and everything joined so far accepts the next
    (MPI_Comm_accept/connect, then Intercomm_merge). Every node first registers in
    the store and waits for all the others, so no accept waits for a node that never
    comes. Ranks are finally ordered by ``rank`` (their global RANK).
    """
    comm = local.comm
    store.set(f"commlib/join/{node}/{comm.Get_rank()}", b"1")
    store.wait([f"commlib/join/{k}/0" for k in range(nnodes)], timeout)
    if node == 0:
        port = MPI.Open_port() if comm.Get_rank() == 0 else ""
        if comm.Get_rank() == 0:
            store.set("commlib/join/port", port)
        merged, joined = comm, 1
    else:
        port = store.get("commlib/join/port").decode()
        merged = comm.Connect(port, root=0).Merge(high=True)
        joined = merged.bcast(None, root=0)
    while joined < nnodes:
        merged = merged.Accept(port, root=0).Merge(high=False)
        joined = merged.bcast(joined + 1, root=0)
    if node == 0 and comm.Get_rank() == 0:
        MPI.Close_port(port)
    return MpiBackend(merged.Split(0, rank))


def world() -> MpiBackend:
    """The backend over ``MPI.COMM_WORLD`` (MPI is initialised by importing mpi4py)."""
    backend = MpiBackend(MPI.COMM_WORLD)
    if backend.size > 1 and os.environ.get("COMMLIB_ABORT_ON_EXCEPTION", "1") != "0":
        _abort_on_uncaught_exception()
    return backend


def _abort_on_uncaught_exception() -> None:
    """An uncaught exception on one rank ends the whole job at once instead of leaving the others waiting.

    Without this the failed rank sits in MPI_Finalize (which waits for every rank)
    while the others wait in a collective until their timeout. ``MPI_Abort`` makes
    the launcher stop every rank; the traceback is printed first.
    """
    previous = sys.excepthook
    if getattr(previous, "_commlib", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: object) -> None:
        previous(kind, value, tb)
        if issubclass(kind, KeyboardInterrupt):
            return
        sys.stdout.flush()
        for before in before_abort:
            with contextlib.suppress(BaseException):  # the job must be aborted whatever happens
                before(kind, value)
        sys.stderr.write(f"commlib: uncaught {kind.__name__} on rank {MPI.COMM_WORLD.Get_rank()}: aborting the job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    hook._commlib = True  # type: ignore[attr-defined]
    sys.excepthook = hook
