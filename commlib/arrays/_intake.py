"""The intake: user objects (numpy/cupy arrays, torch tensors, any DLPack exporter) as backend arrays, and back.

``host_array`` and ``device_array`` run on the hot path of every collective, so the common case
(a contiguous, writable numpy array of a supported dtype) costs a handful of attribute reads and
no allocation. ``ctx`` is anything with a ``label`` attribute (``"[rank 2/4] "``): the message is
built only when there is an error.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np

from commlib.arrays._dtypes import DTYPES, SUPPORTED_NAMES, bfloat16

__all__ = [
    "address",
    "as_array",
    "device_array",
    "strided_view",
    "from_array",
    "host_array",
    "reject",
    "same_kind",
    "to_device",
    "to_host",
]

_addressof, _c_char = ctypes.addressof, ctypes.c_char


class _Where:
    """A ``ctx`` for messages outside any group: just a prefix."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label


def host_array(obj: object, ctx: Any, call: str, arg: str, writable: bool = True) -> np.ndarray:
    """Return ``obj`` as a contiguous host numpy array sharing its memory, or raise a clear error."""
    a = obj if type(obj) is np.ndarray else _host_view(obj, f"{ctx.label}{call}", arg)
    flags = a.flags
    if flags.c_contiguous and (flags.writeable or not writable) and a.dtype in DTYPES:
        return a
    return reject(a, f"{ctx.label}{call}", arg, writable)


def _host_view(obj: object, where: str, arg: str) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack__"):
        from commlib.arrays._dlpack import host_view

        try:
            return host_view(obj)
        except (BufferError, TypeError) as e:  # DLPack's refusals (torch: a tensor that requires grad, a conj view)
            refusal = e
        if _requires_grad(obj):
            try:
                return host_view(obj.detach())  # type: ignore[attr-defined]
            except (BufferError, TypeError) as e:  # a conjugate view that requires grad, say
                refusal = e
        raise TypeError(f"{where}: {arg}: {refusal}") from None
    raise TypeError(
        f"{where}: {arg} must be a numpy array or an object with __dlpack__ "
        f"(e.g. a torch CPU tensor), got {type(obj).__module__}.{type(obj).__qualname__}"
    )


def _requires_grad(obj: object) -> bool:
    """A torch tensor that requires grad: collectives move its data in place, as torch.distributed's do, through
    ``obj.detach()`` (the same memory; DLPack and ``__cuda_array_interface__`` refuse the tensor itself)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor) and obj.requires_grad


def device_array(obj: object, ctx: Any, call: str, arg: str, writable: bool = True) -> Any:
    """``obj`` as a contiguous cupy array sharing its device memory (cupy, torch CUDA, any CUDA array)."""
    import cupy

    a = obj if isinstance(obj, cupy.ndarray) else _device_view(obj, f"{ctx.label}{call}", arg)
    if a.dtype not in DTYPES or not a.flags.c_contiguous:
        reject(a, f"{ctx.label}{call}", arg, writable=False)  # device memory has no read-only flag to check
    return a


def _device_view(obj: object, where: str, arg: str) -> Any:
    """A zero-copy cupy view of any other CUDA array (a torch tensor that requires grad: of its detached view)."""
    import cupy

    if _requires_grad(obj):
        obj = obj.detach()  # type: ignore[attr-defined]
    if not hasattr(obj, "__cuda_array_interface__"):
        raise TypeError(
            f"{where}: {arg} must be a GPU array for the nccl backend (cupy array, torch CUDA tensor, or any "
            f"__cuda_array_interface__ exporter), got {type(obj).__module__}.{type(obj).__qualname__}; "
            "host arrays go through backend='mpi'"
        )
    return cupy.asarray(obj)


def strided_view(obj: object, host: bool, where: str, arg: str) -> Any:
    """``obj`` as a numpy (``host``) or cupy view of its memory, whatever its strides: what a call that stages a
    non-contiguous tensor (copied in, and its result copied back) works from. Other refusals as the intake's."""
    if host:
        return obj if type(obj) is np.ndarray else _host_view(obj, where, arg)
    import cupy

    return obj if isinstance(obj, cupy.ndarray) else _device_view(obj, where, arg)


def reject(a: Any, where: str, arg: str, writable: bool) -> Any:
    """Raise the error that says why ``a`` cannot be used (dtype, layout, read-only)."""
    if a.dtype not in DTYPES:
        raise TypeError(f"{where}: {arg} has dtype {a.dtype}, which commlib cannot move; supported: {SUPPORTED_NAMES}")
    if not a.flags.c_contiguous:
        raise ValueError(
            f"{where}: {arg} must be contiguous (C order), got shape {a.shape} with strides {a.strides}; "
            "pass a contiguous copy (numpy.ascontiguousarray / tensor.contiguous())"
        )
    if writable and not a.flags.writeable:
        raise ValueError(f"{where}: {arg} is read-only, but this call writes its result into it")
    return a


def same_kind(a: Any, ref: Any, ctx: Any, call: str, arg: str, ref_arg: str) -> None:
    """Raise ``TypeError`` when ``a`` and ``ref`` have different dtypes."""
    if a.dtype != ref.dtype:
        raise TypeError(
            f"{ctx.label}{call}: {arg} has dtype {a.dtype} but {ref_arg} has dtype {ref.dtype}; they must match"
        )


def address(a: Any) -> int:
    """The address of ``a``'s first element (host or device)."""
    if type(a) is np.ndarray:
        try:  # ~0.2 us; __array_interface__ builds a dict and costs ~0.8 us
            return _addressof(_c_char.from_buffer(a))  # type: ignore[arg-type]  # ndarray has the buffer protocol
        except (TypeError, ValueError):  # read-only or empty buffers
            return a.__array_interface__["data"][0]
    ptr = getattr(getattr(a, "data", None), "ptr", None)  # cupy: a MemoryPointer
    if ptr is not None:
        return int(ptr)
    return int(a.__cuda_array_interface__["data"][0])


def _on_device(obj: object) -> bool:
    return hasattr(obj, "__cuda_array_interface__") or type(obj).__module__.startswith("cupy")


def as_array(obj: object, *, writable: bool = False, where: str = "commlib.arrays.as_array") -> Any:
    """``obj`` as the array a backend moves, sharing its memory: numpy for host memory, cupy for CUDA memory.

    Takes numpy and cupy arrays, torch tensors (CPU or CUDA) and any other DLPack exporter;
    raises ``TypeError``/``ValueError`` (naming ``where``) for a dtype commlib cannot move,
    a non-contiguous layout, or (with ``writable``) a read-only array.
    """
    ctx = _Where("")
    a = _cpu_tensor_view(obj)
    if a is not None:
        return host_array(a, ctx, where, "array", writable)
    if _requires_grad(obj):  # torch's __cuda_array_interface__ raises for it, even in _on_device's hasattr
        obj = obj.detach()  # type: ignore[attr-defined]
    if _on_device(obj):
        return device_array(obj, ctx, where, "array", writable)
    return host_array(obj, ctx, where, "array", writable)


def from_array(a: Any, like: object) -> Any:
    """``a`` (numpy or cupy) in the family of ``like`` (numpy, cupy or torch), sharing memory where it can.

    A torch ``like`` gives a torch tensor on ``a``'s memory (bfloat16 included); a numpy ``like``
    of a device array gives a host copy; a cupy ``like`` of a host array gives a device copy.
    """
    if type(like).__module__.startswith("torch"):
        return _torch_view(a)
    if isinstance(like, np.ndarray):
        return to_host(a)
    if _on_device(like):
        return to_device(a, sys.modules["cupy"])
    return a


def _cpu_tensor_view(obj: object) -> np.ndarray | None:
    """A plain torch CPU tensor's numpy view (``Tensor.numpy()``: 0.7 us, 5 us with cold caches, where DLPack and
    the device probe cost 3 and 25: globalview converts each boxed part so); None: anything else, or a tensor
    ``numpy()`` refuses (bfloat16, a conjugate or negative view), for the general path."""
    torch = sys.modules.get("torch")
    if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter) or not obj.is_cpu:  # type: ignore[attr-defined]
        return None
    try:
        return obj.detach().numpy()  # type: ignore[attr-defined]
    except (RuntimeError, TypeError):
        return None


def _torch_view(a: Any) -> Any:
    import torch

    if type(a) is np.ndarray and a.dtype != bfloat16 and a.flags.writeable:
        try:  # 0.6 us, 4.5 with cold caches; DLPack's 1.6 and 12
            return torch.from_numpy(a)
        except (TypeError, ValueError):  # a dtype torch has no tensor of, negative strides
            pass
    if a.dtype == bfloat16:  # numpy cannot export bfloat16 through DLPack: move its bits as int16
        return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        a = a.copy()  # torch tensors are always writable: never hand out a writable alias of read-only memory
    return torch.from_dlpack(a)


def to_host(a: Any) -> np.ndarray:
    """A numpy array of ``a``'s values: ``a`` itself when it is one, else a host copy (cupy: ``.get()``)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "get") and _on_device(a):
        return a.get()
    return np.asarray(host_array(a, _Where(""), "commlib.arrays.to_host", "a", writable=False))


def to_device(a: Any, xp: Any) -> Any:
    """``a`` as an array of module ``xp`` (numpy or cupy): itself when it already is one, else a copy."""
    if xp is np:
        return to_host(a)
    return xp.asarray(a) if isinstance(a, np.ndarray) else a
