"""The mpi backend's plans, without processes: on every rank of a group the messages of each step pair up
(what rank a sends rank b in step s, rank b receives from rank a in step s, with the same byte count, in the
same order), buffers are read and written inside their bounds, and the stamps say what must agree."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from commlib._ops import ReduceOp
from commlib.backends import _stamp
from commlib.backends._call import KINDS, OP_CODES, Call
from commlib.backends._plans import IN, OUT, TMP, Copy, Plan, Reduce
from commlib.backends._plans import plan as _plan

SMALL, PIECE = 64, 256
F32 = np.dtype(np.float32)


def _cases(n: int) -> list[tuple[str, dict]]:
    """(kind, plan arguments) for every kind at small, large and piece-wise sizes, every root."""
    cases: list[tuple[str, dict]] = []
    for count in (0, 1, 7, 16, 300):
        cases.append(("all_reduce", {"dtype": F32, "count": count, "op": ReduceOp.SUM}))
        cases.append(("reduce_scatter", {"dtype": F32, "count": count, "op": ReduceOp.MAX}))
        cases.append(("all_gather", {"dtype": F32, "count": count}))
        cases.append(("all_gather", {"dtype": F32, "count": count, "in_place": True}))
        cases.append(("all_to_all", {"dtype": F32, "count": count}))
        for root in range(n):
            cases.append(("reduce", {"dtype": F32, "count": count, "op": ReduceOp.SUM, "root": root}))
            cases.append(("broadcast", {"dtype": F32, "count": count, "root": root}))
            cases.append(("gather", {"dtype": F32, "count": count, "root": root}))
            cases.append(("scatter", {"dtype": F32, "count": count, "root": root}))
    cases.append(("barrier", {}))
    cases.append(("close", {}))
    return cases


def plan(kind, rank, size, dtype=None, count=0, op=None, root=-1, *, small, piece=0, in_place=False, peer=-1):  # type: ignore[no-untyped-def]
    """The plan of a call given as its fields (a send's or receive's ``peer``)."""
    call = Call(kind, dtype, count, op, peer if kind in ("send", "recv") else root)
    return _plan(call, rank, size, small=small, piece=piece, in_place=in_place)


def _plans(n: int, kind: str, kw: dict) -> list[Plan]:
    return [plan(kind, r, n, small=SMALL, piece=PIECE, **kw) for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_every_message_has_its_partner(n: int) -> None:
    for kind, kw in _cases(n):
        plans = _plans(n, kind, kw)
        steps = {len(p.steps) for p in plans}
        for s in range(max(steps)):
            for a, b in itertools.permutations(range(n), 2):
                sent = [m.nbytes for m in _step(plans[a], s).sends if m.peer == b]
                got = [m.nbytes for m in _step(plans[b], s).recvs if m.peer == a]
                assert sent == got, (kind, kw, n, s, a, b, sent, got)


def _step(p: Plan, s: int):  # type: ignore[no-untyped-def]
    from commlib.backends._plans import Step

    return p.steps[s] if s < len(p.steps) else Step((), ())


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_buffers_are_used_within_their_bounds(n: int) -> None:
    for kind, kw in _cases(n):
        for r, p in enumerate(_plans(n, kind, kw)):
            size = {IN: p.in_len, OUT: p.out_len, TMP: p.tmp}
            z = 0 if p.dtype is None else p.dtype.itemsize
            for step in p.steps:
                for m in (*step.recvs, *step.sends):
                    assert m.off >= 0 and m.off + m.nbytes <= size[m.buf], (kind, kw, r, m)
                    assert m.peer != r and 0 <= m.peer < n
                for a in (*step.early, *step.after):
                    if isinstance(a, Copy):
                        for buf, off in (a.dst, a.src):
                            assert off + a.nbytes <= size[buf], (kind, kw, r, a)
                    else:
                        assert isinstance(a, Reduce)
                        for buf, off in (a.dst, *a.srcs):
                            assert off + a.count * z <= size[buf], (kind, kw, r, a)
                        # a reduction's output may be its first source, never another one
                        assert all(src != a.dst for src in a.srcs[1:]), (kind, kw, r, a)


def test_a_small_all_reduce_reduces_in_rank_order_on_every_rank() -> None:
    n = 4
    for r, p in enumerate(_plans(n, "all_reduce", {"dtype": F32, "count": 4, "op": ReduceOp.SUM})):
        (step,) = p.steps
        (red,) = step.after
        assert isinstance(red, Reduce) and len(red.srcs) == n
        # source k is rank k's array: received from k, or (this rank's) copied in early
        for k, src in enumerate(red.srcs):
            if k == r:
                assert src == ((IN, 0) if r == 0 else (TMP, k * 16)), (r, src)
            else:
                assert any(m.peer == k and (m.buf, m.off) == src for m in step.recvs), (r, k, src)


def test_large_all_reduce_goes_in_pipelined_pieces() -> None:
    n, count = 2, 4 * PIECE // 4 * 2  # 8 pieces of PIECE bytes
    p = plan("all_reduce", 0, n, F32, count, ReduceOp.SUM, small=SMALL, piece=PIECE)
    assert len(p.steps) == 8 + 1  # each piece's second step shares a step with the next one's first
    one = plan("all_reduce", 0, n, F32, count, ReduceOp.SUM, small=SMALL, piece=0)
    assert len(one.steps) == 2


def test_stamps_say_what_must_agree() -> None:
    p = plan("reduce", 1, 3, F32, 5, ReduceOp.MAX, 2, small=SMALL)
    raw = p.stamp(1, 7, 20)
    magic, kind, _, op, step, root, seq, count, nbytes = _stamp.unpack(raw)
    assert (magic, KINDS[kind - 1], op, step, root, seq, count, nbytes) == (
        _stamp.MAGIC,
        "reduce",
        OP_CODES[ReduceOp.MAX],
        1,
        2,
        7,
        5,
        20,
    )
    assert _stamp.describe(raw) == "reduce #7 (float32, 5 elements, MAX, root 2, 20 bytes)"
    # a send and its receive stamp their message: its dtype and count (no peer, no tag), so a receive of another
    # dtype of the same byte count is refused as one of another size is
    s = plan("send", 0, 2, F32, 4, peer=1, small=SMALL).stamp(1, 0, 16)
    r = plan("recv", 1, 2, F32, 4, peer=0, small=SMALL).stamp(1, 0, 16)
    other = plan("recv", 1, 2, np.dtype(np.int32), 4, peer=0, small=SMALL).stamp(1, 0, 16)
    half = plan("recv", 1, 2, np.dtype(np.float64), 2, peer=0, small=SMALL).stamp(1, 0, 16)
    assert s == r and s != other and s != half
    assert _stamp.describe(s) == "a message (float32, 4 elements, 16 bytes)"
    assert _stamp.describe(half) == "a message (float64, 2 elements, 16 bytes)"


def test_stamp_op_codes_follow_the_c_executor() -> None:
    """_steps.c numbers the ops as ReduceOp lists them, from 1 (its O_* enum)."""
    assert [op.name for op in OP_CODES] == ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]
    assert list(OP_CODES.values()) == list(range(1, 9))


def test_the_encoding_holds_the_whole_plan() -> None:
    p = plan("all_reduce", 1, 3, F32, 400, ReduceOp.SUM, small=SMALL, piece=PIECE)
    code = p.encode().tolist()
    assert code[:5] == [len(p.steps), p.tmp, p.in_len, p.out_len, 0]
    messages = sum(len(s.recvs) + len(s.sends) for s in p.steps)
    actions = sum(len(s.early) + len(s.after) for s in p.steps)
    sources = sum(len(a.srcs) for s in p.steps for a in s.after if isinstance(a, Reduce))
    copies = sum(isinstance(a, Copy) for s in p.steps for a in (*s.early, *s.after))
    assert len(code) == 5 + 4 * len(p.steps) + 4 * messages + 6 * copies + 5 * (actions - copies) + 2 * sources
