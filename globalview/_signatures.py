"""SBP signatures: which input layouts an operator accepts and the output layout each gives,
and the choice among them by cost (OneFlow's model: the bytes the inputs' boxing moves).

Pure: given logical shapes and layouts, no communication. A rule maps one mesh
axis's input sbp values to candidate (required input sbp, output sbp) pairs; an
nd placement takes one candidate per axis.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from globalview._placement import placement as Placement
from globalview._plan import Plan, plan
from globalview.sbp import SbpParallel, broadcast, partial_max, partial_min, partial_sum, split

__all__ = [
    "Choice",
    "choose",
    "elementwise",
    "embedding",
    "linear",
    "matmul",
    "pick",
    "reduction",
    "rowwise",
    "structural",
]

B, P = broadcast, partial_sum
PARTIAL = {"sum": partial_sum, "max": partial_max, "min": partial_min}
Candidate = tuple[tuple[SbpParallel, ...], SbpParallel]  # (required sbp of each tensor input, output sbp)
Rule = Callable[[tuple[SbpParallel, ...], int], list[Candidate]]  # (this axis's input sbp, its size)


@dataclass(frozen=True)
class Choice:
    """The signature an operator runs with, the boxing each input needs, and what the others cost."""

    op: str
    inputs: tuple[tuple[SbpParallel, ...], ...]  # required nd sbp of each tensor input
    output: tuple[SbpParallel, ...]
    boxing: tuple[Plan, ...]  # one per tensor input (empty plan: no change)
    cost: int
    considered: tuple[tuple[tuple[tuple[SbpParallel, ...], ...], tuple[SbpParallel, ...], int], ...]

    def __str__(self) -> str:
        def f(sbp: Sequence[SbpParallel]) -> str:
            return str(sbp[0]) if len(sbp) == 1 else "(" + ", ".join(map(str, sbp)) + ")"

        head = f"{self.op}: signature {' x '.join(f(s) for s in self.inputs)} -> {f(self.output)}"
        lines = [head + (f", boxing moves {self.cost} bytes" if self.cost else ", no communication")]
        for i, p in enumerate(self.boxing):
            if p.steps:
                lines.append(f"  input {i}: {p}".replace("\n", "\n  "))
        alts = sorted(self.considered, key=lambda c: c[2])[:6]
        lines.append(
            "  candidates by cost: "
            + "; ".join(f"{' x '.join(f(s) for s in ins)} -> {f(out)}: {cost} B" for ins, out, cost in alts)
        )
        return "\n".join(lines)


def choose(op: str, shapes, dtypes, pl: Placement, sbps, rule: Rule) -> Choice:
    """The cheapest signature for tensor inputs of ``shapes``/``dtypes`` laid out as ``sbps``."""
    per_axis = [rule(tuple(s[a] for s in sbps), pl.hierarchy[a]) for a in range(pl.ndim)]
    best, considered, plans_cache = None, [], {}
    for combo in itertools.product(*per_axis):
        required = tuple(tuple(c[0][i] for c in combo) for i in range(len(sbps)))
        if _splits_into_partial(sbps, required):
            continue
        out = tuple(c[1] for c in combo)
        plans = []
        for i, req in enumerate(required):
            key = (i, req)
            if key not in plans_cache:
                plans_cache[key] = plan(shapes[i], dtypes[i], (pl, sbps[i]), (pl, req))
            plans.append(plans_cache[key])
        cost = sum(p.nbytes for p in plans)
        considered.append((required, out, cost))
        if best is None or cost < best[2]:
            best = (required, out, cost, tuple(plans))
    required, out, cost, plans = best
    return Choice(op, required, out, plans, cost, tuple(considered))


def _splits_into_partial(current, required) -> bool:
    """Boxing a split input into a partial one is never worth it: the local part grows to the
    whole block (mostly identity values) and the output is left partial, to be reduced later."""
    return any(
        s.is_split and r.is_partial
        for cur, req in zip(current, required, strict=True)
        for s, r in zip(cur, req, strict=True)
    )


def _dedupe(cands: list[Candidate]) -> list[Candidate]:
    seen, out = set(), []
    for c in cands:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def elementwise(shapes: Sequence[tuple[int, ...]], out_shape: tuple[int, ...], partial: str) -> Rule:
    """Elementwise ops with numpy broadcasting.

    B everywhere -> B; S(o) of the output needs each input split on the dimension
    that lines up with ``o`` (or B where that input broadcasts along it); partial:
    ``"all"`` (add, sub: every input P), ``"one"`` (mul: one input P, the others B),
    ``"first"`` (div: the numerator P), ``"none"``.
    """
    n, out_nd = len(shapes), len(out_shape)

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [((B,) * n, B)]
        for o in range(out_nd):
            req = []
            for shape in shapes:
                m = o - (out_nd - len(shape))
                req.append(split(m) if m >= 0 and shape[m] == out_shape[o] else B)
            if any(s.is_split for s in req):
                cands.append((tuple(req), split(o)))
        if partial == "all":
            cands.append(((P,) * n, P))
        elif partial == "one":
            cands += [(tuple(P if i == j else B for i in range(n)), P) for j in range(n)]
        elif partial == "first":
            cands.append(((P,) + (B,) * (n - 1), P))
        return _prefer_current(current, cands)

    return rule


def _prefer_current(current: tuple[SbpParallel, ...], cands: list[Candidate]) -> list[Candidate]:
    """Candidates that need no boxing first (ties in cost go to them)."""
    cands = _dedupe(cands)
    return [c for c in cands if c[0] == current] + [c for c in cands if c[0] != current]


def matmul(nd: int) -> Rule:
    """``a @ b`` with ``a`` (..., M, K) and ``b`` (..., K, N), both ``nd``-dimensional."""
    m, k = nd - 2, nd - 1

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [
            ((B, B), B),
            ((split(m), B), split(m)),
            ((B, split(k)), split(k)),
            ((split(k), split(m)), P),
            ((P, B), P),
            ((B, P), P),
        ]
        cands += [((split(d), split(d)), split(d)) for d in range(nd - 2)]
        return _prefer_current(current, cands)

    return rule


def reduction(ndim: int, axes: Sequence[int], keepdims: bool, reduce: str, partial: bool = True) -> Rule:
    """sum/mean (``reduce`` "sum"), max, min over ``axes``: a split reduced away becomes partial
    (without ``partial``, a reduced dimension must be whole: no split of it, no partial input)."""
    kept = [d for d in range(ndim) if d not in axes]

    def out_dim(d: int) -> int:
        return d if keepdims else kept.index(d)

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [((B,), B)]
        for d in range(ndim):
            if d not in axes:
                cands.append(((split(d),), split(out_dim(d))))
            elif partial:
                cands.append(((split(d),), PARTIAL[reduce]))
        if partial:
            cands.append(((PARTIAL[reduce],), PARTIAL[reduce]))
        return _prefer_current(current, cands)

    return rule


def structural(ndim: int, dim_map: Callable[[int, int], int | None], partial_ok: bool = True) -> Rule:
    """Transpose, reshape, indexing: S(d) -> S(dim_map(d, p)) where the map is defined, B -> B, P -> P."""

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [((B,), B)]
        for d in range(ndim):
            o = dim_map(d, p)
            if o is not None:
                cands.append(((split(d),), split(o)))
        if partial_ok:
            cands += [((s,), s) for s in PARTIAL.values()]
        return _prefer_current(current, cands)

    return rule


def linear(nd: int) -> Rule:
    """``x @ w.T`` with ``x`` (..., K) of ``nd`` dimensions and ``w`` (N, K) (torch's linear): batch
    split x B -> split; B x S(0) (column parallel) -> S(last); S(last) x S(1) (row parallel) -> P."""
    last = nd - 1

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [((B, B), B), ((B, split(0)), split(last)), ((split(last), split(1)), P)]
        cands += [((split(d), B), split(d)) for d in range(last)]
        cands += [((P, B), P), ((B, P), P)]
        return _prefer_current(current, cands)

    return rule


def rowwise(ndim: int, whole: Sequence[int], n_params: int = 0) -> Rule:
    """Ops that need ``whole`` dimensions intact (softmax, layer norm): split elsewhere or broadcast;
    ``n_params`` further inputs (layer norm's weight and bias) must be broadcast."""

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        rest = (B,) * n_params
        cands: list[Candidate] = [((B, *rest), B)]
        cands += [((split(d), *rest), split(d)) for d in range(ndim) if d not in whole]
        return _prefer_current(current, cands)

    return rule


def embedding(ids_ndim: int) -> Rule:
    """``weight[ids]``: split ids x B -> split; B x S(1) (features split) -> S(last)."""

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [((B, B), B), ((B, split(1)), split(ids_ndim))]
        cands += [((split(d), B), split(d)) for d in range(ids_ndim)]
        return _prefer_current(current, cands)

    return rule


def pick(target_ndim: int) -> Rule:
    """``values[..., target]`` along the last dimension: batch dims split alike, or broadcast."""

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [((B, B), B)]
        cands += [((split(d), split(d)), split(d)) for d in range(target_ndim)]
        return _prefer_current(current, cands)

    return rule
