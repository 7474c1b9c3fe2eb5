"""Arrays at the API boundary: which dtypes exist, and turning user objects into host numpy views.

Everything here runs on the hot path of every collective, so the common case
(a contiguous, writable numpy array of a supported dtype) costs a handful of
attribute reads and no allocation. ``ctx`` is anything with a ``label`` attribute (``"[rank 2/4] "``):
the message is built only when there is an error.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from commlib._ops import ReduceOp

__all__ = ["DTYPES", "LOW_PRECISION", "address", "check_op", "host_array", "reject", "same_kind"]

bfloat16 = np.dtype(ml_dtypes.bfloat16)

#: Every dtype commlib moves, with the class that decides which reductions apply.
DTYPES: dict[np.dtype, str] = {
    np.dtype(np.int8): "int",
    np.dtype(np.uint8): "int",
    np.dtype(np.int16): "int",
    np.dtype(np.uint16): "int",
    np.dtype(np.int32): "int",
    np.dtype(np.uint32): "int",
    np.dtype(np.int64): "int",
    np.dtype(np.uint64): "int",
    np.dtype(np.float16): "float",
    bfloat16: "float",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "float",
    np.dtype(np.complex64): "complex",
    np.dtype(np.complex128): "complex",
    np.dtype(np.bool_): "bool",
}
#: Dtypes reduced on the host in float32 and rounded once (MPI has no native type for them).
LOW_PRECISION = frozenset({np.dtype(np.float16), bfloat16})

_ALLOWED_OPS = {
    "int": frozenset(ReduceOp) - {ReduceOp.AVG},
    "float": frozenset({ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG}),
    "complex": frozenset({ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG}),
    "bool": frozenset(ReduceOp) - {ReduceOp.AVG},
}
_WHY_NOT = {
    ReduceOp.AVG: "AVG would truncate integers; reduce with SUM and divide in floating point",
    ReduceOp.BAND: "bitwise ops need an integer or bool dtype",
    ReduceOp.BOR: "bitwise ops need an integer or bool dtype",
    ReduceOp.BXOR: "bitwise ops need an integer or bool dtype",
    ReduceOp.MIN: "complex numbers are not ordered",
    ReduceOp.MAX: "complex numbers are not ordered",
}
_addressof, _c_char = ctypes.addressof, ctypes.c_char
_SUPPORTED_NAMES = ", ".join(str(d) for d in DTYPES)


def check_op(op: ReduceOp, dtype: np.dtype, ctx: object, call: str) -> None:
    """Raise ``TypeError`` when ``op`` makes no sense for ``dtype`` (AVG on integers, bitwise on floats)."""
    if op not in _ALLOWED_OPS[DTYPES[dtype]]:
        raise TypeError(f"{ctx.label}{call}: op={op} is not defined for dtype {dtype}: {_WHY_NOT[op]}")


def host_array(obj: object, ctx: object, call: str, arg: str, writable: bool = True) -> np.ndarray:
    """Return ``obj`` as a contiguous host numpy array sharing its memory, or raise a clear error."""
    a = obj if type(obj) is np.ndarray else _convert(obj, f"{ctx.label}{call}", arg)
    flags = a.flags
    if flags.c_contiguous and (flags.writeable or not writable) and a.dtype in DTYPES:
        return a
    return reject(a, f"{ctx.label}{call}", arg, writable)


def _convert(obj: object, where: str, arg: str) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack__"):
        from commlib._dlpack import host_view

        try:
            return host_view(obj)
        except TypeError as e:
            raise TypeError(f"{where}: {arg}: {e}") from None
    raise TypeError(
        f"{where}: {arg} must be a numpy array or an object with __dlpack__ "
        f"(e.g. a torch CPU tensor), got {type(obj).__module__}.{type(obj).__qualname__}"
    )


def reject(a: np.ndarray, where: str, arg: str, writable: bool) -> np.ndarray:
    """Raise the error that says why ``a`` cannot be used (dtype, layout, read-only)."""
    if a.dtype not in DTYPES:
        raise TypeError(f"{where}: {arg} has dtype {a.dtype}, which commlib cannot move; supported: {_SUPPORTED_NAMES}")
    if not a.flags.c_contiguous:
        raise ValueError(
            f"{where}: {arg} must be contiguous (C order), got shape {a.shape} with strides {a.strides}; "
            "pass a contiguous copy (numpy.ascontiguousarray / tensor.contiguous())"
        )
    if writable and not a.flags.writeable:
        raise ValueError(f"{where}: {arg} is read-only, but this call writes its result into it")
    return a


def same_kind(a: np.ndarray, ref: np.ndarray, ctx: object, call: str, arg: str, ref_arg: str) -> None:
    """Raise ``TypeError`` when ``a`` and ``ref`` have different dtypes."""
    if a.dtype != ref.dtype:
        raise TypeError(
            f"{ctx.label}{call}: {arg} has dtype {a.dtype} but {ref_arg} has dtype {ref.dtype}; they must match"
        )


def address(a: object) -> int:
    """The address of ``a``'s first element (host or device)."""
    if type(a) is np.ndarray:
        try:  # ~0.2 us; __array_interface__ builds a dict and costs ~0.8 us
            return _addressof(_c_char.from_buffer(a))
        except (TypeError, ValueError):  # read-only or empty buffers
            return a.__array_interface__["data"][0]
    data = getattr(a, "data", None)  # cupy: a MemoryPointer
    if hasattr(data, "ptr"):
        return data.ptr
    return a.__cuda_array_interface__["data"][0]
