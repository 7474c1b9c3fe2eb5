"""The verdicts and the checks' pure parts, without ranks: the call descriptions, the stamps, the running digests
and the words every mismatch is reported in."""

from __future__ import annotations

import numpy as np
import pytest

from commlib._diagnostics import verdicts
from commlib._diagnostics.verdicts import Progress
from commlib._ops import ReduceOp
from commlib.backends import _stamp
from commlib.backends._call import Call, codes, describe, digest, message
from commlib.backends._digests import Digests, difference

F32, F64, I32 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32)


def test_a_call_in_words() -> None:
    assert (
        describe(Call("reduce", F32, 4, ReduceOp.SUM, 1), 5, 16)
        == "reduce #5 (float32, 4 elements, SUM, root 1, 16 bytes)"
    )
    assert describe(Call("all_gather", F32, 1)) == "all_gather (float32, 1 element)"
    assert describe(Call("barrier", None, 0), 3) == "barrier #3"
    assert describe(Call("recv", F64, 2, root=1, tag=4)) == "a message (float64, 2 elements)"


def test_a_send_and_its_receive_agree_on_their_message_alone() -> None:
    send, recv = Call("send", F32, 4, root=1, tag=3), Call("recv", F32, 4, root=0, tag=3)
    assert message(send) == message(recv) and codes(send) == codes(recv) and digest(send) == digest(recv)
    assert digest(Call("recv", F64, 2, root=0)) != digest(send)  # the same bytes, another dtype
    assert digest(Call("recv", I32, 4, root=0)) != digest(send)


def test_an_uneven_all_to_all_agrees_on_its_dtype_alone() -> None:
    a = Call("all_to_all", F32, 0, splits=((1, 2), (2, 1)))
    b = Call("all_to_all", F32, 0, splits=((2, 1), (1, 2)))
    assert digest(a) == digest(b) != digest(Call("all_to_all", F64, 0, splits=((1, 2), (2, 1))))


def test_digests_are_the_same_in_every_process() -> None:
    """Not Python's hash (randomised per process): a digest of codes (checked against a value made elsewhere)."""
    assert digest(Call("all_reduce", F32, 4, ReduceOp.SUM)) == digest(Call("all_reduce", F32, 4, ReduceOp.SUM))
    import subprocess
    import sys

    code = (
        "import numpy as np; from commlib._ops import ReduceOp; from commlib.backends._call import Call, digest; "
        "print(digest(Call('all_reduce', np.dtype(np.float32), 4, ReduceOp.SUM)))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "7"}
    )
    assert int(other.stdout) == digest(Call("all_reduce", F32, 4, ReduceOp.SUM))


def test_a_stamp_says_what_its_call_agrees_on() -> None:
    raw = _stamp.pack(Call("broadcast", F32, 3, None, 2), 1, 9, 12)
    assert _stamp.describe(raw) == "broadcast #9 (float32, 3 elements, root 2, 12 bytes)"
    assert _stamp.describe(raw, got=8) == "a message of 8 bytes, too short to be commlib's"
    old = (0x434D4C01).to_bytes(4, "little") + raw[4:]
    assert _stamp.describe(old) == "a message of commlib protocol 1"


def _ran(calls: list[Call]) -> Digests:
    d = Digests(2)
    for seq, c in enumerate(calls, start=1):
        d.collective(c, seq)
    return d


def test_running_digests_name_the_first_call_that_differs() -> None:
    same = [Call("all_reduce", F32, 4, ReduceOp.SUM), Call("broadcast", F32, 4, None, 0)]
    a = _ran([*same, Call("all_reduce", F32, 2, ReduceOp.SUM), Call("barrier", None, 0)])
    b = _ran([*same, Call("all_reduce", F64, 1, ReduceOp.SUM), Call("barrier", None, 0)])
    assert difference(a.summary(), _ran([*same]).summary()) is None  # agree on every call both know
    assert difference(a.summary(), a.summary()) is None
    assert difference(a.summary(), b.summary()) == (
        3,
        "all_reduce #3 (float32, 2 elements, SUM)",
        "all_reduce #3 (float64, 1 element, SUM)",
    )


def test_a_difference_older_than_what_is_kept_is_still_found() -> None:
    first = [Call("all_reduce", F32, 4, ReduceOp.SUM)]
    rest = [Call("barrier", None, 0)] * (Digests.RECENT + 5)
    got = difference(_ran(first + rest).summary(), _ran([Call("all_reduce", F32, 8, ReduceOp.SUM), *rest]).summary())
    assert got is not None and "they differ before the last" in got[1]


@pytest.mark.parametrize("count", [1, Digests.RECENT - 1, Digests.RECENT, 3 * Digests.RECENT + 7])
def test_calls_folded_in_batches_give_the_call_by_call_digest(count: int) -> None:
    """The device path only notes each call; the fold (every RECENT calls, and when read) is the same chain."""
    calls = [Call("all_reduce", F32, 1 + i % 5, ReduceOp.SUM) for i in range(count)]
    running, recent = 0, []
    for seq, c in enumerate(calls, start=1):
        running = ((running ^ digest(c)) * 0x100000001B3) & ((1 << 64) - 1)
        recent.append((seq, running, c))
    d = _ran(calls)
    assert len(d.pending) == count % Digests.RECENT  # not folded yet: one append per call
    got = d.summary()
    assert got["calls"] == running and got["seq"] == count and not d.pending
    assert [r[:2] for r in got["recent"]] == [list(r[:2]) for r in recent[-Digests.RECENT :]]


def test_the_closing_record_reads_back() -> None:
    d = _ran([Call("reduce", F32, 4, ReduceOp.MAX, 1)])
    d.message(Call("send", F32, 3, root=1))
    back = Digests.read(d.record(), 2)
    assert back["calls"] == d.calls and back["sent"] == d.sent and back["received"] == d.received
    assert back["recent"] == d.summary()["recent"] and back["seq"] == 1


def test_the_closing_check_names_counts_that_differ() -> None:
    rows = [(3, 0, 0), (4, 2, 0), (3, 1, 0)]
    problems = verdicts.closing(0, [0, 1, 2], 3, rows, [0, 2, 0], 0)
    assert problems == [
        "rank 1 made 4 collective calls on the group, this rank 3",
        "rank 2 sent this rank 1 messages, of which this rank received 0",
    ]
    assert verdicts.closing(0, [0, 1], 3, [(3, 0, 0), (3, 1, 0)], [0, 1], 0) == []


@pytest.mark.parametrize(
    ("kind", "peer", "verdict"),
    [
        ("send", Progress(5, "all_reduce", "all_reduce #5 (float32, 1 element, SUM)", {}, {0: 1}), True),
        ("send", Progress(5, "all_reduce", None, {}, {0: 2}), False),  # it posted the receive: it may match
        ("send", Progress(3, "all_reduce", None, {}, {}), False),  # not in a call this rank has still to make
        ("recv", Progress(5, "barrier", None, {0: 0}, {}), True),
        ("recv", Progress(5, "barrier", None, {0: 2}, {}), False),
        ("send", None, False),
    ],
)
def test_a_send_or_receive_that_can_never_match(kind: str, peer: Progress | None, verdict: bool) -> None:
    why = verdicts.unmatched(kind, 0, 3, 2, peer)
    assert (why is not None) == verdict, why
    if verdict:
        assert "which this rank has not reached (it made 3 collective calls" in why and "neither call" in why


def test_who_arrived() -> None:
    seen = {1: Progress(4, "all_reduce"), 2: Progress(3, "barrier")}
    text, differ = verdicts.arrival(0, [0, 1, 2], 4, "all_reduce", None, seen)
    assert not differ and "arrived: ranks [0, 1]; not arrived: ranks [2]" in text
    assert "rank 2 was last seen waiting in barrier #3" in text
    seen = {1: Progress(4, "broadcast", "broadcast #4 (float32, 1 element, root 0)")}
    text, differ = verdicts.arrival(0, [0, 1], 4, "all_reduce", "all_reduce #4 (float32, 1 element, SUM)", seen)
    assert differ and "every rank arrived at call #4, but their calls differ" in text


def test_mismatch_words() -> None:
    text = verdicts.mismatch(
        "[rank 0/2] recv (on group 'world', ranks [0, 1])",
        1,
        "a message (float32, 2 elements)",
        "a message (float64, 1 element)",
    )
    assert text == (
        "[rank 0/2] recv (on group 'world', ranks [0, 1]): the ranks are not making the same call: rank 1 sent a "
        "message (float32, 2 elements), where this rank's call expects a message (float64, 1 element); the group is "
        "now unusable"
    )
