"""The ``mpi`` backend: host (numpy) buffers over mpi4py; nothing blocks without a deadline.

Asynchronous calls are posted with MPI's nonblocking calls (``Iallreduce`` ...) and their
handles are polled with ``Test`` against a deadline. Blocking calls take :meth:`MpiBackend.blocking`:
small ones run as persistent operations over scratch buffers (MPI builds a schedule once, not
per call: about half the latency of a nonblocking call), larger ones post the nonblocking call
and poll the bare request. Either way a collective can time out without a helper thread.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
import zlib
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from mpi4py import MPI

from commlib._ops import ReduceOp
from commlib.arrays import LOW_PRECISION
from commlib.backends import _native
from commlib.backends._direct import OWN, Direct, DirectCache
from commlib.backends._mpi import (
    F32,
    MOVE_TYPE,
    PIECE_BYTES,
    REDUCTIONS,
    Exchange,
    Persistent,
    PersistentCache,
    Pieces,
    Recv,
    Req,
    Requests,
    average,
    pieces,
    settle,
)
from commlib.backends._waker import count_cores
from commlib.backends.base import DONE, RESERVED_TAGS, TAG_COMPOSED, Backend, Chained, Handle, Resident
from commlib.errors import CommTimeoutError

__all__ = ["MpiBackend"]

_AVG, _SUM, _IN_PLACE = ReduceOp.AVG, ReduceOp.SUM, MPI.IN_PLACE  # enum attribute access costs ~50 ns: globals
#: Blocking calls up to this many bytes run as persistent operations (COMMLIB_MPI_PERSISTENT_MAX; 0: never);
#: above it, a Direct (commlib.backends._direct). 4 KiB where the Direct takes the own steps: from 8 KiB they
#: beat a persistent operation's two copies for every kind (2 ranks, 8-64 KiB: 0.80-1.24x of the raw call
#: against 1.02-1.57x), below they do not for all_reduce and reduce (512 B-2 KiB: 1.16-1.49x against
#: 0.75-1.16x). 64 KiB otherwise: a persistent operation still beats MPI's nonblocking call there (32-64 KiB:
#: 5-11% for all_reduce, 15-35% for broadcast, all_gather, reduce_scatter, send/recv, all_to_all, ~2x for
#: gather and scatter). The same on every rank (one install, one environment).
PERSISTENT_MAX = int(
    os.environ.get("COMMLIB_MPI_PERSISTENT_MAX", str((4 if _native.Direct is not None and OWN else 64) << 10))
)
PIECES_FROM = 4 * PIECE_BYTES if PIECE_BYTES else 1 << 62  # see _mpi.pieces


def _even(scounts: list[int], rcounts: list[int]) -> bool:
    """Every block the same size, sent and received."""
    k = scounts[0]
    return scounts.count(k) == len(scounts) and rcounts.count(k) == len(rcounts)  # count(): C speed


_TAG_EXCHANGE = 0  # all_to_all_comm carries only all-to-alls: messages match in the order they are posted


class MpiBackend(Backend):
    """Moves host buffers between the ranks of one MPI communicator."""

    name = "mpi"

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.max_tag = int(comm.Get_attr(MPI.TAG_UB) or 32767) - RESERVED_TAGS
        # COMMLIB_MPI_COMPOSED=1 routes all_to_all/gather/scatter through the send/recv
        # compositions of the Backend base class (what backends without native calls use), to test them.
        self.native = os.environ.get("COMMLIB_MPI_COMPOSED") != "1"
        self.abandoned: list = []  # requests a wait gave up on: MPI may still use their buffers
        self.persistent = PersistentCache()
        # sends and receives apart: each rank makes its own, so they must not push collectives out of
        # ``persistent`` (whose ranks evict in step); one lookup table for the group layer
        self.p2p = PersistentCache(ready=self.persistent.ready)
        # large blocking calls posted on the caller's arrays in C, in the same tables (None: not here)
        self.direct = DirectCache(self.rank, self.size, self.persistent.sums, self.persistent.ready)
        self.direct.steps = (comm, self.max_tag + TAG_COMPOSED, False)  # a communicator of their own: separate_kinds()
        # Every kind of collective on the base communicator until separate_kinds() gives each its own.
        self.dups: list[MPI.Intracomm] = []
        self.reduce_comm = self.reduce_scatter_comm = self.broadcast_comm = self.all_gather_comm = comm
        self.gather_comm = self.scatter_comm = self.all_to_all_comm = self.barrier_comm = comm
        self.now: dict[str, Callable[..., bool]] = {
            "all_reduce": self._all_reduce_now,
            "broadcast": self._broadcast_now,
            "reduce": self._reduce_now,
            "all_gather": self._all_gather_now,
            "reduce_scatter": self._reduce_scatter_now,
            "barrier": self._barrier_now,
            "send": self._send_now,
            "recv": self._recv_now,
        }
        if self.native:
            self.now |= {"all_to_all": self._all_to_all_now, "gather": self._gather_now, "scatter": self._scatter_now}

    def prepare(self, timeout: float) -> None:
        """The world's setup, collective over it: count the node's cores for the waker
        (:func:`commlib.backends._waker.count_cores`), then :meth:`separate_kinds`."""
        if self.size > 1 and not count_cores(self.comm, timeout):
            raise CommTimeoutError(f"not every rank set up the communicator within {timeout:g} s")
        self.separate_kinds(timeout)

    def separate_kinds(self, timeout: float) -> None:
        """Give each kind of collective its own duplicate of the communicator (same ranks).

        MPI matches collectives by their order on a communicator, whatever their kind: a
        rank in all_gather while the others are in all_reduce would be paired with them and
        return garbage. On separate communicators such calls never match: every rank waits,
        and times out naming its own call (``COMMLIB_DEBUG=DETAIL`` lists them all at once).
        all_reduce and point-to-point keep the base communicator; a ninth carries the
        point-to-point steps of :data:`commlib.backends._direct.OWN`. Collective over it; no
        cost per call. ``COMMLIB_MPI_SEPARATE_KINDS=0`` turns it off.
        """
        if self.size == 1 or self.dups or os.environ.get("COMMLIB_MPI_SEPARATE_KINDS", "1") == "0":
            return
        pending = [self.comm.Idup() for _ in range(9)]
        deadline = time.monotonic() + timeout
        for _, req in pending:
            if not settle(req, max(deadline - time.monotonic(), 0.0), self.abandoned):
                raise CommTimeoutError(f"not every rank set up the communicator within {timeout:g} s")
        self.dups = [comm for comm, _ in pending]
        (
            self.reduce_comm,
            self.reduce_scatter_comm,
            self.broadcast_comm,
            self.all_gather_comm,
            self.gather_comm,
            self.scatter_comm,
            self.all_to_all_comm,
            self.barrier_comm,
            steps,
        ) = self.dups
        self.direct.steps = (steps, 0, True)  # the point-to-point steps of _direct.OWN's kinds alone

    # -- asynchronous: one nonblocking call, one handle --------------------------------------------
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> Handle:
        dtype = recvbuf.dtype
        t, mop = REDUCTIONS[dtype, op]
        if dtype in LOW_PRECISION:
            scratch = sendbuf.astype(F32)
            low = Req(self.comm.Iallreduce(_IN_PLACE, [scratch, t], mop), scratch)
            return Chained(low, functools.partial(self._round, scratch, recvbuf, op))
        if PERSISTENT_MAX < recvbuf.nbytes < PIECES_FROM:  # as the blocking call runs
            key, n = ("all_reduce", recvbuf.shape, dtype, op), recvbuf.nbytes
            if (h := self.direct.posted(key, sendbuf, recvbuf, self.comm, t, mop, 0, recvbuf.size, n, n)) is not None:
                return Chained(h, functools.partial(average, recvbuf, self.size)) if op is _AVG else h
        parts = pieces(recvbuf) if sendbuf is recvbuf else None
        if parts is not None:  # AVG divides each piece as it completes, while it is in the cache
            finish = functools.partial(average, n=self.size) if op is _AVG else None
            return Pieces(functools.partial(self._all_reduce_piece, t, mop), parts, finish)
        sb = _IN_PLACE if sendbuf is recvbuf else [sendbuf, t]
        req = Req(self.comm.Iallreduce(sb, [recvbuf, t], mop), (sendbuf, recvbuf))
        return Chained(req, functools.partial(average, recvbuf, self.size)) if op is _AVG else req

    def _all_reduce_piece(self, t: MPI.Datatype, mop: MPI.Op, piece: np.ndarray) -> MPI.Request:
        return self.comm.Iallreduce(_IN_PLACE, [piece, t], mop)

    def reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, root: int) -> Handle:
        dtype = recvbuf.dtype
        t, mop = REDUCTIONS[dtype, op]
        mine = self.rank == root
        if dtype in LOW_PRECISION:
            scratch = sendbuf.astype(F32)
            sb: Any = _IN_PLACE if mine else [scratch, t]
            req = Req(self.reduce_comm.Ireduce(sb, [scratch, t], mop, root), scratch)
            return Chained(req, functools.partial(self._round, scratch, recvbuf, op)) if mine else req
        if recvbuf.nbytes > PERSISTENT_MAX:  # as the blocking call runs
            key, n = ("reduce", recvbuf.shape, dtype, op, root), recvbuf.nbytes
            if (
                h := self.direct.posted(key, sendbuf, recvbuf, self.comm, t, mop, root, recvbuf.size, n, n)
            ) is not None:
                return Chained(h, functools.partial(average, recvbuf, self.size)) if op is _AVG and mine else h
        sb = _IN_PLACE if mine and sendbuf is recvbuf else [sendbuf, t]
        req = Req(self.reduce_comm.Ireduce(sb, [recvbuf, t], mop, root), (sendbuf, recvbuf))
        return Chained(req, functools.partial(average, recvbuf, self.size)) if op is _AVG and mine else req

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> Handle:
        dtype = recvbuf.dtype
        t, mop = REDUCTIONS[dtype, op]
        if dtype in LOW_PRECISION:
            send32, recv32 = sendbuf.astype(F32), np.empty(recvbuf.shape, F32)
            req = Req(self.reduce_scatter_comm.Ireduce_scatter_block([send32, t], [recv32, t], mop), (send32, recv32))
            return Chained(req, functools.partial(self._round, recv32, recvbuf, op))
        if sendbuf.nbytes > PERSISTENT_MAX:  # as the blocking call runs
            key = ("reduce_scatter", sendbuf.shape, recvbuf.shape, dtype, op)
            args = (self.comm, t, mop, 0, recvbuf.size, sendbuf.nbytes, recvbuf.nbytes)
            if (h := self.direct.posted(key, sendbuf, recvbuf, *args)) is not None:
                return Chained(h, functools.partial(average, recvbuf, self.size)) if op is _AVG else h
        req = Req(self.reduce_scatter_comm.Ireduce_scatter_block([sendbuf, t], [recvbuf, t], mop), (sendbuf, recvbuf))
        return Chained(req, functools.partial(average, recvbuf, self.size)) if op is _AVG else req

    def _round(self, scratch: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        if op is _AVG:
            scratch /= self.size
        out[...] = scratch.reshape(out.shape)  # the one rounding to float16/bfloat16

    def broadcast(self, buf: np.ndarray, root: int) -> Handle:
        if buf.nbytes > PERSISTENT_MAX:  # as the blocking call runs
            key, t, n = ("broadcast", buf.shape, buf.dtype, root), MOVE_TYPE[buf.dtype], buf.nbytes
            if (h := self.direct.posted(key, buf, buf, self.comm, t, None, root, buf.size, n, n)) is not None:
                return h
        return Req(self.broadcast_comm.Ibcast([buf, MOVE_TYPE[buf.dtype]], root), buf)

    def all_gather(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray) -> Handle:
        t = MOVE_TYPE[recvbuf.dtype]
        if recvbuf.nbytes > PERSISTENT_MAX:  # as the blocking call runs
            k = ("all_gather", None if sendbuf is None else sendbuf.shape, recvbuf.shape, recvbuf.dtype)
            n, whole = recvbuf.size // self.size, recvbuf.nbytes
            h = self.direct.posted(k, sendbuf, recvbuf, self.comm, t, None, 0, n, whole // self.size, whole)
            if h is not None:
                return h
        sb = _IN_PLACE if sendbuf is None else [sendbuf, t]
        return Req(self.all_gather_comm.Iallgather(sb, [recvbuf, t]), (sendbuf, recvbuf))

    def gather(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> Handle:
        if not self.native:
            return super().gather(sendbuf, recvbuf, root)
        t = MOVE_TYPE[sendbuf.dtype]
        if sendbuf.nbytes * self.size > PERSISTENT_MAX:  # as the blocking call runs
            k, n = ("gather", sendbuf.shape, sendbuf.dtype, root), sendbuf.nbytes
            h = self.direct.posted(k, sendbuf, recvbuf, self.comm, t, None, root, sendbuf.size, n, n * self.size)
            if h is not None:
                return h
        rb = [recvbuf, t] if recvbuf is not None else None
        return Req(self.gather_comm.Igather([sendbuf, t], rb, root), (sendbuf, recvbuf))

    def scatter(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> Handle:
        if not self.native:
            return super().scatter(sendbuf, recvbuf, root)
        t = MOVE_TYPE[recvbuf.dtype]
        if recvbuf.nbytes * self.size > PERSISTENT_MAX:  # as the blocking call runs
            k, n = ("scatter", recvbuf.shape, recvbuf.dtype, root), recvbuf.nbytes
            h = self.direct.posted(k, sendbuf, recvbuf, self.comm, t, None, root, recvbuf.size, n * self.size, n)
            if h is not None:
                return h
        sb = [sendbuf, t] if sendbuf is not None else None
        return Req(self.scatter_comm.Iscatter(sb, [recvbuf, t], root), (sendbuf, recvbuf))

    def all_to_all(
        self, sendbuf: np.ndarray, send_counts: list[int], recvbuf: np.ndarray, recv_counts: list[int]
    ) -> Handle:
        """All-to-all: ``Ialltoall`` when every block is the same size, else pairwise sends and receives.

        MPICH's ``Ialltoallv`` is slower than posting the messages ourselves: 2 ranks, 1 MiB uneven,
        1.30x of a blocking ``Alltoallv`` against 1.06x (16 MiB: 1.34x against 1.08x).
        """
        if not self.native:
            return super().all_to_all(sendbuf, send_counts, recvbuf, recv_counts)
        if not _even(send_counts, recv_counts):
            return self._exchange(sendbuf, send_counts, recvbuf, recv_counts)
        t, k = MOVE_TYPE[recvbuf.dtype], recv_counts[0]
        if recvbuf.nbytes > PERSISTENT_MAX:  # as the blocking call runs
            key, n = ("all_to_all", sendbuf.shape, recvbuf.shape, recvbuf.dtype), recvbuf.nbytes
            if (h := self.direct.posted(key, sendbuf, recvbuf, self.comm, t, None, 0, k, n, n)) is not None:
                return h
        return Req(self.all_to_all_comm.Ialltoall([sendbuf, k, t], [recvbuf, k, t]), (sendbuf, recvbuf))

    def _new_exchange(
        self, key: tuple, sbuf: np.ndarray, scounts: list[int], rbuf: np.ndarray, rcounts: list[int]
    ) -> Exchange:
        """A small uneven all-to-all as persistent requests over scratch buffers (see :meth:`_exchange`)."""
        send, _ = self._scratch(sbuf.shape, rbuf.dtype)
        recv, _ = self._scratch(rbuf.shape, rbuf.dtype)
        reqs, own = self._pairwise(send.reshape(-1), scounts, recv.reshape(-1), rcounts, persistent=True)
        return self.p2p.add(key, Exchange(reqs, send, recv, own))

    def _exchange(self, sbuf: np.ndarray, scounts: list[int], rbuf: np.ndarray, rcounts: list[int]) -> Requests:
        """Uneven all-to-all: receive from rank - k while sending to rank + k, k = 1 .. size-1; copy our own block.

        Empty blocks send no message, so ranks that disagree on a block's size wait (and time out)
        rather than receive a short message silently.
        """
        reqs, (mine, theirs) = self._pairwise(sbuf.reshape(-1), scounts, rbuf.reshape(-1), rcounts, persistent=False)
        mine[...] = theirs
        return Requests(reqs, (sbuf, rbuf), sbuf.nbytes + rbuf.nbytes)

    def _pairwise(
        self, sflat: np.ndarray, scounts: list[int], rflat: np.ndarray, rcounts: list[int], persistent: bool
    ) -> tuple[list, tuple[np.ndarray, np.ndarray]]:
        """:meth:`_exchange`'s receives and sends over flat buffers (posted, or persistent and not yet started),
        and this rank's own block: (its part of ``rflat``, its part of ``sflat``)."""
        t, me, n, comm = MOVE_TYPE[rflat.dtype], self.rank, self.size, self.all_to_all_comm
        recv, send = (comm.Recv_init, comm.Send_init) if persistent else (comm.Irecv, comm.Isend)
        # itertools, not numpy: np.cumsum of a short list costs ~6 us, most of a small call
        sd, rd = list(itertools.accumulate(scounts, initial=0)), list(itertools.accumulate(rcounts, initial=0))
        reqs = []
        for k in range(1, n):
            src, dst = (me - k) % n, (me + k) % n
            if rcounts[src]:
                reqs.append(recv([rflat[rd[src] : rd[src + 1]], t], src, _TAG_EXCHANGE))
            if scounts[dst]:
                reqs.append(send([sflat[sd[dst] : sd[dst + 1]], t], dst, _TAG_EXCHANGE))
        return reqs, (rflat[rd[me] : rd[me + 1]], sflat[sd[me] : sd[me + 1]])

    def send(self, buf: np.ndarray, peer: int, tag: int) -> Handle:
        return Req(self.comm.Isend([buf, MOVE_TYPE[buf.dtype]], peer, tag), buf)

    def recv(self, buf: np.ndarray, peer: int | None, tag: int) -> Recv:
        src = MPI.ANY_SOURCE if peer is None else peer
        return Recv(self.comm.Irecv([buf, MOVE_TYPE[buf.dtype]], src, tag), MPI.Status(), buf)

    def barrier(self) -> Handle:
        return Req(self.barrier_comm.Ibarrier()) if self.size > 1 else DONE

    # -- blocking: persistent operations for small calls, bare requests for the rest ----------------
    def fused(self) -> dict[str, Callable[..., bool]]:
        """Blocking calls in one step (see :meth:`Backend.fused`): small ones as persistent operations."""
        return self.now

    def sums(self) -> dict[tuple, Resident]:
        return self.persistent.sums

    def residents(self) -> dict[str, dict[tuple, Resident]]:
        return self.persistent.ready

    def _scratch(self, shape: tuple, dtype: np.dtype, reduce: bool = False) -> tuple[np.ndarray, Any]:
        """A scratch buffer for a persistent operation and its MPI buffer spec (float32 to reduce 16-bit floats)."""
        buf = np.empty(shape, F32 if reduce and dtype in LOW_PRECISION else dtype)
        return buf, [buf, REDUCTIONS[dtype, ReduceOp.SUM][0] if reduce else MOVE_TYPE[dtype]]

    def _direct(
        self, key: tuple, comm: MPI.Intracomm, t: MPI.Datatype, op: MPI.Op | None, root: int, n: int, i: int, o: int
    ) -> Direct | None:
        """The Direct of ``key`` (see :mod:`commlib.backends._direct`); None where there is none."""
        return self.direct.get(key) or self.direct.make(key, comm, t, op, root, n, i, o)

    def _all_reduce_now(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, timeout: float) -> bool:
        nbytes, dtype = recvbuf.nbytes, recvbuf.dtype
        if sendbuf is recvbuf and nbytes <= PERSISTENT_MAX:
            key = ("all_reduce", recvbuf.shape, dtype, op)
            p = self.persistent.ops.get(key) or self._new_all_reduce(key, recvbuf, op)
            return p.run(recvbuf, recvbuf, timeout)
        if PERSISTENT_MAX < nbytes < PIECES_FROM and op is not _AVG and dtype not in LOW_PRECISION:
            key = ("all_reduce", recvbuf.shape, dtype, op)
            t, mop = REDUCTIONS[dtype, op]
            if (d := self._direct(key, self.comm, t, mop, 0, recvbuf.size, nbytes, nbytes)) is not None:
                return d.run(sendbuf, recvbuf, timeout)
        if sendbuf is not recvbuf or op is _AVG or recvbuf.dtype in LOW_PRECISION or recvbuf.nbytes >= PIECES_FROM:
            return self.all_reduce(sendbuf, recvbuf, op).wait(timeout)
        t, mop = REDUCTIONS[recvbuf.dtype, op]
        return settle(self.comm.Iallreduce(_IN_PLACE, [recvbuf, t], mop), timeout, self.abandoned, recvbuf.nbytes)

    def _new_all_reduce(self, key: tuple, buf: np.ndarray, op: ReduceOp) -> Persistent:
        scratch, spec = self._scratch(buf.shape, buf.dtype, reduce=True)
        req = self.comm.Allreduce_init(_IN_PLACE, spec, REDUCTIONS[buf.dtype, op][1])
        return self.persistent.add(key, Persistent(req, scratch, scratch, self.size if op is _AVG else 0))

    def _reduce_now(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, root: int, timeout: float) -> bool:
        if (
            sendbuf is recvbuf
            and recvbuf.nbytes > PERSISTENT_MAX
            and op is not _AVG
            and sendbuf.dtype not in LOW_PRECISION
        ):
            key, (t, mop), n = (
                ("reduce", recvbuf.shape, recvbuf.dtype, op, root),
                REDUCTIONS[recvbuf.dtype, op],
                recvbuf.nbytes,
            )
            if (d := self._direct(key, self.reduce_comm, t, mop, root, recvbuf.size, n, n)) is not None:
                return d.run(recvbuf, recvbuf, timeout)
        if sendbuf is not recvbuf or recvbuf.nbytes > PERSISTENT_MAX:
            return self.reduce(sendbuf, recvbuf, op, root).wait(timeout)
        key = ("reduce", recvbuf.shape, recvbuf.dtype, op, root)
        p = self.persistent.ops.get(key)
        if p is None:
            mine = self.rank == root
            scratch, spec = self._scratch(recvbuf.shape, recvbuf.dtype, reduce=True)
            mop = REDUCTIONS[recvbuf.dtype, op][1]
            req = self.reduce_comm.Reduce_init(_IN_PLACE if mine else spec, spec if mine else None, mop, root)
            divide = self.size if op is _AVG else 0
            p = self.persistent.add(key, Persistent(req, scratch, scratch if mine else None, divide))
        return p.run(recvbuf, recvbuf, timeout)

    def _broadcast_now(self, buf: np.ndarray, root: int, timeout: float) -> bool:
        if buf.nbytes > PERSISTENT_MAX:
            key, n = ("broadcast", buf.shape, buf.dtype, root), buf.nbytes
            if d := self._direct(key, self.broadcast_comm, MOVE_TYPE[buf.dtype], None, root, buf.size, n, n):
                return d.run(buf, buf, timeout)
            req = self.broadcast_comm.Ibcast([buf, MOVE_TYPE[buf.dtype]], root)
            return settle(req, timeout, self.abandoned, buf.nbytes)
        key = ("broadcast", buf.shape, buf.dtype, root)
        p = self.persistent.ops.get(key)
        if p is None:
            mine = self.rank == root
            scratch, spec = self._scratch(buf.shape, buf.dtype)
            req = self.broadcast_comm.Bcast_init(spec, root)
            p = self.persistent.add(key, Persistent(req, scratch if mine else None, None if mine else scratch))
        return p.run(buf, buf, timeout)

    def _all_gather_now(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, timeout: float) -> bool:
        if recvbuf.nbytes > PERSISTENT_MAX:
            t, n, whole = MOVE_TYPE[recvbuf.dtype], recvbuf.size // self.size, recvbuf.nbytes
            k = ("all_gather", None if sendbuf is None else sendbuf.shape, recvbuf.shape, recvbuf.dtype)
            d = self._direct(k, self.all_gather_comm, t, None, 0, n, whole // self.size, whole)
            if d is not None:
                return d.run(sendbuf, recvbuf, timeout)
            sb = _IN_PLACE if sendbuf is None else [sendbuf, t]
            return settle(self.all_gather_comm.Iallgather(sb, [recvbuf, t]), timeout, self.abandoned, recvbuf.nbytes)
        key = ("all_gather", None if sendbuf is None else sendbuf.shape, recvbuf.shape, recvbuf.dtype)
        p = self.persistent.ops.get(key)
        if p is None:
            recv, rspec = self._scratch(recvbuf.shape, recvbuf.dtype)
            if sendbuf is None:  # in place: the whole output goes in, this rank's chunk already holds its input
                p = Persistent(self.all_gather_comm.Allgather_init(_IN_PLACE, rspec), recv, recv)
            else:
                send, sspec = self._scratch(sendbuf.shape, recvbuf.dtype)
                p = Persistent(self.all_gather_comm.Allgather_init(sspec, rspec), send, recv)
            self.persistent.add(key, p)
        return p.run(recvbuf if sendbuf is None else sendbuf, recvbuf, timeout)

    def _reduce_scatter_now(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, timeout: float) -> bool:
        if sendbuf.nbytes > PERSISTENT_MAX:
            if op is not _AVG and recvbuf.dtype not in LOW_PRECISION:
                key, (t, mop) = (
                    ("reduce_scatter", sendbuf.shape, recvbuf.shape, recvbuf.dtype, op),
                    REDUCTIONS[recvbuf.dtype, op],
                )
                d = self._direct(key, self.reduce_scatter_comm, t, mop, 0, recvbuf.size, sendbuf.nbytes, recvbuf.nbytes)
                if d is not None:
                    return d.run(sendbuf, recvbuf, timeout)
            return self.reduce_scatter(sendbuf, recvbuf, op).wait(timeout)
        key = ("reduce_scatter", sendbuf.shape, recvbuf.shape, recvbuf.dtype, op)
        p = self.persistent.ops.get(key)
        if p is None:
            send, sspec = self._scratch(sendbuf.shape, recvbuf.dtype, reduce=True)
            recv, rspec = self._scratch(recvbuf.shape, recvbuf.dtype, reduce=True)
            req = self.reduce_scatter_comm.Reduce_scatter_block_init(sspec, rspec, REDUCTIONS[recvbuf.dtype, op][1])
            p = self.persistent.add(key, Persistent(req, send, recv, self.size if op is _AVG else 0))
        return p.run(sendbuf, recvbuf, timeout)

    def _all_to_all_now(
        self, sbuf: np.ndarray, scounts: list[int], rbuf: np.ndarray, rcounts: list[int], timeout: float
    ) -> bool:
        if not _even(scounts, rcounts):
            small = sbuf.nbytes + rbuf.nbytes <= PERSISTENT_MAX and sbuf.ndim and rbuf.ndim and sbuf.size
            xkey = ("exchange", sbuf.shape, rbuf.shape, rbuf.dtype, tuple(scounts), tuple(rcounts)) if small else ()
            x = self.p2p.ops.get(xkey) if xkey else None
            if x is None and sbuf.nbytes + rbuf.nbytes > PERSISTENT_MAX:  # the same messages from C (DirectCache.make)
                big = ("exchange", sbuf.shape, rbuf.shape, rbuf.dtype, tuple(scounts), tuple(rcounts))
                d = self.direct.get(big) or self.direct.make(
                    big, self.all_to_all_comm, MOVE_TYPE[rbuf.dtype], None, 0, 0, sbuf.nbytes, rbuf.nbytes,
                    _TAG_EXCHANGE, counts=(*scounts, *rcounts),
                )  # fmt: skip
                if d is not None:
                    return d.run(sbuf, rbuf, timeout)
            if x is None and not (xkey and self.p2p.again(xkey)):
                return self._exchange(sbuf, scounts, rbuf, rcounts).wait(timeout)
            x = x or self._new_exchange(xkey, sbuf, scounts, rbuf, rcounts)
            return x.run(sbuf, rbuf, timeout)
        if rbuf.nbytes > PERSISTENT_MAX:
            t, k = MOVE_TYPE[rbuf.dtype], rcounts[0]
            key = ("all_to_all", sbuf.shape, rbuf.shape, rbuf.dtype)
            if (d := self._direct(key, self.all_to_all_comm, t, None, 0, k, sbuf.nbytes, rbuf.nbytes)) is not None:
                return d.run(sbuf, rbuf, timeout)
            req = self.all_to_all_comm.Ialltoall([sbuf, k, t], [rbuf, k, t])
            return settle(req, timeout, self.abandoned, sbuf.nbytes + rbuf.nbytes)
        key = ("all_to_all", sbuf.shape, rbuf.shape, rbuf.dtype)
        p = self.persistent.ops.get(key)
        if p is None:
            send, sspec = self._scratch(sbuf.shape, rbuf.dtype)
            recv, rspec = self._scratch(rbuf.shape, rbuf.dtype)
            p = self.persistent.add(key, Persistent(self.all_to_all_comm.Alltoall_init(sspec, rspec), send, recv))
        return p.run(sbuf, rbuf, timeout)

    def _gather_now(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int, timeout: float) -> bool:
        if sendbuf.nbytes * self.size > PERSISTENT_MAX:
            key, t, n = ("gather", sendbuf.shape, sendbuf.dtype, root), MOVE_TYPE[sendbuf.dtype], sendbuf.nbytes
            if (d := self._direct(key, self.gather_comm, t, None, root, sendbuf.size, n, n * self.size)) is not None:
                return d.run(sendbuf, recvbuf, timeout)
            return self.gather(sendbuf, recvbuf, root).wait(timeout)
        key = ("gather", sendbuf.shape, sendbuf.dtype, root)
        p = self.persistent.ops.get(key) or self._new_rooted(key, sendbuf, root)
        return p.run(sendbuf, recvbuf, timeout)

    def _scatter_now(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int, timeout: float) -> bool:
        if recvbuf.nbytes * self.size > PERSISTENT_MAX:
            key, t, n = ("scatter", recvbuf.shape, recvbuf.dtype, root), MOVE_TYPE[recvbuf.dtype], recvbuf.nbytes
            if (d := self._direct(key, self.scatter_comm, t, None, root, recvbuf.size, n * self.size, n)) is not None:
                return d.run(sendbuf, recvbuf, timeout)
            return self.scatter(sendbuf, recvbuf, root).wait(timeout)
        key = ("scatter", recvbuf.shape, recvbuf.dtype, root)
        p = self.persistent.ops.get(key) or self._new_rooted(key, recvbuf, root)
        return p.run(sendbuf, recvbuf, timeout)

    def _new_rooted(self, key: tuple, chunk: np.ndarray, root: int) -> Persistent:
        """Persistent gather (every rank's ``chunk`` to the root's whole) or scatter (the root's whole to chunks)."""
        mine, gather = self.rank == root, key[0] == "gather"
        part, part_spec = self._scratch(chunk.shape, chunk.dtype)
        whole, whole_spec = self._scratch((self.size * chunk.size,), chunk.dtype)
        if gather:
            req = self.gather_comm.Gather_init(part_spec, whole_spec if mine else None, root)
            return self.persistent.add(key, Persistent(req, part, whole if mine else None))
        req = self.scatter_comm.Scatter_init(whole_spec if mine else None, part_spec, root)
        return self.persistent.add(key, Persistent(req, whole if mine else None, part))

    def _barrier_now(self, timeout: float) -> bool:
        if self.size == 1:
            return True
        key = ("barrier",)
        p = self.persistent.ops.get(key) or self.persistent.add(key, Persistent(self.barrier_comm.Barrier_init()))
        return p.run(None, None, timeout)

    def _send_now(self, buf: np.ndarray, peer: int, tag: int, timeout: float) -> bool:
        return self._point_now(True, buf, peer, tag, timeout)

    def _recv_now(self, buf: np.ndarray, peer: int, tag: int, timeout: float) -> bool:
        return self._point_now(False, buf, peer, tag, timeout)

    def _point_now(self, sending: bool, buf: np.ndarray, peer: int, tag: int, timeout: float) -> bool:
        """A blocking send (``sending``) or receive: small ones, from their second sighting, as a persistent
        request per (shape, dtype, peer, tag), each rank its own (point to point: nothing to keep in step)."""
        comm, n = self.comm, buf.nbytes
        if n > PERSISTENT_MAX:  # large: from the first sighting, posted on the caller's array (no MPI object)
            big = ("send" if sending else "recv", buf.shape, buf.dtype, peer, tag)
            d = self.direct.get(big) or self.direct.make(
                big, comm, MOVE_TYPE[buf.dtype], None, peer, buf.size, *((n, 0) if sending else (0, n)), tag
            )
            if d is not None:
                return d.run(buf, None, timeout) if sending else d.run(None, buf, timeout)
        key = ("send" if sending else "recv", buf.shape, buf.dtype, peer, tag) if n <= PERSISTENT_MAX else ()
        p = self.p2p.ops.get(key) if key else None
        if p is None and not (key and self.p2p.again(key)):
            req = (comm.Isend if sending else comm.Irecv)([buf, MOVE_TYPE[buf.dtype]], peer, tag)
            return settle(req, timeout, self.abandoned, buf.nbytes)
        if p is None:
            scratch, spec = self._scratch(buf.shape, buf.dtype)
            req = (comm.Send_init if sending else comm.Recv_init)(spec, peer, tag)
            p = self.p2p.add(key, Persistent(req, scratch, None) if sending else Persistent(req, None, scratch))
        return p.run(buf, None, timeout) if sending else p.run(None, buf, timeout)

    # -- communicators -----------------------------------------------------------------------------
    def split(self, ranks: list[int], timeout: float) -> MpiBackend | None:
        """Sub-communicator of ``ranks`` (in that order); collective over this communicator."""
        # A nonblocking barrier first, so a missing rank times out instead of hanging in Split.
        if not settle(self.comm.Ibarrier(), timeout, self.abandoned):
            raise CommTimeoutError(f"not every rank called new_group within {timeout:.1f} s")
        member = self.rank in ranks
        sub = self.comm.Split(0 if member else MPI.UNDEFINED, ranks.index(self.rank) if member else 0)
        if not member:
            return None
        backend = MpiBackend(cast(MPI.Intracomm, sub))  # Split of an intracommunicator is one
        backend.separate_kinds(timeout)
        return backend

    def create_group(self, ranks: list[int], timeout: float) -> MpiBackend:
        """Sub-communicator of ``ranks`` (in that order), made by its members alone (MPI_Comm_create_group)."""
        self.rendezvous(ranks, timeout)  # every member is here: Create_group, which cannot time out, will not wait
        tag = zlib.crc32(repr(ranks).encode()) % 32768  # tells concurrent creations over overlapping ranks apart
        everyone = self.comm.Get_group()
        members = everyone.Incl(ranks)
        backend = MpiBackend(self.comm.Create_group(members, tag))
        members.Free()
        everyone.Free()
        backend.separate_kinds(timeout)
        return backend

    def abort(self) -> None:
        """MPI cannot abort one communicator without killing the job; the group layer fences it off."""

    def close(self) -> None:
        """Free the persistent operations, the per-kind duplicates and the communicator (never the world's)."""
        self.persistent.close()
        self.p2p.close()
        self.direct.close()
        for comm in self.dups:
            if comm != MPI.COMM_NULL:
                comm.Free()
        self.dups = []
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.comm != MPI.COMM_NULL:
            self.comm.Free()
