"""Bucket plans: which parameter's gradient goes in which flat buffer, at which offset.

Pure functions over parameter descriptions (element count, item size, dtype, device); no
arrays, no processes. The reducer executes a plan; tests check plans directly.

The rule, as torch's DDP: parameters are grouped by (dtype, device) and walked in reverse
registration order (the order backward usually produces their gradients). Each group's
first bucket closes once it holds ``first_bucket_mb`` (1 MiB: the first all-reduce starts
early), later ones once they hold ``bucket_cap_mb`` (25 MiB by default); a bucket closes
*after* the parameter that reaches the cap, so one large parameter gets a bucket of its
own. Buckets are numbered by the position of their first parameter in the walk. After the
first iteration the plan is rebuilt from the order gradients actually became ready
(:func:`complete_order` turns a partial ready order into the walk).

With ``lone_mb`` (off by default; :class:`~commlib.buckets.reducer.Reducer` sets it when it
reduces gradients in place) a parameter of that many MiB or more gets a bucket of its own
and the smaller ones around it go on filling the open bucket; buckets are then numbered by
the position of their *last* parameter (the moment they become complete), so a bucket of
small parameters collected across the walk does not hold back the large ones after it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "FIRST_BUCKET_MB",
    "LONE_MB",
    "MIB",
    "Bucket",
    "BucketPlan",
    "ParamInfo",
    "complete_order",
    "plan_buckets",
]

MIB = 1 << 20
DEFAULT_BUCKET_CAP_MB = 25.0
FIRST_BUCKET_MB = 1.0
LONE_MB = 4.0  # the Reducer's lone_mb when it reduces gradients in place


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """What planning needs to know about one parameter: size, dtype and device (as strings)."""

    numel: int
    itemsize: int
    dtype: str
    device: str = "cpu"
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 0:
            raise ValueError(f"ParamInfo: numel must be an int >= 0, got {self.numel!r}")
        if isinstance(self.itemsize, bool) or not isinstance(self.itemsize, int) or self.itemsize < 1:
            raise ValueError(f"ParamInfo: itemsize must be an int >= 1, got {self.itemsize!r}")

    @property
    def nbytes(self) -> int:
        """Size of the gradient in bytes."""
        return self.numel * self.itemsize

    @property
    def key(self) -> tuple[str, str]:
        """Parameters share a bucket only when this (dtype, device) pair is equal."""
        return (self.dtype, self.device)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One flat buffer: its parameters (by index), where each starts, its dtype and device."""

    index: int
    dtype: str
    device: str
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    nbytes: int

    def __post_init__(self) -> None:
        if len(self.params) != len(self.offsets):
            raise ValueError(f"Bucket: {len(self.params)} params but {len(self.offsets)} offsets")


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """Buckets in issue order, and for every parameter its (bucket, offset)."""

    buckets: tuple[Bucket, ...]
    location: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        seen = sorted(p for b in self.buckets for p in b.params)
        if seen != list(range(len(self.location))):
            raise ValueError(f"BucketPlan: buckets must hold each of {len(self.location)} parameters exactly once")

    def bucket_of(self, param: int) -> int:
        """Index of the bucket holding parameter ``param``."""
        return self.location[param][0]

    def __str__(self) -> str:
        parts = [f"#{b.index} {b.dtype}@{b.device} {b.nbytes} B {list(b.params)}" for b in self.buckets]
        return "BucketPlan(" + "; ".join(parts) + ")"


def _limit_bytes(mb: float | int | None, arg: str, default: float) -> int:
    value = default if mb is None else mb
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"plan_buckets: {arg} must be a positive number of MiB, got {mb!r}")
    return max(1, int(value * MIB))


def _check_order(order: Sequence[int], n: int) -> list[int]:
    out = list(order)
    if sorted(out) != list(range(n)):
        raise ValueError(f"plan_buckets: order must be a permutation of range({n}), got {out!r}")
    return out


def plan_buckets(
    params: Sequence[ParamInfo],
    bucket_cap_mb: float | None = None,
    first_bucket_mb: float | None = FIRST_BUCKET_MB,
    order: Sequence[int] | None = None,
    lone_mb: float | None = None,
) -> BucketPlan:
    """Assign parameters to buckets (see the module docstring for the rule).

    Args:
        params: one description per parameter, in registration order.
        bucket_cap_mb: cap of every bucket after the first of each (dtype, device); default 25.
        first_bucket_mb: cap of the first bucket of each (dtype, device); never above
            ``bucket_cap_mb``; ``None`` means the same as ``bucket_cap_mb``.
        order: the walk over parameter indices; default reverse registration order.
        lone_mb: parameters of at least this many MiB get a bucket of their own (None: off).

    Raises:
        ValueError: a cap is not a positive number, or ``order`` is not a permutation.
    """
    if not all(isinstance(p, ParamInfo) for p in params):
        raise TypeError(f"plan_buckets: params must be ParamInfo objects, got {[type(p).__name__ for p in params]}")
    cap = _limit_bytes(bucket_cap_mb, "bucket_cap_mb", DEFAULT_BUCKET_CAP_MB)
    first = cap if first_bucket_mb is None else min(cap, _limit_bytes(first_bucket_mb, "first_bucket_mb", 1.0))
    walk = list(range(len(params)))[::-1] if order is None else _check_order(order, len(params))
    lone = None if lone_mb is None else _limit_bytes(lone_mb, "lone_mb", LONE_MB)
    groups = _fill(params, walk, first, cap, lone)
    position = {p: i for i, p in enumerate(walk)}
    end = 0 if lone is None else -1  # with lone buckets: by when a bucket completes (see the module docstring)
    groups.sort(key=lambda members: position[members[end]])
    return _layout(params, groups)


def _fill(
    params: Sequence[ParamInfo], walk: Iterable[int], first: int, cap: int, lone: int | None = None
) -> list[list[int]]:
    """Walk the parameters, filling one open bucket per (dtype, device); close a bucket at its cap."""
    closed: list[list[int]] = []
    open_: dict[tuple[str, str], list[int]] = {}
    size: dict[tuple[str, str], int] = {}
    started: set[tuple[str, str]] = set()  # keys whose first bucket has closed
    for p in walk:
        key = params[p].key
        if lone is not None and params[p].nbytes >= lone:
            closed.append([p])
            started.add(key)
            continue
        open_.setdefault(key, []).append(p)
        size[key] = size.get(key, 0) + params[p].nbytes
        if size[key] >= (cap if key in started else first):
            closed.append(open_.pop(key))
            size[key] = 0
            started.add(key)
    return closed + list(open_.values())


def _layout(params: Sequence[ParamInfo], groups: list[list[int]]) -> BucketPlan:
    buckets = []
    location: list[tuple[int, int]] = [(-1, -1)] * len(params)
    for index, members in enumerate(groups):
        offsets, offset = [], 0
        for p in members:
            offsets.append(offset)
            location[p] = (index, offset)
            offset += params[p].numel
        dtype, device = params[members[0]].key
        nbytes = offset * params[members[0]].itemsize
        buckets.append(Bucket(index, dtype, device, tuple(members), tuple(offsets), offset, nbytes))
    return BucketPlan(tuple(buckets), tuple(location))


def complete_order(ready: Sequence[int], n: int) -> list[int]:
    """A full walk from a partial ready order: ``ready`` first (duplicates dropped), then the rest reversed.

    Parameters that never became ready (unused ones) go last, in reverse registration order.
    """
    seen: dict[int, None] = {}
    for p in ready:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < n:
            raise ValueError(f"complete_order: ready holds {p!r}, not a parameter index in range({n})")
        seen.setdefault(p, None)
    return [*seen, *(p for p in range(n - 1, -1, -1) if p not in seen)]
