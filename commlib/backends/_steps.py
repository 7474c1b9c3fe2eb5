"""Running a plan (:mod:`commlib.backends._plans`): the Python executor, and what both executors share.

A :class:`Steps` runs one call of one plan at a time, again and again (a ``base.Resident``): ``go(inp, out,
seq)`` binds the caller's arrays, posts step 1's messages and tests them a few times; True means done, the
result in ``out``; False means still running (``wait(timeout)``, then ``finish(out)``). An asynchronous call
does ``start`` and later ``test``/``wait``. ``_steps.c`` runs the same plans in C (``native``): the same
messages, so a rank running one and a rank running the other work together.

Messages of at most ``small`` bytes carry their stamp inline: persistent requests over scratch slots of their
own (``32 + small`` bytes for a receive, so a message of another call still fits and is named). Larger ones
are a stamp message (a persistent request) followed by the data, sent from and received into the caller's
arrays. Every received stamp is compared with the one this rank's own call would send, and a received
message's size with the size this rank expects: a difference raises ``CollectiveMismatchError`` at once (the
call is abandoned: MPI may still use its buffers).
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from commlib._ops import ReduceOp
from commlib._settings import value as setting
from commlib.arrays import LOW_PRECISION
from commlib.backends import _native, _stamp
from commlib.backends._call import OP_CODES
from commlib.backends._mpi_waits import may_block
from commlib.backends._plans import IN, OUT, Copy, Plan, Reduce
from commlib.backends.base import SLOW_BYTES_PER_S, poll
from commlib.errors import CollectiveMismatchError, GroupBrokenError, TransportError

__all__ = [
    "TAG_SPAN",
    "NativeSteps",
    "Steps",
    "average",
    "bind",
    "executed",
    "make",
    "mismatch",
    "reduce_into",
    "tag_of",
]

_F32 = np.dtype(np.float32)
_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # then divided (reduce_into)
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
#: tags a collective's steps cycle through (step s: tag 1 + (s - 1) % TAG_SPAN; MPI guarantees 32767)
TAG_SPAN = 32000
_STAMP = _stamp.SIZE
BLOCK_FROM = setting("COMMLIB_MPI_BLOCK_FROM")
_BLOCK_MAX = 0.25  # seconds at most a wait blocks in MPI (then poll(): naps and the watchdog)
_TESTS = 256  # tests go() makes before it hands the wait to its caller


class _Executed:
    """The Python executor's record of the runs go() completed, as the C executor keeps its own (``_executor.c``:
    ``record_run``): (label, sequence number, ``time.perf_counter_ns()``) in a ring of
    ``COMMLIB_FLIGHT_RECORDER_SIZE`` slots."""

    def __init__(self, size: int) -> None:
        self.slots: list[Any] = [None] * size
        self.next = itertools.cycle(range(size)) if size else None

    def entries(self) -> list[tuple[Any, int, int]]:
        return [e for e in self.slots if e is not None]


_EXECUTED = _Executed(int(setting("COMMLIB_FLIGHT_RECORDER_SIZE")))


def _record(label: Any, seq: int) -> None:
    if _EXECUTED.next is not None:
        _EXECUTED.slots[next(_EXECUTED.next)] = (label, seq, time.perf_counter_ns())


def executed() -> list[tuple[Any, int, int]]:
    """The runs the executors' go() completed, for the flight recorder: (label, sequence number, CLOCK_MONOTONIC
    in ns), both executors', in no particular order (each executor's label: see ``ReadyOp.label``)."""
    c = [] if _native.module is None else _native.module.completed_runs()
    return c + _EXECUTED.entries()


def tag_of(step: int, tag: int) -> int:
    """The tag of step ``step`` (1-based): a point-to-point message's own ``tag`` (>= 0), else the step's."""
    return tag if tag >= 0 else 1 + (step - 1) % TAG_SPAN


def reduce_into(dtype: np.dtype, op: ReduceOp, dst: np.ndarray, srcs: list[np.ndarray]) -> None:
    """``dst = srcs[0] op srcs[1] op ...`` (uint8 views, reinterpreted as ``dtype``); 16-bit floats in float32,
    rounded once. AVG: the sum, divided by the number of sources (every reduction of a plan has every rank's
    part), in ``dtype`` (:func:`average`) while it is in the cache. The C executor calls this for what it does
    not reduce itself, so both give the same bits."""
    d = dst.view(dtype)
    _reduce_views(dtype, _UFUNC[op], d, [s.view(dtype) for s in srcs])
    if op is ReduceOp.AVG and len(srcs) > 1:
        average(d, len(srcs))


def _reduce_views(dtype: np.dtype, uf: Any, d: np.ndarray, views: list[np.ndarray]) -> None:
    if dtype in LOW_PRECISION:
        acc = views[0].astype(_F32)
        for v in views[1:]:
            uf(acc, v.astype(_F32), out=acc)
        d[...] = acc
        return
    if len(views) == 1:
        d[...] = views[0]
        return
    uf(views[0], views[1], out=d)
    for v in views[2:]:
        uf(d, v, out=d)


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


def reduce_views(dtype: np.dtype, op: ReduceOp, dst: memoryview, srcs: list[memoryview]) -> None:
    """:func:`reduce_into` on memoryviews (the C executor's calls)."""
    reduce_into(dtype, op, np.frombuffer(dst, np.uint8), [np.frombuffer(s, np.uint8) for s in srcs])


def mismatch(peer: int, raw: bytes, got: int, want: bytes, data: bool) -> CollectiveMismatchError:
    """The error for a message of another call from group rank ``peer``: ``raw`` its stamp (or what came in
    its place), ``got`` bytes received, ``want`` the stamp this rank's call expects (``data``: a large
    message's data, ``got`` bytes after a stamp that matched). The group layer words it in full."""
    wanted = _stamp.describe(want)
    theirs = f"{got} bytes of data after the stamp of {wanted}" if data else _received(raw, got)
    return CollectiveMismatchError(f"group rank {peer} sent {theirs}", peer=peer, theirs=theirs, mine=wanted)


def _received(raw: bytes, got: int) -> str:
    """What came: its stamp in words, and the bytes that came with it where they differ from the stamp's own."""
    text = _stamp.describe(raw, got)
    if got < _STAMP:
        return text
    said = _stamp.unpack(raw)[-1]
    if got not in (_STAMP, _STAMP + said):
        text += f" in a message of {got} bytes"
    return text


def _fits(a: Any, length: int, dtype: np.dtype | None, out: bool, inp: Any = None) -> bool:
    """As ``_steps.c``'s fits(): an array (or a root list of them) of the executor's dtype and ``length`` bytes,
    contiguous (a list's items may be strided: staged), writable where written; none on this rank: None, or a
    reduce's output off the root (its input itself), or an empty array."""
    if not length:
        return a is None or (out and a is inp) or (type(a) is np.ndarray and not a.nbytes)
    items = a if type(a) is list and a else [a]
    if not all(type(x) is np.ndarray and (dtype is None or x.dtype == dtype) for x in items):
        return False
    if out and not all(x.flags.writeable for x in items):
        return False
    if type(a) is list:  # one chunk each, in rank order
        return all(x.nbytes * len(items) == length for x in items)
    return a.nbytes == length and a.flags.c_contiguous


def _overlap(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None or not a.nbytes or not b.nbytes:
        return False
    x, y = a.ctypes.data, b.ctypes.data
    return x < y + b.nbytes and y < x + a.nbytes


def bind(a: Any, length: int, what: str) -> np.ndarray | None:
    """A caller's array (or None, or a root list of equal arrays) as the flat bytes a plan addresses."""
    if not length:  # this rank's call has no such buffer (a reduce's output off the root): whatever it is given
        return None
    if a is None:
        raise ValueError(f"Steps: this rank's call needs its {what} ({length} bytes)")
    if type(a) is list:
        flat = (
            np.concatenate([np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in a])
            if a
            else np.empty(0, np.uint8)
        )
    else:
        flat = a.reshape(-1).view(np.uint8)
    if flat.nbytes != length:
        raise ValueError(f"Steps: expected {length} bytes of {what}, got {flat.nbytes}")
    return flat


class _Message:
    """One message of a step, with what it needs each run."""

    __slots__ = ("buf", "direct", "nbytes", "off", "peer", "req", "seqview", "slot", "stamp", "tag")

    def __init__(self, peer: int, buf: int, off: int, nbytes: int, tag: int) -> None:
        self.peer, self.buf, self.off, self.nbytes, self.tag = peer, buf, off, nbytes, tag
        self.slot: np.ndarray | None = None  # inline: stamp and payload; direct: the stamp
        self.req: Any = None  # the persistent request over the slot
        self.direct = False
        self.stamp = bytearray()  # a receive's expected stamp (its seq written in each run)
        self.seqview: np.ndarray | None = None  # a send's stamp's seq field, in its slot


class Steps:
    """One plan on one communicator, run by Python (see the module docstring)."""

    native = False

    def __init__(self, plan: Plan, comm: MPI.Intracomm, small: int, tag: int = -1, notice: Notice | None = None):
        self.plan, self.comm, self.small, self.notice = plan, comm, small, notice
        self.call = plan.call
        self.nbytes = max(plan.in_len, plan.out_len)
        self.tmp = np.empty(plan.tmp, np.uint8)
        self.state = "idle"  # idle, running, abandoned
        self.steps: list[tuple[list[_Message], list[_Message]]] = []
        for s, step in enumerate(plan.steps, start=1):
            t = tag_of(s, tag)
            recvs = [self._receive(_Message(m.peer, m.buf, m.off, m.nbytes, t), s) for m in step.recvs]
            sends = [self._send(_Message(m.peer, m.buf, m.off, m.nbytes, t), s) for m in step.sends]
            self.steps.append((recvs, sends))
        self.inp: np.ndarray | None = None
        self.out: np.ndarray | None = None
        self.seq = 0
        self.at = 0  # the step in flight (0-based)
        self.direct = False  # the step in flight has large messages (its early copies: _advance's)
        self.copied = True  # the step's early copies are done (or are _land()'s to do)
        self.checks: list[_Message] = []  # receives of stamps (or inline messages) still awaited
        self.rest: list[tuple[Any, _Message | None]] = []  # then data receives (their message) and sends
        self.status = MPI.Status()
        self.held: tuple = ()
        self.label: Any = None  # what the flight record says of each run go() completes (None: no record)

    def _receive(self, m: _Message, step: int) -> _Message:
        m.direct = m.nbytes > self.small
        m.slot = np.zeros(_STAMP + self.small, np.uint8)  # room for any inline message: a stranger is named
        m.req = self.comm.Recv_init([m.slot, MPI.BYTE], m.peer, m.tag)
        m.stamp = bytearray(self.plan.stamp(step, 0, m.nbytes))
        return m

    def _send(self, m: _Message, step: int) -> _Message:
        m.direct = m.nbytes > self.small
        m.slot = np.zeros(_STAMP if m.direct else _STAMP + m.nbytes, np.uint8)
        m.slot[:_STAMP] = np.frombuffer(self.plan.stamp(step, 0, m.nbytes), np.uint8)
        m.seqview = m.slot[12:16].view(np.uint32)
        m.req = self.comm.Send_init([m.slot, MPI.BYTE], m.peer, m.tag)
        return m

    # -- a run ------------------------------------------------------------------------------------------
    def go(self, inp: Any, out: Any, seq: int) -> bool | None:
        """Start a run and test it a few times: True, complete (the result is in ``out``); False, still running;
        None, the arrays are not this executor's (another dtype or size, not contiguous, read-only where written):
        nothing started."""
        plan = self.plan
        fit = _fits(inp, plan.in_len, plan.dtype, False) and _fits(out, plan.out_len, plan.dtype, True, inp)
        if self.state == "idle" and not fit:
            return None
        self.start(inp, out, seq)
        done = any(self.test() for _ in range(_TESTS))
        if done and self.label is not None:
            _record(self.label, self.seq)
        return done

    def start(self, inp: Any, out: Any, seq: int) -> None:
        """Bind ``inp`` and ``out`` (arrays as the plan's byte regions, or None) and post step 1."""
        if self.state != "idle":
            raise RuntimeError(f"Steps.start: the executor is {self.state}")
        self.inp, self.out = bind(inp, self.plan.in_len, "input"), bind(out, self.plan.out_len, "output")
        if self.plan.copy_in and _overlap(self.inp, self.out):  # the messages would read it while writing the output
            self.inp = self.inp.copy()  # type: ignore[union-attr]
        self.seq, self.at = seq & 0xFFFFFFFF, 0
        self.held = (inp, out)
        self.state = "running"
        try:
            self._post()
        except BaseException:
            self.state = "abandoned"
            raise

    def _region(self, buf: int) -> np.ndarray:
        region = self.inp if buf == IN else self.out if buf == OUT else self.tmp
        if region is None:
            raise ValueError(f"Steps: the plan reads buffer {buf}, which this call has not got")
        return region

    def _post(self) -> None:
        recvs, sends = self.steps[self.at]
        seq = self.seq
        checks: list[_Message] = []
        rest: list[tuple[Any, _Message | None]] = []
        for m in recvs:
            m.req.Start()
            checks.append(m)
            if m.direct:
                data = self._region(m.buf)[m.off : m.off + m.nbytes]
                rest.append((self.comm.Irecv([data, MPI.BYTE], m.peer, m.tag), m))
        for m in sends:
            slot, seqview = m.slot, m.seqview
            assert slot is not None and seqview is not None
            seqview[0] = seq
            if not m.direct and m.nbytes:
                slot[_STAMP:] = self._region(m.buf)[m.off : m.off + m.nbytes]
            m.req.Start()
            rest.append((m.req, None))
            if m.direct:
                data = self._region(m.buf)[m.off : m.off + m.nbytes]
                rest.append((self.comm.Isend([data, MPI.BYTE], m.peer, m.tag), None))
        self.checks, self.rest = checks, rest
        # a step with large messages makes its early copies while they move (_advance), once they are under way;
        # a step of inline messages only, once every message is here (_land): as the C executor does
        self.direct = any(m.direct for m in (*recvs, *sends))
        self.copied = not self.direct

    def test(self) -> bool:
        """Whether the run is complete, moving it to its next step where one ended; raises a mismatch at once."""
        if self.state != "running":
            return self.state == "idle"
        try:
            return self._advance()
        except BaseException:
            self.state = "abandoned"  # MPI may still use the buffers: never run again
            raise

    def _advance(self) -> bool:
        status = self.status
        while True:
            checks, rest = self.checks, self.rest
            if checks:  # every stamp still awaited, each time: a stranger is named as soon as it is here
                waiting = []
                for m in checks:
                    if m.req.Test(status):
                        self._check(m, status.Get_count(MPI.BYTE))
                    else:
                        waiting.append(m)
                self.checks = checks = waiting
            while rest:  # the data and the sends in order: one at a time moves a large transfer fastest
                req, data = rest[0]
                if not req.Test(status):
                    if not self.copied:  # the early copies, once the messages are under way (the peers'
                        self._early()  # handshakes answered first: a large copy would hold them up)
                    return False
                rest.pop(0)
                if data is not None and (got := status.Get_count(MPI.BYTE)) != data.nbytes:
                    raise mismatch(data.peer, b"", got, bytes(data.stamp), True)
            if checks:
                return False
            if not self.copied:  # a step with large messages whose messages all went before its copies
                self._early()
            self._land()
            for a in self.plan.steps[self.at].after:
                self._copy(a) if isinstance(a, Copy) else self._reduce(a)
            self.at += 1
            if self.at == len(self.steps):
                self._complete()
                return True
            self._post()

    def _check(self, m: _Message, got: int) -> None:
        """An inline message or a stamp arrived, ``got`` bytes: is it this call's? (Its payload lands with the
        step's others: :meth:`_land`.)"""
        slot = m.slot
        assert slot is not None
        want = m.stamp
        want[12:16] = self.seq.to_bytes(4, "little")
        size = _STAMP if m.direct else _STAMP + m.nbytes
        if got != size or slot[:_STAMP].tobytes() != want:
            raise mismatch(m.peer, slot[:_STAMP].tobytes(), got, bytes(want), False)

    def _land(self) -> None:
        """A step whose messages all arrived: the inline payloads into their places, and (a step of inline
        messages only) the early copies: until now, a call that fails has not touched its output."""
        recvs = self.steps[self.at][0]
        for m in recvs:
            if not m.direct and m.nbytes:
                self._region(m.buf)[m.off : m.off + m.nbytes] = m.slot[_STAMP : _STAMP + m.nbytes]  # type: ignore[index]
        if not self.direct:  # a step of inline messages only: its early copies now
            for c in self.plan.steps[self.at].early:
                self._copy(c)

    def _early(self) -> None:
        """The early copies (this rank's own chunk) of a step with large messages, once."""
        for c in self.plan.steps[self.at].early:
            self._copy(c)
        self.copied = True

    def _copy(self, c: Copy) -> None:
        if c.nbytes:
            (db, do), (sb, so) = c.dst, c.src
            dst, src = self._region(db)[do : do + c.nbytes], self._region(sb)[so : so + c.nbytes]
            if dst.ctypes.data != src.ctypes.data:
                dst[...] = src

    def _reduce(self, r: Reduce) -> None:
        plan = self.plan
        assert plan.dtype is not None and plan.op is not None
        n = r.count * plan.dtype.itemsize
        if not n:
            return
        dst = self._region(r.dst[0])[r.dst[1] : r.dst[1] + n]
        reduce_into(plan.dtype, plan.op, dst, [self._region(b)[o : o + n] for b, o in r.srcs])

    def wait(self, timeout: float) -> bool:
        """The run ``go`` or ``start`` left running, up to ``timeout`` s (False: it is abandoned, never run again)."""
        try:
            if poll(self.test, timeout, slow=self._slow):
                return True
        except MPI.Exception as e:
            self.state = "abandoned"
            raise error(e) from None
        except BaseException:
            self.state = "abandoned"
            raise
        self.state = "abandoned"
        return False

    def _slow(self, waited: float) -> None:
        """A long wait's check (base.poll's ``slow``): a peer's notice that it gave up ends it."""
        gave_up(self.comm, self.notice)

    def finish(self, out: Any) -> None:
        """Resident.finish: nothing left (the run completed into the caller's arrays, a root list included)."""

    def _complete(self) -> None:
        """The run is done: a root list output staged (gather's) spread into its arrays; the arrays let go."""
        out = self.held[1] if self.held else None
        if type(out) is list and self.out is not None:
            at = 0
            for a in out:  # gather's root list: each array its chunk (numpy copies into a strided view too)
                n = a.nbytes
                if not a.flags.c_contiguous or a.ctypes.data != self.out[at:].ctypes.data:
                    a[...] = self.out[at : at + n].view(a.dtype).reshape(a.shape)
                at += n
        self.held = ()
        self.inp = self.out = None
        self.state = "idle"

    @staticmethod
    def error(exc: BaseException) -> BaseException:
        """Resident.error: MPI's exceptions as commlib's."""
        return error(exc) if isinstance(exc, MPI.Exception) else exc

    def free(self) -> None:
        """Free the persistent requests (none may be active: only an idle executor is freed)."""
        if self.state == "idle":
            for recvs, sends in self.steps:
                for m in (*recvs, *sends):
                    m.req.Free()
        self.steps = []


class NativeSteps:
    """The same executor in C (``_steps.c``): ``go``, ``start`` and ``test`` are the C object's own methods."""

    native = True
    __slots__ = ("c", "call", "comm", "go", "nbytes", "notice", "plan", "start", "test")

    @property
    def label(self) -> Any:
        """What the flight record says of each run go() completes (the C object records it: :func:`executed`)."""
        return self.c.label

    @label.setter
    def label(self, value: Any) -> None:
        self.c.label = value

    def __init__(
        self,
        plan: Plan,
        comm: MPI.Intracomm,
        small: int,
        tag: int = -1,
        notice: Notice | None = None,
        block: float = 0.0,
    ) -> None:
        stamps = b"".join(
            plan.stamp(s, 0, m.nbytes) for s, step in enumerate(plan.steps, 1) for m in (*step.recvs, *step.sends)
        )
        op = 0 if plan.op is None else OP_CODES[plan.op]
        reducer = (
            None if plan.op is None or plan.dtype is None else functools.partial(reduce_views, plan.dtype, plan.op)
        )
        self.c = _native.Steps(
            plan.encode(), _native.handle(comm), small, tag, plan.dtype, op, plan.call.count, reducer, mismatch, block,
            stamps,
        )  # fmt: skip
        self.go, self.start, self.test = self.c.go, self.c.start, self.c.test
        self.call = plan.call
        self.nbytes = max(plan.in_len, plan.out_len)
        self.plan, self.comm, self.notice = plan, comm, notice

    @property
    def state(self) -> str:
        return ("idle", "running", "abandoned")[self.c.state]

    def wait(self, timeout: float) -> bool:
        """As :meth:`Steps.wait`: C's spin without the GIL while the data may be moving (where ranks may
        block), then :func:`poll` of the C test (naps, the watchdog). False: abandoned."""
        c = self.c
        timeout, busy = max(timeout - c.spent(), 0.0), self.nbytes / SLOW_BYTES_PER_S
        try:
            if _blocks(self.nbytes):
                spent = min(timeout, busy, _BLOCK_MAX)
                done = c.spin(spent)
                if done:
                    return True
                if done is not None:
                    timeout, busy = max(timeout - spent, 0.0), max(busy - spent, 0.0)
            if poll(c.test, timeout, busy, self._slow):
                return True
        except MPI.Exception as e:
            c.abandon()
            raise error(e) from None
        except BaseException:
            c.abandon()
            raise
        c.abandon()
        return False

    def _slow(self, waited: float) -> None:
        """As :meth:`Steps._slow`."""
        gave_up(self.comm, self.notice)

    def finish(self, out: Any) -> None:
        """Resident.finish: nothing left (the C object completed the run, a staged root list included)."""

    @staticmethod
    def error(exc: BaseException) -> BaseException:
        return error(exc) if isinstance(exc, MPI.Exception) else exc

    def free(self) -> None:
        self.c.free()


def make(
    plan: Plan, comm: MPI.Intracomm, small: int, tag: int = -1, notice: Notice | None = None
) -> Steps | NativeSteps:
    """The executor of ``plan``: C where it was built and is on, else Python. ``notice``: how a peer's notice
    that it gave up on the group looks (see :func:`gave_up`; None: not looked for)."""
    if _native.Steps is not None:
        nbytes = max(plan.in_len, plan.out_len)
        block = min(nbytes / SLOW_BYTES_PER_S, _BLOCK_MAX) if _blocks(nbytes) else 0.0
        return NativeSteps(plan, comm, small, tag, notice, block)
    return Steps(plan, comm, small, tag, notice)


@dataclass(frozen=True, slots=True)
class Notice:
    """A peer's notice that it gave up on the group (``MpiBackend.abort``): sent with ``tag``, its text begins
    with ``nonce``, the 8 bytes the group's ranks agreed on when the communicator was made. A notice with
    another nonce was sent on an earlier communicator that had the same MPI context id (MPICH reuses the id of
    a freed one, and a notice no one received outlives it): it is read and dropped."""

    tag: int
    nonce: bytes

    def text(self, reason: str) -> bytes:
        return self.nonce + (reason.encode()[:2000] or b"(no reason given)")


def gave_up(comm: MPI.Intracomm, notice: Notice | None) -> None:
    """Raise ``GroupBrokenError`` (its ``peer`` and ``reason``) if a peer's notice that it gave up on the group
    (sent by ``MpiBackend.abort``) is here: a wait for that peer would never end. A stale notice (another
    nonce, see :class:`Notice`) is read and dropped."""
    if notice is None:
        return
    status = MPI.Status()
    while comm.Iprobe(MPI.ANY_SOURCE, notice.tag, status):
        text = np.zeros(max(status.Get_count(MPI.BYTE), 0), np.uint8)
        comm.Recv([text, MPI.BYTE], status.Get_source(), notice.tag)
        data = text.tobytes()
        if data[: len(notice.nonce)] != notice.nonce:
            continue
        peer, reason = status.Get_source(), data[len(notice.nonce) :].decode(errors="replace")
        raise GroupBrokenError(f"group rank {peer} gave up on the group: {reason}", peer=peer, reason=reason)


def _blocks(nbytes: int) -> bool:
    """Whether a wait for ``nbytes`` blocks in MPI (COMMLIB_MPI_BLOCK_FROM, a core for every rank)."""
    return nbytes >= BLOCK_FROM > 0 and may_block()


def error(e: MPI.Exception) -> TransportError:
    """An MPI error inside a call, as commlib's (a truncated message: a longer one than this rank expects)."""
    if e.Get_error_class() == MPI.ERR_TRUNCATE:
        return TransportError("a peer sent a longer message than this rank's call expects")
    return TransportError(f"MPI reported an error: {e.Get_error_string()}")
