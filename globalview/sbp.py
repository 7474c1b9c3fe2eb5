"""SBP: how a global tensor's logical value relates to each rank's local part.

``split(dim)`` (``S(dim)``): the logical tensor is cut along ``dim``, one piece per
rank of the placement axis. ``broadcast`` (``B``): every rank holds all of it.
``partial_sum`` (``P``): the logical value is the elementwise sum of the local
parts; ``partial_max`` / ``partial_min`` likewise with max / min.

Values are small, immutable and hashable; ``str`` gives OneFlow's short form
(``S(0)``, ``B``, ``P``, ``Pmax``, ``Pmin``), ``repr`` the constructor.
"""

from __future__ import annotations

from globalview._frozen import Frozen

__all__ = ["SbpParallel", "broadcast", "partial_max", "partial_min", "partial_sum", "split"]


class SbpParallel(Frozen):
    """One axis's distribution: kind ``"S"``, ``"B"`` or ``"P"`` (with ``reduce`` ``sum``/``max``/``min``)."""

    __slots__ = ("_dim", "_hash", "_kind", "_reduce")

    _what = "sbp values"

    def __init__(self, kind: str, dim: int | None = None, reduce: str | None = None) -> None:
        self._freeze(kind=kind, dim=dim, reduce=reduce, hash=hash((kind, dim, reduce)))

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def dim(self) -> int | None:
        """The split dimension (``None`` unless this is ``split``)."""
        return self._dim

    @property
    def reduce(self) -> str | None:
        """``"sum"``, ``"max"`` or ``"min"`` for partial values, else ``None``."""
        return self._reduce

    @property
    def is_split(self) -> bool:
        return self._kind == "S"

    @property
    def is_broadcast(self) -> bool:
        return self._kind == "B"

    @property
    def is_partial(self) -> bool:
        return self._kind == "P"

    def __call__(self) -> SbpParallel:
        """``sbp.broadcast()`` is ``sbp.broadcast`` (both spellings appear in OneFlow's docs)."""
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SbpParallel):
            return NotImplemented
        return (self._kind, self._dim, self._reduce) == (other._kind, other._dim, other._reduce)

    def __hash__(self) -> int:
        return self._hash  # computed once: layouts are dictionary keys throughout a plan's search

    def __str__(self) -> str:
        if self._kind == "S":
            return f"S({self._dim})"
        if self._kind == "P":
            return "P" if self._reduce == "sum" else f"P{self._reduce}"
        return "B"

    def __repr__(self) -> str:
        if self._kind == "S":
            return f"globalview.sbp.split(dim={self._dim})"
        if self._kind == "P":
            return f"globalview.sbp.partial_{self._reduce}"
        return "globalview.sbp.broadcast"

    def __reduce__(self) -> tuple:
        return (SbpParallel, (self._kind, self._dim, self._reduce))


def split(dim: int) -> SbpParallel:
    """``S(dim)``: the logical tensor is cut along ``dim`` (OneFlow's rule for uneven sizes:
    with ``n`` elements on ``p`` ranks, the first ``n % p`` ranks hold one more)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"globalview.sbp.split: dim must be a non-negative int, got {dim!r}")
    return SbpParallel("S", dim)


broadcast = SbpParallel("B")
partial_sum = SbpParallel("P", reduce="sum")
partial_max = SbpParallel("P", reduce="max")
partial_min = SbpParallel("P", reduce="min")
