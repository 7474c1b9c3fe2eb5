"""Diagnosis on real ranks: COMMLIB_DEBUG=DETAIL call checks, timeouts that say who arrived, the flight
recorder, monitored_barrier on every backend; and the flight recorder's ring and summary without processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from reference import BACKENDS

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

DETAIL = {"COMMLIB_DEBUG": "DETAIL"}


def detail_job() -> dict:
    """Matching calls pass the check; rank 1 calling all_gather, or a different shape, fails on every rank."""
    import commlib as dist
    from commlib._diagnostics import flight
    from commlib.errors import CollectiveMismatchError, GroupBrokenError

    me, n = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    x = np.full(4, me + 1.0, np.float32)
    dist.all_reduce(x)
    dist.broadcast(x, src=1)
    gathered = np.zeros(4 * n, np.float32)
    dist.all_gather_into_tensor(gathered, x)
    split = [me + 1 if p == 0 else 1 for p in range(n)]  # uneven, different on every rank
    recv = np.zeros(sum(p + 1 if me == 0 else 1 for p in range(n)), np.float32)
    dist.all_to_all_single(recv, np.ones(sum(split), np.float32), [p + 1 if me == 0 else 1 for p in range(n)], split)
    objs: list = [None] * n
    dist.all_gather_object(objs, {"rank": me})
    dist.barrier()
    out["matching"] = (float(x.sum()), objs == [{"rank": r} for r in range(n)])
    for case in ("op", "shape"):
        g = dist.new_group(list(range(n)))
        start = time.monotonic()
        try:
            if case == "op" and me == 1:
                dist.all_gather([np.zeros(4, np.float32) for _ in range(n)], np.ones(4, np.float32), group=g)
            else:
                dist.all_reduce(np.ones(8 if case == "shape" and me == 1 else 4, np.float32), group=g)
            out[case] = ("no error",)
        except CollectiveMismatchError as e:
            out[case] = (type(e).__name__, str(e), time.monotonic() - start)
        last = [(e["op"], e["seq"], e["state"]) for e in flight.entries() if e["group"] == g.name][-1:]
        out[f"{case} recorded"] = last  # the call this rank was making, for dumps and the launcher's summary
        try:
            dist.barrier(group=g)
        except GroupBrokenError as e:
            out[case] += (str(e),)
    return out


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_detail_lists_every_ranks_call(backend: str) -> None:
    n = 3
    results = run(detail_job, n, timeout=90, env={**BACKENDS[backend], **DETAIL})
    for rank, res in enumerate(results):
        assert res["matching"] == (4 * (1.0 + 2.0 + 3.0), True), res  # the checked calls ran correctly
        kind, message, waited, later = res["op"]
        assert kind == "CollectiveMismatchError", res["op"]
        assert message.startswith(f"[rank {rank}/{n}] "), message
        assert (
            "rank 0: all_reduce #1 (float32, 4 elements, SUM) / rank 1: all_gather #1 (float32, 4 elements) / "
            "rank 2: all_reduce #1 (float32, 4 elements, SUM)" in message
        ), message
        assert waited < 5, waited  # found by the check, not by a timeout
        assert "failed earlier and cannot be used" in later, later
        assert res["op recorded"] == [("all_gather" if rank == 1 else "all_reduce", 1, "failed")], res
        assert res["shape recorded"] == [("all_reduce", 1, "failed")], res
        kind, message, _, _ = res["shape"]
        assert kind == "CollectiveMismatchError", res["shape"]
        assert "rank 1: all_reduce #1 (float32, 8 elements, SUM)" in message, message
        assert "rank 0: all_reduce #1 (float32, 4 elements, SUM)" in message, message


def undetected_mismatch_job(size: int) -> tuple:
    """Without DETAIL: rank 1 all-gathers while the others all-reduce; no rank may hang."""
    import commlib as dist

    me, n = dist.get_rank(), dist.get_world_size()
    x = np.ones(size, np.float32)
    start = time.monotonic()
    try:
        if me == 1:
            dist.all_gather_into_tensor(np.zeros(n * size, np.float32), x)
        else:
            dist.all_reduce(x)
        return ("no error", "", time.monotonic() - start)
    except dist.CommError as e:
        return (type(e).__name__, str(e), time.monotonic() - start)


@pytest.mark.parametrize(
    ("backend", "size"),
    # NCCL (and so the emulator) would pair a small all_gather with an all_reduce of the same bytes: the digests
    # catch that one at the closing check (tests/test_mismatch.py), this test the sizes that differ.
    [("mpi", 4), ("mpi", 1 << 18), ("nccl", 1 << 18)],
)
def test_mismatch_without_detail_fails_on_every_rank(backend: str, size: int) -> None:
    """On mpi every message carries a stamp of its call: the first rank to receive one of the other call raises
    ``CollectiveMismatchError`` naming both calls, at once, and tells the others (``GroupBrokenError`` naming it),
    even for small calls MPI would match by order. The emulator refuses the sizes that differ, and the nccl
    backend names both calls from the ranks' digests."""
    timeout = 2.0
    env = {**BACKENDS[backend], "COMMLIB_TIMEOUT": str(timeout)}
    results = run(undetected_mismatch_job, 3, size, timeout=90, env=env)
    for rank, (kind, message, waited) in enumerate(results):
        assert waited < timeout + 10, waited
        if backend != "mpi":  # a rank still comparing when a peer has gone may see it go (CommError)
            assert kind in ("CollectiveMismatchError", "GroupBrokenError", "CommError"), (rank, kind, message)
            if kind == "CollectiveMismatchError":
                mine, theirs = ("all_gather", "all_reduce") if rank == 1 else ("all_reduce", "all_gather")
                assert f"the digest of {theirs} #1" in message and f"expects {mine} #1" in message, message
            continue
        assert kind in ("CollectiveMismatchError", "GroupBrokenError"), (rank, kind, message)
        assert waited < 1.5, (rank, waited)  # found by a stamp, not by a timeout
    assert any(k == "CollectiveMismatchError" for k, _, _ in results), results
    if backend == "mpi":
        found = [m for k, m, _ in results if k == "CollectiveMismatchError"]
        assert found, results
        named = f"all_gather #1 (float32, {size} elements, {n_bytes(size * 4)})"
        assert any(named in m and "all_reduce #1" in m for m in found), found


def n_bytes(n: int) -> str:
    return f"{n} bytes"


def straggler_job(flight_dir: str) -> tuple:
    """Rank 2 arrives after the timeout: ranks 0 and 1 name it; their flight recorders show the failed call."""
    import commlib as dist
    from commlib.errors import GroupBrokenError

    me = dist.get_rank()
    x = np.ones(2, np.float32)
    dist.all_reduce(x)
    if me == 2:
        time.sleep(4)
        return ("late", "", 0.0, "")
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        return ("no error", "", 0.0, "")
    except dist.CommTimeoutError as e:
        waited = time.monotonic() - start
        try:
            dist.all_reduce(x)
            later = "no error"
        except GroupBrokenError as e2:
            later = str(e2)
        return ("CommTimeoutError", str(e), waited, later)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_timeout_names_ranks_that_did_not_arrive(backend: str, tmp_path: Path) -> None:
    env = {**BACKENDS[backend], "COMMLIB_TIMEOUT": "1.5", "COMMLIB_FLIGHT_DIR": str(tmp_path)}
    results = run(straggler_job, 3, str(tmp_path), timeout=90, env=env)
    for rank in (0, 1):
        kind, message, waited, later = results[rank]
        assert kind == "CommTimeoutError", results[rank]
        assert f"[rank {rank}/3] all_reduce (call #2 on group 'world', ranks [0, 1, 2])" in message, message
        assert "arrived: ranks [0, 1]; not arrived: ranks [2]" in message, message
        assert 1.5 <= waited < 1.5 + 10, waited
        assert "failed earlier and cannot be used" in later, later
        dump = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert dump["rank"] == rank and dump["reason"].startswith("timeout in all_reduce #2")
        states = [(e["op"], e["seq"], e["state"]) for e in dump["entries"]]
        assert states == [("all_reduce", 1, "completed"), ("all_reduce", 2, "failed")], states


def crossed_p2p_job(way: str) -> str:
    """One rank makes a send or receive the other never matches: the other is in an all_reduce. Rank 0 sends
    64 KiB (too large to go eagerly: it waits for a matching receive) to rank 1 (``send``; ``isend``: isend then
    wait; ``tagged send``: with tag 5), or rank 1 receives from rank 0 (``recv``; ``irecv``: irecv then wait;
    ``irecv any``: from any rank). This rank's error, with its type."""
    import commlib as dist

    x, big = np.ones(2, np.float32), np.ones(16384, np.float32)
    r = dist.get_rank()
    try:
        if way == "send" and r == 0:
            dist.send(big, 1)
        elif way == "tagged send" and r == 0:
            dist.send(big, 1, tag=5)
        elif way == "isend" and r == 0:
            dist.isend(big, 1).wait()
        elif way == "recv" and r == 1:
            dist.recv(x, 0)
        elif way == "irecv" and r == 1:
            dist.irecv(x, 0).wait()
        elif way == "irecv any" and r == 1:
            dist.irecv(x).wait()
        dist.all_reduce(x)
    except dist.CommError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("way", ["irecv any", "tagged send"])
def test_a_timeout_names_the_send_or_receive_a_peer_waits_in(way: str) -> None:
    """A receive from any rank (no peer to ask), or a send with a tag (messages of other tags may overtake, so
    counts cannot tell a match): no early verdict; the timeout ends it, naming where each rank waits."""
    results = run(crossed_p2p_job, 2, way, timeout=60, env={"COMMLIB_TIMEOUT": "1.5"})
    waiter, other = (1, 0) if way == "irecv any" else (0, 1)
    waits = "the wait for an irecv from any rank" if way == "irecv any" else "send to rank 1"
    # Both time out after 1.5 s; the first to do so tells the other (whose call then ends naming it): the first
    # one's timeout says where the other waits.
    errors = ("CommTimeoutError", "CollectiveMismatchError", "GroupBrokenError")
    assert all(r.startswith(errors) for r in results), results
    assert "all_reduce (call #1" in results[other], results
    said_by_other = f"not arrived: ranks [{waiter}] (rank {waiter} was last seen waiting in {waits})" in results[other]
    said_by_waiter = f"rank {other} was last seen waiting in all_reduce #1" in results[waiter]
    assert said_by_other or said_by_waiter, results


@pytest.mark.parametrize("way", ["send", "recv", "isend", "irecv"])
def test_a_send_or_receive_that_cannot_match_fails_at_once(way: str) -> None:
    """A send (receive), blocking or waited for, whose peer waits in a collective this rank has not reached, having
    posted no receive from (send to) it: neither can complete. On default settings (the mpi timeout is 30
    minutes) it is a CollectiveMismatchError naming both calls within about a second, not a hang until the
    timeout (the job's deadline, 120 s, is far below it)."""
    results = run(crossed_p2p_job, 2, way, timeout=120)
    waiter, other = (0, 1) if way.endswith("send") else (1, 0)
    mine = {
        "send": "send to rank 1",
        "recv": "recv from rank 0",
        "isend": "the wait for an isend to rank 1",
        "irecv": "the wait for an irecv from rank 0",
    }[way]
    assert results[waiter].startswith(f"CollectiveMismatchError: [rank {waiter}/2] {mine} (on group 'world'"), results
    assert (
        f"rank {other} waits in all_reduce #1 (float32, 2 elements, SUM), which this rank has not reached"
        in (results[waiter])
    ), results[waiter]
    posted = "posted 0 receives from this rank" if way.endswith("send") else "posted 0 sends to this rank"
    assert posted in results[waiter] and "neither call can complete" in results[waiter], results[waiter]
    assert results[other].startswith(("CollectiveMismatchError", "GroupBrokenError")), results[other]
    assert "all_reduce (call #1 on group 'world'" in results[other], results[other]


def matched_p2p_job(way: str) -> tuple[str, float]:
    """A correct program whose send (receive), blocking or waited for, waits while its peer is in a collective this
    rank has not reached: the peer posted the matching irecv (isend) of 8 MiB first, then was stopped (SIGSTOP)
    for 1.5 s, so the transfer cannot move and the wait reaches the monitor's check (at 0.75 s). Both complete:
    (results, seconds waited)."""
    import os
    import signal
    import threading

    import commlib as dist

    big, x = np.full(1 << 21, 1 + dist.get_rank(), np.float32), np.ones(2, np.float32)
    pids = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    waited = 0.0
    if dist.get_rank() == 1:
        work = dist.irecv(big, 0) if way.endswith("send") else dist.isend(big, 0)
        dist.all_reduce(x)  # waits here (past the monitor's 0.25 s: its counts published) for rank 0
        work.wait()
    else:
        time.sleep(0.75)
        os.kill(pids[1], signal.SIGSTOP)
        threading.Timer(1.5, os.kill, (pids[1], signal.SIGCONT)).start()
        start = time.monotonic()
        if way in ("send", "recv"):
            (dist.send if way == "send" else dist.recv)(big, 1)
        else:
            (dist.isend if way == "isend" else dist.irecv)(big, 1).wait()
        waited = time.monotonic() - start
        dist.all_reduce(x)
    return f"{float(x[0])} {float(big.sum())}", waited


@pytest.mark.parametrize("way", ["send", "irecv"])  # a blocking send, a waited-for receive: both rules, both waits
def test_a_send_or_receive_its_peer_posted_first_is_no_mismatch(way: str) -> None:
    results = run(matched_p2p_job, 2, way, timeout=120)
    moved = float(1 << 21) * (1 if way.endswith("send") else 2)  # rank 0's 1s into rank 1, or rank 1's 2s into rank 0
    assert [r[0] for r in results] == [f"2.0 {moved}"] * 2, results
    assert results[0][1] >= 0.75, f"the {way} did not wait ({results[0][1]:.2f} s): the check was not reached"


def monitored_late_job() -> str:
    import commlib as dist

    dist.barrier()  # start together: process start-up on 2 cores can be skewed by more than the timeout
    if dist.get_rank() == 2:
        time.sleep(2.5)
        return "late"
    try:
        dist.monitored_barrier(timeout=1)
    except dist.CommError as e:
        return str(e)
    return "passed"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_monitored_barrier_names_missing_ranks(backend: str) -> None:
    """Group rank 0 names the late rank; the others say rank 0 did not release them (4 ranks: 3 wait)."""
    results = run(monitored_late_job, 4, timeout=60, env=BACKENDS[backend])
    assert results[2] == "late"
    assert "monitored_barrier" in results[0] and "ranks [2] did not reach the barrier" in results[0], results[0]
    for r in (1, 3):
        # On nccl, rank 0's timeout aborts its communicator, which a waiting rank may see before its own timeout.
        released = "rank 0 (global rank 0) did not release the barrier" in results[r]
        aborted = backend == "nccl" and "rank 0 closed the connection without destroying its communicator" in results[r]
        assert released or aborted, (r, results[r])


def test_default_timeouts_follow_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from commlib import _world
    from commlib.backends import REGISTRY

    nccl, mpi = REGISTRY["nccl"], REGISTRY["mpi"]
    monkeypatch.delenv("COMMLIB_TIMEOUT", raising=False)
    assert _world._default_timeout(nccl) == 600.0 and _world._default_timeout(mpi) == 1800.0
    monkeypatch.setenv("COMMLIB_TIMEOUT", "7")
    assert _world._default_timeout(nccl) == _world._default_timeout(mpi) == 7.0


def dist_sum():  # type: ignore[no-untyped-def]
    from commlib import ReduceOp

    return ReduceOp.SUM


class _Group:
    def __init__(self, name: str) -> None:
        self.name, self.ranks, self.rank, self.label = name, [0, 1], 0, ""


def test_flight_ring_states_and_wraparound() -> None:
    from commlib._diagnostics.flight import Ring
    from commlib.backends._call import Call

    ring, g = Ring(4), _Group("world")
    call = Call("all_reduce", np.dtype(np.float32), 4, dist_sum())
    slots = [ring.start(g, "all_reduce", call, seq) for seq in range(1, 7)]
    assert slots == [0, 1, 2, 3, 0, 1]  # 6 calls in 4 slots: seqs 5 and 6 replaced 1 and 2
    ring.end(slots[2], g, 3)
    ring.end(slots[3], g, 4, ok=False)
    ring.end(slots[0], g, 1)  # seq 1's slot now holds seq 5: its end must not be recorded there
    states = {ring.record(i).seq: ring.ends[i] for i in range(4)}  # type: ignore[union-attr]
    assert sorted(states) == [3, 4, 5, 6]
    assert states[3] > 0 and states[4] < 0 and states[5] == 0 and states[6] == 0


def recorded_job() -> list:
    """Blocking calls the executor completes at once (the fast path) and one it does not finish in its first
    tests (a large all_reduce on a fresh group): the flight recorder lists each, in order, completed."""
    import commlib as dist
    from commlib._diagnostics import flight

    x = np.ones(4, np.float32)
    for _ in range(3):
        dist.all_reduce(x)
    dist.barrier()
    dist.broadcast(x, src=0)
    g = dist.new_group([0, 1])
    dist.all_reduce(np.ones(1 << 20, np.float32), group=g)
    return [(e["group"], e["op"], e["seq"], e["state"], e["count"]) for e in flight.entries()][-6:]


@pytest.mark.parametrize("native", ["1", "0"])
def test_the_flight_recorder_lists_the_calls_an_executor_completed_at_once(native: str) -> None:
    for got in run(recorded_job, 2, env={"COMMLIB_NATIVE": native}):
        world = [(1, "all_reduce"), (2, "all_reduce"), (3, "all_reduce"), (4, "barrier"), (5, "broadcast")]
        assert got[:5] == [("world", op, seq, "completed", 0 if op == "barrier" else 4) for seq, op in world]
        assert got[5][1:] == ("all_reduce", 1, "completed", 1 << 20) and got[5][0] != "world"


def test_flight_summary_names_the_stuck_and_the_missing(tmp_path: Path) -> None:
    from commlib._diagnostics.flight import summarize

    def entry(seq: int, state: str) -> dict:
        return {"group": "world", "op": "all_reduce", "seq": seq, "state": state, "start_ns": seq * 10**9}

    for rank, entries in {0: [entry(1, "completed"), entry(2, "started")], 1: [entry(1, "completed")]}.items():
        doc = {"rank": rank, "reason": "SIGUSR1", "time_ns": 5 * 10**9, "entries": entries}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))
    text = summarize(tmp_path, 3)
    assert text.splitlines()[0] == (
        "ranks [0] did not complete all_reduce #2 on group 'world'; ranks [1] never reached it; "
        "ranks [2] left no record (dead or stopped?)"
    )
    assert "rank 2: no flight record" in text


def uneven_all_to_all_job(case: str) -> tuple:
    """Uneven all_to_all_single (pairwise sends and receives on mpi) that cannot complete: a timeout, never a hang.

    "absent": rank 1 never calls it. "disagree": rank 1 sends rank 0 nothing while rank 0 expects 3 rows
    (a short message must not be taken silently), and async: the error comes from ``wait()``.
    """
    import commlib as dist

    me = dist.get_rank()
    inp = np.arange(4, dtype=np.float32) + 10 * me
    sends, recvs = [1, 3], [1, 3]  # rank 0 to itself 1 row, to rank 1 3 rows; rank 1 the other way round
    if case == "disagree" and me == 1:
        sends, recvs = [0, 4], [3, 4]  # rank 0 waits for 3 rows that never come
    out = np.zeros(sum(recvs), np.float32)
    if case == "absent" and me == 1:
        time.sleep(3)
        return ("absent", "", 0.0)
    start = time.monotonic()
    try:
        dist.all_to_all_single(out, inp, recvs, sends, async_op=case == "disagree").wait()
        return ("no error", out.tolist(), 0.0)
    except dist.CommError as e:
        return (type(e).__name__, str(e), time.monotonic() - start)


@pytest.mark.parametrize("case", ["absent", "disagree"])
def test_uneven_all_to_all_that_cannot_complete_fails_naming_the_call(case: str) -> None:
    """ "absent": a timeout. "disagree": rank 0 receives 0 bytes where it expects 3 rows (12 bytes): the stamp
    of rank 1's message says so at once."""
    results = run(uneven_all_to_all_job, 2, case, timeout=60, env={"COMMLIB_TIMEOUT": "1.5"})
    kind, message, waited = results[0]
    assert "all_to_all_single" in message, results
    if case == "absent":
        assert kind == "CommTimeoutError", results
        assert 1.5 <= waited < 1.5 + 10, waited
    else:
        assert kind == "CollectiveMismatchError" and waited < 1.5, results
        assert "rank 1 sent all_to_all #1 (float32, 0 bytes)" in message, message
        assert "this rank's call expects all_to_all #1 (float32, 12 bytes)" in message, message
        assert results[1] == ("no error", [1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0], 0.0), results[1]


def own_block_job() -> tuple:
    import commlib as dist

    out, inp = np.zeros(3, np.float32), np.ones(4, np.float32)
    try:
        dist.all_to_all_single(out, inp, [3], [4])
        return ("no error", out.tolist())
    except ValueError as e:
        return (str(e), out.tolist())


def test_all_to_all_own_block_sizes_must_agree() -> None:
    """Refused before anything moves, on the rank whose splits disagree with themselves."""
    message, out = run(own_block_job, 1, timeout=60)[0]
    assert "all_to_all_single: input_split_sizes[0] and output_split_sizes[0]" in message, message
    assert "got 4 and 3 elements" in message and out == [0.0] * 3, (message, out)


def late_store_in_a_second_world_job() -> dict:
    """A world, gone; then a second one whose store rank 0 starts 0.5 s late (a loaded machine: a thread, a
    socket, a host name lookup): the others wait in the setup's broadcast of its address past the slow path's
    first look (which the last world's slow path must not take)."""
    import commlib as dist
    from commlib._diagnostics import jobstore, lifelines

    dist.init_process_group()
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(np.ones(1))
    dist.destroy_process_group()
    serve = jobstore._serve

    def late() -> str:
        time.sleep(0.5)
        return serve()

    jobstore._serve = late  # type: ignore[assignment]
    try:
        dist.init_process_group()
    finally:
        jobstore._serve = serve  # type: ignore[assignment]
    out = np.zeros(n, np.float64)
    dist.all_gather_into_tensor(out, np.full(1, float(rank)))
    return {"store": jobstore.dead(), "lifelines": lifelines.current() is not None, "gathered": out.tolist()}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_second_world_finds_its_store_when_it_starts_late(backend: str) -> None:
    """The last world's slow path ran in the new world's setup (a wait past 0.05 s) and gave its store up before
    the address arrived: no store, no lifelines, and (4 ranks, loaded CI) a first call that hung."""
    for r in run(late_store_in_a_second_world_job, 3, env=BACKENDS[backend], timeout=120):
        assert r == {"store": None, "lifelines": True, "gathered": [0.0, 1.0, 2.0]}, r


def _stale_notice_job() -> str:
    """Rank 0 gives up on a group ranks 1 and 2 never used (its notices are never read), every rank destroys
    it, and the next group, of ranks 1 and 2 (MPICH gives them the context ids they freed: rank 0, not a
    member, has no say), must not read those notices as its own."""
    import commlib as dist

    dist.init_process_group()
    me = dist.get_rank()
    old = dist.new_group([0, 1, 2], timeout=0.3)
    if me == 0:
        with pytest.raises(dist.CommTimeoutError):
            dist.all_reduce(np.ones(4, np.float32), group=old)  # ranks 1 and 2 never call: rank 0 gives up
    dist.barrier()
    dist.destroy_process_group(old)
    new = dist.new_group([1, 2])
    x = np.full(4, me + 1.0, np.float32)
    if me > 0:
        if me == 2:
            time.sleep(0.5)  # rank 1 waits long enough to look for notices (its wait's slow path)
        dist.all_reduce(x, group=new)
    dist.destroy_process_group()
    return f"{x.tolist()}"


def test_a_notice_left_on_a_destroyed_group_does_not_break_the_next() -> None:
    # A notice carries the nonce its group's ranks agreed on; one sent on an earlier communicator (the same MPI
    # context id, reused once freed) is dropped: before, rank 1's all_reduce raised "rank 0 gave up on the group".
    assert run(_stale_notice_job, 3, env=BACKENDS["mpi"]) == ["[1.0, 1.0, 1.0, 1.0]"] + ["[5.0, 5.0, 5.0, 5.0]"] * 2


def _different_groups_job() -> str:
    import commlib as dist

    dist.init_process_group()
    me = dist.get_rank()
    ranks = [0, 1, 2] if me == 0 else [0, 1]  # rank 0's would be a duplicate, the others' a split
    with pytest.raises(dist.CollectiveMismatchError) as caught:
        dist.new_group(ranks, timeout=20)
    x = np.ones(2, np.float32)
    dist.all_reduce(x)  # the default group goes on
    dist.destroy_process_group()
    return f"{caught.value} | {x.tolist()}"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_new_group_with_different_ranks_fails_on_every_rank_and_the_world_goes_on(backend: str) -> None:
    # nccl (through the emulator): before, commSplit grouped the ranks by what each one said, silently
    out = run(_different_groups_job, 3, env=BACKENDS[backend])
    for me, line in enumerate(out):
        mine = [0, 1, 2] if me == 0 else [0, 1]
        assert line == (
            f"[rank {me}/3] new_group: the ranks asked for different groups (this rank: ranks={mine}); every rank "
            "must pass the same ranks | [3.0, 3.0]"
        ), line
