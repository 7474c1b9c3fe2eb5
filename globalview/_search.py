"""The exact search behind ``globalview.auto_parallel``: min-sum variable elimination, and a memory budget.

Pure (numpy only). A problem is a set of *variables* (the layout of each parameter and of each operator's
output: an index into its list of layouts) and *factors*. A factor is a list of candidates (an operator's
admissible plans; a parameter's layouts): each candidate fixes the value of the factor's output variable
and costs a constant plus, per input variable, an amount that depends on that input's value (boxing it
to what the candidate needs). Costs are a time (seconds) and a memory (bytes per rank), both additive,
and a transient peak (a gathered weight, per input value) bounded by a cap.

:func:`minimize` finds the assignment of every variable that minimises ``time + lam * memory`` exactly, by
eliminating variables one at a time (bucket elimination; the order only changes the speed). Under a
memory budget, :func:`solve` walks the lower convex hull of (time, memory) with the Lagrange multiplier
``lam`` and closes the remaining gap by branch and bound on the variables: the result is the plan of least
time within the budget, or, when the node limit stops the search first, the best found and its proven gap.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Factor", "Result", "least_memory", "minimize", "solve"]

INF = float("inf")
TIE = 1e-12  # seconds per byte that break ties in time (1 us per MiB)
LEAST = 1e12  # seconds per byte: the multiplier at which minimize gives the least memory (time breaks ties)


@dataclass
class Factor:
    """Candidates over ``inputs`` (variables) that each set variable ``output`` (or none) to ``out[c]``."""

    inputs: tuple[int, ...]
    output: int | None
    out: np.ndarray  # (C,) the output variable's value under each candidate
    time: np.ndarray  # (C,) constant seconds of each candidate
    mem: np.ndarray  # (C,) constant bytes
    in_time: list[np.ndarray] = field(default_factory=list)  # per input: (C, D_input) seconds
    in_mem: list[np.ndarray] = field(default_factory=list)  # per input: (C, D_input) bytes
    in_peak: list[np.ndarray] = field(default_factory=list)  # per input: (C, D_input) transient bytes (<= cap)
    peak: np.ndarray | None = None  # (C,) transient bytes of the candidate itself (<= cap)

    def variables(self) -> tuple[int, ...]:
        return self.inputs + (() if self.output is None else (self.output,))

    def value(self, lam: float, cap: float, allowed: np.ndarray | None = None) -> np.ndarray:
        """(C, D_in0, D_in1, ...): each candidate's time + lam * memory for every value of the inputs
        (INF for a candidate whose transient peak exceeds ``cap``, or not ``allowed``)."""
        const = self.time + lam * self.mem
        if self.peak is not None:
            const = np.where(self.peak > cap, INF, const)
        if allowed is not None:
            const = np.where(allowed, const, INF)
        total = const.reshape((-1,) + (1,) * len(self.inputs))
        peaks = self.in_peak or [None] * len(self.inputs)
        for i, (t, m, pk) in enumerate(zip(self.in_time, self.in_mem, peaks, strict=True)):
            shape = [t.shape[0]] + [1] * len(self.inputs)
            shape[1 + i] = t.shape[1]
            cost = t + lam * m if pk is None else np.where(pk > cap, INF, t + lam * m)
            total = total + cost.reshape(shape)
        return total

    def table(self, lam: float, cap: float, domain: int, allowed: np.ndarray | None = None) -> np.ndarray:
        """The dense table over (inputs..., output): the least candidate value for each combination."""
        vals = self.value(lam, cap, allowed)
        if self.output is None:
            return vals.min(axis=0)
        out = np.full((domain, *vals.shape[1:]), INF)
        np.minimum.at(out, self.out, vals)
        return np.moveaxis(out, 0, -1)


@dataclass
class Result:
    """An assignment of every variable, each factor's candidate, and their total time and memory."""

    values: list[int]
    choices: list[int]
    time: float
    mem: float
    gap: float = 0.0  # seconds the true optimum may lie below ``time`` (0: proven optimal)
    nodes: int = 1  # branch-and-bound nodes searched


def _order(domains: Sequence[int], scopes: list[tuple[int, ...]]) -> list[int]:
    """A greedy elimination order: each time, the variable whose combined table is smallest (its neighbours'
    domains times its own); eliminating it joins its neighbours."""
    near: list[set[int]] = [set() for _ in domains]
    for scope in scopes:
        for v in scope:
            near[v].update(u for u in scope if u != v)
    cost = [math.prod(domains[u] for u in near[v]) * domains[v] for v in range(len(domains))]
    todo, order = set(range(len(domains))), []
    while todo:
        best = min(todo, key=lambda v: (cost[v], v))
        order.append(best)
        todo.discard(best)
        others = near[best]
        for u in others:
            near[u].discard(best)
            near[u].update(w for w in others if w != u)
            cost[u] = math.prod(domains[w] for w in near[u]) * domains[u]
    return order


def _align(arr: np.ndarray, vars_: Sequence[int], scope: Sequence[int]) -> np.ndarray:
    """``arr`` over ``vars_`` as an array broadcastable over ``scope``."""
    perm = sorted(range(len(vars_)), key=lambda i: scope.index(vars_[i]))
    arr = np.transpose(arr, perm)
    shape = [1] * len(scope)
    for i in perm:
        shape[scope.index(vars_[i])] = arr.shape[perm.index(i)]
    return arr.reshape(shape)


def minimize(
    domains: Sequence[int],
    factors: Sequence[Factor],
    lam: float = 0.0,
    cap: float = INF,
    masks: dict[tuple[str, int], np.ndarray] | None = None,
    order: list[int] | None = None,
) -> Result:
    """The assignment minimising ``time + lam * memory`` over the factors (exact); ``masks`` allow some values
    of a variable (``("v", index)``) or some candidates of a factor (``("f", index)``)."""
    masks = masks or {}
    tables = [
        (f.variables(), f.table(lam, cap, domains[f.output] if f.output is not None else 0, masks.get(("f", i))))
        for i, f in enumerate(factors)
    ]
    for (kind, v), allowed in masks.items():
        if kind == "v":
            tables.append(((v,), np.where(allowed, 0.0, INF)))
    order = order or _order(domains, [f.variables() for f in factors])
    kept = []
    for v in order:
        mine = [t for t in tables if v in t[0]]
        tables = [t for t in tables if v not in t[0]]
        scope = sorted({u for vs, _ in mine for u in vs} | {v})
        combined = np.zeros([domains[u] for u in scope])
        for vs, arr in mine:
            combined = combined + _align(arr, vs, scope)
        kept.append((v, scope, combined))
        rest = [u for u in scope if u != v]
        tables.append((tuple(rest), combined.min(axis=scope.index(v))))
    values = [0] * len(domains)
    for v, scope, combined in reversed(kept):
        index = tuple(slice(None) if u == v else values[u] for u in scope)
        values[v] = int(np.argmin(combined[index]))
    return _evaluate(factors, values, lam, cap, masks)


def _evaluate(factors, values, lam, cap, masks) -> Result:
    """Each factor's best candidate under ``values``, and the exact time and memory of them all."""
    choices, time, mem = [], 0.0, 0.0
    for i, f in enumerate(factors):
        vals = f.value(lam, cap, masks.get(("f", i)))[(slice(None), *(values[v] for v in f.inputs))]
        if f.output is not None:
            vals = np.where(f.out == values[f.output], vals, INF)
        c = int(np.argmin(vals))
        choices.append(c)
        if not math.isfinite(float(vals[c])):  # no admissible candidate (a cap, a mask): infeasible
            time = INF
        time += float(f.time[c]) + sum(float(t[c, values[v]]) for t, v in zip(f.in_time, f.inputs, strict=True))
        mem += float(f.mem[c]) + sum(float(m[c, values[v]]) for m, v in zip(f.in_mem, f.inputs, strict=True))
    if not math.isfinite(time):
        time = INF
    return Result(values, choices, time, mem)


def solve(
    domains: Sequence[int],
    factors: Sequence[Factor],
    budget: float | None = None,
    caps: Sequence[float] = (INF,),
    max_nodes: int = 200,
    max_seconds: float = INF,
) -> Result | None:
    """The least-time assignment with memory + cap <= ``budget`` over the transient ``caps`` (None: infeasible).

    Best-first branch and bound over (cap, masks) nodes, each bounded by its Lagrangian dual: the first node
    whose bound is no better than the best plan found ends the search (the optimum); ``max_nodes`` hull walks
    (and ``max_seconds``) at most, after which the best found comes with its proven gap."""
    deadline = time.perf_counter() + max_seconds
    order = _order(domains, [f.variables() for f in factors])
    if budget is None:  # ties in time go to the plan with less memory (1 us per MiB: below any real difference)
        return minimize(domains, factors, TIE, order=order)
    best: Result | None = None
    queue: list[tuple[float, int, float, dict]] = []  # (lower bound, tie, cap, masks)
    floor = max((_least_peak(f) for f in factors), default=0.0)  # every factor holds some transient
    for cap in sorted(c for c in caps if floor <= c and (c <= budget or math.isinf(c))):
        fastest = minimize(domains, factors, 0.0, cap, None, order)  # a bound for this cap, whatever the memory
        if not math.isfinite(fastest.time) or (best is not None and fastest.time >= best.time):
            continue
        room = budget - (0.0 if math.isinf(cap) else cap)
        if fastest.mem <= room:  # the fastest with this cap fits: nothing better under it
            best = fastest
            continue
        # The least memory under this cap: a plan that fits, if any does with this cap. The search below only
        # improves on it, so that a node limit reached before a hull walk found a plan is not taken for "none fits".
        small = minimize(domains, factors, LEAST, cap, None, order)
        if math.isfinite(small.time) and small.mem <= room and (best is None or small.time < best.time):
            best = small
        heapq.heappush(queue, (fastest.time, len(queue), cap, {}))
    nodes = 0
    while queue and nodes < max_nodes and (best is None or time.perf_counter() < deadline):
        bound, _, cap, masks = heapq.heappop(queue)
        if best is not None and bound >= best.time * (1 - 1e-9):
            queue.clear()  # best first: every other node is bounded no better
            break
        nodes += 1
        room = budget - (0.0 if math.isinf(cap) else cap)
        best = _expand(domains, factors, room, cap, order, masks, best, queue)
    if best is not None:
        best.nodes = nodes
        best.gap = max(0.0, best.time - min(b for b, *_ in queue)) if queue else 0.0
    return best


def least_memory(domains: Sequence[int], factors: Sequence[Factor], caps: Sequence[float]) -> float:
    """The least memory any assignment needs: its memory and the transient cap it runs under, together."""
    order = _order(domains, [f.variables() for f in factors])
    least = INF
    for cap in caps:
        small = minimize(domains, factors, LEAST, cap, None, order)
        if math.isfinite(small.time):
            least = min(least, small.mem + (0.0 if math.isinf(cap) else cap))
    return least


def _expand(domains, factors, room, cap, order, masks, best, queue) -> Result | None:
    """One node: its hull walk; a better plan found replaces ``best``; children go on the queue."""
    found, bound, low = _hull(domains, factors, room, cap, order, masks)
    if found is None:
        return best
    if best is None or found.time < best.time:
        best = found
    if low is None or bound >= best.time * (1 - 1e-9):
        return best
    key = _differing(domains, factors, low, found)
    if key is None:
        return best
    size = domains[key[1]] if key[0] == "v" else len(factors[key[1]].out)
    value = low.values[key[1]] if key[0] == "v" else low.choices[key[1]]
    keep = masks.get(key, np.ones(size, bool))
    one, rest = np.zeros_like(keep), keep.copy()
    one[value] = True
    rest[value] = False
    for child in ({**masks, key: rest}, {**masks, key: one & keep}):
        heapq.heappush(queue, (bound, id(child), cap, child))
    return best


def _least_peak(f: Factor) -> float:
    """The least transient any candidate of ``f`` holds, whatever its inputs' values."""
    peak = np.zeros(len(f.out)) if f.peak is None else f.peak.astype(float)
    for p in f.in_peak:
        peak = np.maximum(peak, p.min(axis=1))
    return float(peak.min()) if peak.size else 0.0


def _hull(domains, factors, room, cap, order, masks) -> tuple[Result | None, float, Result | None]:
    """Walk the lower hull with the multiplier: (the best feasible found, the Lagrangian bound, the infeasible end)."""
    fast = minimize(domains, factors, 0.0, cap, masks, order)
    if not math.isfinite(fast.time):
        return None, INF, None
    if fast.mem <= room:
        return fast, fast.time, None
    small = minimize(domains, factors, LEAST, cap, masks, order)  # the least memory (time breaks ties)
    if not math.isfinite(small.time) or small.mem > room:
        return None, INF, None
    lo, hi = fast, small
    for _ in range(60):
        lam = (hi.time - lo.time) / (lo.mem - hi.mem)
        mid = minimize(domains, factors, lam, cap, masks, order)
        line = lo.time + lam * lo.mem
        if mid.time + lam * mid.mem >= line * (1 - 1e-12) - 1e-15:
            break  # nothing below the segment: lo and hi are neighbours on the hull
        if mid.mem <= room:
            hi = mid
        else:
            lo = mid
    lam = (hi.time - lo.time) / (lo.mem - hi.mem)
    return hi, lo.time + lam * (lo.mem - room), lo


def _differing(domains: Sequence[int], factors: Sequence[Factor], a: Result, b: Result) -> tuple[str, int] | None:
    """What to branch on: a variable whose value differs between the hull's ends (the largest domain),
    else a factor whose candidate does (two candidates can set the same values)."""
    diff = [u for u in range(len(domains)) if a.values[u] != b.values[u]]
    if diff:
        return ("v", max(diff, key=lambda u: domains[u]))
    cands = [i for i in range(len(factors)) if a.choices[i] != b.choices[i]]
    return ("f", cands[0]) if cands else None
