"""SBP signatures: which input layouts an operator accepts and the output layout each gives.

Pure: given logical shapes and layouts, no communication. A rule maps one mesh
axis's input sbp values to candidate (required input sbp, output sbp) pairs; an
nd placement takes one candidate per axis. ``_cost`` prices the candidates and chooses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from globalview.sbp import SbpParallel, broadcast, partial_max, partial_min, partial_sum, split

__all__ = [
    "Rule",
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


@dataclass(frozen=True)
class Rule:
    """An operator's signatures: ``rule(current, p)`` lists the candidates of one mesh axis of ``p`` ranks
    whose inputs are laid out ``current``. ``key`` names the rule and its parameters (rules with equal keys
    give equal candidates), so a choice can be cached."""

    key: tuple
    fn: Callable[[tuple[SbpParallel, ...], int], list[Candidate]] = field(compare=False, repr=False)

    def __call__(self, current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        return self.fn(current, p)


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

    return Rule(("elementwise", tuple(shapes), out_shape, partial), rule)


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

    return Rule(("matmul", nd), rule)


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

    return Rule(("reduction", ndim, tuple(axes), keepdims, reduce, partial), rule)


def structural(key: tuple, ndim: int, dim_map: Callable[[int, int], int | None], partial_ok: bool = True) -> Rule:
    """Transpose, reshape, indexing: S(d) -> S(dim_map(d, p)) where the map is defined, B -> B, P -> P.
    ``key`` names the map (the operator and its arguments)."""

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [((B,), B)]
        for d in range(ndim):
            o = dim_map(d, p)
            if o is not None:
                cands.append(((split(d),), split(o)))
        if partial_ok:
            cands += [((s,), s) for s in PARTIAL.values()]
        return _prefer_current(current, cands)

    return Rule(("structural", ndim, partial_ok, *key), rule)


def linear(nd: int) -> Rule:
    """``x @ w.T`` with ``x`` (..., K) of ``nd`` dimensions and ``w`` (N, K) (torch's linear): batch
    split x B -> split; B x S(0) (column parallel) -> S(last); S(last) x S(1) (row parallel) -> P."""
    last = nd - 1

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [((B, B), B), ((B, split(0)), split(last)), ((split(last), split(1)), P)]
        cands += [((split(d), B), split(d)) for d in range(last)]
        cands += [((P, B), P), ((B, P), P)]
        return _prefer_current(current, cands)

    return Rule(("linear", nd), rule)


def rowwise(ndim: int, whole: Sequence[int], n_params: int = 0) -> Rule:
    """Ops that need ``whole`` dimensions intact (softmax, layer norm): split elsewhere or broadcast;
    ``n_params`` further inputs (layer norm's weight and bias) must be broadcast."""

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        rest = (B,) * n_params
        cands: list[Candidate] = [((B, *rest), B)]
        cands += [((split(d), *rest), split(d)) for d in range(ndim) if d not in whole]
        return _prefer_current(current, cands)

    return Rule(("rowwise", ndim, tuple(whole), n_params), rule)


def embedding(ids_ndim: int) -> Rule:
    """``weight[ids]``: split ids x B -> split; B x S(1) (features split) -> S(last)."""

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [((B, B), B), ((B, split(1)), split(ids_ndim))]
        cands += [((split(d), B), split(d)) for d in range(ids_ndim)]
        return _prefer_current(current, cands)

    return Rule(("embedding", ids_ndim), rule)


def pick(target_ndim: int) -> Rule:
    """``values[..., target]`` along the last dimension: batch dims split alike, or broadcast."""

    def rule(current: tuple[SbpParallel, ...], p: int) -> list[Candidate]:
        cands: list[Candidate] = [((B, B), B)]
        cands += [((split(d), split(d)), split(d)) for d in range(target_ndim)]
        return _prefer_current(current, cands)

    return Rule(("pick", target_ndim), rule)
