"""The dtypes commlib moves, in one table, and the reductions that make sense for each.

numpy dtypes are the vocabulary: torch dtypes and dtype names map onto them here, so every
layer (the collectives, ddp, globalview) asks this one table which dtypes exist.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from commlib._ops import ReduceOp

__all__ = ["DTYPES", "LOW_PRECISION", "bfloat16", "kind", "numpy_dtype", "op_error", "torch_dtype"]

bfloat16 = np.dtype(ml_dtypes.bfloat16)

#: Every dtype commlib moves, with the kind that decides which reductions apply.
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
#: Dtypes MPI has no arithmetic type for: reduced in float32 and rounded once.
LOW_PRECISION = frozenset({np.dtype(np.float16), bfloat16})
SUPPORTED_NAMES = ", ".join(str(d) for d in DTYPES)

# torch's dtype names are numpy's, but for these two spellings.
_TORCH_NAME = {np.dtype(np.bool_): "bool", bfloat16: "bfloat16"}
_BY_NAME = {str(d): d for d in DTYPES} | {"bool": np.dtype(np.bool_), "half": np.dtype(np.float16)}
_BY_NAME |= {"float": np.dtype(np.float32), "double": np.dtype(np.float64), "cfloat": np.dtype(np.complex64)}

_ALLOWED_OPS = {
    "int": frozenset(ReduceOp),  # AVG as NCCL's: the sum (wrapping as the dtype does), divided truncating toward zero
    "float": frozenset({ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG}),
    "complex": frozenset({ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG}),
    "bool": frozenset(ReduceOp) - {ReduceOp.AVG},
}
_WHY_NOT = {
    ReduceOp.AVG: "an average of true/false is not a bool; reduce with SUM (logical or) or cast to an integer",
    ReduceOp.BAND: "bitwise ops need an integer or bool dtype",
    ReduceOp.BOR: "bitwise ops need an integer or bool dtype",
    ReduceOp.BXOR: "bitwise ops need an integer or bool dtype",
    ReduceOp.MIN: "complex numbers are not ordered",
    ReduceOp.MAX: "complex numbers are not ordered",
}


def numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype for ``dtype`` (a numpy/cupy dtype or type, a torch dtype, or a name like ``"bfloat16"``).

    Raises ``TypeError`` when commlib cannot move it, listing the dtypes it can.
    """
    if isinstance(dtype, np.dtype) and dtype in DTYPES:
        return dtype
    name = str(dtype).removeprefix("torch.")
    found = _BY_NAME.get(name)
    if found is None and not type(dtype).__module__.startswith("torch"):
        try:
            found = np.dtype(dtype)
        except TypeError:
            found = None
    if found is None or found not in DTYPES:
        raise TypeError(f"dtype {dtype} is not one commlib moves; supported: {SUPPORTED_NAMES}")
    return found


def torch_dtype(dtype: Any) -> Any:
    """The torch dtype for ``dtype`` (anything :func:`numpy_dtype` takes); imports torch."""
    import torch

    d = numpy_dtype(dtype)
    return getattr(torch, _TORCH_NAME.get(d, str(d)))


def kind(dtype: Any) -> str:
    """``"int"``, ``"float"``, ``"complex"`` or ``"bool"``: which reductions ``dtype`` takes."""
    return DTYPES[numpy_dtype(dtype)]


def op_error(op: ReduceOp, dtype: np.dtype) -> str | None:
    """Why ``op`` makes no sense on ``dtype`` (AVG on bool, bitwise on floats), or None."""
    return None if op in _ALLOWED_OPS[DTYPES[dtype]] else f"op={op} is not defined for dtype {dtype}: {_WHY_NOT[op]}"
