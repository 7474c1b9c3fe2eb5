"""Creation functions: ``tensor, zeros, ones, full, arange, randn, rand``.

With ``placement`` and ``sbp`` each rank builds exactly its own part, with no
communication; without them they return a local numpy array (the
single-process result). ``partial_sum`` places the value on the first rank of
each partial axis and zeros elsewhere (``partial_max``/``partial_min``: the value
everywhere).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import commlib
from globalview import _random
from globalview._boxing import empty_local
from globalview._layout import block, normalize_sbp
from globalview._placement import array_module
from globalview._placement import placement as Placement
from globalview._tensor import GlobalTensor, _check_placement

__all__ = ["arange", "full", "ones", "rand", "randn", "tensor", "zeros"]


def _shape(size: tuple, call: str) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0 for n in size):
        raise ValueError(f"{call}: sizes must be non-negative ints, got {size!r}")
    return tuple(int(n) for n in size)


def _build(
    call: str,
    shape: tuple[int, ...],
    dtype: Any,
    pl: Placement | None,
    sbp: Any,
    make: Callable[[Any, list[tuple[int, int]]], Any],
) -> Any:
    """``make(xp, ranges)`` gives the values of a block; this places them."""
    if pl is None:
        if sbp is not None:
            raise ValueError(f"{call}: sbp without placement; give both for a global tensor, neither for a local one")
        return make(np, [(0, n) for n in shape])
    pl = _check_placement(pl, call)
    if sbp is None:
        raise ValueError(f"{call}: a global tensor needs sbp as well as placement")
    sbp = normalize_sbp(sbp, pl.ndim, len(shape), call)
    xp = array_module(pl.type, call)
    coords = pl.coords(commlib.get_rank())
    if coords is None:
        return GlobalTensor(empty_local(xp, np.dtype(dtype)), shape, dtype, pl, sbp, xp)
    local = make(xp, block(shape, pl.hierarchy, sbp, coords))
    if any(s.is_partial and s.reduce == "sum" and coords[a] != 0 for a, s in enumerate(sbp)):
        local = xp.zeros_like(local)
    return GlobalTensor(xp.ascontiguousarray(local), shape, local.dtype, pl, sbp, xp)


def tensor(data: Any, placement: Placement | None = None, sbp: Any = None, dtype: Any = None) -> Any:
    """A tensor of ``data`` (the whole logical value, the same on every rank): each rank keeps its part."""
    full = np.asarray(data if not hasattr(data, "get") else data.get(), dtype=dtype)
    if full.dtype == np.float64 and dtype is None and _is_python_floats(data):
        full = full.astype(np.float32)  # OneFlow's default floating dtype for Python floats

    def make(xp: Any, ranges: list[tuple[int, int]]) -> Any:
        return xp.asarray(full[tuple(slice(lo, hi) for lo, hi in ranges)])

    return _build("globalview.tensor", full.shape, full.dtype, placement, sbp, make)


def _is_python_floats(data: Any) -> bool:
    while isinstance(data, (list, tuple)) and data:
        data = data[0]
    return isinstance(data, float)


def full(size: Sequence[int], fill_value: Any, *, dtype: Any = None, placement=None, sbp=None) -> Any:
    """A tensor of ``size`` filled with ``fill_value``."""
    dt = np.dtype(dtype) if dtype is not None else np.asarray(fill_value).dtype
    if dtype is None and dt == np.float64:
        dt = np.dtype(np.float32)
    shape = _shape((size,) if isinstance(size, int) else tuple(size), "globalview.full")
    return _build("globalview.full", shape, dt, placement, sbp, lambda xp, r: xp.full(_sizes(r), fill_value, dt))


def _sizes(ranges: list[tuple[int, int]]) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in ranges)


def zeros(*size: Any, dtype: Any = np.float32, placement=None, sbp=None) -> Any:
    shape = _shape(size, "globalview.zeros")
    return _build("globalview.zeros", shape, dtype, placement, sbp, lambda xp, r: xp.zeros(_sizes(r), dtype))


def ones(*size: Any, dtype: Any = np.float32, placement=None, sbp=None) -> Any:
    shape = _shape(size, "globalview.ones")
    return _build("globalview.ones", shape, dtype, placement, sbp, lambda xp, r: xp.ones(_sizes(r), dtype))


def arange(start: Any, end: Any = None, step: Any = 1, *, dtype: Any = None, placement=None, sbp=None) -> Any:
    """``start, start + step, ...`` up to ``end`` (excluded), as numpy.arange; 1-D."""
    if end is None:
        start, end = 0, start
    if not step:
        raise ValueError("globalview.arange: step must not be 0")
    n = max(0, int(np.ceil((end - start) / step)))
    dt = np.dtype(dtype) if dtype is not None else np.arange(start, start + step, step).dtype

    def make(xp: Any, ranges: list[tuple[int, int]]) -> Any:
        lo, hi = ranges[0]
        return (start + step * xp.arange(lo, hi)).astype(dt)

    return _build("globalview.arange", (n,), dt, placement, sbp, make)


def _random_tensor(call: str, draw: Callable, size: tuple, dtype: Any, seed: Any, placement, sbp) -> Any:
    shape = _shape(size, call)
    k = _random.next_key() if seed is None else _random.key(seed)
    return _build(call, shape, dtype, placement, sbp, lambda xp, r: draw(xp, k, shape, r, dtype))


def randn(*size: Any, dtype: Any = np.float32, seed: int | None = None, placement=None, sbp=None) -> Any:
    """Standard normal values; the logical tensor depends only on the seed (or the default
    generator's position, see :func:`manual_seed`), not on placement, sbp or world size."""
    return _random_tensor("globalview.randn", _random.normal, size, dtype, seed, placement, sbp)


def rand(*size: Any, dtype: Any = np.float32, seed: int | None = None, placement=None, sbp=None) -> Any:
    """Uniform values in [0, 1); the same logical tensor for every placement, sbp and world size."""
    return _random_tensor("globalview.rand", _random.uniform, size, dtype, seed, placement, sbp)
