"""Where numpy keeps an array's data pointer, dimensions, flags and dtype inside its object.

commlib's C module (``commlib/backends/_ready.c``) reads these fields directly on its hot paths: asking
numpy through the buffer protocol costs ~70-100 ns an array, several times per small call. The offsets
are numpy's ``PyArrayObject_fields`` (the same in numpy 1.x and 2.x) and are checked here, on arrays whose
fields differ, before anything uses them; where they do not match, the C module falls back to the buffer
protocol and the group layer to its Python checks.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

__all__ = ["struct_offsets"]

_P = ctypes.sizeof(ctypes.c_void_p)
# PyObject_HEAD, then: char *data; int nd; npy_intp *dimensions; npy_intp *strides; PyObject *base;
# PyArray_Descr *descr; int flags
_DATA, _ND, _DIMS, _DESCR, _FLAGS = 2 * _P, 3 * _P, 4 * _P, 7 * _P, 8 * _P


@functools.cache
def struct_offsets() -> tuple[int, int, int, int, int] | None:
    """(data, nd, dimensions, flags, descr) byte offsets in an ndarray, checked; None if numpy differs."""
    samples: list[np.ndarray] = [
        np.zeros((2, 3), np.float32),
        np.arange(12, dtype=np.int16)[::2].reshape(2, 3)[:, 1:],
        np.ones(1, np.complex128),
        np.zeros((), np.uint8),
    ]
    samples[2].flags.writeable = False
    if np.ndarray.__basicsize__ < _FLAGS + ctypes.sizeof(ctypes.c_int):
        return None
    for a in samples:
        at = id(a)
        if ctypes.c_void_p.from_address(at + _DATA).value != a.__array_interface__["data"][0]:
            return None
        if ctypes.c_int.from_address(at + _ND).value != a.ndim:
            return None
        dims = ctypes.c_void_p.from_address(at + _DIMS).value
        if a.ndim and tuple((ctypes.c_ssize_t * a.ndim).from_address(dims or 0)) != a.shape:
            return None
        if ctypes.c_int.from_address(at + _FLAGS).value != a.flags.num:
            return None
        if ctypes.c_void_p.from_address(at + _DESCR).value != id(a.dtype):
            return None
    return _DATA, _ND, _DIMS, _FLAGS, _DESCR
