"""Zero-copy numpy views of host-memory DLPack exporters, bfloat16 included."""

from __future__ import annotations

import ctypes
import struct
import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["device_of", "host_view"]

# Paths, fastest first: numpy arrays are viewed directly; a plain torch.Tensor is exported by torch's C
# entry point; other objects via __dlpack__. Capsules go to numpy's C consumer when it takes them, else
# (bfloat16, legacy capsules) to the ctypes consumer below, which also reports unsupported input.

# DLPack constants (dlpack.h, v1.x).
_FLAG_READ_ONLY = 1 << 0  # DLPACK_FLAG_BITMASK_READ_ONLY
_HOST_DEVICES = frozenset({1, 3, 11})  # kDLCPU, kDLCUDAHost, kDLROCMHost: CPU-addressable
_DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDAHost", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm"}
_DEVICE_NAMES |= {11: "ROCmHost", 12: "ExtDev", 13: "CUDAManaged", 14: "OneAPI", 15: "WebGPU", 16: "Hexagon"}
# Codes 0-6 take the bit width as a suffix; 7+ (DLPack 1.1 float8/6/4) name it already.
_CODE_NAMES = ["int", "uint", "float", "opaque_handle", "bfloat", "complex", "bool", "float8_e3m4", "float8_e4m3"]
_CODE_NAMES += ["float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"]
_CODE_NAMES += ["float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"]

# The dtypes commlib supports, keyed by DLPack (code, bits, lanes): lanes is in the key so
# one dict lookup validates all three. bfloat16 is the only kind "V" (void-like) dtype here.
_INTS = (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64, np.bool_)
_FLOATS = (np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex64, np.complex128)
_SUPPORTED = frozenset(np.dtype(t) for t in (*_INTS, *_FLOATS))
_KIND_CODES = {"i": 0, "u": 1, "f": 2, "V": 4, "c": 5, "b": 6}
_DTYPES = {(_KIND_CODES[d.kind], 8 * d.itemsize, 1): d for d in _SUPPORTED}
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# Native-layout mirrors of DLManagedTensorVersioned / DLManagedTensor (DLTensor inlined).
_VERSIONED = struct.Struct("@IIPPQPiiiBBHPPQ")
_LEGACY = struct.Struct("@PiiiBBHPPQPP")
_INT64S = [struct.Struct(f"@{n}q") for n in range(65)]  # shape/strides readers per ndim

# Private prototypes of the C API, resolved once (per-call ctypes setup would dominate);
# private so nobody else's argtypes on the shared ctypes.pythonapi attributes can clash.
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))
_from_memory = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi)
)
# Read-only window over the address space: struct.unpack_from on it reads a C struct
# ~5x faster than ctypes.string_at/Structure (and is exactly as unsafe: valid ptrs only).
_MEM = _from_memory(0, sys.maxsize, 0x100)  # 0x100 = PyBUF_READ

# Capsule names must outlive the capsule (SetName keeps the pointer): module constants.
_NAME_V, _USED_V = b"dltensor_versioned", b"used_dltensor_versioned"
_NAME_L, _USED_L = b"dltensor", b"used_dltensor"

# PYFUNCTYPE keeps the GIL: deleters such as numpy's may touch Python refcounts.
_DELETER_T = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)
_DELETERS: dict[int, Any] = {}  # deleter address -> callable; deleters are few static fns


_Huge: Any = ctypes.c_ubyte * (1 << 62)  # a type made at run time: typed Any for the checker


class _Owner(_Huge):
    """Buffer placed over producer memory that runs the DLPack deleter once when freed."""

    # A ctypes array is a buffer numpy accepts as `buffer=` and keeps as `.base`, so the
    # view chain owns this object; the huge length only bounds numpy's extent check.
    __slots__ = ("_deleter", "_managed")

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # Skip at interpreter exit: the producer library may already be torn down.
        if self._deleter is not None and not _finalizing():
            self._deleter(self._managed)


def _dtype_error(code: int, bits: int, lanes: int) -> TypeError:
    """Build the error for a DLPack dtype host_view cannot represent."""
    name = f"{_CODE_NAMES[code]}{bits if code < 7 else ''}" if code < len(_CODE_NAMES) else "unknown"
    what = f"vector DLPack dtype {name}x{lanes}" if lanes != 1 else f"DLPack dtype {name}"
    return TypeError(f"host_view does not support {what} (code={code}, bits={bits}, lanes={lanes})")


def _device_error(dev_type: int, dev_id: int) -> TypeError:
    """Build the error for a tensor that does not live in host memory."""
    name = _DEVICE_NAMES.get(int(dev_type), "an unknown")
    where = f"{name} device {int(dev_id)} (DLPack device type {int(dev_type)})"
    return TypeError(f"tensor is on {where}; host_view needs host (CPU) memory")


def _own_consume(cap: Any) -> np.ndarray:
    """Consume a capsule with ctypes: for bfloat16 (numpy refuses it) and legacy capsules."""
    try:
        ptr = _get_pointer(cap, _NAME_V)
        used = _USED_V
    except ValueError:  # legacy (pre-1.0) capsule; raises again if it is neither
        ptr = _get_pointer(cap, _NAME_L)
        used = _USED_L
    if used is _USED_V:
        (major, _, _, deleter, flags, data, dev, dev_id, ndim, code, bits, lanes, shape_p, strides_p, offset) = (
            _VERSIONED.unpack_from(_MEM, ptr)
        )
        if major != 1:  # a different major version may change the struct layout
            raise BufferError(f"unsupported DLPack version {major}.x (need 1.x)")
    else:
        (data, dev, dev_id, ndim, code, bits, lanes, shape_p, strides_p, offset, _, deleter) = _LEGACY.unpack_from(
            _MEM, ptr
        )
        flags = 0
    # Validate before consuming, so an error leaves the capsule to free itself.
    if dev not in _HOST_DEVICES:
        raise _device_error(dev, dev_id)
    dtype = _DTYPES.get((code, bits, lanes))
    if dtype is None:
        raise _dtype_error(code, bits, lanes)
    if ndim > 64:
        raise BufferError(f"DLPack tensor has {ndim} dimensions; numpy supports 64")
    reader = _INT64S[ndim]
    shape = reader.unpack_from(_MEM, shape_p)
    strides = None  # NULL strides mean C-contiguous
    base = data + offset
    start = 0
    if strides_p:
        raw = reader.unpack_from(_MEM, strides_p)
        size = dtype.itemsize
        strides = tuple([s * size for s in raw])
        if ndim and min(raw) < 0 and 0 not in shape:
            # numpy measures extents from the buffer start: anchor it at the lowest byte.
            start = -sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s < 0)
    fn = _DELETERS.get(deleter) if deleter else None  # a NULL deleter means nothing to free
    if fn is None and deleter:
        fn = _DELETERS[deleter] = _DELETER_T(deleter)
    # Rename + owner creation cannot fail, so the deleter is owned exactly once from here.
    _set_name(cap, used)
    owner = _Owner.from_address(base - start)
    owner._managed = ptr
    owner._deleter = fn
    arr = np.ndarray(shape, dtype, owner, start, strides)
    if flags & _FLAG_READ_ONLY:
        arr.flags.writeable = False
    return arr


class _Exported:
    """Hands an already exported capsule to np.from_dlpack, numpy's C consumer."""

    __slots__ = ("_capsule",)

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        """Return the capsule whatever numpy asks for: it was exported as we wanted."""
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        """Claim CPU: numpy checks the capsule's own device field, not this."""
        return (1, 0)


def _consume(cap: Any) -> np.ndarray:
    """Consume a capsule: numpy's C consumer (~4x cheaper than ctypes) when it can."""
    try:
        return np.from_dlpack(_Exported(cap))
    except (BufferError, RuntimeError):
        # numpy refuses bfloat16 (and non-host devices) before renaming the capsule,
        # so it is still ours to consume, or to reject with a precise TypeError.
        return _own_consume(cap)


def _view_generic(obj: Any) -> np.ndarray:
    """View any exporter: device check first (no stream sync on device arrays), then export."""
    dev_type, dev_id = obj.__dlpack_device__()
    if dev_type not in _HOST_DEVICES:
        raise _device_error(dev_type, dev_id)
    if type(obj) in _LEGACY_EXPORTERS:
        cap = obj.__dlpack__(stream=None)
    else:
        try:
            cap = obj.__dlpack__(max_version=(1, 0), stream=None)
        except TypeError:  # pre-1.0 exporter without max_version: retry, and remember
            cap = obj.__dlpack__(stream=None)
            _LEGACY_EXPORTERS.add(type(obj))
    # numpy makes views of legacy capsules read-only (they cannot signal it); ours don't.
    return _consume(cap) if _is_valid(cap, _NAME_V) else _own_consume(cap)


_LEGACY_EXPORTERS: set[type] = set()


def _view_ndarray(arr: np.ndarray) -> np.ndarray:
    """numpy arrays need no DLPack round trip (and numpy cannot export bfloat16)."""
    if arr.dtype not in _SUPPORTED:
        raise TypeError(f"host_view does not support dtype {arr.dtype}")
    return arr.view(np.ndarray)


def _make_torch_viewer(torch: Any) -> Callable[[Any], np.ndarray] | None:
    """Fast path for plain torch.Tensor: Tensor.__dlpack__ is ~1.9 us of Python checks."""
    export = getattr(torch._C, "_to_dlpack_versioned", None)
    has_torch_function = getattr(torch._C, "_has_torch_function_unary", None)
    if export is None or has_torch_function is None:
        return None
    bfloat16, int16 = torch.bfloat16, torch.int16

    def view(t: Any) -> np.ndarray:
        """Export via torch's C entry point; tensors it would refuse take the public method."""
        # Tensor.__dlpack__'s refusals; the C export rejects non-strided layouts itself
        # and does no stream sync, and device tensors fail in _consume with a TypeError.
        if t.requires_grad or t.is_conj() or has_torch_function(t):
            return _view_generic(t)
        if t.dtype is bfloat16:  # same bits as int16, which numpy's fast consumer takes
            return _consume(export(t.view(int16))).view(_BFLOAT16)
        return _consume(export(t))

    return view


def _viewer_for(tp: type) -> Callable[[Any], np.ndarray]:
    """Pick and cache the viewer for an exporter type."""
    torch = sys.modules.get("torch")  # never import torch ourselves
    viewer: Callable[[Any], np.ndarray] | None = None
    if issubclass(tp, np.ndarray):
        viewer = _view_ndarray
    elif torch is not None and tp is getattr(torch, "Tensor", None):
        viewer = _make_torch_viewer(torch)
    if viewer is None:
        if not hasattr(tp, "__dlpack__"):
            raise TypeError(f"{tp.__name__} is not a DLPack exporter (no __dlpack__)")
        viewer = _view_generic
    _VIEWERS[tp] = viewer
    return viewer


_VIEWERS: dict[type, Callable[[Any], np.ndarray]] = {}


def host_view(obj: Any) -> np.ndarray:
    """Return a zero-copy numpy view of a host-memory DLPack exporter (owns the export)."""
    tp = type(obj)
    viewer = _VIEWERS.get(tp) or _viewer_for(tp)
    return viewer(obj)


def device_of(obj: Any) -> tuple[int, int]:
    """Return the exporter's DLPack (device type, device id) without exporting."""
    dev_type, dev_id = obj.__dlpack_device__()
    return int(dev_type), int(dev_id)
