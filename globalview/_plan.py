"""The boxing planner: a pure function from (shape, dtype, source layout, target layout)
to the steps that convert one into the other, and the bytes each step moves.

No communication happens here; ``_boxing`` executes a plan. One mesh axis changes
per step. A 1-D conversion is one collective or none:

=============  =====================  =================================
from -> to     step                   communication
=============  =====================  =================================
S(i) -> B      all_gather             every rank receives every piece
P -> B         all_reduce             sum (or max/min for Pmax/Pmin)
P -> S(i)      reduce_scatter         each rank receives its reduced piece
S(i) -> S(j)   all_to_all             each rank swaps pieces with every other
B -> S(i)      slice                  none (keep your piece)
B -> P         zero                   none (one rank keeps the value, the others 0)
any, 1 rank    relabel                none (a single rank's part is the whole)
S(i) -> P      fill                   none (your piece in place, identity elsewhere)
P -> P'        all_reduce             then the B -> P' local step
=============  =====================  =================================

Bytes are what all ranks receive in total, padded sizes included (uneven
splits pad every piece to the largest, run one collective, then trim).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from globalview._layout import block_shape, without
from globalview._placement import placement as Placement
from globalview.sbp import SbpParallel, broadcast, partial_sum

__all__ = ["Plan", "Step", "adjoint", "dual", "plan"]

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "gather", "reduce", "send_recv")


@dataclass(frozen=True)
class Step:
    """One step of a plan: ``kind`` on mesh ``axis`` of ``placement`` (``axis`` is None for whole-placement steps)."""

    kind: str
    placement: Placement
    axis: int | None
    src: tuple[SbpParallel, ...]
    dst: tuple[SbpParallel, ...]
    nbytes: int
    op: str | None = None  # the reduction of all_reduce / reduce_scatter / reduce
    root: int | None = None  # the global rank that sends (broadcast) or receives (gather, reduce)
    ranks: tuple[int, ...] = ()  # broadcast's group; send_recv's receivers, in mesh order
    to: Placement | None = None  # send_recv's and broadcast's target placement

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    def __str__(self) -> str:
        src, dst = _fmt(self.src), _fmt(self.dst)
        if self.kind == "broadcast":
            where = f"from rank {self.root} to ranks {list(self.ranks)}"
        elif self.kind in ("gather", "reduce"):
            where = f"to rank {self.root} over ranks {list(self.placement.flat)}"
        elif self.kind == "send_recv":
            where = f"ranks {list(self.placement.flat)} -> {list(self.ranks)}"
        elif self.axis is None or self.placement.ndim == 1:
            where = f"over ranks {list(self.placement.flat)}"
        else:
            where = f"along mesh axis {self.axis} of {self.placement.ranks.tolist()}"
        op = f"({self.op})" if self.op and self.op != "sum" and self.is_collective else ""
        moves = f"moves {self.nbytes} bytes" if self.is_collective else "local, moves nothing"
        return f"{self.kind}{op} {where}: {src} -> {dst}, {moves}"


@dataclass(frozen=True)
class Plan:
    """The steps that convert a (shape, dtype) tensor from ``src`` to ``dst`` layout."""

    shape: tuple[int, ...]
    dtype: np.dtype
    src: tuple[Placement, tuple[SbpParallel, ...]]
    dst: tuple[Placement, tuple[SbpParallel, ...]]
    steps: tuple[Step, ...] = field(default_factory=tuple)

    @property
    def nbytes(self) -> int:
        """Bytes moved by all steps, summed over ranks."""
        return sum(s.nbytes for s in self.steps)

    @property
    def collectives(self) -> list[str]:
        """The collective steps' kinds, in order."""
        return [s.kind for s in self.steps if s.is_collective]

    def __str__(self) -> str:
        head = (
            f"{_fmt(self.src[1])} on {list(self.src[0].flat)} -> {_fmt(self.dst[1])} on {list(self.dst[0].flat)}, "
            f"shape {self.shape} {self.dtype}: "
        )
        if not self.steps:
            return head + "nothing to do"
        lines = [f"  {i}. {s}" for i, s in enumerate(self.steps, 1)]
        return head + f"{len(self.collectives)} collective(s), {self.nbytes} bytes\n" + "\n".join(lines)


def _fmt(sbp: Sequence[SbpParallel]) -> str:
    return str(sbp[0]) if len(sbp) == 1 else "(" + ", ".join(map(str, sbp)) + ")"


def _dims(s: SbpParallel) -> set[int]:
    return {s.dim} if s.is_split else set()


def kind_1d(a: SbpParallel, b: SbpParallel) -> tuple[str, str | None]:
    """The step that turns layout ``a`` into ``b`` along one mesh axis, and its reduction."""
    if a.is_partial:
        return ("reduce_scatter" if b.is_split else "all_reduce"), a.reduce
    if a.is_split:
        if b.is_broadcast:
            return "all_gather", None
        if b.is_split:
            return "all_to_all", None
        return "fill", None
    return ("slice" if b.is_split else "zero"), None


def _valid(k: int, a: SbpParallel, b: SbpParallel, state: Sequence[SbpParallel]) -> bool:
    """Can axis ``k`` go from ``a`` to ``b`` alone? Not when a later axis cuts a dimension this
    step cuts or joins (the pieces would not be contiguous), nor when a reduction would have to
    cross a later axis's partial value of another kind."""
    touched = _dims(a) | _dims(b)
    for s in state[k + 1 :]:
        if s.is_split and s.dim in touched:
            return False
        if a.is_partial and s.is_partial and s.reduce != a.reduce:
            return False
    return True


def _line_shapes(shape: Sequence[int], pl: Placement, sbp: Sequence[SbpParallel], axis: int) -> list[tuple[int, ...]]:
    """The block each mesh line along ``axis`` shares (one per line)."""
    mesh = pl.hierarchy
    shared = without(sbp, axis)
    shapes = []
    for line in pl.lines(axis):
        coords = pl.coords(line[0])
        shapes.append(block_shape(shape, mesh, shared, coords))
    return shapes


def step_bytes(kind: str, t: Sequence[int], p: int, a: SbpParallel, b: SbpParallel, itemsize: int) -> int:
    """Bytes one mesh line of ``p`` ranks receives in total for a 1-D step on a block of shape ``t``."""
    total = math.prod(t) * itemsize
    if kind == "all_reduce":
        return 2 * (p - 1) * total
    if kind in ("all_gather", "reduce_scatter"):
        d = (a if a.is_split else b).dim
        m = -(-t[d] // p)
        rest = total // t[d] if t[d] else math.prod(t[:d] + tuple(t[d + 1 :])) * itemsize
        return p * (p - 1) * m * rest
    if kind == "all_to_all":
        d, e = a.dim, b.dim
        md, me = -(-t[d] // p), -(-t[e] // p)
        others = math.prod(n for i, n in enumerate(t) if i not in (d, e)) * itemsize
        return p * (p - 1) * md * me * others
    return 0


def _axis_step(shape, dtype, pl, state, k, target) -> Step:
    a = state[k]
    kind, op = kind_1d(a, target)
    new = tuple(target if i == k else s for i, s in enumerate(state))
    p = pl.hierarchy[k]
    nbytes = 0
    if kind in COLLECTIVES and p == 1:
        kind, op = "relabel", None  # one rank on this axis: its part is already the whole
    elif kind in COLLECTIVES:
        nbytes = sum(step_bytes(kind, t, p, a, target, dtype.itemsize) for t in _line_shapes(shape, pl, state, k))
    return Step(kind, pl, k, tuple(state), new, nbytes, op)


def same_placement(shape, dtype, pl: Placement, src, dst) -> list[Step]:
    """Axis-by-axis steps from ``src`` to ``dst`` on one placement.

    Greedy: gathering steps (whose source is not B) from the last axis back, slicing
    steps (source B) from the first axis on, each taken only when valid alone. When
    no valid step remains, every axis goes to B (last axis first), then to ``dst``
    (first axis first): always valid, at most one collective per axis.
    """
    state, steps, n = list(src), [], len(src)
    while tuple(state) != tuple(dst):
        order = [k for k in reversed(range(n)) if not state[k].is_broadcast]
        order += [k for k in range(n) if state[k].is_broadcast]
        for k in order:
            if state[k] != dst[k] and _valid(k, state[k], dst[k], state):
                steps.append(_axis_step(shape, dtype, pl, state, k, dst[k]))
                state[k] = dst[k]
                break
        else:
            for k in reversed(range(n)):
                if not state[k].is_broadcast:
                    steps.append(_axis_step(shape, dtype, pl, state, k, broadcast))
                    state[k] = broadcast
            for k in range(n):
                if state[k] != dst[k]:
                    steps.append(_axis_step(shape, dtype, pl, state, k, dst[k]))
                    state[k] = dst[k]
    return steps


def plan(shape, dtype, src: tuple[Placement, tuple], dst: tuple[Placement, tuple]) -> Plan:
    """The plan that turns ``shape``/``dtype`` from ``src`` = (placement, sbp) into ``dst``."""
    key = (src[0], tuple(src[1])), (dst[0], tuple(dst[1]))
    return _planned(tuple(int(n) for n in shape), np.dtype(dtype), *key)


@functools.lru_cache(maxsize=1 << 14)
def _planned(shape: tuple[int, ...], dtype: np.dtype, src: tuple, dst: tuple) -> Plan:
    """:func:`plan`, once per question: a pure function, which a search asks the same questions many times (the
    operators of equal layers, every candidate layout of a tensor's consumers)."""
    (spl, ssbp), (dpl, dsbp) = src, dst
    if spl == dpl:
        return Plan(shape, dtype, src, dst, tuple(same_placement(shape, dtype, spl, ssbp, dsbp)))
    if spl.hierarchy == dpl.hierarchy and ssbp == dsbp:
        moved = sum(
            math.prod(block_shape(shape, spl.hierarchy, ssbp, spl.coords(s)))
            for s, d in zip(spl.flat, dpl.flat, strict=True)
            if s != d
        )
        step = Step("send_recv", spl, None, ssbp, dsbp, moved * dtype.itemsize, ranks=dpl.flat, to=dpl)
        return Plan(shape, dtype, src, dst, (step,))
    steps: list[Step] = []
    total = math.prod(shape) * dtype.itemsize
    shared = [r for r in spl.flat if r in dpl]
    root = shared[0] if shared else spl.flat[0]
    allb = (broadcast,) * spl.ndim
    s0 = ssbp[0]
    if not shared and spl.ndim == 1 and not s0.is_broadcast and spl.hierarchy[0] > 1:
        # Only the root needs the whole value: gather or reduce to it, not to everyone.
        p = spl.hierarchy[0]
        if s0.is_split:
            m = -(-shape[s0.dim] // p)
            rest = total // shape[s0.dim] if shape[s0.dim] else 0
            steps.append(Step("gather", spl, 0, ssbp, allb, (p - 1) * m * rest, root=root))
        else:
            steps.append(Step("reduce", spl, 0, ssbp, allb, (p - 1) * total, op=s0.reduce, root=root))
        need = [r for r in dpl.flat if r != root]
    else:
        steps += same_placement(shape, dtype, spl, ssbp, allb)
        need = [r for r in dpl.flat if r not in spl]
    if need:
        group = tuple(sorted({root, *need}))
        steps.append(Step("broadcast", spl, None, allb, allb, total * len(need), root=root, ranks=group, to=dpl))
    tail = same_placement(shape, dtype, dpl, (broadcast,) * dpl.ndim, dsbp)
    return Plan(shape, dtype, src, dst, tuple(steps + tail))


def dual(sbp: Sequence[SbpParallel]) -> tuple[SbpParallel, ...]:
    """The layout of a tensor's gradient in the local autograd graph: S(d) -> S(d), B -> P, P -> B.

    OneFlow's rule for the gradient of a local -> global cast, and the layout every local
    operator's backward produces: a rank that used a broadcast value holds only its share of the
    gradient (the shares sum to it), and each rank of a partial sum receives the whole gradient.
    """
    out = []
    for s in sbp:
        if s.is_partial and s.reduce != "sum":
            raise ValueError(f"globalview: a partial_{s.reduce} tensor has no gradient layout (max/min do not sum)")
        out.append(s if s.is_split else partial_sum if s.is_broadcast else broadcast)
    return tuple(out)


def adjoint(p: Plan, via: tuple[SbpParallel, ...] | None = None) -> tuple[Plan, ...]:
    """The backward of boxing plan ``p``: the gradient goes from ``dual(dst)`` back to ``dual(src)``.

    Boxing keeps the logical value, so its adjoint is the boxing of the gradient between the dual
    layouts (all_gather <-> reduce_scatter, all_reduce <-> all_reduce, all_to_all <-> all_to_all,
    slice <-> fill, zero <-> zero, send/recv and broadcast reversed). ``via`` (``to_global``'s
    ``grad_sbp``) routes the gradient through that layout of the destination placement first.
    """
    (spl, ssbp), (dpl, dsbp) = p.src, p.dst
    start = (dpl, dual(dsbp))
    plans = []
    if via is not None and tuple(via) != start[1]:
        plans.append(plan(p.shape, p.dtype, start, (dpl, tuple(via))))
        start = (dpl, tuple(via))
    plans.append(plan(p.shape, p.dtype, start, (spl, dual(ssbp))))
    return tuple(plans)
