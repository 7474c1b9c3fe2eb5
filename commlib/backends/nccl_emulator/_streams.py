"""Emulated CUDA streams, events and devices for the NCCL emulator (host threads, no GPU).

A :class:`Stream` is a FIFO worker thread running enqueued host callables in
order. Its ``ptr`` is the key under which NCCL calls find it (``stream=ptr``).
The null stream (``ptr == 0``) is the host itself: work "enqueued" on it runs
synchronously in the caller, so it is complete as soon as the call returns.
Events remember a position in a stream's queue and are done once the stream
has executed everything enqueued before the record.
"""

from __future__ import annotations

import itertools
import sys
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

__all__ = ["CUDARuntimeError", "Device", "Event", "Stream", "cuda", "get_current_stream", "resolve_stream"]

_DEVICE_COUNT = 1  # one emulated device per process: device 0


class CUDARuntimeError(RuntimeError):
    """A misuse of the emulated CUDA runtime (e.g. a device ordinal that does not exist)."""


class _StreamCore:
    """The queue and worker thread behind a Stream; kept apart so the thread does not keep the Stream alive."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self._cond = threading.Condition()
        self._queue: deque[Callable[[], Any]] = deque()
        self._enqueued = 0  # tickets: the n-th enqueued callable has ticket n
        self.completed = 0
        self._thread: threading.Thread | None = None
        self._closing = False

    def submit(self, fn: Callable[[], Any]) -> None:
        """Enqueue ``fn``; it runs on the worker after everything enqueued before it."""
        with self._cond:
            self._queue.append(fn)
            self._enqueued += 1
            if self._thread is None:  # started lazily: streams that never get work cost no thread
                self._thread = threading.Thread(target=self._run, name=f"emulated-stream-{self.ptr:#x}", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def ticket(self) -> int:
        """The ticket of the last enqueued callable (0 if none): what an event recorded now waits for."""
        with self._cond:
            return self._enqueued

    def reached(self, ticket: int) -> bool:
        """Whether every callable up to ``ticket`` has run (never blocks)."""
        return self.completed >= ticket

    def wait_for(self, ticket: int) -> None:
        """Block until every callable up to ``ticket`` has run."""
        if self.completed >= ticket:
            return
        with self._cond:
            self._cond.wait_for(lambda: self.completed >= ticket)

    def close(self) -> None:
        """Let the worker exit once its queue is empty (the Stream object is gone)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closing:
                        return
                    self._cond.wait()
                fn = self._queue.popleft()
            try:
                fn()
            except BaseException:  # a task must not kill the stream: later work and events depend on it
                print(f"nccl emulator: work on stream {self.ptr:#x} raised:", file=sys.stderr)
                traceback.print_exc()
            with self._cond:
                self.completed += 1
                self._cond.notify_all()


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

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
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

    @property
    def done(self) -> bool:
        """Whether all work enqueued so far has run (never blocks)."""
        return self._core is None or self._core.reached(self._core.ticket())

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
        """Whether the recorded work has completed (True if never recorded, like cudaEventQuery)."""
        return self._core is None or self._core.reached(self._ticket)

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
