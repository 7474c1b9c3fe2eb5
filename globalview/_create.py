"""Creation functions: ``tensor, zeros, ones, full, arange, randn, rand``.

With ``placement`` and ``sbp`` each rank builds exactly its own part, with no
communication; without them they return a local numpy array (the
single-process result). A torch ``dtype`` (``torch.float64``) gives torch local parts
(a torch tensor without placement), and ``requires_grad=True`` makes the result a leaf.
``partial_sum`` places the value on the first rank of
each partial axis and zeros elsewhere (``partial_max``/``partial_min``: the value
everywhere).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import commlib
from commlib.arrays import numpy_dtype, to_host
from globalview import _random
from globalview._family import placement_family
from globalview._layout import block, normalize_sbp
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
    family = placement_family(pl, call)
    xp = family.xp
    coords = pl.coords(commlib.get_rank())
    if coords is None:
        return GlobalTensor(family.empty(pl, np.dtype(dtype)), shape, dtype, pl, sbp, family)
    local = make(xp, block(shape, pl.hierarchy, sbp, coords))
    if any(s.is_partial and s.reduce == "sum" and coords[a] != 0 for a, s in enumerate(sbp)):
        local = xp.zeros_like(local)
    return GlobalTensor(xp.ascontiguousarray(local), shape, local.dtype, pl, sbp, family)


def _is_torch_dtype(dtype: Any) -> bool:
    return type(dtype).__module__.startswith("torch")


def _np(dtype: Any) -> Any:
    """numpy's dtype for a torch dtype (commlib's table); anything else unchanged."""
    return numpy_dtype(dtype) if _is_torch_dtype(dtype) else dtype


def _finish(out: Any, torch_parts: bool, requires_grad: bool, call: str) -> Any:
    """Make ``out`` (numpy parts, or a local numpy array) torch when asked, and a leaf when asked."""
    if requires_grad and not torch_parts:
        raise TypeError(f"{call}: requires_grad=True needs torch local parts: pass a torch dtype")
    if not torch_parts:
        return out
    from globalview._torchfamily import TORCH  # imports torch: only for torch parts

    xp = TORCH.xp
    if not isinstance(out, GlobalTensor):
        return xp.asarray(out).requires_grad_(requires_grad)
    local = xp.asarray(to_host(out._local), device=xp.device_for(out.placement.type, out._xp))
    t = GlobalTensor(local, out.shape, out._dtype, out.placement, out.sbp, TORCH)
    return t.requires_grad_() if requires_grad else t


def tensor(
    data: Any, placement: Placement | None = None, sbp: Any = None, dtype: Any = None, requires_grad: bool = False
) -> Any:
    """A tensor of ``data`` (the whole logical value, the same on every rank): each rank keeps its part.

    torch ``data`` or a torch ``dtype`` give torch parts."""
    torch_parts = _is_torch_dtype(dtype) or type(data).__module__.startswith("torch")
    if type(data).__module__.startswith("torch"):
        data = data.detach().cpu().numpy()
    full = np.asarray(data if not hasattr(data, "get") else data.get(), dtype=_np(dtype))
    if full.dtype == np.float64 and dtype is None and _is_python_floats(data):
        full = full.astype(np.float32)  # OneFlow's default floating dtype for Python floats

    def make(xp: Any, ranges: list[tuple[int, int]]) -> Any:
        return xp.asarray(full[tuple(slice(lo, hi) for lo, hi in ranges)])

    out = _build("globalview.tensor", full.shape, full.dtype, placement, sbp, make)
    return _finish(out, torch_parts, requires_grad, "globalview.tensor")


def _is_python_floats(data: Any) -> bool:
    while isinstance(data, (list, tuple)) and data:
        data = data[0]
    return isinstance(data, float)


def full(
    size: Sequence[int], fill_value: Any, *, dtype: Any = None, placement=None, sbp=None, requires_grad: bool = False
) -> Any:
    """A tensor of ``size`` filled with ``fill_value``."""
    torch_parts, dtype = _is_torch_dtype(dtype), _np(dtype)
    dt = np.dtype(dtype) if dtype is not None else np.asarray(fill_value).dtype
    if dtype is None and dt == np.float64:
        dt = np.dtype(np.float32)
    shape = _shape((size,) if isinstance(size, int) else tuple(size), "globalview.full")
    out = _build("globalview.full", shape, dt, placement, sbp, lambda xp, r: xp.full(_sizes(r), fill_value, dt))
    return _finish(out, torch_parts, requires_grad, "globalview.full")


def _sizes(ranges: list[tuple[int, int]]) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in ranges)


def zeros(*size: Any, dtype: Any = np.float32, placement=None, sbp=None, requires_grad: bool = False) -> Any:
    """A tensor of zeros."""
    shape, torch_parts, dtype = _shape(size, "globalview.zeros"), _is_torch_dtype(dtype), _np(dtype)
    out = _build("globalview.zeros", shape, dtype, placement, sbp, lambda xp, r: xp.zeros(_sizes(r), dtype))
    return _finish(out, torch_parts, requires_grad, "globalview.zeros")


def ones(*size: Any, dtype: Any = np.float32, placement=None, sbp=None, requires_grad: bool = False) -> Any:
    """A tensor of ones."""
    shape, torch_parts, dtype = _shape(size, "globalview.ones"), _is_torch_dtype(dtype), _np(dtype)
    out = _build("globalview.ones", shape, dtype, placement, sbp, lambda xp, r: xp.ones(_sizes(r), dtype))
    return _finish(out, torch_parts, requires_grad, "globalview.ones")


def arange(start: Any, end: Any = None, step: Any = 1, *, dtype: Any = None, placement=None, sbp=None) -> Any:
    """``start, start + step, ...`` up to ``end`` (excluded), as numpy.arange; 1-D."""
    if end is None:
        start, end = 0, start
    if not step:
        raise ValueError("globalview.arange: step must not be 0")
    torch_parts, dtype = _is_torch_dtype(dtype), _np(dtype)
    n = max(0, int(np.ceil((end - start) / step)))
    dt = np.dtype(dtype) if dtype is not None else np.arange(start, start + step, step).dtype

    def make(xp: Any, ranges: list[tuple[int, int]]) -> Any:
        lo, hi = ranges[0]
        return (start + step * xp.arange(lo, hi)).astype(dt)

    return _finish(_build("globalview.arange", (n,), dt, placement, sbp, make), torch_parts, False, "globalview.arange")


def _random_tensor(call: str, draw: Callable, size: tuple, dtype: Any, seed: Any, placement, sbp, grad: bool) -> Any:
    shape, torch_parts, dtype = _shape(size, call), _is_torch_dtype(dtype), _np(dtype)
    k = _random.next_key() if seed is None else _random.key(seed)
    out = _build(call, shape, dtype, placement, sbp, lambda xp, r: draw(xp, k, shape, r, dtype))
    return _finish(out, torch_parts, grad, call)


def randn(
    *size: Any, dtype: Any = np.float32, seed: int | None = None, placement=None, sbp=None, requires_grad: bool = False
) -> Any:
    """Standard normal values; the logical tensor depends only on the seed (or the default
    generator's position, see :func:`manual_seed`), not on placement, sbp or world size."""
    return _random_tensor("globalview.randn", _random.normal, size, dtype, seed, placement, sbp, requires_grad)


def rand(
    *size: Any, dtype: Any = np.float32, seed: int | None = None, placement=None, sbp=None, requires_grad: bool = False
) -> Any:
    """Uniform values in [0, 1); the same logical tensor for every placement, sbp and world size."""
    return _random_tensor("globalview.rand", _random.uniform, size, dtype, seed, placement, sbp, requires_grad)
