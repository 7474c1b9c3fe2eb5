"""The ``mpi`` backend: host (numpy) buffers over mpi4py and the MPICH wheel; nothing blocks without a deadline.

Every call, collective or point to point, blocking or not, runs a plan of :mod:`commlib.backends._plans`:
commlib's own point-to-point messages, each with a stamp that says which call sent it
(:mod:`commlib.backends._stamp`), checked by its receiver, so ranks that disagree on a call end in an error
naming both calls instead of in wrong data. One executor (:mod:`commlib.backends._steps`, in C where it was
built) runs a plan again and again for calls of one description: small messages through persistent requests
over scratch buffers, large ones on the caller's arrays.

What shapes the messages (the inline size, the piece size, composed calls; the executor in C or Python,
which does not) is agreed by the group's ranks when the group is made (:meth:`MpiBackend.agree`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from mpi4py import MPI

from commlib._ops import ReduceOp
from commlib._settings import value as setting
from commlib.backends import _native, _stamp, _steps
from commlib.backends._mpi import average, settle
from commlib.backends._plans import Plan, plan
from commlib.backends._waker import count_cores
from commlib.backends.base import DONE, RESERVED_TAGS, TAG_FAIL, Backend, Handle, Resident
from commlib.errors import CommError, CommTimeoutError

__all__ = ["MpiBackend", "pattern"]

_AVG, _SUM = ReduceOp.AVG, ReduceOp.SUM
_CACHE = 128  # executors a communicator keeps (each holds its scratch and persistent requests)


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("commlib")
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path, not installed
        return "unknown"


def pattern() -> dict[str, Any]:
    """What this process brings to a group: the settings that shape messages, and what it runs on."""
    return {
        "protocol": _stamp.MAGIC & 0xFF,
        "commlib": _version(),
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "native": _native.Steps is not None,
        "small": setting("COMMLIB_MPI_PERSISTENT_MAX"),
        "piece": setting("COMMLIB_MPI_PIECE_BYTES"),
        "composed": setting("COMMLIB_MPI_COMPOSED"),
    }


class _Run:
    """The handle of an asynchronous call: one executor's run; back to its backend's spares once complete."""

    __slots__ = ("backend", "ex", "finish", "key", "out")

    def __init__(self, backend: MpiBackend, key: tuple, ex: Any, out: Any, finish: Callable[[], None] | None):
        self.backend, self.key, self.ex, self.out, self.finish = backend, key, ex, out, finish

    def test(self) -> bool:
        ex = self.ex
        if ex is None:
            return True
        try:
            if not ex.test():
                return False
        except BaseException as e:
            raise ex.error(e) from None
        self._end()
        return True

    def wait(self, timeout: float) -> bool:
        ex = self.ex
        if ex is None:
            return True
        try:
            if not ex.wait(timeout):
                self.backend.abandoned.append(ex)
                return False
        except BaseException as e:
            self.backend.abandoned.append(ex)
            raise ex.error(e) from None
        self._end()
        return True

    def _end(self) -> None:
        ex, self.ex = self.ex, None
        ex.finish(self.out)
        if self.finish is not None:
            self.finish()
        self.backend.give_back(self.key, ex)

    def defer(self) -> bool:
        return False  # host memory: the caller waits


class _AnySource:
    """A receive from any rank: the first message with the tag found (probed), then received from its sender."""

    __slots__ = ("backend", "buf", "run", "source", "status", "tag")

    def __init__(self, backend: MpiBackend, buf: np.ndarray, tag: int) -> None:
        self.backend, self.buf, self.tag = backend, buf, tag
        self.run: _Run | None = None
        self.status = MPI.Status()
        self.source = -1

    def test(self) -> bool:
        if self.run is None:
            if not self.backend.p2p.Iprobe(MPI.ANY_SOURCE, self.tag, self.status):
                return False
            self.source = self.status.Get_source()
            self.run = cast(_Run, self.backend.recv(self.buf, self.source, self.tag))
        return self.run.test()

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        from commlib.backends.base import poll

        if self.run is None and not poll(lambda: self.test() or self.run is not None, timeout):
            return False
        assert self.run is not None
        return self.run.wait(max(deadline - time.monotonic(), 0.0))

    def defer(self) -> bool:
        return False


class MpiBackend(Backend):
    """Moves host buffers between the ranks of one MPI communicator."""

    name = "mpi"

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.max_tag = int(comm.Get_attr(MPI.TAG_UB) or 32767) - RESERVED_TAGS
        # the collectives' steps and the sends and receives each on a duplicate of their own (prepare())
        self.coll: MPI.Intracomm = comm
        self.p2p: MPI.Intracomm = comm
        self.dups: list[MPI.Intracomm] = []
        mine = pattern()
        self.agreed = mine  # what every rank of the group speaks (agree())
        self.small, self.piece, self.composed = mine["small"], mine["piece"], mine["composed"]
        self.ops: dict[tuple, Any] = {}  # executors by call description (oldest first)
        self.limit = _CACHE
        self.spares: dict[tuple, list[Any]] = {}  # executors of asynchronous calls, idle
        self.abandoned: list = []  # executors a wait gave up on: MPI may still use their buffers
        self.noticed = False  # abort() told the others already
        #: the group layer's lookups (Backend.sums, Backend.residents): SUM all_reduces by (shape, dtype), and
        #: the other ready calls by their own keys (see _lookup)
        self.summed: dict[int, Resident] = {}
        self.ready: dict[str, dict[Any, Resident]] = {k: {} for k in _TABLES}
        self.now: dict[str, Callable[..., bool]] = {
            "all_reduce": self._all_reduce_now,
            "broadcast": self._broadcast_now,
            "reduce": self._reduce_now,
            "all_gather": self._all_gather_now,
            "reduce_scatter": self._reduce_scatter_now,
            "barrier": self._barrier_now,
            "send": self._send_now,
            "recv": self._recv_now,
            "all_to_all": self._all_to_all_now,
            "gather": self._gather_now,
            "scatter": self._scatter_now,
        }

    # -- setup: the group's communicators and its agreed pattern -----------------------------------------
    def prepare(self, timeout: float, world: bool = False) -> None:
        """Collective over the communicator: (the world) count the node's cores for waits that block
        (:func:`commlib.backends._waker.count_cores`); make the two duplicates; agree on the pattern."""
        if world and self.size > 1 and not count_cores(self.comm, timeout):
            raise CommTimeoutError(f"not every rank set up the communicator within {timeout:g} s")
        if self.size > 1 and not self.dups:
            pending = [self.comm.Idup() for _ in range(2)]
            deadline = time.monotonic() + timeout
            for _, req in pending:
                if not settle(req, max(deadline - time.monotonic(), 0.0), self.abandoned):
                    raise CommTimeoutError(f"not every rank set up the communicator within {timeout:g} s")
            self.dups = [c for c, _ in pending]
            self.coll, self.p2p = self.dups
        self.agree(timeout)

    def agree(self, timeout: float) -> None:
        """Exchange :func:`pattern` with every rank and take what all of them speak: the smallest inline and
        piece sizes, composed calls if any rank asks. Ranks of another protocol version cannot work together:
        ``CommError`` naming them. Other differences (the executor in C or in Python, commlib's or MPI's
        version) work, and group rank 0 says so once (a ``RuntimeWarning``)."""
        mine = json.dumps(pattern(), sort_keys=True).encode()
        if len(mine) > 480:
            raise ValueError("mpi backend: the pattern to agree on is too long")
        if self.size == 1:
            return
        buf = np.zeros(512, np.uint8)
        buf[: len(mine)] = np.frombuffer(mine, np.uint8)
        everyone = np.zeros(512 * self.size, np.uint8)
        if not settle(self.comm.Iallgather(buf, everyone), timeout, self.abandoned):
            raise CommTimeoutError(f"not every rank set up the communicator within {timeout:g} s")
        rows = [json.loads(bytes(everyone[512 * p : 512 * (p + 1)]).rstrip(b"\0")) for p in range(self.size)]
        self.agreed, notes = _agree(rows)
        self.small, self.piece, self.composed = self.agreed["small"], self.agreed["piece"], self.agreed["composed"]
        if notes and self.rank == 0:
            warnings.warn(f"commlib: the ranks of this group differ: {'; '.join(notes)}", RuntimeWarning, stacklevel=2)

    # -- executors ------------------------------------------------------------------------------------------
    def executor(self, key: tuple, build: Callable[[], Plan], tag: int = -1) -> Any:  # a Steps or NativeSteps
        """An idle executor for calls described by ``key``: the cached one, a spare, or a new one (cached)."""
        ex: Any = self.ops.get(key)
        if ex is not None and ex.state == "idle":
            return ex
        spares = self.spares.get(key)
        if spares:
            return spares.pop()
        ex = _steps.make(build(), self.p2p if tag >= 0 else self.coll, self.small, tag, self.max_tag + TAG_FAIL)
        if key not in self.ops:
            if len(self.ops) >= self.limit:
                self._evict(next(iter(self.ops)))
            self.ops[key] = ex
            for table, entry in _lookups(key, self.size):
                (self.summed if table == "sums" else self.ready[table])[entry] = ex
        return ex

    def _unlist(self, key: tuple, ex: Any) -> None:
        """``ex`` out of the cache and of the group layer's lookups."""
        if self.ops.get(key) is ex:
            del self.ops[key]
        for name, entry in _lookups(key, self.size):
            table = self.summed if name == "sums" else self.ready[name]
            if table.get(entry) is ex:
                del table[entry]

    def give_back(self, key: tuple, ex: Any) -> None:
        """An asynchronous call's executor, idle again."""
        if self.ops.get(key) is ex:
            return
        spares = self.spares.setdefault(key, [])
        if len(spares) < 4 and len(self.spares) <= _CACHE:
            spares.append(ex)
        else:
            ex.free()

    def _evict(self, key: tuple) -> None:
        ex = self.ops[key]
        self._unlist(key, ex)
        if ex.state == "idle":
            ex.free()
        else:
            self.abandoned.append(ex)

    def _plan(self, kind: str, dtype: Any = None, count: int = 0, op: Any = None, root: int = -1, **kw: Any) -> Any:
        return functools.partial(
            plan, kind, self.rank, self.size, dtype, count, op, root, small=self.small, piece=self.piece, **kw
        )

    def _start(self, key: tuple, build: Callable[[], Plan], inp: Any, out: Any, seq: int, tag: int = -1,
               finish: Callable[[], None] | None = None) -> Handle:  # fmt: skip
        ex = self.executor(key, build, tag)
        try:
            ex.start(inp, out, seq)
        except BaseException as e:
            self._forget(key, ex)
            raise ex.error(e) from None
        return _Run(self, key, ex, out, finish)

    def _go(self, key: tuple, build: Callable[[], Plan], inp: Any, out: Any, seq: int, timeout: float,
            tag: int = -1) -> bool:  # fmt: skip
        """A blocking call: run it (False: ``timeout`` passed first; the executor is abandoned)."""
        ex = self.executor(key, build, tag)
        try:
            done = ex.go(inp, out, seq)
            if done is None:  # the group layer checked these arrays: they must be the executor's
                raise ValueError(f"mpi backend: the arrays of {key[0]} are not those its executor was made for")
            if not done and not ex.wait(timeout):
                self._forget(key, ex)
                return False
        except BaseException as e:
            self._forget(key, ex)
            raise ex.error(e) from None
        ex.finish(out)
        return True

    def _forget(self, key: tuple, ex: Any) -> None:
        """An executor that failed or timed out: out of every table, kept referenced (MPI may use its buffers)."""
        self._unlist(key, ex)
        self.abandoned.append(ex)

    # -- collectives: asynchronous --------------------------------------------------------------------------
    def all_reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, seq: int) -> Handle:
        key = ("all_reduce", recvbuf.shape, recvbuf.dtype, op)
        build = self._plan("all_reduce", recvbuf.dtype, recvbuf.size, op)
        return self._start(key, build, sendbuf, recvbuf, seq, finish=self._avg(op, recvbuf))

    def reduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, root: int, seq: int) -> Handle:
        mine = self.rank == root
        key = ("reduce", recvbuf.shape, recvbuf.dtype, op, root)
        build = self._plan("reduce", recvbuf.dtype, recvbuf.size, op, root)
        return self._start(key, build, sendbuf, recvbuf if mine else None, seq, finish=self._avg(op, recvbuf, mine))

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, seq: int) -> Handle:
        key = ("reduce_scatter", sendbuf.shape, recvbuf.shape, recvbuf.dtype, op)
        build = self._plan("reduce_scatter", recvbuf.dtype, recvbuf.size, op)
        return self._start(key, build, sendbuf, recvbuf, seq, finish=self._avg(op, recvbuf))

    def _avg(self, op: ReduceOp, out: np.ndarray, mine: bool = True) -> Callable[[], None] | None:
        return functools.partial(average, out, self.size) if op is _AVG and mine else None

    def broadcast(self, buf: np.ndarray, root: int, seq: int) -> Handle:
        key = ("broadcast", buf.shape, buf.dtype, root)
        return self._start(key, self._plan("broadcast", buf.dtype, buf.size, None, root), buf, buf, seq)

    def all_gather(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, seq: int) -> Handle:
        key = ("all_gather", None if sendbuf is None else sendbuf.shape, recvbuf.shape, recvbuf.dtype)
        build = self._plan("all_gather", recvbuf.dtype, recvbuf.size // self.size, in_place=sendbuf is None)
        return self._start(key, build, sendbuf, recvbuf, seq)

    def gather(self, sendbuf: np.ndarray, recvbuf: Any, root: int, seq: int) -> Handle:
        if self.composed:
            return super().gather(sendbuf, recvbuf, root, seq)
        key = ("gather", sendbuf.shape, sendbuf.dtype, root)
        return self._start(key, self._plan("gather", sendbuf.dtype, sendbuf.size, None, root), sendbuf, recvbuf, seq)

    def scatter(self, sendbuf: Any, recvbuf: np.ndarray, root: int, seq: int) -> Handle:
        if self.composed:
            return super().scatter(sendbuf, recvbuf, root, seq)
        key = ("scatter", recvbuf.shape, recvbuf.dtype, root)
        return self._start(key, self._plan("scatter", recvbuf.dtype, recvbuf.size, None, root), sendbuf, recvbuf, seq)

    def all_to_all(
        self, sendbuf: np.ndarray, send_counts: list[int], recvbuf: np.ndarray, recv_counts: list[int], seq: int
    ) -> Handle:
        if self.composed:
            return super().all_to_all(sendbuf, send_counts, recvbuf, recv_counts, seq)
        key, build = self._all_to_all(sendbuf, send_counts, recvbuf, recv_counts)
        return self._start(key, build, sendbuf, recvbuf, seq)

    def _all_to_all(self, sbuf: np.ndarray, sc: list[int], rbuf: np.ndarray, rc: list[int]) -> tuple[tuple, Any]:
        k = sc[0]
        if sc.count(k) == len(sc) and rc.count(k) == len(rc):  # even blocks (count(): C speed)
            return ("all_to_all", sbuf.shape, rbuf.shape, rbuf.dtype), self._plan("all_to_all", rbuf.dtype, k)
        counts = (tuple(sc), tuple(rc))
        key = ("exchange", sbuf.shape, rbuf.shape, rbuf.dtype, *counts)
        return key, self._plan("all_to_all", rbuf.dtype, 0, counts=counts)

    def barrier(self, seq: int) -> Handle:
        if self.size == 1:
            return DONE
        return self._start(("barrier",), self._plan("barrier"), None, None, seq)

    # -- point to point ---------------------------------------------------------------------------------------
    def send(self, buf: np.ndarray, peer: int, tag: int) -> Handle:
        key = ("send", buf.shape, buf.dtype, peer, tag)
        return self._start(key, self._plan("send", buf.dtype, buf.size, peer=peer), buf, None, 0, tag)

    def recv(self, buf: np.ndarray, peer: int | None, tag: int) -> Handle:
        if peer is None:
            return _AnySource(self, buf, tag)
        key = ("recv", buf.shape, buf.dtype, peer, tag)
        return self._start(key, self._plan("recv", buf.dtype, buf.size, peer=peer), None, buf, 0, tag)

    # -- blocking: an executor run to completion --------------------------------------------------------------
    def fused(self) -> dict[str, Callable[..., bool]]:
        """Blocking calls in one step (see :meth:`Backend.fused`)."""
        return self.now if not self.composed else {k: v for k, v in self.now.items() if k not in _COMPOSED}

    def sums(self) -> dict[int, Resident]:
        return self.summed

    def residents(self) -> dict[str, dict[Any, Resident]]:
        return self.ready

    def _all_reduce_now(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, seq: int, timeout: float) -> bool:
        key = ("all_reduce", recvbuf.shape, recvbuf.dtype, op)
        done = self._go(key, self._plan("all_reduce", recvbuf.dtype, recvbuf.size, op), sendbuf, recvbuf, seq, timeout)
        if done and op is _AVG:
            average(recvbuf, self.size)
        return done

    def _reduce_now(
        self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, root: int, seq: int, timeout: float
    ) -> bool:
        mine = self.rank == root
        key = ("reduce", recvbuf.shape, recvbuf.dtype, op, root)
        build = self._plan("reduce", recvbuf.dtype, recvbuf.size, op, root)
        done = self._go(key, build, sendbuf, recvbuf if mine else None, seq, timeout)
        if done and mine and op is _AVG:
            average(recvbuf, self.size)
        return done

    def _reduce_scatter_now(
        self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, seq: int, timeout: float
    ) -> bool:
        key = ("reduce_scatter", sendbuf.shape, recvbuf.shape, recvbuf.dtype, op)
        build = self._plan("reduce_scatter", recvbuf.dtype, recvbuf.size, op)
        done = self._go(key, build, sendbuf, recvbuf, seq, timeout)
        if done and op is _AVG:
            average(recvbuf, self.size)
        return done

    def _broadcast_now(self, buf: np.ndarray, root: int, seq: int, timeout: float) -> bool:
        key = ("broadcast", buf.shape, buf.dtype, root)
        return self._go(key, self._plan("broadcast", buf.dtype, buf.size, None, root), buf, buf, seq, timeout)

    def _all_gather_now(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, seq: int, timeout: float) -> bool:
        key = ("all_gather", None if sendbuf is None else sendbuf.shape, recvbuf.shape, recvbuf.dtype)
        build = self._plan("all_gather", recvbuf.dtype, recvbuf.size // self.size, in_place=sendbuf is None)
        return self._go(key, build, sendbuf, recvbuf, seq, timeout)

    def _gather_now(self, sendbuf: np.ndarray, recvbuf: Any, root: int, seq: int, timeout: float) -> bool:
        key = ("gather", sendbuf.shape, sendbuf.dtype, root)
        build = self._plan("gather", sendbuf.dtype, sendbuf.size, None, root)
        return self._go(key, build, sendbuf, recvbuf, seq, timeout)

    def _scatter_now(self, sendbuf: Any, recvbuf: np.ndarray, root: int, seq: int, timeout: float) -> bool:
        key = ("scatter", recvbuf.shape, recvbuf.dtype, root)
        build = self._plan("scatter", recvbuf.dtype, recvbuf.size, None, root)
        return self._go(key, build, sendbuf, recvbuf, seq, timeout)

    def _all_to_all_now(
        self, sbuf: np.ndarray, sc: list[int], rbuf: np.ndarray, rc: list[int], seq: int, timeout: float
    ) -> bool:
        key, build = self._all_to_all(sbuf, sc, rbuf, rc)
        return self._go(key, build, sbuf, rbuf, seq, timeout)

    def _barrier_now(self, seq: int, timeout: float) -> bool:
        return self.size == 1 or self._go(("barrier",), self._plan("barrier"), None, None, seq, timeout)

    def _send_now(self, buf: np.ndarray, peer: int, tag: int, timeout: float) -> bool:
        key = ("send", buf.shape, buf.dtype, peer, tag)
        return self._go(key, self._plan("send", buf.dtype, buf.size, peer=peer), buf, None, 0, timeout, tag)

    def _recv_now(self, buf: np.ndarray, peer: int, tag: int, timeout: float) -> bool:
        key = ("recv", buf.shape, buf.dtype, peer, tag)
        return self._go(key, self._plan("recv", buf.dtype, buf.size, peer=peer), None, buf, 0, timeout, tag)

    def close_check(self, seq: int, sent: list[int], received: list[int], timeout: float) -> list[tuple[int, int, int]]:
        """The closing exchange (see :meth:`Backend.close_check`), as a stamped plan of its own: a rank that
        made another number of calls is named by the stamps (the ``close`` stamp carries the count)."""
        if self.size == 1:
            return [(seq, 0, 0)]
        mine = np.zeros((self.size, 3), np.int64)
        mine[:, 0], mine[:, 1], mine[:, 2] = seq, sent, received
        theirs = np.zeros((self.size, 3), np.int64)
        ex = _steps.make(self._plan("close")(), self.coll, self.small, -1, self.max_tag + TAG_FAIL)
        try:
            if not ex.go(mine, theirs, seq) and not ex.wait(timeout):
                self.abandoned.append(ex)
                raise CommTimeoutError(f"not every rank ended its calls within {timeout:g} s")
        except CommTimeoutError:
            raise
        except BaseException as e:
            self.abandoned.append(ex)
            raise ex.error(e) from None
        ex.finish(theirs)
        ex.free()
        return [tuple(int(v) for v in row) for row in theirs]  # type: ignore[misc]

    def close_failed(self, seq: int) -> None:
        """The group failed on this rank: tell the others, who are (or will be) in their closing check, without
        waiting for anything (see :meth:`Backend.close_failed`)."""
        if self.size == 1:
            return
        ex = _steps.make(self._plan("close", None, 1)(), self.coll, self.small, -1, self.max_tag + TAG_FAIL)
        ex.start(np.zeros((self.size, 3), np.int64), None, seq)
        self.abandoned.append(ex)  # its sends may never complete (a peer that is gone)

    # -- communicators -----------------------------------------------------------------------------------------
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
        backend.prepare(timeout)
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
        backend.prepare(timeout)
        return backend

    def abort(self, reason: str = "") -> None:
        """The group failed on this rank: its executors are dropped (never run again), and, as MPI cannot abort
        one communicator without killing the job, the others are told instead (a notice with ``reason`` on both
        communicators, sent without waiting): a peer still waiting for this rank reads it on its wait's slow path
        and fails at once, naming this rank."""
        self.abandoned += list(self.ops.values())  # some may still run: never started (nor freed) again
        self.ops.clear()
        self.spares.clear()
        self.summed.clear()
        for table in self.ready.values():
            table.clear()
        if self.size == 1 or self.noticed:
            return
        self.noticed = True
        text = np.frombuffer(reason.encode()[:2000] or b"(no reason given)", np.uint8).copy()
        for comm in {id(self.coll): self.coll, id(self.p2p): self.p2p}.values():
            for p in range(self.size):
                if p != self.rank:
                    self.abandoned.append((comm.Isend([text, MPI.BYTE], p, self.max_tag + TAG_FAIL), text))

    def close(self) -> None:
        """Free the executors, the duplicates and the communicator (never the world's)."""
        for ex in list(self.ops.values()) + [s for spares in self.spares.values() for s in spares]:
            if ex.state == "idle":
                ex.free()
        self.ops.clear()
        self.spares.clear()
        self.summed.clear()
        for table in self.ready.values():
            table.clear()
        for comm in self.dups:
            if comm != MPI.COMM_NULL:
                comm.Free()
        self.dups = []
        self.coll = self.p2p = self.comm
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.comm != MPI.COMM_NULL:
            self.comm.Free()


_COMPOSED = ("all_to_all", "gather", "scatter")
#: the tables of Backend.residents
_TABLES = (
    *("broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "barrier"),
    *("all_to_all_v", "send", "recv"),
)


def _lookups(key: tuple, size: int) -> list[tuple[str, Any]]:
    """Where the group layer finds the executor of ``key`` (Backend.sums / residents), by byte counts (the
    executor checks the dtype: another dtype's call is not its, and takes the generic path): (table, entry)
    pairs; none: only through Backend.fused (another op than SUM, an in-place all_gather)."""
    kind = key[0]
    if kind in ("all_reduce", "reduce", "broadcast", "gather", "scatter", "send", "recv"):
        nbytes = math.prod(key[1]) * key[2].itemsize
        if kind == "all_reduce":  # (kind, shape, dtype, op)
            return [("sums", nbytes)] if key[3] is _SUM else []
        if kind == "reduce":  # (kind, shape, dtype, op, root)
            return [("reduce", (nbytes, key[4]))] if key[3] is _SUM else []
        if kind in ("send", "recv"):  # (kind, shape, dtype, peer, tag)
            return [(kind, (nbytes, key[3], key[4]))]
        return [(kind, (nbytes, key[3]))]  # broadcast (the buffer), gather and scatter (a chunk), and the root
    if kind == "barrier":
        return [("barrier", ())]
    if kind == "all_gather" and key[1] is None:  # in place: only through Backend.fused
        return []
    z = key[3].itemsize  # (kind, input shape, output shape, dtype, ...)
    sizes = (math.prod(key[1]) * z, math.prod(key[2]) * z)
    if kind == "all_gather":
        return [("all_gather", sizes)]
    if kind == "reduce_scatter":  # (..., op)
        return [("reduce_scatter", sizes)] if key[4] is _SUM else []
    if kind == "all_to_all":  # even blocks, whether the caller gave even splits or none
        rows_in, rows_out = (key[1][0] if key[1] else 1), (key[2][0] if key[2] else 1)
        even = ((rows_in // size,) * size, (rows_out // size,) * size)
        return [("all_to_all", sizes), ("all_to_all_v", (*sizes, even))]
    if kind == "exchange":  # (..., send counts, receive counts): uneven
        srow, rrow = math.prod(key[1][1:]), math.prod(key[2][1:])  # the callers' split sizes count rows
        splits = (tuple(c // srow for c in key[4]), tuple(c // rrow for c in key[5]))
        return [("all_to_all_v", (*sizes, splits))]
    return []


def _agree(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """What every rank of ``rows`` (one :func:`pattern` per group rank) speaks, and notes on the differences."""
    versions = {r["protocol"] for r in rows}
    if len(versions) > 1:
        raise CommError(
            "the ranks of this group speak different commlib protocols and cannot work together: "
            + _who(rows, "protocol")
            + " (install the same commlib on every node)"
        )
    agreed = dict(rows[0])
    agreed["small"] = min(r["small"] for r in rows)
    agreed["piece"] = min(r["piece"] for r in rows)
    agreed["composed"] = any(r["composed"] for r in rows)
    agreed["native"] = all(r["native"] for r in rows)
    notes = []
    for name, what, then in (
        ("native", "the compiled executor", "the Python executor runs the same messages, slower"),
        ("small", "COMMLIB_MPI_PERSISTENT_MAX", f"the group uses {agreed['small']}"),
        ("piece", "COMMLIB_MPI_PIECE_BYTES", f"the group uses {agreed['piece']}"),
        ("composed", "COMMLIB_MPI_COMPOSED", f"the group uses {int(agreed['composed'])}"),
        ("commlib", "commlib's version", "the same protocol: they work together"),
        ("mpi", "the MPI library", "MPI connected them: they work together"),
    ):
        if len({json.dumps(r[name]) for r in rows}) > 1:
            notes.append(f"{what}: {_who(rows, name)} ({then})")
    return agreed, notes


def _who(rows: list[dict[str, Any]], name: str) -> str:
    """Which ranks have which value of ``name``: ``ranks [0, 2]: True, ranks [1]: False``."""
    groups: dict[str, list[int]] = {}
    for p, r in enumerate(rows):
        groups.setdefault(json.dumps(r[name]), []).append(p)
    return ", ".join(f"ranks {ps}: {value}" for value, ps in groups.items())
