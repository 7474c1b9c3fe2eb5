"""torch ``Work`` objects over commlib ``Work``, and the progress thread that completes them.

Every call from torch arrives holding the GIL, and MPI moves a nonblocking
collective forward only while somebody tests it. An asynchronous op is
therefore handed to one progress thread per process, which tests the pending
commlib Works (MPI releases the GIL inside each test) and completes each torch
Work's future as soon as its commlib Works are done: DDP's bucket all-reduces
run while backward computes, and DDP's future callbacks run without anybody
calling ``wait()``. While a pending op may be moving data the thread tests it
back to back (MPI moves one shared-memory cell per test); otherwise it naps.
commlib's groups are not thread-safe, so every call into commlib from this
package holds :data:`LOCK`.
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import commlib

__all__ = ["LOCK", "DoneWork", "TorchWork", "completed", "submit"]

#: Serialises every call into commlib made by the torch backend (callers and the progress thread).
LOCK = threading.RLock()

_SPIN_S = 0.0002  # a waiting caller polls without sleeping this long (small messages finish within it)
_NAP_S = 0.00005  # then, and in the progress thread, it sleeps this long between polls
_MAX_NAP_S = 0.0008  # the progress thread's longest nap while nothing completes
# MPI moves a large transfer one shared-memory cell (16 KiB) per test: a thread that naps between
# tests moves 96 MiB in seconds instead of milliseconds. So the progress thread tests without
# napping while some pending work may still be moving data: for _BUSY_S, plus the time its bytes
# take at _SLOW_BYTES_PER_S (a peer that is late past that gets naps again).
_BUSY_S = 0.05
_SLOW_BYTES_PER_S = 100e6
_BURST_S = 0.0005  # such a burst of tests, in seconds (it holds LOCK: new calls wait at most this long)
_LAST_LOOK_S = 0.001  # past its deadline, a Work gets this last wait in commlib, which then raises its timeout error


class TorchWork(dist.Work):
    """A ``torch.distributed.Work`` whose completion is that of one or more commlib Works."""

    def __init__(
        self,
        works: list[Any],
        result: Any,
        call: str,
        timeout: float,
        finish: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._works = works  # commlib Works, completed in order
        self._result = result  # the future's value: the output tensors
        self._finish = finish  # copy-out run once, after the commlib Works complete
        self._call = call
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._claimed = False  # set (under LOCK) by the one thread that completes the work
        self._future: torch.futures.Future = torch.futures.Future()
        self._failing: torch.futures.Future | None = None  # get_future's: failed in C++ too when the op fails
        self._source: Callable[[Any], int] | None = None  # recv from any source: commlib Work -> group rank
        self._last = works[-1] if works else None
        self._before: Callable[[], None] | None = None  # posts this work first (queued nccl point-to-point)
        self._queue: object = None  # collectives: their group (complete in issue order); None: independent
        self._busy = _BUSY_S + _nbytes(result) / _SLOW_BYTES_PER_S  # seconds it may keep moving data (_BUSY_S)
        self._started = time.monotonic()
        self._watch_at = commlib.Work.FIRST_LOOK  # seconds after the start when commlib's slow path looks next

    def __repr__(self) -> str:
        return f"<commlib TorchWork {self._call} {'completed' if self._done.is_set() else 'pending'}>"

    def _poll(self, spin: float = 0.0) -> bool:
        """Test (up to ``spin`` s; takes the lock); complete the work once its commlib Works are done; True if done."""
        if self._done.is_set():
            return True
        with LOCK:
            if self._claimed:  # another thread is completing it: done in a moment
                return False
            try:
                if self._before is not None:
                    self._before()
                while self._works and (self._works[0].progress(spin) if spin else self._works[0].is_completed()):
                    self._works.pop(0)
                now = time.monotonic()
                if self._works and now > self._deadline:
                    self._expire()
                if self._works and (waited := now - self._started) > self._watch_at:
                    # commlib's slow path: publish, judge, fail fast (may raise); says when to look next
                    self._watch_at = self._works[0].watch(waited)
                if self._works:
                    return False
                if self._finish is not None:
                    self._finish()
            except BaseException as e:  # reported through wait() and the future
                self._error = e
            self._claimed = True
        # Outside the lock: a future callback (a DDP comm hook) may issue the next collective.
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(self._result)
        self._done.set()  # only now: whoever waited may read the future's value
        return True

    def _expire(self) -> None:
        """Raise commlib's ``CommTimeoutError`` (call, sequence number, group, ranks that arrived); breaks the group."""
        try:
            self._works[0].wait(timeout=_LAST_LOOK_S)
        except commlib.CommTimeoutError as e:  # commlib waited only for its last look: say how long the op had
            said = f"within {_LAST_LOOK_S:g} s"
            if said not in str(e):
                raise
            raise commlib.CommTimeoutError(str(e).replace(said, f"within {self._timeout:g} s")) from None

    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation completes (True); raise commlib's error if it failed or timed out."""
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else (timeout or 0)
        if seconds > 0:
            self._deadline = min(self._deadline, time.monotonic() + seconds)
        start = time.monotonic()
        busy_until = start + self._busy
        while True:  # test in bursts while data may be moving, then poll between naps
            now = time.monotonic()
            if self._poll(_BURST_S if now < busy_until else 0.0):
                break
            if now - start > _SPIN_S and now >= busy_until:
                time.sleep(_NAP_S)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the operation is complete; never blocks."""
        return self._poll()

    def exception(self) -> BaseException | None:
        """The error the operation failed with, or None."""
        return self._error

    def _source_rank(self) -> int:
        """For ``recv(src=None)``: the group rank the message came from (torch's name)."""
        self.wait()
        if self._source is None:
            raise ValueError(f"{self._call}: source_rank() is only defined for a receive from any source")
        return self._source(self._last)

    source_rank = _source_rank

    def get_future(self) -> torch.futures.Future:
        """A future completed with the output tensors, or failed with the op's error (DDP chains its bucket
        handling on it, and reads it in C++)."""
        if self._failing is None:
            self._failing = self._future.then(_value_or_raise)
        return self._failing


def _value_or_raise(future: torch.futures.Future) -> Any:
    """The value of ``future``, whose error (if it failed) is raised here: the future ``then`` returns is then
    failed in C++ as well. torch's Python ``Future.set_exception`` completes a future in C++ with the exception
    object as its *value*: DDP's reducer, which reads a bucket's result in C++, took the first tensor of a value
    that holds none and the process died of a segmentation fault when a peer died mid-step. Now ``backward()``
    raises a ``RuntimeError`` that carries commlib's message (which rank failed, in which call)."""
    return future.value()


def _nbytes(tensors: Any) -> int:
    """Bytes in a tensor or a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


class DoneWork(dist.Work):
    """The Work of a call that finished before it returned (torch's blocking API): nothing to wait for."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        """Return True: the operation is complete."""
        return True

    def is_completed(self) -> bool:
        """True."""
        return True

    def exception(self) -> None:
        """None: the operation succeeded."""

    def get_future(self) -> torch.futures.Future:
        """A completed future holding the output tensors."""
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


completed = DoneWork


class _Progress:
    """The thread that completes asynchronous Works without their callers."""

    def __init__(self) -> None:
        self.pending: collections.deque[TorchWork] = collections.deque()
        self.wake = threading.Condition(threading.Lock())
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.registered = False
        self.busy_until = 0.0  # until then pending works may be moving data (see _BUSY_S)

    def submit(self, work: TorchWork) -> None:
        with self.wake:
            self.pending.append(work)
            self.busy_until = max(self.busy_until, time.monotonic() + work._busy)
            if self.thread is None:
                self.stopping = False
                self.thread = threading.Thread(target=self._run, name="commlib-torch-progress", daemon=True)
                self.thread.start()
                if not self.registered:  # stop before MPI finalises (mpi4py's exit handler was registered earlier)
                    atexit.register(self.stop)
                    self.registered = True
            self.wake.notify()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug here must not leave torch waiting on futures nobody completes
            with self.wake:
                works, self.thread = list(self.pending), None
                self.pending.clear()
            for w in works:
                with LOCK:
                    if w._claimed:
                        continue
                    w._claimed, w._error = True, e
                w._future.set_exception(e)
                w._done.set()
            raise

    def _loop(self) -> None:
        nap, spin = _NAP_S, 0.0
        while True:
            with self.wake:
                while not self.pending and not self.stopping:
                    self.wake.wait()
                if self.stopping:
                    return
                works = list(self.pending)
            done = self._sweep(works, spin)
            with self.wake:
                for w in done:
                    self.pending.remove(w)
                now = time.monotonic()
                if done and self.pending:  # the next ones start moving now
                    self.busy_until = max(self.busy_until, now + max(w._busy for w in self.pending))
                busy = self.pending and now < self.busy_until
            spin = _BURST_S if busy else 0.0  # data may be moving: test back to back, in bursts
            if spin:
                continue
            # Back off while nothing completes (each test costs the compute threads the GIL and a core).
            nap = _NAP_S if done else min(nap * 2, _MAX_NAP_S)
            if len(done) < len(works):
                time.sleep(nap)

    @staticmethod
    def _sweep(works: list[TorchWork], spin: float) -> list[TorchWork]:
        """Test the works that can complete now: of each group's collectives only the oldest pending one."""
        done, blocked = [], set()
        for w in works:
            if w._queue is not None and id(w._queue) in blocked:
                continue
            if w._poll(spin):
                done.append(w)
            elif w._queue is not None:
                blocked.add(id(w._queue))
        return done

    def stop(self) -> None:
        """Stop the thread (at exit, or when the process group is destroyed); pending Works stay pending."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
            thread, self.thread = self.thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)


_progress = _Progress()
submit = _progress.submit
stop = _progress.stop
