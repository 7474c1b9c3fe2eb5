"""The ``mpi`` backend: host (numpy) buffers over mpi4py and the MPICH wheel; nothing blocks without a deadline.

Every call, collective or point to point, blocking or not, runs a plan of :mod:`commlib.backends._plans`
made from its description (:class:`~commlib.backends._call.Call`): commlib's own point-to-point messages,
each with a stamp of the call (:mod:`commlib.backends._stamp`), checked by its receiver, so ranks that
disagree on a call end in an error naming both calls instead of in wrong data. One executor
(:mod:`commlib.backends._steps`, in C where it was built) runs a plan again and again for calls of one
description: small messages through persistent requests over scratch buffers, large ones on the caller's
arrays. :meth:`MpiBackend.start` posts a call on an executor; :meth:`MpiBackend.prepared` hands the group
layer one to run inline (a blocking call).

What shapes the messages (the inline size, the piece size, composed calls; the executor in C or Python,
which does not) is agreed by the group's ranks when the group is made (:meth:`MpiBackend.agree`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from mpi4py import MPI

from commlib._environment import mpi_launched
from commlib._settings import value as setting
from commlib.backends import _native, _stamp, _steps
from commlib.backends._call import Call
from commlib.backends._mpi_waits import count_cores, settle
from commlib.backends._plans import plan
from commlib.backends.base import (
    RESERVED_TAGS,
    TAG_FAIL,
    Backend,
    Handle,
    ReadyOp,
    check_same_ranks,
    poll,
    ranks_checksum,
    setup_timeout,
)
from commlib.errors import CommError, CommTimeoutError

__all__ = ["MpiBackend", "pattern", "unavailable", "world"]

_CACHE = 128  # executors a communicator keeps (each holds its scratch and persistent requests)


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("commlib")
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path, not installed
        return "unknown"


def unavailable() -> str | None:
    """None: MPI is here (mpi4py and the MPICH wheel are commlib's dependencies; this module imported them)."""
    return None


def world(place: Any) -> MpiBackend:
    """The default group's communicator (``commlib.backends.Spec.world``): the MPI world an MPI launcher made,
    else the processes joined through the job's store (``_mpi_world.join_singletons``); then its ranks agree on
    their pattern (:meth:`MpiBackend.prepare`)."""
    from commlib.backends import _mpi_world

    backend = place.mpi
    if place.join is not None:  # a newcomer to a running job (commlib.grow_group)
        nth, newcomers = place.join.nth, place.join.newcomers
        backend = _mpi_world.join_running(place.store, place.rank, nth, newcomers, place.timeout)
    elif backend is None:
        backend = _mpi_world.join_singletons(place.store, place.rank, place.size, place.timeout)
    backend.prepare(place.timeout, world=True)
    return backend


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

    def detach(self) -> None:
        return None


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
            call = Call("recv", self.buf.dtype, self.buf.size, root=self.source, tag=self.tag)
            self.run = cast(_Run, self.backend.start(call, None, self.buf, 0))
        return self.run.test()

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        if self.run is None and not poll(lambda: self.test() or self.run is not None, timeout):
            return False
        assert self.run is not None
        return self.run.wait(max(deadline - time.monotonic(), 0.0))

    def defer(self) -> bool:
        return False

    def detach(self) -> None:
        return None


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
        self.nonce = os.urandom(8)  # this communicator's, as its ranks agreed (agree()): in notices (_steps.Notice)
        self.small, self.piece, self.composed = mine["small"], mine["piece"], mine["composed"]
        self.ops: dict[tuple, Any] = {}  # executors by call description (oldest first)
        self.limit = _CACHE
        self.spares: dict[tuple, list[Any]] = {}  # executors of asynchronous calls, idle
        self.abandoned: list = []  # executors a wait gave up on: MPI may still use their buffers
        self.noticed = False  # abort() told the others already
        self.orphaned = False  # a peer died (abandon()): the communicator is kept for good, never freed
        self.ready: dict[Any, ReadyOp] = {}  # the group layer's ready operations, by the keys it gave (prepared())
        self.keys: dict[int, list[Any]] = {}  # id(executor) -> its keys in self.ready

    # -- setup: the group's communicators and its agreed pattern -----------------------------------------
    def prepare(self, timeout: float, world: bool = False) -> None:
        """Collective over the communicator: (the world) count the node's cores for waits that block
        (:func:`commlib.backends._mpi_waits.count_cores`); make the two duplicates; agree on the pattern."""
        if world and self.size > 1 and not count_cores(self.comm, timeout):
            raise setup_timeout("set up the communicator", timeout)
        if self.size > 1 and not self.dups:
            pending = [self.comm.Idup() for _ in range(2)]
            deadline = time.monotonic() + timeout
            for _, req in pending:
                if not settle(req, max(deadline - time.monotonic(), 0.0), self.abandoned):
                    raise setup_timeout("set up the communicator", timeout)
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
        buf[504:] = np.frombuffer(self.nonce, np.uint8)
        everyone = np.zeros(512 * self.size, np.uint8)
        if not settle(self.comm.Iallgather(buf, everyone), timeout, self.abandoned):
            raise setup_timeout("set up the communicator", timeout)
        self.nonce = everyone[504:512].tobytes()  # group rank 0's
        rows = [json.loads(bytes(everyone[512 * p : 512 * p + 480]).rstrip(b"\0")) for p in range(self.size)]
        self.agreed, notes = _agree(rows)
        self.small, self.piece, self.composed = self.agreed["small"], self.agreed["piece"], self.agreed["composed"]
        if notes and self.rank == 0:
            warnings.warn(f"commlib: the ranks of this group differ: {'; '.join(notes)}", RuntimeWarning, stacklevel=2)

    # -- executors ------------------------------------------------------------------------------------------
    def executor(self, call: Call, in_place: bool = False) -> Any:  # a Steps or NativeSteps
        """An idle executor for ``call``: the cached one, a spare, or a new one (cached)."""
        key = (call, in_place)
        ex: Any = self.ops.get(key)
        if ex is not None and ex.state == "idle":
            return ex
        spares = self.spares.get(key)
        if spares:
            return spares.pop()
        p2p = call.p2p
        built = plan(call, self.rank, self.size, small=self.small, piece=self.piece, in_place=in_place)
        ex = _steps.make(built, self.p2p if p2p else self.coll, self.small, call.tag if p2p else -1, self.notice)
        if key not in self.ops:
            if len(self.ops) >= self.limit:
                self._evict(next(iter(self.ops)))
            self.ops[key] = ex
        return ex

    @property
    def notice(self) -> _steps.Notice:
        """How this communicator's notices that a rank gave up look (:meth:`abort`, ``_steps.gave_up``)."""
        return _steps.Notice(self.max_tag + TAG_FAIL, self.nonce)

    def prepared(self, call: Call, inp: Any, out: Any, key: Any) -> ReadyOp | None:
        """The cached executor of ``call``, listed in :attr:`ready` under ``key`` (see :meth:`Backend.prepared`);
        None where a call needs more than the executor's run: composed calls, a receive from any rank."""
        if (self.composed and call.kind in _COMPOSED) or (call.p2p and call.root < 0):
            return None
        cached = (call, call.kind == "all_gather" and inp is None)
        ex: Any = self.ops.get(cached)
        if ex is None:
            ex = self.executor(*cached)
        op: ReadyOp = ex
        if ex.state != "idle" or self.ops.get(cached) is not ex:  # an asynchronous run still holds it
            return None
        if key is not None and key not in self.ready:
            self.ready[key] = op
            self.keys.setdefault(id(op), []).append(key)
        return op

    def _unlist(self, key: tuple, ex: Any) -> None:
        """``ex`` out of the cache and of the group layer's ready operations."""
        if self.ops.get(key) is ex:
            del self.ops[key]
        for k in self.keys.pop(id(ex), ()):
            if self.ready.get(k) is ex:
                del self.ready[k]

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

    def _forget(self, key: tuple, ex: Any) -> None:
        """An executor that failed or timed out: out of every table, kept referenced (MPI may use its buffers)."""
        self._unlist(key, ex)
        self.abandoned.append(ex)

    # -- calls --------------------------------------------------------------------------------------------------
    def start(self, call: Call, inp: Any, out: Any, seq: int) -> Handle:
        """Post ``call`` on an executor of its description (see :meth:`Backend.start`)."""
        if call.p2p and call.root < 0:
            return _AnySource(self, out, call.tag)
        if self.composed and call.kind in _COMPOSED:
            return self.compose(call, inp, out)
        in_place = call.kind == "all_gather" and inp is None
        key = (call, in_place)
        ex = self.executor(call, in_place)
        try:
            ex.start(inp, out, seq)
        except BaseException as e:
            self._forget(key, ex)
            raise ex.error(e) from None
        return _Run(self, key, ex, out, None)

    def close_check(self, seq: int, sent: list[int], received: list[int], timeout: float) -> list[tuple[int, int, int]]:
        """The closing exchange (see :meth:`Backend.close_check`), as a stamped plan of its own: a rank that
        made another number of calls is named by the stamps (the ``close`` stamp carries the count)."""
        if self.size == 1:
            return [(seq, 0, 0)]
        mine = np.zeros((self.size, 3), np.int64)
        mine[:, 0], mine[:, 1], mine[:, 2] = seq, sent, received
        theirs = np.zeros((self.size, 3), np.int64)
        close = plan(Call("close", None, 0), self.rank, self.size, small=self.small)
        ex = _steps.make(close, self.coll, self.small, -1, self.notice)
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
        failed = plan(Call("close", None, 1), self.rank, self.size, small=self.small)
        ex = _steps.make(failed, self.coll, self.small, -1, self.notice)
        ex.start(np.zeros((self.size, 3), np.int64), None, seq)
        self.abandoned.append(ex)  # its sends may never complete (a peer that is gone)

    # -- communicators -----------------------------------------------------------------------------------------
    def split(self, ranks: list[int], timeout: float) -> MpiBackend | None:
        """Sub-communicator of ``ranks`` (in that order); collective over this communicator."""
        # A nonblocking check first: a missing rank times out instead of hanging in Split, and ranks that ask for
        # different groups (one would Idup while another splits, and wait for good) fail alike, saying so.
        extremes = np.zeros(2, np.int64)
        if not settle(self.comm.Iallreduce(ranks_checksum(ranks), extremes, op=MPI.MAX), timeout, self.abandoned):
            raise setup_timeout("called new_group", timeout)
        check_same_ranks(ranks, extremes)
        if ranks == list(range(self.size)):
            # every rank in order: a duplicate, made without blocking (MPICH's Split spins in a blocking
            # allgather: 20 ms on 4 ranks over 2 cores against 1-2 for Idup, mostly ranks waiting for their turn)
            sub, req = self.comm.Idup()
            if not settle(req, timeout, self.abandoned):
                raise setup_timeout("called new_group", timeout)
        else:
            member = self.rank in ranks
            sub = cast(
                MPI.Intracomm, self.comm.Split(0 if member else MPI.UNDEFINED, ranks.index(self.rank) if member else 0)
            )
            if not member:
                return None
        backend = MpiBackend(sub)  # a Split or Idup of an intracommunicator is one
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
        self.ready.clear()
        self.keys.clear()
        if self.size == 1 or self.noticed:
            return
        self.noticed = True
        text = np.frombuffer(self.notice.text(reason), np.uint8).copy()
        for comm in {id(self.coll): self.coll, id(self.p2p): self.p2p}.values():
            for p in range(self.size):
                if p != self.rank:
                    self.abandoned.append((comm.Isend([text, MPI.BYTE], p, self.max_tag + TAG_FAIL), text))

    def abandon(self, reason: str = "") -> None:
        """A peer died: the executors are dropped (never run, nor freed, again) and no one is told (a message to
        the dead may never leave); the communicator is kept as it is for good: freeing or disconnecting it may
        wait for the dead."""
        self.noticed = self.orphaned = True
        self.abort(reason)

    def shrink(self, keep: list[int], key: int, timeout: float, payload: Any, died: bool) -> MpiBackend:
        """The survivors' communicator: ``MPI_Comm_create_group`` over this one, called by the ranks of ``keep``
        alone (it speaks only to them; MPICH builds it in milliseconds, the dead never asked)."""
        everyone = self.comm.Get_group()
        kept = everyone.Incl(keep)
        everyone.Free()
        try:
            comm = self.comm.Create_group(kept, _SHRINK_TAG + key % 1024)
        finally:
            kept.Free()
        backend = MpiBackend(cast(MPI.Intracomm, comm))
        try:
            backend.prepare(timeout)
        except CommTimeoutError as e:
            if died and _on_shared_memory():
                raise CommTimeoutError(f"{e}; {_SHARED_MEMORY_HINT}") from None
            raise
        return backend

    def grow(self, newcomers: int, store: Any, timeout: float, payload: Any) -> MpiBackend:
        """The members' side of a growing world: accept the newcomers through ``store`` (MPI's connect/accept,
        :func:`_mpi_world.admit`), then agree on the pattern with them."""
        from commlib.backends import _mpi_world

        backend = _mpi_world.admit(self, newcomers, store, timeout)
        backend.prepare(timeout, world=True)
        return backend

    def terminate(self) -> None:
        """End every process of the job: MPI_Abort on this communicator (all processes connected to it)."""
        self.comm.Abort(1)

    def close(self) -> None:
        """Free the executors, the duplicates and the communicator (never the world's; never one a dead peer
        left behind: see :meth:`abandon`; never one with a message no call here received)."""
        if self.orphaned:
            return
        if self.size > 1 and any(c.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG) for c in [*self.dups, self.comm]):
            # A peer sent this rank what no call received (it gave up on the group: its call's messages, its
            # notice). Freed, the communicator's context id would go to a later one, which would read those
            # messages as its own (a stale all_reduce's data, stamped alike): kept for good instead.
            self.orphaned = True
            return
        for ex in list(self.ops.values()) + [s for spares in self.spares.values() for s in spares]:
            if ex.state == "idle":
                ex.free()
        self.ops.clear()
        self.spares.clear()
        self.ready.clear()
        self.keys.clear()
        for comm in self.dups:
            if comm != MPI.COMM_NULL:
                comm.Free()
        self.dups = []
        self.coll = self.p2p = self.comm
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.comm != MPI.COMM_NULL:
            self.comm.Free()


_COMPOSED = ("all_to_all", "gather", "scatter")
_SHARED_MEMORY_HINT = (
    "a survivor's shared-memory queue is likely blocked for good: a rank killed while it wrote a message into "
    "it (UCX's shared memory, between ranks that met through the store) never marked the message written, and "
    "its owner reads nothing after it (docs/reliability.md); restart the job"
)


def _on_shared_memory() -> bool:
    """Whether this process's peers on its host write into its UCX shared-memory queue (ranks that met through
    the store, with UCX's transports left to UCX)."""
    return not mpi_launched() and "UCX_TLS" not in os.environ


_SHRINK_TAG = 4096  # MPI_Comm_create_group's tags for shrink_group (one per attempt of the survivors' agreement)


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
