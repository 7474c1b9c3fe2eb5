"""Blocking MPI waits that still end at a deadline.

MPI has no timed wait, so commlib tests requests in a loop. That costs throughput on large
transfers: MPICH moves a message only while it is progressed, and a Python loop of ``Test``
calls progresses it more slowly than MPI's own ``Wait`` (1 MiB uneven all-to-all, 2 ranks,
shared memory: 1.12-1.18x of the blocking call against 1.00-1.05x). :func:`blocker` gives a
large wait MPI's own pace and still a deadline, one of two ways:

- the C module's ``spin`` (:mod:`commlib.backends._native`): ``MPI_Test`` in a loop in C, without
  the GIL, until the request completes or the seconds pass (as fast as ``MPI_Wait``: 1 MiB
  all_reduce on 2 ranks, ``Iallreduce`` + spin 1.01-1.04x of ``Allreduce``, + ``Wait`` 1.02x);
- without it, :class:`Waker`: the caller blocks in ``MPI_Waitany`` on its request *and* on a
  receive from itself, and a helper thread sends that message when the deadline passes (about
  1.5 us more per wait than the spin, and a thread).

Either way the request keeps its normal completion; the deadline only ends the blocking phase,
and the caller goes on to its usual polling loop (naps, the watchdog, the timeout error).

Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default), and a core for every rank on this node: a
blocked rank spins inside MPI without yielding, which would starve a rank sharing its core.
:func:`count_cores` (called collectively when the world is set up) counts the cores the node's ranks
may run on, together: ranks bound one to a core (``mpiexec -bind-to core``, ``srun --cpu-bind``)
qualify as much as unbound ones on enough cores. Otherwise :func:`blocker` returns None and waits poll
as before (they yield and nap). One thread at a time blocks here; another one polls instead.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from commlib._environment import detect
from commlib.backends._native import spin

__all__ = ["Waker", "blocker", "count_cores", "waker"]

_TICK = 0.01  # the helper thread looks at the deadline at least this often while a wait is armed
_PARK_AFTER = 0.1  # seconds without a wait before the helper thread parks (no wake-ups at all)


class Waker:
    """Blocks in MPI on one request until it completes or ``seconds`` pass (see the module docstring)."""

    def __init__(self) -> None:
        self.comm = MPI.COMM_SELF.Dup()
        self.comm.Set_name("commlib-waker")
        self._inbox, self._note = np.zeros(1, np.uint8), np.ones(1, np.uint8)
        self._wake = self.comm.Irecv(self._inbox, 0, 0)  # completed only by the helper thread
        self._busy = threading.Lock()  # held by the one thread blocked in wait()
        self.due = 0.0  # monotonic time at which the blocked thread must be woken; 0: none is blocked
        self._last = time.monotonic()  # when a wait last started
        self._parked, self._kick, self._stop = False, threading.Event(), False
        self._thread = threading.Thread(target=self._run, name="commlib-mpi-waker", daemon=True)
        self._thread.start()

    def wait(self, req: MPI.Request, seconds: float) -> bool | None:
        """Block until ``req`` completes (True) or ``seconds`` pass (False); None: another thread is blocked here.

        Raises ``MPI.Exception`` as ``Request.Wait`` does; ``req`` is still pending after False.
        """
        if not self._busy.acquire(blocking=False):
            return None
        try:
            self._last = now = time.monotonic()
            self.due = due = now + seconds
            if self._parked:
                self._kick.set()
            while True:
                if MPI.Request.Waitany([req, self._wake]) == 0:
                    return True
                self._wake = self.comm.Irecv(self._inbox, 0, 0)
                if time.monotonic() >= due:
                    return False
                # else: a late wake-up meant for an earlier wait; keep waiting
        finally:
            self.due = 0.0
            self._busy.release()

    def _run(self) -> None:
        while not self._stop:
            due, now = self.due, time.monotonic()
            if due == 0.0:
                if now - self._last < _PARK_AFTER:
                    time.sleep(_TICK)
                    continue
                self._kick.clear()
                self._parked = True
                if self.due == 0.0 and not self._stop:  # read after _parked is set: wait() sees one or the other
                    self._kick.wait()
                self._parked = False
            elif now >= due:
                self.comm.Send(self._note, 0, 0)
                while self.due == due and not self._stop:  # one wake-up per wait
                    time.sleep(_TICK / 10)
            else:
                time.sleep(min(due - now, _TICK))

    def close(self) -> None:
        """Stop the helper thread and free the MPI objects (before MPI_Finalize)."""
        self._stop = True
        self._kick.set()
        self._thread.join(timeout=1.0)
        self._wake.Cancel()
        self._wake.Wait()
        self.comm.Free()


_waker: Waker | None = None
_made = False
_core_each: bool | None = None  # whether every rank on this node has a core of its own (count_cores)
_RECORD = 8 + 128  # count_cores' record per rank: its host's hash, a bit per CPU (1024)
_unfinished: list = []  # a count_cores that timed out: its request and buffers, kept for good


def count_cores(comm: MPI.Intracomm, timeout: float) -> bool:
    """Collective over ``comm`` (the world): whether the ranks on this node have a core each, counting the
    cores any of them may run on (each rank's affinity, shared among the ranks of its host). False: not
    every rank took part within ``timeout`` seconds (nothing is decided then)."""
    global _core_each
    mask = np.zeros(_RECORD, np.uint8)
    for cpu in os.sched_getaffinity(0):
        mask[8 + (cpu % (8 * (_RECORD - 8))) // 8] |= 1 << (cpu % 8)  # a CPU past the mask shares a bit: fewer
    host = hashlib.blake2b(MPI.Get_processor_name().encode(), digest_size=8).digest()
    mask[:8] = np.frombuffer(host, np.uint8)
    every = np.empty((comm.Get_size(), _RECORD), np.uint8)
    req = comm.Iallgather(mask, every)
    deadline = time.monotonic() + timeout
    while not req.Test():
        if time.monotonic() > deadline:
            _unfinished.append((req, mask, every))  # MPI may still write into them
            return False
        time.sleep(0.0005)
    here = every[(every[:, :8] == mask[:8]).all(axis=1)]
    cores = int(np.unpackbits(np.bitwise_or.reduce(here[:, 8:], axis=0)).sum())
    _core_each = cores >= len(here)
    return True


def _may_block() -> bool:
    """Whether a thread may block (spin) in MPI: MPI_THREAD_MULTIPLE and a core for every rank of the node."""
    threads = MPI.Is_initialized() and not MPI.Is_finalized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE
    core_each = _core_each
    if core_each is None:
        core_each = detect().local_world_size <= len(os.sched_getaffinity(0))
    return bool(threads and core_each)


def waker() -> Waker | None:
    """The process's :class:`Waker`, made on first use; None when MPI cannot host one."""
    global _waker, _made
    if not _made:
        _made = True
        if _may_block():
            _waker = Waker()
    return _waker


_blocker: Any = False  # not chosen yet


def blocker() -> Callable[[MPI.Request, float], bool | None] | None:
    """How this process blocks in MPI on one request until it completes (True) or some seconds pass (False;
    None: another thread is blocked, poll instead): the C module's ``spin`` (MPI_Test in a loop without the
    GIL) where it was built, else :meth:`Waker.wait`; None when ranks may not block (:func:`_may_block`)."""
    global _blocker
    if _blocker is False:
        if spin is not None:
            _blocker = spin if _may_block() else None
        else:
            w = waker()
            _blocker = None if w is None else w.wait
    return _blocker


@atexit.register  # registered after mpi4py's own exit handler, so it runs first: before MPI_Finalize
def _close_at_exit() -> None:
    if _waker is not None and not MPI.Is_finalized():
        _waker.close()
