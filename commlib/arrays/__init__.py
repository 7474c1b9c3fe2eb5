"""Arrays in and out of commlib: the dtypes it moves, and the one intake every layer uses.

commlib's backends move numpy arrays (host memory) and cupy arrays (device memory). Everything
else a user passes, torch tensors above all, is viewed as one of those without a copy (DLPack, or
``__cuda_array_interface__``), and can be turned back::

    from commlib import arrays

    t = torch.ones(3, dtype=torch.bfloat16)
    a = arrays.as_array(t)              # a numpy bfloat16 view of t's memory
    arrays.from_array(a, like=t)        # a torch tensor again, on the same memory
    arrays.numpy_dtype(torch.bfloat16)  # dtype(bfloat16): the table below speaks numpy
    arrays.DTYPES                       # every dtype commlib moves -> "int" / "float" / "complex" / "bool"

``ddp`` and ``globalview`` ask this module which dtypes exist and how to convert, so a dtype
commlib moves is accepted by every layer (bfloat16 through ``ml_dtypes`` included).
"""

from __future__ import annotations

from commlib.arrays._dtypes import DTYPES, LOW_PRECISION, bfloat16, kind, numpy_dtype, op_error, torch_dtype
from commlib.arrays._intake import (
    address,
    as_array,
    device_array,
    from_array,
    host_array,
    reject,
    same_kind,
    strided_view,
    to_device,
    to_host,
)
from commlib.arrays._lists import packed, unpack

__all__ = [
    "DTYPES",
    "LOW_PRECISION",
    "address",
    "as_array",
    "bfloat16",
    "device_array",
    "from_array",
    "host_array",
    "kind",
    "numpy_dtype",
    "op_error",
    "packed",
    "reject",
    "same_kind",
    "strided_view",
    "to_device",
    "to_host",
    "torch_dtype",
    "unpack",
]
