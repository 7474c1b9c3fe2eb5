"""Counter-based random numbers: each element's value is a hash of (seed, its logical index).

So a random global tensor is the same logical tensor whatever its placement, sbp
and the world size, and the same as the single-process result with that seed:
each rank computes exactly its own elements, with no communication. The hash is
SplitMix64's finaliser (a bijective 64-bit mixer, the one that seeds numpy's
generators); 53 bits of it make a uniform double; normals use Box-Muller on two
uniforms drawn from counters ``2 i`` and ``2 i + 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["key", "manual_seed", "next_key", "normal", "uniform"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_state = {"seed": 0, "calls": 0}


def _mix_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def key(seed: int, stream: int = 0) -> int:
    """The 64-bit key of (``seed``, ``stream``)."""
    return _mix_int((_mix_int(((int(seed) + 1) * _GOLDEN) & _MASK) + (stream + 1) * _GOLDEN) & _MASK)


def manual_seed(seed: int) -> None:
    """Seed the default generator: calls without ``seed=`` then draw keys (seed, 0), (seed, 1), ..."""
    _state["seed"], _state["calls"] = int(seed), 0


def next_key() -> int:
    """The key of the next call that gives no seed (the same on every rank: every rank makes the same calls)."""
    k = key(_state["seed"], _state["calls"])
    _state["calls"] += 1
    return k


def _indices(xp: Any, shape: Sequence[int], ranges: Sequence[tuple[int, int]]) -> Any:
    """The row-major logical index of every element of the block ``ranges`` of a ``shape`` tensor."""
    out = xp.zeros(tuple(hi - lo for lo, hi in ranges), np.uint64)
    stride = 1
    for d in reversed(range(len(shape))):
        lo, hi = ranges[d]
        view = [1] * len(shape)
        view[d] = hi - lo
        out += (xp.arange(lo, hi, dtype=np.uint64) * np.uint64(stride)).reshape(view)
        stride *= shape[d]
    return out


def _bits(xp: Any, k: int, counters: Any) -> Any:
    z = (counters + np.uint64(1)) * np.uint64(_GOLDEN) + np.uint64(k)  # SplitMix64's state at step i + 1
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def _unit(xp: Any, k: int, counters: Any) -> Any:
    """Uniform doubles in [0, 1) from 53 bits of the hash."""
    return (_bits(xp, k, counters) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def uniform(xp: Any, k: int, shape: Sequence[int], ranges: Sequence[tuple[int, int]], dtype: Any) -> Any:
    """U[0, 1) for the block ``ranges`` of a ``shape`` tensor."""
    return _unit(xp, k, _indices(xp, shape, ranges)).astype(dtype)


def normal(xp: Any, k: int, shape: Sequence[int], ranges: Sequence[tuple[int, int]], dtype: Any) -> Any:
    """N(0, 1) for the block ``ranges`` of a ``shape`` tensor."""
    i = _indices(xp, shape, ranges) * np.uint64(2)
    u1 = _unit(xp, k, i)
    u2 = _unit(xp, k, i + np.uint64(1))
    return (xp.sqrt(-2.0 * xp.log1p(-u1)) * xp.cos((2.0 * math.pi) * u2)).astype(dtype)
