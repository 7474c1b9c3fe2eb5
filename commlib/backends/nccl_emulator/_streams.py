"""Emulated CUDA streams, events and devices for the NCCL emulator (host threads, no GPU).

A :class:`Stream` is a FIFO worker thread running enqueued host callables in
order. Its ``ptr`` is the key under which NCCL calls find it (``stream=ptr``).
The null stream (``ptr == 0``) is the host itself: work "enqueued" on it runs
synchronously in the caller, so it is complete as soon as the call returns.
Events remember a position in a stream's queue and are done once the stream
has executed everything enqueued before the record.

A task may also run "in place": started by the caller while the stream is idle
and finished later by whichever thread completes it, with the worker only
guarding its deadline (see ``_launch``). A thread that waits for such a task
drives it (reads its replies itself), and a query of pending work (``done``)
waits up to a millisecond before it answers no: the emulated device's threads
share the GIL with the host, and a host spinning on ``done`` held them off for
a whole switch interval (5 ms) per hand-off, where a GPU runs on regardless.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Protocol

__all__ = ["CUDARuntimeError", "Device", "Event", "Stream", "cuda", "get_current_stream", "resolve_stream"]

_DEVICE_COUNT = 1  # one emulated device per process: device 0
# How long a query of pending work waits for it (without the GIL, or driving it);
# long enough to cover a small operation, short enough that a polling host never notices.
_QUERY_YIELD = 0.001
_RETRY = 0.001  # how soon a host waiting behind another thread that drives the task looks again


class InPlaceTask(Protocol):
    """Work started in place (see _StreamCore.start_in_place)."""

    deadline: float  # monotonic
    expiring: bool  # set by the worker once it called expire()

    def expire(self) -> None: ...
    def drive(self, until: float | None) -> bool: ...


class CUDARuntimeError(RuntimeError):
    """A misuse of the emulated CUDA runtime (e.g. a device ordinal that does not exist)."""


class _StreamCore:
    """The queue and worker thread behind a Stream; kept apart so the thread does not keep the Stream alive."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self._lock = threading.RLock()  # reentrant: a garbage-collected Stream closes its core from inside any step
        self._work = threading.Condition(self._lock)  # the worker waits here for tasks (and deadlines)
        self._progress = threading.Condition(self._lock)  # hosts wait here for completions: never wakes the worker
        self._hosts = 0  # threads waiting on _progress (notify_all costs a few calls: skipped when none)
        self._queue: deque[Callable[[], Any]] = deque()
        self._enqueued = 0  # tickets: the n-th enqueued callable has ticket n
        self.completed = 0
        self._busy = False  # a task is running on the worker, or in flight in place
        self._task: InPlaceTask | None = None  # the task started in place, while it is in flight
        self._armed = math.inf  # when the waiting worker wakes up next
        self._horizon = -math.inf  # the latest deadline of a task started in place
        self._thread: threading.Thread | None = None
        self._closing = False

    def submit(self, fn: Callable[[], Any]) -> None:
        """Enqueue ``fn``; it runs on the worker after everything enqueued before it."""
        with self._lock:
            self._queue.append(fn)
            self._enqueued += 1
            self._start_worker()
            self._work.notify()

    def start_in_place(self, task: InPlaceTask) -> bool:
        """Take the next ticket for a task the caller starts itself, if the stream is idle (else False).

        Whoever completes the task calls ``finish_in_place()``; if it is still in flight at
        ``task.deadline``, the worker calls ``task.expire()``.
        """
        with self._lock:
            if self._busy or self._queue:
                return False
            self._enqueued += 1
            self._busy, self._task = True, task
            self._horizon = max(self._horizon, task.deadline)
            self._start_worker()
            if task.deadline < self._armed:  # else the worker wakes up in time anyway: no wake-up per call
                self._work.notify()
            return True

    def finish_in_place(self) -> None:
        """The task started in place is done (successfully or not)."""
        with self._lock:
            self._busy, self._task = False, None
            self.completed += 1
            if self._hosts:
                self._progress.notify_all()
            if self._queue or self._closing:  # the worker has work, or may exit: else let it sleep on
                self._work.notify()

    def _start_worker(self) -> None:
        if self._thread is None:  # started lazily: streams that never get work cost no thread
            self._thread = threading.Thread(target=self._run, name=f"emulated-stream-{self.ptr:#x}", daemon=True)
            self._thread.start()

    def ticket(self) -> int:
        """The ticket of the last enqueued callable (0 if none): what an event recorded now waits for."""
        return self._enqueued  # one int read is atomic: no lock needed

    def wait_for(self, ticket: int, timeout: float | None = None) -> bool:
        """Block until every callable up to ``ticket`` has run (True), or ``timeout`` seconds passed (False).

        While a task started in place is in flight, the waiting thread drives it (reads its replies).
        """
        if self.completed >= ticket:
            return True
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            task = self._task  # a stale read is harmless: drive() declines a task that is told already
            if task is None or not task.drive(until):
                with self._lock:
                    if self.completed < ticket:
                        remaining = math.inf if until is None else max(until - time.monotonic(), 0.0)
                        # Another thread drives the task: look again soon, it may stop before this one's is in.
                        remaining = min(remaining, _RETRY) if task is not None else remaining
                        self._hosts += 1
                        try:
                            self._progress.wait(None if remaining == math.inf else remaining)
                        finally:
                            self._hosts -= 1
            if self.completed >= ticket:
                return True
            if until is not None and time.monotonic() >= until:
                return False

    def close(self) -> None:
        """Let the worker exit once its queue is empty (the Stream object is gone)."""
        with self._lock:
            self._closing = True
            self._work.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                job = self._next_job()
            if job is None:
                return
            fn, queued = job
            try:
                fn()
            except BaseException:  # a task must not kill the stream: later work and events depend on it
                print(f"nccl emulator: work on stream {self.ptr:#x} raised:", file=sys.stderr)
                traceback.print_exc()
            if queued:
                with self._lock:
                    self._busy = False
                    self.completed += 1
                    if self._hosts:
                        self._progress.notify_all()

    def _next_job(self) -> tuple[Callable[[], Any], bool] | None:
        """Wait (lock held) for the worker's next job: (callable, whether it is a queued task), or None to exit."""
        while True:
            task = self._task
            if task is not None and task.deadline <= time.monotonic() and not task.expiring:
                task.expiring = True
                return task.expire, False
            if self._queue and not self._busy:
                self._busy = True
                return self._queue.popleft(), True
            if self._closing and not self._busy:
                return None
            # Sleep until the guarded deadline, or the last one seen: the next task started in place
            # has a later deadline, so the worker needs no wake-up per task (see start_in_place).
            wake = task.deadline if task is not None and not task.expiring else self._horizon
            remaining = wake - time.monotonic()
            self._armed = wake if remaining > 0 else math.inf
            self._work.wait(min(remaining, threading.TIMEOUT_MAX) if remaining > 0 else None)
            self._armed = -math.inf  # awake: a new deadline needs no wake-up, it is looked at next


_ptrs = itertools.count(0xE0000010, 0x10)  # non-zero, recognisable "handles"
_streams: weakref.WeakValueDictionary[int, Stream] = weakref.WeakValueDictionary()
_local = threading.local()


class Stream:
    """An emulated CUDA stream (cupy.cuda.Stream's signature); ``ptr`` is what NCCL calls take."""

    null: Stream  # the null stream, set below

    def __init__(
        self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority: int | None = None
    ) -> None:
        self.non_blocking = non_blocking  # accepted for parity; the emulator has no legacy-stream sync
        if null:
            self.ptr, self._core = 0, None
        else:
            self.ptr = next(_ptrs)
            self._core = _StreamCore(self.ptr)
            _streams[self.ptr] = self

    # Bound as a default: at interpreter exit module globals may already be None.
    def __del__(self, _finalizing=sys.is_finalizing) -> None:
        core = getattr(self, "_core", None)
        if core is not None and not _finalizing():  # at exit the worker may have been frozen holding the lock
            core.close()

    def __repr__(self) -> str:
        return f"<emulated Stream {self.ptr:#x}>" if self.ptr else "<emulated null Stream>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return hash(self.ptr)

    def enqueue(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` after the work already on this stream (on the null stream: now, in the caller)."""
        if self._core is None:
            fn()
        else:
            self._core.submit(fn)

    def start_in_place(self, task: InPlaceTask) -> bool:
        """Take the next position for work the caller starts itself, if the stream is idle (see _StreamCore)."""
        return self._core is not None and self._core.start_in_place(task)

    def finish_in_place(self) -> None:
        """The work started in place is done: later work may run."""
        if self._core is not None:
            self._core.finish_in_place()

    @property
    def done(self) -> bool:
        """Whether all work enqueued so far has run (if not, after waiting for it up to 1 ms)."""
        core = self._core
        return core is None or core.wait_for(core.ticket(), _QUERY_YIELD)

    def synchronize(self) -> None:
        """Block until all work enqueued so far has run."""
        if self._core is not None:
            self._core.wait_for(self._core.ticket())

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) at the current end of this stream and return it."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``; on the null stream, block the host until it is done."""
        core, ticket = event._position()  # CUDA semantics: the record as of now, not a later re-record
        if core is None or core is self._core:
            return  # done already, or earlier work of this very stream: FIFO order suffices
        if self._core is None:
            core.wait_for(ticket)
        else:
            self._core.submit(lambda: core.wait_for(ticket))

    def use(self) -> Stream:
        """Make this the current stream of the calling thread."""
        _local.stream = self
        return self

    def __enter__(self) -> Stream:
        _stack().append(get_current_stream())
        return self.use()

    def __exit__(self, *exc: object) -> None:
        _local.stream = _stack().pop()


Stream.null = Stream(null=True)


def _stack() -> list[Stream]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def get_current_stream(device_id: int = -1) -> Stream:
    """The calling thread's current stream: the null stream unless one was made current with ``use()``."""
    return getattr(_local, "stream", Stream.null)


def resolve_stream(ptr: int) -> Stream:
    """The Stream registered under ``ptr`` (0: the null stream); KeyError if none is."""
    if ptr == 0:
        return Stream.null
    return _streams[ptr]


class Event:
    """An emulated CUDA event (cupy.cuda.Event's signature); the timing flags are accepted and ignored."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self.ptr = next(_ptrs)
        self._core: _StreamCore | None = None
        self._ticket = 0

    def __repr__(self) -> str:
        return f"<emulated Event {self.ptr:#x} done={self.done}>"

    def _position(self) -> tuple[_StreamCore | None, int]:
        return self._core, self._ticket

    def record(self, stream: Stream | None = None) -> None:
        """Capture the current end of ``stream`` (default: the current stream)."""
        stream = get_current_stream() if stream is None else stream
        core = stream._core
        self._core, self._ticket = (core, core.ticket()) if core is not None else (None, 0)

    @property
    def done(self) -> bool:
        """Whether the recorded work has completed (True if never recorded, like cudaEventQuery).

        Pending work is first given up to 1 ms to finish (see the module docstring).
        """
        core = self._core
        return core is None or core.wait_for(self._ticket, _QUERY_YIELD)

    def synchronize(self) -> None:
        """Block the host until the recorded work has completed."""
        if self._core is not None:
            self._core.wait_for(self._ticket)


class Device:
    """An emulated CUDA device; only device 0 exists (``runtime.getDeviceCount() == 1``)."""

    def __init__(self, device: int | None = None) -> None:
        self.id = _current_device() if device is None else int(device)

    def __repr__(self) -> str:
        return f"<emulated CUDA Device {self.id}>"

    def __int__(self) -> int:
        return self.id

    def use(self) -> None:
        """Make this the current device of the calling thread."""
        _set_device(self.id)

    def synchronize(self) -> None:
        """Wait for all streams (the emulator has one device)."""
        _device_synchronize()

    def __enter__(self) -> Device:
        _local.devices = [*getattr(_local, "devices", []), _current_device()]
        self.use()
        return self

    def __exit__(self, *exc: object) -> None:
        _set_device(_local.devices.pop())


def _current_device() -> int:
    return getattr(_local, "device", 0)


def _set_device(device: int) -> None:
    if not 0 <= device < _DEVICE_COUNT:
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {device} (the emulator has 1 device)")
    _local.device = device


def _device_count() -> int:
    return _DEVICE_COUNT


def _device_synchronize() -> None:
    for stream in list(_streams.values()):
        stream.synchronize()


# The part of cupy.cuda that commlib's nccl backend uses.
cuda = SimpleNamespace(
    Stream=Stream,
    Event=Event,
    Device=Device,
    get_current_stream=get_current_stream,
    runtime=SimpleNamespace(
        getDeviceCount=_device_count,
        getDevice=_current_device,
        setDevice=_set_device,
        deviceSynchronize=_device_synchronize,
        CUDARuntimeError=CUDARuntimeError,
    ),
)
