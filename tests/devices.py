"""Stand-ins for a GPU, to count what the nccl backend's device path does per call (no GPU here).

- :class:`Device`: device memory that is not host memory (:class:`DeviceArray`, an array module that makes
  them, :attr:`Device.xp`), a CUDA runtime whose streams and events complete at once (:attr:`Device.cuda`),
  and an NCCL module whose calls return at once, with the real ``cupy.cuda.nccl``'s constants where it imports
  (:attr:`Device.nccl`). Every allocation of device memory, copy between host and device, and host
  synchronisation (a stream's or event's ``synchronize``, an event or stream query) is counted in
  :attr:`Device.counts`.
- Capture mode (:meth:`Device.capture`): as in CUDA graph capture, each of those raises instead.

A device array is no numpy array (``isinstance`` says no, and numpy cannot read it without a counted copy), so a
path that treated it as host memory would be seen.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["Device", "DeviceArray"]


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _Flags:
    c_contiguous = True
    writeable = True


class DeviceArray:
    """A contiguous array in "device memory" (a numpy array the host may not read without a counted copy)."""

    flags = _Flags()

    def __init__(self, device: Device, host: np.ndarray) -> None:
        self._device, self._a = device, host

    # metadata: free
    dtype = property(lambda self: self._a.dtype)
    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)

    @property
    def data(self) -> _Pointer:
        return _Pointer(self._a.__array_interface__["data"][0])

    @property
    def __cuda_array_interface__(self) -> dict:
        face = dict(self._a.__array_interface__)
        face["version"] = 3
        return face

    def __len__(self) -> int:
        return len(self._a)

    # views: free
    def view(self, dtype: Any) -> DeviceArray:
        return DeviceArray(self._device, self._a.view(dtype))

    def reshape(self, *shape: Any) -> DeviceArray:
        return DeviceArray(self._device, self._a.reshape(*shape))

    def __getitem__(self, key: Any) -> DeviceArray:
        return DeviceArray(self._device, self._a[key])

    # work on the device: a kernel, counted apart (not a host copy)
    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, DeviceArray):
            self._device.counts["device copy"] += 1
            self._a[key] = value._a
        else:
            self._device.host_copy("host-to-device")
            self._a[key] = value

    def copy(self) -> DeviceArray:
        return self._device.xp.empty_like(self)

    # what only a host copy gives
    def get(self) -> np.ndarray:
        self._device.host_copy("device-to-host")
        return self._a.copy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self._device.host_copy("device-to-host")
        return self._a.astype(dtype) if dtype is not None else self._a.copy()

    def tolist(self) -> list:
        return self.get().tolist()


class _Arrays:
    """The device's array module (cupy's names)."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self.ndarray = DeviceArray

    def _new(self, host: np.ndarray) -> DeviceArray:
        self._device.alloc()
        return DeviceArray(self._device, host)

    def empty(self, shape: Any, dtype: Any = np.float32) -> DeviceArray:
        return self._new(np.empty(shape, dtype))

    def zeros(self, shape: Any, dtype: Any = np.float32) -> DeviceArray:
        return self._new(np.zeros(shape, dtype))

    def ones(self, shape: Any, dtype: Any = np.float32) -> DeviceArray:
        return self._new(np.ones(shape, dtype))

    def empty_like(self, a: DeviceArray) -> DeviceArray:
        out = self._new(np.empty_like(a._a))
        out._a[...] = a._a
        return out

    def asarray(self, a: Any, dtype: Any = None) -> DeviceArray:
        if isinstance(a, DeviceArray) and (dtype is None or a.dtype == dtype):
            return a
        self._device.host_copy("host-to-device")
        return self._new(np.array(a, dtype=dtype))

    def ascontiguousarray(self, a: DeviceArray) -> DeviceArray:
        return self.empty_like(a)

    def concatenate(self, parts: list[DeviceArray]) -> DeviceArray:
        return self._new(np.concatenate([p._a for p in parts]))

    @staticmethod
    def may_share_memory(a: DeviceArray, b: DeviceArray) -> bool:
        return bool(np.may_share_memory(a._a, b._a))


class _Stream:
    def __init__(self, device: Device, ptr: int = 1) -> None:
        self._device, self.ptr = device, ptr

    def wait_event(self, event: _Event) -> None:
        return None  # enqueued: the host does not wait

    def synchronize(self) -> None:
        self._device.sync("Stream.synchronize")

    @property
    def done(self) -> bool:
        self._device.sync("Stream.done (a query)")
        return True


class _Event:
    def __init__(self, device: Device, **kwargs: Any) -> None:
        self._device = device
        device.counts["event made"] += 1

    def record(self, stream: Any = None) -> None:
        return None

    @property
    def done(self) -> bool:
        self._device.sync("Event.done (a query)")
        return True

    def synchronize(self) -> None:
        self._device.sync("Event.synchronize")


class _Communicator:
    """A NcclCommunicator whose every call returns at once (each call is counted by name)."""

    def __init__(self, device: Device, ndev: int, commId: Any, rank: int) -> None:
        self._device, self._rank, self._size = device, rank, ndev

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def check_async_error(self) -> None:
        return None

    def abort(self) -> None:
        return None

    def destroy(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name in ("allReduce", "reduce", "bcast", "broadcast", "reduceScatter", "allGather", "send", "recv"):

            def call(*args: Any) -> None:
                self._device.counts[f"nccl {name}"] += 1

            return call
        raise AttributeError(name)


def _nccl_constants() -> dict[str, int]:
    try:
        from cupy.cuda import nccl  # the real module's constants (it imports without a GPU)

        return {k: getattr(nccl, k) for k in dir(nccl) if k.startswith("NCCL_")}
    except ImportError:
        names = ("INT8", "UINT8", "INT32", "UINT32", "INT64", "UINT64", "FLOAT16", "FLOAT32", "FLOAT64", "BFLOAT16")
        ops = ("SUM", "PROD", "MAX", "MIN", "AVG")
        return {f"NCCL_{n}": i for i, n in enumerate(names)} | {f"NCCL_{n}": i for i, n in enumerate(ops)}


class Device:
    """One stand-in GPU: its array module, CUDA runtime and NCCL module, and the counts (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.capturing = False
        self.xp = _Arrays(self)
        device = self
        current = _Stream(self, ptr=7)
        self.cuda = types.SimpleNamespace(
            Stream=lambda non_blocking=False: _Stream(device),
            Event=lambda **kwargs: _Event(device, **kwargs),
            ExternalStream=lambda ptr: _Stream(device, ptr),
            get_current_stream=lambda: current,
        )
        self.nccl = types.SimpleNamespace(
            NcclCommunicator=lambda ndev, commId, rank: _Communicator(device, ndev, commId, rank),
            NcclError=RuntimeError,
            get_version=lambda: 22705,
            get_unique_id=lambda: bytes(128),
            groupStart=lambda: None,
            groupEnd=lambda: None,
            **_nccl_constants(),
        )

    def array(self, values: Any, dtype: Any = np.float32) -> DeviceArray:
        """A device array of ``values`` (made outside the counted calls)."""
        return DeviceArray(self, np.array(values, dtype=dtype))

    def host(self, a: DeviceArray) -> np.ndarray:
        """``a``'s values, read without counting (the test's own look)."""
        return a._a

    # -- what is counted, or refused while capturing ----------------------------------------------------
    def _refuse(self, what: str) -> None:
        if self.capturing:
            raise RuntimeError(f"{what} is not permitted while a stream is being captured (CUDA graph capture)")

    def alloc(self) -> None:
        self._refuse("a device allocation")
        self.counts["device allocation"] += 1

    def host_copy(self, way: str) -> None:
        self._refuse(f"a {way} copy")
        self.counts[f"{way} copy"] += 1

    def sync(self, what: str) -> None:
        self._refuse(what)
        self.counts["host synchronisation"] += 1

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """CUDA graph capture: allocations, host copies and synchronisation raise meanwhile."""
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False
