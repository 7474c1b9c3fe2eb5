"""The NCCL emulator when a rank dies and the job goes on: detection, abort, commShrink, a fresh unique id.

A rank that is killed must be a real process killed by a signal (mpiexec would end the whole job), so
these tests start plain processes (``_ranks``) that meet through a unique id written to a file, as any
launcher could carry it. A rank kills itself with SIGKILL at a known moment and writes the time first
(``CLOCK_MONOTONIC`` is one clock for every process of the host), so the survivors measure their own
detection latency.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from commlib.backends import nccl_emulator as nccl

F64, I64, SUM, MAX = nccl.NCCL_FLOAT64, nccl.NCCL_INT64, nccl.NCCL_SUM, nccl.NCCL_MAX
REMOTE_ERROR, INVALID_ARGUMENT, INVALID_USAGE = 6, 4, 5
_OP_TIMEOUT = "EMULATOR_FAILURES_OP_TIMEOUT"
DETECTED_WITHIN = 1.0  # seconds from a kill to every survivor's error (it takes ~10 ms; the machine is loaded)
# Each rank runs `job(comm, rank, size, workdir, *args)` from this module and prints its JSON result.
_CHILD = """
import faulthandler, json, sys
sys.path.insert(0, sys.argv[1])
faulthandler.dump_traceback_later(float(sys.argv[2]), exit=False)  # a hung rank's stacks, before it is killed
import test_nccl_emulator_failures as jobs
print(json.dumps(jobs.rank_main(*sys.argv[3:])), flush=True)
"""


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _ranks(
    tmp_path: Path,
    job,
    size: int,
    *args: object,
    timeout: float = 30.0,
    op_timeout: float = 60.0,
    env: dict | None = None,
) -> list:
    """Run ``job`` on ``size`` plain processes; return each rank's result (a killed rank: its exit code).

    ``op_timeout`` is the emulator's timeout once the ranks have joined (joining may take longer on a
    loaded machine: it gets the default).

    Past ``timeout`` every rank still running is killed (after its stacks were dumped) and the test
    fails with every rank's stderr and the list of the ranks that never finished.
    """
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), _OP_TIMEOUT: str(op_timeout)}
    environ.pop("COMMLIB_NCCL_EMULATOR_TIMEOUT", None)
    environ.update(env or {})
    tests, spec = str(Path(__file__).parent), json.dumps(args)
    procs, logs = [], []
    for rank in range(size):
        logs.append(open(tmp_path / f"stderr.{rank}", "w+"))  # noqa: SIM115  # closed below
        argv = [sys.executable, "-c", _CHILD, tests, str(timeout - 2), job.__name__, str(rank), str(size)]
        procs.append(
            subprocess.Popen([*argv, str(tmp_path), spec], stdout=subprocess.PIPE, stderr=logs[-1], env=environ)
        )
    deadline = time.monotonic() + timeout
    outputs: list = [None] * size
    try:
        for rank, proc in enumerate(procs):
            try:
                outputs[rank] = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0]
            except subprocess.TimeoutExpired:
                break
    finally:
        hung = [r for r, proc in enumerate(procs) if proc.poll() is None]
        for rank in hung:
            procs[rank].kill()
        for proc in procs:
            proc.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    unfinished = [r for r, p in enumerate(procs) if r in hung or p.returncode not in (0, -signal.SIGKILL)]
    if unfinished:
        report = "\n".join(f"--- rank {r} (exit {procs[r].returncode}):\n{texts[r][-3000:]}" for r in unfinished)
        pytest.fail(f"{job.__name__}: ranks {unfinished} did not finish in {timeout} s or failed\n{report}")
    return [json.loads(out) if out.strip() else procs[r].returncode for r, out in enumerate(outputs)]


def rank_main(job: str, rank: str, size: str, workdir: str, args: str) -> object:
    """A rank's life: join the communicator (the id through a file), then run ``job``."""
    me, n = int(rank), int(size)
    comm = nccl.NcclCommunicator(n, _unique_id(Path(workdir), "world", me == 0), me)
    x = np.ones(1)  # all connected before the job starts
    comm.allReduce(ptr(x), ptr(x), 1, F64, SUM, 0)
    os.environ["COMMLIB_NCCL_EMULATOR_TIMEOUT"] = os.environ[_OP_TIMEOUT]  # read by the emulator at each call
    return globals()[job](comm, me, n, Path(workdir), *json.loads(args))


def _unique_id(workdir: Path, name: str, make: bool) -> bytes:
    """The id ``name``: made here and published if ``make``, else read once it appears (10 s at most)."""
    path = workdir / f"{name}.uid"
    if make:
        path.with_suffix(".tmp").write_bytes(nccl.get_unique_id())
        os.replace(path.with_suffix(".tmp"), path)
    deadline = time.monotonic() + 10
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no unique id {name} after 10 s")
        time.sleep(0.01)
    return path.read_bytes()


def _die(workdir: Path, after: float = 0.3) -> None:
    """Record the time, then be killed (SIGKILL: no cleanup, no goodbye), ``after`` seconds from now."""
    time.sleep(after)
    (workdir / "killed.tmp").write_text(repr(time.monotonic()))
    os.replace(workdir / "killed.tmp", workdir / "killed")
    os.kill(os.getpid(), signal.SIGKILL)


def _await(workdir: Path, *names: str, timeout: float = 20.0) -> None:
    """Wait until the files ``names`` exist in ``workdir`` (what a silent rank waits for before it leaves)."""
    deadline = time.monotonic() + timeout
    while not all((workdir / name).exists() for name in names) and time.monotonic() < deadline:
        time.sleep(0.01)


def _killed_at(workdir: Path) -> float:
    return float((workdir / "killed").read_text())


def _wait_broken(comm, timeout: float = 5.0) -> nccl.NcclError | None:
    """Poll check_async_error (as the backend's watchdog does) until it raises; the error, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            comm.check_async_error()
        except nccl.NcclError as exc:
            return exc
        time.sleep(0.001)
    return None


# --- a death is noticed at once -------------------------------------------------------------


def killed_rank_job(comm, me: int, n: int, workdir: Path, state: str) -> object:
    if me == n - 1:
        _die(workdir)
    s, y = nccl.cuda.Stream(), np.ones(1 << 19)  # 4 MiB: runs on the stream's worker, in two phases
    small = np.ones(4)
    if state == "in an all-reduce":
        comm.allReduce(ptr(y), ptr(y), y.size, F64, SUM, s.ptr)  # the dead rank never joins
        comm.allReduce(ptr(small), ptr(small), 4, F64, SUM, s.ptr)  # queued behind it
    elif me == 0:  # the others are idle
        comm.recv(ptr(small), 4, F64, 1, s.ptr)  # rank 1 sends nothing: only the death can end it
    event, done = s.record(), {}
    waiter = threading.Thread(target=lambda: (event.synchronize(), done.setdefault("at", time.monotonic())))
    waiter.start()
    error = _wait_broken(comm)
    noticed = time.monotonic()
    waiter.join(5)
    killed = _killed_at(workdir)
    try:
        comm.allReduce(ptr(small), ptr(small), 4, F64, SUM, s.ptr)
        later = "a later call worked"
    except nccl.NcclError as exc:
        later = exc.status
    destroy_started = time.monotonic()
    comm.destroy()
    return {
        "status": error and error.status,
        "message": str(error),
        "noticed": noticed - killed,
        "event": done.get("at", float("inf")) - killed,
        "later": later,
        "destroy": time.monotonic() - destroy_started,
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("state", ["in an all-reduce", "rank 0 in a receive from a live rank, the others idle"])
def test_a_killed_rank_breaks_every_survivor_at_once(tmp_path: Path, state: str) -> None:
    results = _ranks(tmp_path, killed_rank_job, 4, state)
    assert results[3] == -signal.SIGKILL
    for rank, got in enumerate(results[:3]):
        assert got["status"] == REMOTE_ERROR, (rank, got)
        said = got["message"]
        # rank 0, waiting on rank 1 only, may hear rank 1 leave (it saw the death and destroyed its communicator)
        # before its own link to rank 3 reports the death: seen once under load; either way it ends at once
        left = rank == 0 and state != "in an all-reduce" and "rank 1 of this communicator: destroyed" in said
        assert left or "rank 3 of this communicator: connection closed (process died?)" in said, (rank, got)
        assert got["noticed"] < DETECTED_WITHIN and got["event"] < DETECTED_WITHIN, (rank, got)
        assert got["later"] == REMOTE_ERROR and got["destroy"] < 1.0, (rank, got)


def clean_exit_job(comm, me: int, n: int, workdir: Path) -> object:
    if me == n - 1:
        comm.destroy()  # then the process exits: a goodbye, not a death
        return "left"
    time.sleep(0.5)
    comm.check_async_error()  # nothing to report
    x = np.full(3, me + 1.0)
    if me == 0:
        comm.send(ptr(x), 3, F64, 1, 0)
    else:
        comm.recv(ptr(x), 3, F64, 0, 0)
    (workdir / f"done.{me}").touch()
    _await(workdir, *(f"done.{r}" for r in range(n - 1)))  # a failing call below breaks the others' too
    try:  # an operation that needs the departed rank fails, naming it
        comm.allReduce(ptr(x), ptr(x), 3, F64, SUM, 0)
    except nccl.NcclError as exc:
        return [x.tolist(), exc.status, str(exc)]
    return "the all-reduce worked without rank 2"


@pytest.mark.timeout(60)
def test_a_rank_that_destroys_its_communicator_and_exits_breaks_nobody(tmp_path: Path) -> None:
    results = _ranks(tmp_path, clean_exit_job, 3)
    assert results[2] == "left"
    for values, status, message in results[:2]:
        assert values == [1.0] * 3 and status == REMOTE_ERROR
        assert "rank 2 of this communicator: destroyed its communicator" in message, message


# --- abort -----------------------------------------------------------------------------------


def abort_job(comm, me: int, n: int, workdir: Path) -> object:
    if me == 1:
        _await(workdir, "done.0")  # alive and silent: rank 0's operations can only end by the abort
        return "silent"
    s1, s2 = nccl.cuda.Stream(), nccl.cuda.Stream()
    small, large = np.ones(4), np.ones(1 << 19)
    comm.allReduce(ptr(small), ptr(small), 4, F64, SUM, s1.ptr)  # runs in place
    comm.allReduce(ptr(large), ptr(large), large.size, F64, SUM, s2.ptr)  # on s2's worker
    comm.allReduce(ptr(small), ptr(small), 4, F64, SUM, s2.ptr)  # queued behind it
    events = [s1.record(), s2.record()]
    returned: list[float] = []

    def watchdog() -> None:  # what the backend's watchdog thread does
        time.sleep(0.3)
        start = time.monotonic()
        comm.abort()
        returned.extend([start, time.monotonic() - start])

    thread = threading.Thread(target=watchdog)
    thread.start()
    for event in events:
        event.synchronize()  # the host waits here; the abort must end it
    ended = time.monotonic()
    thread.join()
    try:
        comm.allReduce(ptr(small), ptr(small), 4, F64, SUM, s1.ptr)
        later = "a later call worked"
    except nccl.NcclError as exc:
        later = exc.status
    (workdir / "done.0").touch()
    return {"abort": returned[1], "ended": ended - returned[0], "later": later, "done": [e.done for e in events]}


@pytest.mark.timeout(60)
def test_abort_from_another_thread_ends_pending_operations_on_every_stream(tmp_path: Path) -> None:
    got = _ranks(tmp_path, abort_job, 2)[0]
    assert got["abort"] < 0.1 and got["ended"] < 0.5, got
    assert got["done"] == [True, True] and got["later"] == INVALID_ARGUMENT, got


# --- commShrink ------------------------------------------------------------------------------


def _check_collectives(comm, me: int, n: int, rounds: int) -> int:
    """Every kind of operation ``rounds`` times on a stream, each checked against numpy."""
    s, checked = nccl.cuda.Stream(), 0
    right, left = (me + 1) % n, (me - 1) % n
    for i in range(rounds):
        count = 5 if i % 2 else 70_000  # in place, and on the worker (> 256 KiB in two phases for the all-reduce)
        a = np.arange(count, dtype=np.float64) + me + i
        total, gathered = np.zeros(count), np.zeros(count * n)
        bcast, scattered = (a.copy() if me == i % n else np.zeros(count)), np.zeros(count // n)
        sent, got = np.full(count, 100 * me + i, np.int64), np.zeros(count, np.int64)
        comm.allReduce(ptr(a), ptr(total), count, F64, SUM, s.ptr)
        comm.broadcast(ptr(bcast), ptr(bcast), count, F64, i % n, s.ptr)
        comm.allGather(ptr(a), ptr(gathered), count, F64, s.ptr)
        comm.reduceScatter(ptr(gathered), ptr(scattered), count // n, F64, SUM, s.ptr)
        nccl.groupStart()
        comm.send(ptr(sent), count, I64, right, s.ptr)
        comm.recv(ptr(got), count, I64, left, s.ptr)
        nccl.groupEnd()
        s.synchronize()
        comm.check_async_error()
        everyone = [np.arange(count, dtype=np.float64) + r + i for r in range(n)]
        assert np.array_equal(total, sum(everyone)), ("allReduce", i)
        assert np.array_equal(bcast, everyone[i % n]), ("broadcast", i)
        assert np.array_equal(gathered, np.concatenate(everyone)), ("allGather", i)
        block = slice(me * (count // n), (me + 1) * (count // n))
        assert np.array_equal(scattered, n * np.concatenate(everyone)[block]), ("reduceScatter", i)
        assert (got == 100 * left + i).all(), ("send/recv", i)
        checked += 5
    return checked


def shrink_after_death_job(comm, me: int, n: int, workdir: Path) -> object:
    if me == 1:
        _die(workdir)  # a middle rank: the survivors are renumbered
    error = _wait_broken(comm)
    child = comm.commShrink([1])
    ranks = [child.rank_id(), child.size()]
    checked = _check_collectives(child, child.rank_id(), child.size(), 20)
    child.destroy()
    comm.abort()
    return [error and error.status, ranks, checked]


@pytest.mark.timeout(90)
def test_commshrink_after_a_death_gives_a_working_communicator(tmp_path: Path) -> None:
    results = _ranks(tmp_path, shrink_after_death_job, 4, timeout=60)
    assert results[1] == -signal.SIGKILL
    assert [r[1] for r in (results[0], results[2], results[3])] == [[0, 3], [1, 3], [2, 3]]
    for status, _, checked in (results[0], results[2], results[3]):
        assert status == REMOTE_ERROR and checked == 100


def shrink_abort_job(comm, me: int, n: int, workdir: Path) -> object:
    if me == n - 1:
        _await(workdir, *(f"done.{r}" for r in range(n - 1)))  # alive but stuck: never joins, is shrunk away
        return "excluded"
    s, y = nccl.cuda.Stream(), np.ones(1 << 19)
    comm.allReduce(ptr(y), ptr(y), y.size, F64, SUM, s.ptr)  # pending: the last rank never joins
    event = s.record()
    start = time.monotonic()
    child = comm.commShrink([n - 1], nccl.NCCL_SHRINK_ABORT)
    shrunk = time.monotonic() - start
    flushed = event.done
    x = np.full(2, me + 1.0)
    child.allReduce(ptr(x), ptr(x), 2, F64, SUM, 0)
    try:
        comm.check_async_error()
        parent = "not broken"
    except nccl.NcclError as exc:
        parent = [exc.status, str(exc)]
    child.destroy()
    (workdir / f"done.{me}").touch()
    return [shrunk, flushed, x.tolist(), parent]


@pytest.mark.timeout(60)
def test_commshrink_with_abort_ends_the_parents_pending_operation(tmp_path: Path) -> None:
    results = _ranks(tmp_path, shrink_abort_job, 3)
    assert results[2] == "excluded"
    for shrunk, flushed, values, (status, message) in results[:2]:
        assert shrunk < 2.0 and flushed and values == [3.0, 3.0]
        # Its own abort, or its peer's notice of the same (whichever came first).
        assert status in (INVALID_USAGE, REMOTE_ERROR) and "NCCL_SHRINK_ABORT" in message


def shrink_non_caller_job(comm, me: int, n: int, workdir: Path, absent: int) -> object:
    callers = [f"done.{r}" for r in range(n - 1) if r != absent]
    if me in (n - 1, absent):  # excluded (alive, not calling, as it must not), or staying but never calling
        _await(workdir, *callers)
        return "excluded" if me == n - 1 else "absent"
    start = time.monotonic()
    try:
        comm.commShrink([n - 1])
        return "commShrink returned without the absent rank"
    except nccl.NcclError as exc:
        return [exc.status, str(exc), time.monotonic() - start]
    finally:
        (workdir / f"done.{me}").touch()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("absent", [0, 2], ids=["the lowest survivor", "the highest survivor"])
def test_a_survivor_that_never_calls_commshrink_makes_the_others_time_out(tmp_path: Path, absent: int) -> None:
    results = _ranks(tmp_path, shrink_non_caller_job, 4, absent, op_timeout=1.5)
    for rank in {0, 1, 2} - {absent}:
        status, message, elapsed = results[rank]
        assert status in (REMOTE_ERROR, 2) and "commShrink" in message, results[rank]  # 2: ncclSystemError
        assert 1.0 < elapsed < 3.5, results[rank]


def second_death_job(comm, me: int, n: int, workdir: Path) -> object:
    """Rank 3 dies; rank 2 dies too, before it calls commShrink: the others' first try fails, the second works."""
    if me == n - 1:
        _die(workdir)
    _wait_broken(comm)
    if me == n - 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.commShrink([n - 1])
        return "the first commShrink worked without rank 2"
    except nccl.NcclError as exc:
        first = exc.status
    child = comm.commShrink([n - 2, n - 1], nccl.NCCL_SHRINK_ABORT)
    x = np.full(2, me + 1.0)
    child.allReduce(ptr(x), ptr(x), 2, F64, SUM, 0)
    child.destroy()
    return [first, x.tolist()]


@pytest.mark.timeout(60)
def test_a_second_death_during_commshrink_then_a_retry_without_it(tmp_path: Path) -> None:
    results = _ranks(tmp_path, second_death_job, 4, op_timeout=1.5)
    assert results[2:] == [-signal.SIGKILL] * 2
    for first, values in results[:2]:
        assert first in (REMOTE_ERROR, 2) and values == [3.0, 3.0]  # 2: ncclSystemError (a connection timed out)


@pytest.mark.timeout(60)
def test_commshrink_arguments_in_one_process() -> None:
    comms = nccl.NcclCommunicator.initAll(3)
    with pytest.raises(nccl.NcclError, match="rank 2 is in excludeRanks") as excinfo:
        comms[2].commShrink([2])  # an excluded rank must not call: it fails at once, talking to nobody
    assert excinfo.value.status == INVALID_ARGUMENT
    for bad, status in [([], INVALID_ARGUMENT), ([3], INVALID_ARGUMENT), ([-1], INVALID_ARGUMENT)]:
        with pytest.raises(nccl.NcclError) as excinfo:
            comms[0].commShrink(bad)
        assert excinfo.value.status == status, bad
    with pytest.raises(nccl.NcclError, match="flags"):
        comms[0].commShrink([2], 2)
    with pytest.raises(TypeError, match="excludeRanks"):
        comms[0].commShrink(2)
    assert (nccl.NCCL_SHRINK_DEFAULT, nccl.NCCL_SHRINK_ABORT) == (0, 1)  # nccl.h (NCCL 2.27+)
    children: list = [None, None]

    def shrink(rank: int) -> None:
        children[rank] = comms[rank].commShrink([2, 2])  # repeats are one rank

    threads = [threading.Thread(target=shrink, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    x, y = np.ones(3), np.full(3, 2.0)
    nccl.groupStart()
    children[0].allReduce(ptr(x), ptr(x), 3, F64, MAX, 0)
    children[1].allReduce(ptr(y), ptr(y), 3, F64, MAX, 0)
    nccl.groupEnd()
    assert x.tolist() == y.tolist() == [2.0] * 3
    assert [c.rank_id() for c in children] == [0, 1] and children[0].size() == 2
    comms[0].check_async_error()  # the parent is as it was
    for comm in [*children, *comms]:
        comm.abort()


# --- a fresh unique id among the survivors ---------------------------------------------------


def fresh_id_job(comm, me: int, n: int, workdir: Path) -> object:
    """The old communicators are aborted, destroyed or left alone; a new world of the survivors works."""
    spare = [nccl.NcclCommunicator(n, _unique_id(workdir, f"spare{k}", me == 0), me) for k in range(2)]
    if me == n - 1:
        _die(workdir)
    for old in [comm, *spare]:
        _wait_broken(old)
    start = time.monotonic()
    comm.abort()
    spare[0].destroy()  # spare[1] is leaked: never destroyed
    closed = time.monotonic() - start
    survivors = n - 1
    fresh = nccl.NcclCommunicator(survivors, _unique_id(workdir, "fresh", me == 0), me)
    checked = _check_collectives(fresh, me, survivors, 4)
    fresh.destroy()
    return [closed, checked]


@pytest.mark.timeout(60)
def test_a_fresh_unique_id_among_the_survivors_after_a_death(tmp_path: Path) -> None:
    results = _ranks(tmp_path, fresh_id_job, 4)
    assert results[3] == -signal.SIGKILL
    for closed, checked in results[:3]:
        assert closed < 1.0 and checked == 20
