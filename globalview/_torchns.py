"""torch tensors as local parts: the numpy-like namespace the operators call (``xp.sum``, ``xp.matmul``...).

A global tensor's ``_xp`` is the namespace of its local parts: numpy, cupy, or this module for
torch tensors, so each operator is written once. Dtypes go through ``commlib.arrays`` (the one
table); boxing moves a torch part as the numpy/cupy array commlib views it as (zero copy).
Imported only when torch local parts are used, so ``import globalview`` does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from commlib.arrays import numpy_dtype, torch_dtype

exp, log, sqrt, abs, tanh, sin, cos = torch.exp, torch.log, torch.sqrt, torch.abs, torch.tanh, torch.sin, torch.cos
matmul = torch.matmul


def is_tensor(a: Any) -> bool:
    """True for a torch tensor."""
    return isinstance(a, torch.Tensor)


def device_for(placement_type: str, array_module: Any) -> torch.device:
    """CPU for "cpu" placements and the NCCL emulator; the current CUDA device on GPUs (cupy arrays)."""
    if placement_type == "cuda" and array_module is not np:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def asarray(a: Any, dtype: Any = None, device: Any = None) -> torch.Tensor:
    """``a`` as a torch tensor (numpy arrays are converted; tensors are kept)."""
    dt = None if dtype is None else torch_dtype(dtype)
    if isinstance(a, torch.Tensor):
        return a if dt is None and device is None else a.to(device=device, dtype=dt)
    if isinstance(a, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if dt is None and device is None else t.to(device=device, dtype=dt)
    return torch.as_tensor(a, dtype=dt, device=device)


def ascontiguousarray(a: torch.Tensor) -> torch.Tensor:
    return a.contiguous()


def empty(shape: Sequence[int], dtype: Any, device: Any = None) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=device)


def ones(shape: Sequence[int], dtype: Any, device: Any = None) -> torch.Tensor:
    return torch.ones(tuple(shape), dtype=torch_dtype(dtype), device=device)


def full(shape: Sequence[int], value: Any, dtype: Any, device: Any = None) -> torch.Tensor:
    return torch.full(tuple(shape), value, dtype=torch_dtype(dtype), device=device)


def zeros_like(a: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(a)


def where(condition: Any, x: Any, y: Any) -> torch.Tensor:
    return torch.where(condition, x, y)


def sum(a: torch.Tensor, axis: Sequence[int] = (), keepdims: bool = False) -> torch.Tensor:
    """numpy's sum: ``axis=()`` reduces nothing (torch would reduce every dimension)."""
    return torch.sum(a, dim=tuple(axis), keepdim=keepdims) if len(axis) else a


def max(a: torch.Tensor, axis: Sequence[int], keepdims: bool = False) -> torch.Tensor:
    return torch.amax(a, dim=tuple(axis), keepdim=keepdims)


def min(a: torch.Tensor, axis: Sequence[int], keepdims: bool = False) -> torch.Tensor:
    return torch.amin(a, dim=tuple(axis), keepdim=keepdims)


def transpose(a: torch.Tensor, perm: Sequence[int]) -> torch.Tensor:
    return a.permute(tuple(perm))


def dtype_of(a: torch.Tensor) -> np.dtype:
    """The numpy dtype (commlib's vocabulary) of tensor ``a``."""
    return numpy_dtype(a.dtype)
