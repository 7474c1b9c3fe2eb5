"""The mpi backend's algorithms, as plans: which bytes each rank sends to and receives from which rank, step
by step, and what it computes between steps. Pure functions of the call and the group's agreed settings.

A plan is written once here and run by either executor (``_steps.c`` in C, :mod:`commlib.backends._steps` in
Python), so a rank running one and a rank running the other exchange the very same messages. Buffers are
byte regions: ``IN`` (the caller's input), ``OUT`` (the caller's output) and ``TMP`` (the executor's
scratch). Every message of step ``s`` carries a stamp (:mod:`commlib.backends._stamp`) and goes with tag
``s`` on the group's communicator for collectives; a point-to-point message with the caller's tag on the one
for sends and receives.

Algorithms (n ranks, this rank r; every rank sends each message of a step at once):

- all_reduce, small (the whole array at most ``small`` bytes): every rank sends its array to every other,
  then reduces all n arrays in rank order (every rank computes the same bits). Large: the array is cut in n
  pieces; step 1 sends piece j to rank j, which reduces it (its own first, then ranks r-1, r-2, ...);
  step 2 sends each reduced piece to every rank. From 4 ``piece`` bytes on, the array goes in pieces of
  ``piece`` bytes, each the two steps above, piece k's second step sharing a step with piece k+1's first.
- reduce: as all_reduce, the result to the root alone (small: the root reduces in rank order; large:
  step 2 sends the reduced pieces to the root). The other ranks' arrays are left as they were.
- reduce_scatter: chunk j of every rank to rank j, which reduces it (its own first, then r-1, r-2, ...).
- broadcast: the root's array to every rank; large on more than 2 ranks: piece j to rank j, then every
  rank's piece to every other (the root sends less).
- all_gather, gather, scatter, all_to_all: each chunk (or block) straight to the rank it belongs to;
  this rank's own is copied while the messages move.
- barrier: a stamp (no payload) to every other rank. close: 24 bytes of counts to every other rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from commlib._ops import ReduceOp
from commlib.backends import _stamp
from commlib.backends._call import Call, describe

__all__ = ["COPY_CODE", "IN", "OUT", "REDUCE_CODE", "TMP", "Copy", "Msg", "Plan", "Reduce", "Step", "plan"]

IN, OUT, TMP = 1, 2, 3  # the byte regions a plan addresses
COPY_CODE, REDUCE_CODE = 1, 2  # action codes of the flat encoding


@dataclass(frozen=True, slots=True)
class Msg:
    """One message: to or from group rank ``peer``, ``nbytes`` at offset ``off`` of buffer ``buf``."""

    peer: int
    buf: int
    off: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Copy:
    """``dst = src``: ``nbytes`` between (buffer, offset) pairs."""

    dst: tuple[int, int]
    src: tuple[int, int]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Reduce:
    """``dst = srcs[0] op srcs[1] op ...``, ``count`` elements; ``dst`` may be ``srcs[0]``, no other source."""

    dst: tuple[int, int]
    count: int
    srcs: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Step:
    """The messages of one step, the copies made while they move, and the work once they arrived."""

    recvs: tuple[Msg, ...]
    sends: tuple[Msg, ...]
    early: tuple[Copy, ...] = ()
    after: tuple[Copy | Reduce, ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    """A call's whole algorithm on one rank, and the description its stamps carry."""

    call: Call  # the call (its stamps: what every rank agrees on, a send's and a receive's message alike)
    in_len: int
    out_len: int
    tmp: int  # bytes of scratch
    steps: tuple[Step, ...]
    #: the input is copied aside first where it overlaps the output (the messages read one while writing the
    #: other); calls whose input *is* their output (in place by design: all_reduce, reduce, broadcast) do not
    copy_in: bool = False

    @property
    def dtype(self) -> np.dtype | None:
        return self.call.dtype

    @property
    def op(self) -> ReduceOp | None:
        return self.call.op

    def stamp(self, step: int, seq: int, nbytes: int) -> bytes:
        """The stamp of a message of ``step`` (1-based) of call ``seq``."""
        return _stamp.pack(self.call, step, seq, nbytes)

    def describe(self, seq: int) -> str:
        """This call in its stamps' words (without a byte count)."""
        return describe(self.call, seq)

    def encode(self) -> np.ndarray:
        """The plan as int64s, for the C executor: [steps, tmp, in_len, out_len, copy_in], then per step [recvs, sends,
        early, after] and its messages [peer, buf, off, nbytes], copies [1, dbuf, doff, sbuf, soff, nbytes] and
        reductions [2, dbuf, doff, count, sources, (buf, off) per source]."""
        out = [len(self.steps), self.tmp, self.in_len, self.out_len, int(self.copy_in)]
        for s in self.steps:
            out += [len(s.recvs), len(s.sends), len(s.early), len(s.after)]
            for m in (*s.recvs, *s.sends):
                out += [m.peer, m.buf, m.off, m.nbytes]
            for a in (*s.early, *s.after):
                if isinstance(a, Copy):
                    out += [COPY_CODE, *a.dst, *a.src, a.nbytes]
                else:
                    out += [REDUCE_CODE, *a.dst, a.count, len(a.srcs)]
                    for src in a.srcs:
                        out += list(src)
        return np.array(out, np.int64)


def _cuts(count: int, n: int) -> list[int]:
    """Where n nearly equal pieces of ``count`` elements start (and the end): piece j is [cuts[j], cuts[j+1])."""
    return [count * j // n for j in range(n + 1)]


def plan(call: Call, rank: int, size: int, *, small: int, piece: int = 0, in_place: bool = False) -> Plan:
    """The plan of ``call`` on group rank ``rank`` of ``size``.

    ``in_place``: all_gather's input is this rank's chunk of the output. ``small``: the agreed byte size up to
    which small algorithms run; ``piece``: an all_reduce's piece size (0: none). A send's or receive's peer is
    ``call.root``.
    """
    z = 0 if call.dtype is None else call.dtype.itemsize
    builder = _BUILDERS[call.kind]
    counts = call.splits
    steps, in_len, out_len, tmp = builder(
        rank, size, z, call.count, call.root, small, piece, counts, in_place, call.root
    )
    copy_in = call.kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
    return Plan(call, in_len, out_len, tmp, tuple(steps), copy_in)


# -- the builders: (rank, size, itemsize, count, root, small, piece, counts, in_place, peer) ->
#    (steps, in_len, out_len, tmp) ------------------------------------------------------

_Counts = tuple[tuple[int, ...], tuple[int, ...]] | None
_Built = tuple[list[Step], int, int, int]


def _all_reduce(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    nbytes = count * z
    if n == 1:
        return [Step((), (), (), (Copy((OUT, 0), (IN, 0), nbytes),))], nbytes, nbytes, 0
    if nbytes <= small:
        one, need = _everyone_reduces(r, n, count, z, (OUT, 0))
        return one, nbytes, nbytes, need
    pieces = _pieces(count, z, piece)
    steps: list[Step] = []
    tmp = 0
    for i, (start, length) in enumerate(pieces):
        first, second, need = _two_steps(r, n, z, start, length, reduce_to=None)
        tmp = max(tmp, need)
        if i == 0:
            steps.append(first)
        else:  # this piece's first step with the previous piece's second
            prev = steps[-1]
            steps[-1] = Step(prev.recvs + first.recvs, prev.sends + first.sends, prev.early, prev.after + first.after)
        steps.append(second)
    return steps, nbytes, nbytes, tmp


def _pieces(count: int, z: int, piece: int) -> list[tuple[int, int]]:
    """(first element, elements) of each piece of an all_reduce: one, unless it is 4 ``piece`` bytes or more."""
    if not piece or count * z < 4 * piece:
        return [(0, count)]
    step = max(piece // z, 1)
    return [(s, min(step, count - s)) for s in range(0, count, step)]


def _everyone_reduces(r: int, n: int, count: int, z: int, dst: tuple[int, int] | None) -> tuple[list[Step], int]:
    """Small all_reduce (``dst``: OUT) or reduce (``dst`` None off the root): the whole array to every rank
    that reduces (all, or the root), then a reduction in rank order. TMP holds each peer's array, then (rank
    2 and up) a copy of this rank's own, since OUT may be IN."""
    nbytes = count * z
    slot = [p * nbytes for p in range(n)]  # TMP slot of rank p's array (this rank's: its copy)
    recvs = tuple(Msg(p, TMP, slot[p], nbytes) for p in range(n) if p != r)
    sends = tuple(Msg(p, IN, 0, nbytes) for p in range(n) if p != r)
    own = (IN, 0) if r == 0 else (TMP, slot[r])
    early = (Copy((TMP, slot[r]), (IN, 0), nbytes),) if r else ()
    srcs = tuple(own if p == r else (TMP, slot[p]) for p in range(n))
    return [Step(recvs, sends, early, (Reduce(dst, count, srcs),) if dst is not None else ())], n * nbytes


def _two_steps(r: int, n: int, z: int, start: int, length: int, reduce_to: int | None) -> tuple[Step, Step, int]:
    """Large all_reduce (``reduce_to`` None) or reduce (the root) of elements [start, start + length): step 1
    sends piece j to rank j, which reduces it; step 2 sends the reduced pieces to every rank or to the root.
    Rank r reduces its piece into OUT (all_reduce, the root) or into TMP after the received copies (reduce,
    elsewhere: its array stays as it was). TMP: the n - 1 received copies of this rank's piece, then that."""
    cuts = [start + c for c in _cuts(length, n)]
    mine, width = cuts[r] * z, (cuts[r + 1] - cuts[r]) * z
    widest = max(cuts[j + 1] - cuts[j] for j in range(n)) * z
    came = {p: ((r - p) % n - 1) * widest for p in range(n) if p != r}  # TMP slot of the copy from rank p
    recvs = tuple(Msg(p, TMP, came[p], width) for p in _from_left(r, n))
    sends = tuple(Msg(t, IN, cuts[t] * z, (cuts[t + 1] - cuts[t]) * z) for t in _to_right(r, n))
    keeps = reduce_to is None or r == reduce_to
    into = (OUT, mine) if keeps else (TMP, (n - 1) * widest)
    srcs = ((IN, mine), *((TMP, came[p]) for p in _from_left(r, n)))
    first = Step(recvs, sends, (), (Reduce(into, cuts[r + 1] - cuts[r], srcs),))
    if reduce_to is None:
        back = tuple(Msg(p, OUT, cuts[p] * z, (cuts[p + 1] - cuts[p]) * z) for p in _from_left(r, n))
        ahead = tuple(Msg(t, OUT, mine, width) for t in _to_right(r, n))
        second = Step(back, ahead)
    elif r == reduce_to:
        back = tuple(Msg(p, OUT, cuts[p] * z, (cuts[p + 1] - cuts[p]) * z) for p in _from_left(r, n))
        second = Step(back, ())
    else:
        second = Step((), (Msg(reduce_to, into[0], into[1], width),))
    return first, second, n * widest


def _from_left(r: int, n: int) -> list[int]:
    """The other ranks as receives are posted: r - 1, r - 2, ... (each rank's partners in the same order)."""
    return [(r - k) % n for k in range(1, n)]


def _to_right(r: int, n: int) -> list[int]:
    return [(r + k) % n for k in range(1, n)]


def _reduce(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    nbytes = count * z
    out_len = nbytes if r == root else 0
    if n == 1:
        return [Step((), (), (), (Copy((OUT, 0), (IN, 0), nbytes),))], nbytes, out_len, 0
    if nbytes <= small:
        if r != root:
            return [Step((), (Msg(root, IN, 0, nbytes),))], nbytes, 0, 0
        steps, tmp = _everyone_reduces(r, n, count, z, (OUT, 0))
        only = steps[0]
        return [Step(only.recvs, (), only.early, only.after)], nbytes, out_len, tmp
    first, second, tmp = _two_steps(r, n, z, 0, count, reduce_to=root)
    return [first, second], nbytes, out_len, tmp


def _reduce_scatter(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    chunk = count * z  # this rank's output; the input holds n such chunks
    if n == 1:
        return [Step((), (), (), (Copy((OUT, 0), (IN, 0), chunk),))], chunk, chunk, 0
    came = {p: ((r - p) % n - 1) * chunk for p in range(n) if p != r}
    recvs = tuple(Msg(p, TMP, came[p], chunk) for p in _from_left(r, n))
    sends = tuple(Msg(t, IN, t * chunk, chunk) for t in _to_right(r, n))
    srcs = ((IN, r * chunk), *((TMP, came[p]) for p in _from_left(r, n)))
    step = Step(recvs, sends, (), (Reduce((OUT, 0), count, srcs),))
    return [step], n * chunk, chunk, (n - 1) * chunk


def _broadcast(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    nbytes = count * z
    if n == 1:
        return [Step((), ())], nbytes, nbytes, 0
    if nbytes <= small or n == 2:
        if r == root:
            return [Step((), tuple(Msg(t, OUT, 0, nbytes) for t in _to_right(r, n)))], nbytes, nbytes, 0
        return [Step((Msg(root, OUT, 0, nbytes),), ())], nbytes, nbytes, 0
    cuts = _cuts(count, n)

    def part(j: int) -> tuple[int, int]:
        return cuts[j] * z, (cuts[j + 1] - cuts[j]) * z

    if r == root:  # step 1: piece t to rank t; step 2: its own piece to every rank
        first = Step((), tuple(Msg(t, OUT, *part(t)) for t in _to_right(r, n)))
        second = Step((), tuple(Msg(t, OUT, *part(r)) for t in _to_right(r, n)))
    else:  # step 1: this rank's piece from the root; step 2: every other piece from its rank, this one to the rest
        first = Step((Msg(root, OUT, *part(r)),), ())
        second = Step(
            tuple(Msg(p, OUT, *part(p)) for p in _from_left(r, n)),
            tuple(Msg(t, OUT, *part(r)) for t in _to_right(r, n) if t != root),
        )
    return [first, second], nbytes, nbytes, 0


def _all_gather(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    chunk = count * z
    src = (OUT, r * chunk) if in_place else (IN, 0)
    recvs = tuple(Msg(p, OUT, p * chunk, chunk) for p in _from_left(r, n))
    sends = tuple(Msg(t, *src, chunk) for t in _to_right(r, n))
    early = () if in_place else (Copy((OUT, r * chunk), (IN, 0), chunk),)
    return [Step(recvs, sends, early)], 0 if in_place else chunk, n * chunk, 0


def _gather(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    chunk = count * z
    if r != root:
        return [Step((), (Msg(root, IN, 0, chunk),))], chunk, 0, 0
    recvs = tuple(Msg(p, OUT, p * chunk, chunk) for p in _from_left(r, n))
    return [Step(recvs, (), (Copy((OUT, r * chunk), (IN, 0), chunk),))], chunk, n * chunk, 0


def _scatter(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    chunk = count * z
    if r != root:
        return [Step((Msg(root, OUT, 0, chunk),), ())], 0, chunk, 0
    sends = tuple(Msg(t, IN, t * chunk, chunk) for t in _to_right(r, n))
    return [Step((), sends, (Copy((OUT, 0), (IN, r * chunk), chunk),))], n * chunk, chunk, 0


def _all_to_all(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    if counts is None:  # even blocks of ``count``
        sc = rc = (count,) * n
    else:
        sc, rc = counts  # each pair's sizes are its own: every message's byte count is checked
    sd, rd = _offsets(sc), _offsets(rc)
    recvs = tuple(Msg(p, OUT, rd[p] * z, rc[p] * z) for p in _from_left(r, n))
    sends = tuple(Msg(t, IN, sd[t] * z, sc[t] * z) for t in _to_right(r, n))
    early = (Copy((OUT, rd[r] * z), (IN, sd[r] * z), sc[r] * z),) if sc[r] == rc[r] else ()
    return [Step(recvs, sends, early)], sum(sc) * z, sum(rc) * z, 0


def _offsets(counts: tuple[int, ...]) -> list[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


def _barrier(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    recvs = tuple(Msg(p, TMP, 0, 0) for p in _from_left(r, n))
    sends = tuple(Msg(t, IN, 0, 0) for t in _to_right(r, n))
    return [Step(recvs, sends)], 0, 0, 0


def _close(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    """24 bytes to every other rank: IN holds them per destination (rank t's at t * 24), OUT gets rank p's at
    p * 24. ``count`` 1: the group failed on this rank: it only tells the others (stamped so), and waits for
    nobody."""
    if count == 1:
        return [Step((), tuple(Msg(t, IN, t * 24, 24) for t in _to_right(r, n)))], n * 24, 0, 0
    recvs = tuple(Msg(p, OUT, p * 24, 24) for p in _from_left(r, n))
    sends = tuple(Msg(t, IN, t * 24, 24) for t in _to_right(r, n))
    return [Step(recvs, sends)], n * 24, n * 24, 0


def _send(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    return [Step((), (Msg(peer, IN, 0, count * z),))], count * z, 0, 0


def _recv(
    r: int, n: int, z: int, count: int, root: int, small: int, piece: int, counts: _Counts, in_place: bool, peer: int
) -> _Built:
    return [Step((Msg(peer, OUT, 0, count * z),), ())], 0, count * z, 0


_BUILDERS = {
    "all_reduce": _all_reduce,
    "reduce": _reduce,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "gather": _gather,
    "scatter": _scatter,
    "all_to_all": _all_to_all,
    "barrier": _barrier,
    "close": _close,
    "send": _send,
    "recv": _recv,
}
