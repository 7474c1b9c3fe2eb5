"""``placement(type, ranks)``: which processes hold a global tensor, arranged as a mesh."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

import commlib
import commlib.groups
from globalview._frozen import Frozen

__all__ = ["array_module", "placement"]

TYPES = ("cpu", "cuda")


def array_module(type_: str, call: str) -> ModuleType:
    """numpy or cupy for a placement of ``type_``, after checking the job's backend can carry it.

    "cuda" takes the nccl backend's arrays: cupy on GPUs, numpy on commlib's CPU emulator of NCCL.
    """
    backend, xp = commlib.get_backend(), commlib.groups.array_module()
    if type_ == "cuda":
        if backend != "nccl":
            raise ValueError(
                f"{call}: placement type 'cuda' needs the nccl backend (a GPU, or the CPU emulator with "
                f"COMMLIB_NCCL_EMULATOR=1); this job's backend is {backend!r}: use type 'cpu'"
            )
        return xp
    if xp is not np:
        raise ValueError(
            f"{call}: placement type 'cpu' needs host collectives, but this job's backend is nccl on GPUs: "
            f"use type 'cuda'"
        )
    return np


class placement(Frozen):
    """The devices a global tensor lives on: ``type`` ("cpu": numpy arrays; "cuda": the
    nccl backend's device arrays) and ``ranks``, a list or a nested list (an nd mesh).

    ``placement("cuda", [[0, 1], [2, 3]])`` is a 2 x 2 mesh: a tensor on it takes a
    tuple of two sbp values, one per mesh axis.
    """

    __slots__ = ("_coords", "_hash", "_key", "_lines", "_mesh", "_type")
    _what = "placements"

    def __init__(self, type: str, ranks: Any) -> None:
        if type not in TYPES:
            raise ValueError(f"globalview.placement: type must be one of {TYPES}, got {type!r}")
        mesh = _mesh(ranks)
        key = (type, mesh.shape, tuple(mesh.ravel().tolist()))
        self._freeze(type=type, mesh=mesh, key=key, hash=hash(key), coords={}, lines={})  # coords, lines: memos

    @property
    def type(self) -> str:
        return self._type

    @property
    def ranks(self) -> np.ndarray:
        """The mesh of ranks (a copy: placements are immutable)."""
        return self._mesh.copy()

    @property
    def hierarchy(self) -> tuple[int, ...]:
        """The mesh's shape, e.g. ``(4,)`` or ``(2, 2)``."""
        return self._mesh.shape

    @property
    def ndim(self) -> int:
        return self._mesh.ndim

    @property
    def flat(self) -> tuple[int, ...]:
        """Every rank of the mesh in row-major order."""
        return self._key[2]

    def coords(self, rank: int) -> tuple[int, ...] | None:
        """``rank``'s position in the mesh, or ``None`` when it is not part of it."""
        try:
            return self._coords[rank]
        except KeyError:
            pass
        try:
            i = self.flat.index(rank)
        except ValueError:
            return None
        found = self._coords[rank] = tuple(int(c) for c in np.unravel_index(i, self._mesh.shape))
        return found

    def line(self, coords: tuple[int, ...], axis: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``coords`` but the one on ``axis`` (kept: each boxing step
        asks, and numpy's indexing costs 10 us with cold caches)."""
        key = (tuple(coords), axis)
        if (found := self._lines.get(key)) is None:
            index: list[Any] = list(coords)
            index[axis] = slice(None)
            found = self._lines[key] = tuple(int(r) for r in self._mesh[tuple(index)])
        return found

    def lines(self, axis: int) -> list[tuple[int, ...]]:
        """All the mesh's lines along ``axis``, in row-major order of the other coordinates."""
        if (found := self._lines.get(axis)) is None:
            moved = np.moveaxis(self._mesh, axis, -1).reshape(-1, self._mesh.shape[axis])
            found = self._lines[axis] = tuple(tuple(int(r) for r in row) for row in moved)
        return list(found)

    def __contains__(self, rank: object) -> bool:
        return rank in self.flat

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, placement):
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"globalview.placement(type={self._type!r}, ranks={self._mesh.tolist()})"

    __str__ = __repr__

    def __reduce__(self) -> tuple:
        return (placement, (self._type, self._mesh.tolist()))


def _mesh(ranks: Any) -> np.ndarray:
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = [ranks]
    try:
        mesh = np.array(ranks)
    except ValueError:
        mesh = None
    if mesh is None or mesh.dtype == object or mesh.size == 0 or mesh.dtype.kind not in "iu":
        raise ValueError(
            f"globalview.placement: ranks must be a non-empty list (or nested list of equal-length lists) "
            f"of ints, got {ranks!r}"
        )
    if mesh.ndim == 0:
        mesh = mesh.reshape(1)
    if (mesh < 0).any() or len(set(mesh.ravel().tolist())) != mesh.size:
        raise ValueError(f"globalview.placement: ranks must be distinct non-negative ints, got {mesh.tolist()}")
    return mesh.astype(np.int64)
