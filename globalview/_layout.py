"""Pure layout arithmetic: which part of the logical tensor each rank holds.

The one rule for uneven splits (OneFlow's): ``n`` elements split over ``p`` ranks
give the first ``n % p`` ranks ``n // p + 1`` elements and the rest ``n // p``.
On an nd mesh the axes apply in order: axis 0 cuts the logical tensor, axis 1
cuts axis 0's piece, and so on; partial values nest the same way (axis 0's
reduction outermost).
"""

from __future__ import annotations

from collections.abc import Sequence

from globalview.sbp import SbpParallel, broadcast

__all__ = ["block", "block_shape", "normalize_sbp", "split_range", "split_sizes"]

Range = tuple[int, int]


def split_sizes(n: int, p: int) -> list[int]:
    """Sizes of the ``p`` pieces of ``n`` elements (the first ``n % p`` are one larger)."""
    q, r = divmod(n, p)
    return [q + 1 if i < r else q for i in range(p)]


def split_range(n: int, p: int, i: int) -> Range:
    """``[lo, hi)`` of piece ``i`` of ``n`` elements split ``p`` ways."""
    q, r = divmod(n, p)
    lo = i * q + min(i, r)
    return lo, lo + q + (1 if i < r else 0)


def block(shape: Sequence[int], mesh: Sequence[int], sbp: Sequence[SbpParallel], coords: Sequence[int]) -> list[Range]:
    """Index ranges, one per dimension, of the part the rank at ``coords`` holds."""
    ranges = [(0, n) for n in shape]
    for axis, s in enumerate(sbp):
        if s.is_split:
            lo, hi = ranges[s.dim]
            a, b = split_range(hi - lo, mesh[axis], coords[axis])
            ranges[s.dim] = (lo + a, lo + b)
    return ranges


def block_shape(
    shape: Sequence[int], mesh: Sequence[int], sbp: Sequence[SbpParallel], coords: Sequence[int]
) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in block(shape, mesh, sbp, coords))


def without(sbp: Sequence[SbpParallel], axis: int) -> tuple[SbpParallel, ...]:
    """``sbp`` with ``axis`` made broadcast: the block a whole mesh line shares."""
    out = list(sbp)
    out[axis] = broadcast
    return tuple(out)


def normalize_sbp(sbp: object, mesh_ndim: int, ndim: int, call: str) -> tuple[SbpParallel, ...]:
    """``sbp`` as a tuple with one value per mesh axis, checked against the tensor's ``ndim``."""
    values = (sbp,) if isinstance(sbp, SbpParallel) else sbp
    if not isinstance(values, (tuple, list)) or not all(isinstance(s, SbpParallel) for s in values):
        raise TypeError(
            f"{call}: sbp must be a globalview.sbp value or a tuple of them (one per placement axis), got {sbp!r}"
        )
    values = tuple(values)
    if len(values) != mesh_ndim:
        raise ValueError(
            f"{call}: the placement has {mesh_ndim} axis(es), so sbp needs {mesh_ndim} value(s), got {len(values)}: "
            f"{', '.join(map(str, values))}"
        )
    for s in values:
        if s.is_split and s.dim >= ndim:
            raise ValueError(f"{call}: sbp {s} splits dimension {s.dim}, but the tensor has {ndim} dimension(s)")
    return values
