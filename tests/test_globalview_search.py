"""The automatic planner's pure parts: the exact search against brute force (with and without a memory budget),
FSDP2's prefetch order and reduce_scatter buckets, and a plan's JSON form. No processes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from globalview._search import Factor, least_memory, minimize, solve


def _problem(rng: np.random.Generator, n: int, d: int, cands: int = 4) -> tuple[list[int], list[Factor]]:
    """A random problem: variable v is set by a factor over up to two earlier variables (a DAG, as a forward)."""
    factors = []
    for v in range(n):
        ins = tuple(int(u) for u in rng.choice(v, size=min(v, 2), replace=False)) if v else ()
        out = rng.integers(0, d, cands)
        out[0] = v % d  # every value of v reachable by some candidate in most problems
        factors.append(
            Factor(
                ins,
                v,
                out,
                rng.random(cands),
                rng.random(cands) * 10,
                [rng.random((cands, d)) for _ in ins],
                [rng.random((cands, d)) * 5 for _ in ins],
            )
        )
    factors.append(Factor((0, n - 1), None, np.zeros(2, int), rng.random(2), rng.random(2), *_pair(rng, 2, d)))
    return [d] * n, factors


def _pair(rng: np.random.Generator, c: int, d: int) -> tuple[list, list]:
    return [rng.random((c, d)), rng.random((c, d))], [rng.random((c, d)), rng.random((c, d))]


def _brute(domains: list[int], factors: list[Factor], budget: float | None) -> float | None:
    """The least time over every assignment and every choice of candidates (memory within ``budget``)."""
    best = None
    for values in itertools.product(*[range(d) for d in domains]):
        options = []
        for f in factors:
            ok = [c for c in range(len(f.out)) if f.output is None or f.out[c] == values[f.output]]
            if not ok:
                break
            options.append([(_cost(f, c, values, f.in_time, f.time), _cost(f, c, values, f.in_mem, f.mem)) for c in ok])
        else:
            for combo in itertools.product(*options):
                t, m = sum(a for a, _ in combo), sum(b for _, b in combo)
                if (budget is None or m <= budget) and (best is None or t < best):
                    best = t
    return best


def _cost(f: Factor, c: int, values: tuple, per_input: list, const: np.ndarray) -> float:
    return float(const[c]) + sum(float(a[c, values[v]]) for a, v in zip(per_input, f.inputs, strict=True))


@pytest.mark.parametrize("seed", range(12))
def test_minimize_is_exact(seed: int) -> None:
    domains, factors = _problem(np.random.default_rng(seed), 6, 3)
    assert minimize(domains, factors).time == pytest.approx(_brute(domains, factors, None), rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_solve_under_a_budget_is_exact(seed: int) -> None:
    """Between the least memory and the fastest plan's, the budget binds: branch and bound finds the optimum."""
    domains, factors = _problem(np.random.default_rng(100 + seed), 5, 2)
    low, high = minimize(domains, factors, lam=1e9).mem, minimize(domains, factors).mem
    budget = (low + high) / 2
    found = solve(domains, factors, budget, max_nodes=1000)
    want = _brute(domains, factors, budget)
    assert found is not None and want is not None
    assert found.mem <= budget and found.gap == 0.0
    assert found.time == pytest.approx(want, rel=1e-12)


def test_solve_reports_an_infeasible_budget() -> None:
    domains, factors = _problem(np.random.default_rng(7), 4, 2)
    least = minimize(domains, factors, lam=1e9).mem
    assert solve(domains, factors, least * 0.5) is None
    assert solve(domains, factors, least * 1.0001) is not None


@pytest.mark.parametrize("seed", range(6))
def test_a_node_limit_still_gives_a_plan_that_fits(seed: int) -> None:
    """The search stops at its node limit before any hull walk: a budget some plan fits still gets one (the least
    memory's, at worst), never "no plan fits"."""
    domains, factors = _problem(np.random.default_rng(200 + seed), 5, 2)
    low, high = minimize(domains, factors, lam=1e9).mem, minimize(domains, factors).mem
    budget = (low + high) / 2
    found = solve(domains, factors, budget, max_nodes=0)
    assert found is not None and found.mem <= budget
    assert found.time >= _brute(domains, factors, budget) * (1 - 1e-12)


def test_least_memory_counts_the_transient_it_runs_under() -> None:
    f = Factor((), 0, np.array([0, 1]), np.array([1.0, 2.0]), np.array([10.0, 30.0]), peak=np.array([50.0, 0.0]))
    assert least_memory([2], [f], [0.0, 50.0]) == 30.0  # 30 + 0 beats 10 + 50
    g = Factor((), 0, np.array([0, 1]), np.array([1.0, 2.0]), np.array([10.0, 80.0]), peak=np.array([50.0, 0.0]))
    assert least_memory([2], [g], [0.0, 50.0]) == 60.0
    assert solve([2], [g], budget=59.0, caps=[0.0, 50.0]) is None
    assert solve([2], [g], budget=60.0, caps=[0.0, 50.0]).values == [0]


def test_transient_caps_exclude_what_does_not_fit() -> None:
    """A candidate whose transient peak exceeds the cap is not taken; the cap counts against the budget."""
    f = Factor((), 0, np.array([0, 1]), np.array([1.0, 2.0]), np.array([10.0, 10.0]), peak=np.array([50.0, 0.0]))
    assert solve([2], [f], budget=None).values == [0]  # no budget: the fast one
    assert solve([2], [f], budget=40.0, caps=[0.0, 50.0]).values == [1]  # 10 + 50 > 40: the slow one fits
    assert solve([2], [f], budget=70.0, caps=[0.0, 50.0]).values == [0]
    both = Factor((), 0, np.array([0, 1]), np.array([1.0, 2.0]), np.array([1.0, 1.0]), peak=np.array([50.0, 60.0]))
    assert solve([2], [both], budget=1000.0, caps=[0.0]) is None  # every candidate over the only cap
    assert solve([2], [both], budget=1000.0, caps=[0.0, 50.0]).values == [0]


class _FakeFlight:
    def __init__(self, key: str, log: list[str]) -> None:
        self.key, self.work = key, None
        log.append(key)


def test_prefetch_follows_the_recorded_order() -> None:
    """The first pass records; the next starts the next gather when one is taken; another order re-records."""
    from globalview._weights import _Order

    started: list[str] = []
    order = _Order(lambda k: _FakeFlight(k, started))
    order.begin()
    assert [order.take(k).key for k in "abc"] == list("abc") and started == list("abc")  # recorded, on demand
    started.clear()
    order.begin()
    order.take("a")
    assert started == ["a", "b"]  # a (not prefetched: the first), and b prefetched
    order.take("b")
    assert started == ["a", "b", "c"]  # b was ready; c prefetched
    order.take("c")
    assert started == ["a", "b", "c"]
    started.clear()
    order.begin()
    order.take("a")
    order.take("x")  # another order: b's prefetch is drained, x served on demand and recorded
    assert started == ["a", "b", "x"] and order.order == ["a", "x"] and not order.pending


def test_bucket_plan() -> None:
    """Consecutive gradients share a bucket up to the cap; a large even one is alone; a repeat is not bucketed."""
    from types import SimpleNamespace

    from globalview import _weights

    def line(rows: int, rest: int) -> SimpleNamespace:
        return SimpleNamespace(sizes=(rows, rows), rest=(rest,), ranks=(0, 1), width=rows * rest)

    param = SimpleNamespace(dtype="f", element_size=lambda: 4)
    owner = SimpleNamespace(
        lines={(0, 0): line(8, 8), (1, 0): line(8, 8), (2, 0): line(1024, 1024), (3, 0): line(4, 4)},
        leaves=[SimpleNamespace(param=param)] * 4,
        sums={},
    )
    order = [(0, 0), (1, 0), (2, 0), (3, 0), (1, 0)]
    assert _weights._plan_buckets(order, owner) == [[(0, 0), (1, 0)], [(2, 0)], [(3, 0)]]


def test_plan_json_round_trip() -> None:
    import globalview as gv
    from globalview._autoplan import AutoPlan, parse_sbp

    S = gv.sbp
    assert [parse_sbp(str(s)) for s in (S.split(3), S.broadcast, S.partial_sum, S.partial_max)] == [
        S.split(3),
        S.broadcast,
        S.partial_sum,
        S.partial_max,
    ]
    with pytest.raises(ValueError, match="unknown sbp 'Q'"):
        parse_sbp("Q")
    pl = gv.placement("cpu", [[0, 1], [2, 3]])
    plan = AutoPlan(
        pl,
        {"w": (S.broadcast, S.split(0))},
        [("linear", ((S.split(0), S.broadcast), (S.broadcast, S.split(0))), (S.split(0), S.split(1)))],
        1.5,
        2.0,
        {"data parallel": {"layouts": {"w": (S.broadcast, S.broadcast)}, "time": 2.0, "memory": 3.0}},
        "report",
        {"nodes": 1},
    )
    again = AutoPlan.from_json(plan.to_json())
    assert again == plan
