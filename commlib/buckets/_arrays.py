"""The few array operations the reducer needs, for numpy, cupy, torch and other DLPack arrays.

Which dtypes exist, and how a foreign array becomes one commlib moves, is ``commlib.arrays``'
answer (so the reducer takes every dtype commlib moves, bfloat16 included). What is left here is
family-generic arithmetic: torch tensors have ``new_zeros``/``copy_``; numpy and cupy arrays
have ``__array_namespace__``; nothing here imports torch or cupy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from commlib import arrays
from commlib.buckets.planner import ParamInfo

__all__ = [
    "as_array",
    "copy_into",
    "describe",
    "flat_view",
    "is_inexact",
    "like",
    "scale",
    "scale_into",
    "zero",
    "zeros_like",
]


def _is_torch(a: Any) -> bool:
    return hasattr(a, "new_zeros") and hasattr(a, "copy_")


def as_array(a: Any, where: str, arg: str) -> Any:
    """``a`` itself when it is a numpy/cupy array or torch tensor; else commlib's zero-copy view of it."""
    if _is_torch(a) or hasattr(a, "__array_namespace__"):
        return a
    if hasattr(a, "__dlpack__"):
        return arrays.as_array(a, where=f"{where}: {arg}")
    raise TypeError(
        f"{where}: {arg} must be a numpy, cupy or DLPack array (e.g. a torch tensor), got {type(a).__qualname__}"
    )


def is_inexact(a: Any) -> bool:
    """True for the floating-point and complex dtypes commlib moves (gradients can be averaged in place)."""
    try:
        return arrays.kind(a.dtype) in ("float", "complex")
    except TypeError:  # a dtype commlib cannot move at all
        return False


def describe(a: Any, name: str) -> ParamInfo:
    """The planner's view of array ``a``: element count, item size, dtype and device names."""
    itemsize = arrays.numpy_dtype(a.dtype).itemsize
    device = str(getattr(a, "device", "cpu"))
    return ParamInfo(math.prod(a.shape), int(itemsize), str(a.dtype), device, name)


def zeros_like(a: Any, numel: int) -> Any:
    """A flat zero buffer of ``numel`` elements with ``a``'s family, dtype and device."""
    if _is_torch(a):
        return a.new_zeros(numel)
    xp = a.__array_namespace__()
    return xp.zeros(numel, dtype=a.dtype)


def flat_view(buffer: Any, start: int, numel: int, shape: tuple[int, ...]) -> Any:
    """``buffer[start:start + numel]`` shaped as ``shape``, sharing memory (same for every family)."""
    return buffer[start : start + numel].reshape(shape)


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst`` (same shape); a foreign DLPack ``src`` is read through commlib's view."""
    if _is_torch(dst):
        dst.copy_(src)
        return
    if not hasattr(src, "__array_namespace__") and isinstance(dst, np.ndarray):
        src = arrays.as_array(src)
    dst[...] = src


def scale_into(dst: Any, src: Any, factor: float) -> None:
    """``dst = src * factor`` in one pass (same shape); ``factor == 1`` is a plain copy."""
    if factor == 1:
        copy_into(dst, src)
    elif _is_torch(dst):
        import torch  # already imported: dst is a torch tensor

        torch.mul(src, factor, out=dst)
    elif hasattr(src, "__array_namespace__") or not isinstance(dst, np.ndarray):
        dst.__array_namespace__().multiply(src, factor, out=dst)
    else:
        np.multiply(arrays.as_array(src), factor, out=dst)


def scale(dst: Any, factor: float) -> None:
    """``dst *= factor`` in place (nothing when ``factor == 1``)."""
    if factor != 1:
        dst *= factor


def like(a: Any, view: Any) -> bool:
    """True when ``a`` can stand in for ``view`` (reduced where it is): same family, dtype, shape and
    device, C-contiguous and writable."""
    if type(a) is not type(view) or a.dtype != view.dtype or tuple(a.shape) != tuple(view.shape):
        return False
    if _is_torch(a):
        return bool(a.is_contiguous()) and a.device == view.device and not a.requires_grad
    flags = getattr(a, "flags", None)
    return (
        flags is not None
        and bool(flags.c_contiguous)
        and bool(getattr(flags, "writeable", True))
        and (str(getattr(a, "device", "cpu")) == str(getattr(view, "device", "cpu")))
    )


def zero(dst: Any) -> None:
    """Fill ``dst`` with zeros in place."""
    if _is_torch(dst):
        dst.zero_()
    else:
        dst[...] = 0
