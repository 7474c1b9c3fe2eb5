"""globalview on real ranks: every 1-D conversion at world sizes 1-4 (even and uneven shapes)
against the numpy truth, with the exact collectives each one ran; operators' sbp inference;
random tensors independent of layout; placement changes and 2-D meshes; both backends."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from reference import BACKENDS

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

B, S0, S1, P = "B", "S(0)", "S(1)", "P"
# The collectives each 1-D conversion runs (on more than one rank): one, or none.
EXPECT = {
    (B, B): [],
    (B, S0): [],
    (B, S1): [],
    (B, P): [],
    (S0, B): ["all_gather"],
    (S0, S0): [],
    (S0, S1): ["all_to_all"],
    (S0, P): [],
    (S1, B): ["all_gather"],
    (S1, S0): ["all_to_all"],
    (S1, S1): [],
    (S1, P): [],
    (P, B): ["all_reduce"],
    (P, S0): ["reduce_scatter"],
    (P, S1): ["reduce_scatter"],
    (P, P): [],
}


def _sbp(gv, name):
    return {B: gv.sbp.broadcast, S0: gv.sbp.split(0), S1: gv.sbp.split(1), P: gv.sbp.partial_sum}[name]


def _device(commlib):
    return "cuda" if commlib.get_backend() == "nccl" else "cpu"


def _make(gv, commlib, truth, pl, name, p):
    """A global tensor of value ``truth`` laid out as ``name``; partial values are genuine sums of
    different parts (not one rank's value and zeros)."""
    if name != P:
        return gv.tensor(truth, placement=pl, sbp=_sbp(gv, name))
    me = commlib.get_rank()
    rng = np.random.default_rng(7)
    parts = [rng.integers(-50, 50, truth.shape).astype(truth.dtype) for _ in range(p - 1)]
    parts.append(truth - sum(parts, np.zeros_like(truth)))
    return gv.to_global(parts[list(pl.flat).index(me)], pl, gv.sbp.partial_sum)


def _expected_local(truth, name, p, c):
    from globalview._layout import split_range

    if name in (B,):
        return truth
    d = 0 if name == S0 else 1
    lo, hi = split_range(truth.shape[d], p, c)
    return truth[lo:hi] if d == 0 else truth[:, lo:hi]


# The scenarios conversions_job runs, by name: every pair on an even and an uneven shape, and partial max/min.
PAIRS = list(itertools.product([B, S0, S1, P], repeat=2))
CONVERSIONS = [f"{a}->{b} {kind}" for kind in ("even", "uneven") for a, b in PAIRS]
CONVERSIONS += [f"P{reduce}->{target}" for reduce in ("max", "min") for target in (B, S0)]
# 3-D: pieces along a middle or the last dimension (moved as runs of whole pieces), a collective each.
THREE_D = [("S(1)", "B"), ("S(2)", "B"), ("P", "S(1)"), ("P", "S(2)"), ("S(0)", "S(2)"), ("S(2)", "S(0)")]
THREE_D += [("S(1)", "S(2)"), ("S(2)", "S(1)")]
CONVERSIONS += [f"3-D {a}->{b} {kind}" for kind in ("even", "uneven") for a, b in THREE_D]


def _outcome(fn) -> str:
    """Run one scenario's checks: "ok", or what failed (the collectives before a failed check all ran)."""
    try:
        fn()
        return "ok"
    except AssertionError as e:
        return f"failed: {e}"


def conversions_job() -> dict[str, str]:
    """Every pair of (B, S(0), S(1), P), on shapes that divide and do not: scenario name -> outcome."""
    import commlib
    import globalview as gv

    p, me = commlib.get_world_size(), commlib.get_rank()
    pl = gv.placement(_device(commlib), list(range(p)))
    out = {}
    for kind, shape in (("even", (4 * p, 6)), ("uneven", (4 * p + 1, 2 * p + 3))):
        truth = np.arange(np.prod(shape), dtype=np.int64).reshape(shape) * 3 - 7
        for a, b in PAIRS:
            x = _make(gv, commlib, truth, pl, a, p)
            with gv.record() as calls:
                y = x.to_global(sbp=_sbp(gv, b))
            numpy = y.numpy()

            def check(a=a, b=b, x=x, y=y, calls=calls, numpy=numpy, truth=truth, shape=shape) -> None:
                assert x.shape == shape and x.sbp == (_sbp(gv, a),)
                want = EXPECT[(a, b)] if p > 1 else []
                assert [c.name for c in calls] == want, f"ran {calls}, expected {want}"
                assert y.sbp == (_sbp(gv, b),) and y.shape == shape
                if b != P:
                    np.testing.assert_array_equal(np.asarray(y.to_local()), _expected_local(truth, b, p, me))
                np.testing.assert_array_equal(numpy, truth)

            out[f"{a}->{b} {kind}"] = _outcome(check)
    # partial max / min: the logical value is the elementwise max / min of the parts
    for reduce in ("max", "min"):
        sbp = getattr(gv.sbp, f"partial_{reduce}")
        parts = [np.arange(12.0).reshape(4, 3) * ((r % 3) - 1) for r in range(p)]
        truth = getattr(np, reduce)(np.stack(parts), axis=0)
        x = gv.to_global(parts[me], pl, sbp)
        for target, want in ((B, "all_reduce"), (S0, "reduce_scatter")):
            with gv.record() as calls:
                y = x.to_global(sbp=_sbp(gv, target))
            numpy = y.numpy()

            def check(calls=calls, numpy=numpy, want=want, truth=truth) -> None:
                assert [c.name for c in calls] == ([want] if p > 1 else [])
                np.testing.assert_array_equal(numpy, truth)

            out[f"P{reduce}->{target}"] = _outcome(check)
    out.update(_three_d(gv, commlib, pl, p, me))
    return out


def _three_d(gv, commlib, pl, p: int, me: int) -> dict[str, str]:
    """THREE_D's conversions on (3, n, m) tensors (even: n, m divide by the world; uneven: they do not)."""
    from globalview._layout import split_range

    def layout(name):
        return gv.sbp.partial_sum if name == P else gv.sbp.broadcast if name == B else gv.sbp.split(int(name[2]))

    want = {B: "all_gather", "S(1)": "reduce_scatter", "S(2)": "reduce_scatter"}
    out = {}
    for kind, shape in (("even", (3, 2 * p, 4 * p)), ("uneven", (3, 2 * p + 1, 4 * p + 3))):
        truth = np.arange(np.prod(shape), dtype=np.int64).reshape(shape) * 5 - 11
        for a, b in THREE_D:
            x = _make(gv, commlib, truth, pl, P, p) if a == P else gv.tensor(truth, placement=pl, sbp=layout(a))
            with gv.record() as calls:
                y = x.to_global(sbp=layout(b))
            numpy, local = y.numpy(), np.asarray(y.to_local())

            def check(a=a, b=b, y=y, calls=calls, numpy=numpy, local=local, truth=truth) -> None:
                expected = [] if p == 1 else [want[b] if a == P else "all_to_all" if b != B else "all_gather"]
                assert [c.name for c in calls] == expected, f"ran {calls}, expected {expected}"
                assert y.shape == truth.shape and y.sbp == (layout(b),)
                np.testing.assert_array_equal(numpy, truth)
                if b != B:
                    d = int(b[2])
                    lo, hi = split_range(truth.shape[d], p, me)
                    np.testing.assert_array_equal(local, np.take(truth, range(lo, hi), axis=d))

            out[f"3-D {a}->{b} {kind}"] = _outcome(check)
    return out


def operators_job() -> int:
    """Signature inference: the acceptance cases, then each operator against numpy."""
    import commlib
    import globalview as gv

    p = commlib.get_world_size()
    pl = gv.placement(_device(commlib), list(range(p)))
    S = gv.sbp
    n = 4 * p + 1  # uneven on purpose
    xt, yt = gv.randn(n, n, seed=1), gv.randn(n, n, seed=2)
    x = gv.randn(n, n, placement=pl, sbp=S.split(0), seed=1)
    y = gv.randn(n, n, placement=pl, sbp=S.split(1), seed=2)
    one = 1 if p > 1 else 0

    with gv.record() as calls:
        z = x + y
    assert len(calls) == one, calls  # exactly one collective: one input is re-split
    np.testing.assert_allclose(z.numpy(), xt + yt, rtol=1e-6)

    w = gv.randn(n, 3, placement=pl, sbp=S.broadcast, seed=3)
    with gv.record() as calls:
        m = gv.matmul(x, w)
    assert calls == [] and m.sbp == (S.split(0),)
    np.testing.assert_allclose(m.numpy(), xt @ gv.randn(n, 3, seed=3), rtol=1e-4, atol=1e-5)

    with gv.record() as calls:
        m = gv.matmul(y, x)  # S(1) x S(0): each rank multiplies its slice of K -> partial sum
    assert calls == [] and m.sbp == (S.partial_sum,)
    np.testing.assert_allclose(m.numpy(), yt @ xt, rtol=1e-4, atol=1e-4)
    assert (x @ w).sbp == (S.split(0),)

    cases = {
        "sum0": (lambda t: t.sum(0), lambda a: a.sum(0), S.partial_sum),
        "sum1": (lambda t: t.sum(1), lambda a: a.sum(1), S.split(0)),
        "mean_all": (lambda t: t.mean(), lambda a: a.mean(), S.partial_sum),
        "max0": (lambda t: t.max(0), lambda a: a.max(0), S.partial_max),
        "min0_keep": (lambda t: gv.min(t, 0, keepdims=True), lambda a: a.min(0, keepdims=True), S.partial_min),
        "T": (lambda t: t.T, lambda a: a.T, S.split(1)),
        "neg": (lambda t: -t, lambda a: -a, S.split(0)),
        "exp": (lambda t: gv.exp(t), np.exp, S.split(0)),
        "scale": (lambda t: 2.0 * t - 1, lambda a: 2.0 * a - 1, S.split(0)),
        "cmp": (lambda t: t > 0.5, lambda a: a > 0.5, S.split(0)),
        "where": (lambda t: gv.where(t > 0, t, 0.0), lambda a: np.where(a > 0, a, 0.0), S.split(0)),
        "row_bcast": (lambda t: t * t[0:1, :].to_global(sbp=S.broadcast), lambda a: a * a[0:1, :], S.split(0)),
        "slice_cols": (lambda t: t[:, 1:3], lambda a: a[:, 1:3], S.split(0)),
        "index_row": (lambda t: t[2], lambda a: a[2], None),
        "reshape": (lambda t: t.reshape(n, n, 1), lambda a: a.reshape(n, n, 1), S.split(0)),
    }
    for name, (op, ref, sbp) in cases.items():
        out = op(x)
        if sbp is not None and p > 1:
            assert out.sbp == (sbp,), f"{name}: {out.sbp}"
        np.testing.assert_allclose(out.numpy(), ref(xt), rtol=1e-5, atol=1e-6, err_msg=name)
    # a partial input to a non-linear op is reduced first (the cheapest way: reduce_scatter)
    s = x.sum(0, keepdims=True) * 1.0
    with gv.record() as calls:
        e = gv.exp(s)
    assert [c.name for c in calls] == (["reduce_scatter"] if p > 1 else [])
    np.testing.assert_allclose(e.numpy(), np.exp(xt.sum(0, keepdims=True)), rtol=1e-5)
    # explain says which input is boxed and what it costs, without running anything
    with gv.record() as calls:
        choice = gv.explain("add", x, y)
    assert calls == [] and len(choice.boxing) == 2
    assert sum(len(b.collectives) for b in choice.boxing) == one
    return len(cases) + 5


def random_job() -> list:
    """randn / rand give the same logical tensor for every sbp and world size."""
    import commlib
    import globalview as gv

    p = commlib.get_world_size()
    pl = gv.placement(_device(commlib), list(range(p)))
    out = []
    for fn in (gv.randn, gv.rand):
        single = fn(7, 5, seed=11)
        for sbp in (gv.sbp.split(0), gv.sbp.split(1), gv.sbp.broadcast):
            x = fn(7, 5, placement=pl, sbp=sbp, seed=11)
            np.testing.assert_array_equal(x.numpy(), single)
        out.append(single)
    gv.manual_seed(5)
    a = gv.randn(3, 3, placement=pl, sbp=gv.sbp.split(0)).numpy()
    b = gv.randn(3, 3, placement=pl, sbp=gv.sbp.split(0)).numpy()
    assert not np.array_equal(a, b)  # the default generator moves on
    gv.manual_seed(5)
    np.testing.assert_array_equal(gv.randn(3, 3), a)
    return out


def local_parts_job() -> int:
    """to_global from local parts: concatenate, rank 0's value, sum; and the errors."""
    import commlib
    import globalview as gv

    p, me = commlib.get_world_size(), commlib.get_rank()
    pl = gv.placement(_device(commlib), list(range(p)))
    rows = [3 if r < 2 else 2 for r in range(p)]  # uneven, following the rule for sum(rows) rows
    mine = np.full((rows[me], 2), float(me))
    x = gv.to_global(mine, pl, gv.sbp.split(0))
    assert x.shape == (sum(rows), 2)
    np.testing.assert_array_equal(x.numpy(), np.concatenate([np.full((k, 2), float(r)) for r, k in enumerate(rows)]))
    mine = np.full((2, 2), float(me + 5))
    before = mine.copy()
    b = gv.to_global(mine, pl, gv.sbp.broadcast)  # rank 0's value, as OneFlow
    np.testing.assert_array_equal(b.to_local(), np.full((2, 2), 5.0))
    np.testing.assert_array_equal(mine, before)  # the caller's array is never written
    s = gv.to_global(np.full((2, 2), float(me + 1)), pl, gv.sbp.partial_sum)
    np.testing.assert_array_equal(s.numpy(), np.full((2, 2), p * (p + 1) / 2))
    checks = 3
    if p > 1:
        bad = np.zeros((1 if me == 0 else 4, 2))  # rank 0 too short
        try:
            gv.to_global(bad, pl, gv.sbp.split(0))
        except ValueError as e:
            assert "rank 0 has (1, 2)" in str(e), e
            checks += 1
        else:
            raise AssertionError("mismatched local parts were accepted")
    return checks


def _job(tmp) -> dict:
    out = {"conversions": conversions_job(), "operators": operators_job(), "local": local_parts_job()}
    out["random"] = random_job()
    return out


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_globalview_on_ranks(world_size: int, backend: str) -> None:
    results = run(_job, world_size, None, env=BACKENDS[backend], timeout=240)
    r0 = results[0]
    assert r0["conversions"] == dict.fromkeys(CONVERSIONS, "ok")
    assert r0["operators"] >= 15 and r0["local"] >= 3
    # the random tensors match the single-process ones, so they match across world sizes too
    import globalview as gv

    np.testing.assert_array_equal(r0["random"][0], gv.randn(7, 5, seed=11))
    np.testing.assert_array_equal(r0["random"][1], gv.rand(7, 5, seed=11))


def _participants(step) -> set[int]:
    if not step.is_collective:
        return set()
    if step.kind == "broadcast":
        return set(step.ranks)
    if step.kind == "send_recv":
        return {r for pair in zip(step.placement.flat, step.ranks, strict=True) if pair[0] != pair[1] for r in pair}
    return set(step.placement.flat)


MOVES = [([0, 1], [2, 3]), ([0, 1, 2], [1, 2, 3]), ([0, 1], [1, 0]), ([3], [0, 1, 2, 3]), ([0, 1, 2, 3], [2])]
LAYOUTS = [B, S0, S1, P]
MESH_TARGETS = [(B, B), (S0, S1), (S1, S0), (S0, S0), (B, S0), (P, S1)]
# The scenarios mesh_job runs, by name.
MESH_SCENARIOS = [f"{src}->{dst} {a}->{b}" for (src, dst), a, b in itertools.product(MOVES, LAYOUTS, LAYOUTS)]
MESH_SCENARIOS += ["seed [0, 1] S(0) -> [2, 3] B"]
MESH_SCENARIOS += [f"mesh {a}->{b}" for a in itertools.product(LAYOUTS, repeat=2) for b in MESH_TARGETS]
MESH_SCENARIOS += ["mesh matmul (S(0), B) x (B, S(1))"]


def mesh_job() -> dict[str, str]:
    """World size 4: placement changes (disjoint, overlapping, same-shape moves) and a 2 x 2 mesh."""
    import commlib
    import globalview as gv

    me, dev = commlib.get_rank(), _device(commlib)
    truth = np.arange(9 * 7, dtype=np.float64).reshape(9, 7)
    out = {}
    for (src, dst), a, b in itertools.product(MOVES, LAYOUTS, LAYOUTS):
        x = gv.tensor(truth, placement=gv.placement(dev, src), sbp=_sbp(gv, a))
        with gv.record() as calls:
            y = x.to_global(placement=gv.placement(dev, dst), sbp=_sbp(gv, b))
        plan, numpy = x.plan_to(gv.placement(dev, dst), (_sbp(gv, b),)), y.numpy()

        def check(calls=calls, plan=plan, y=y, numpy=numpy, dst=dst) -> None:
            assert [c.name for c in calls] == [s.kind for s in plan.steps if me in _participants(s)]
            assert len(plan.collectives) <= 2
            assert me in dst or y.to_local().size == 0
            np.testing.assert_array_equal(numpy, truth)

        out[f"{src}->{dst} {a}->{b}"] = _outcome(check)
    # the seed's example: [0, 1] S(0) -> [2, 3] B is a gather to rank 0 and one broadcast
    x = gv.tensor([1.0, 2.0], placement=gv.placement(dev, [0, 1]), sbp=gv.sbp.split(0))
    y = x.to_global(placement=gv.placement(dev, [2, 3]), sbp=gv.sbp.broadcast)

    def seed() -> None:
        assert x.plan_to(y.placement, y.sbp).collectives == ["gather", "broadcast"]
        np.testing.assert_array_equal(y.to_local(), [1.0, 2.0] if me in (2, 3) else [])

    out["seed [0, 1] S(0) -> [2, 3] B"] = _outcome(seed)
    # a 2 x 2 mesh: nd sbp converted axis by axis over the mesh's sub-groups
    mesh = gv.placement(dev, [[0, 1], [2, 3]])
    for a in itertools.product(LAYOUTS, repeat=2):
        for b in MESH_TARGETS:
            x = gv.tensor(truth, placement=mesh, sbp=tuple(_sbp(gv, s) for s in a))
            y = x.to_global(sbp=tuple(_sbp(gv, s) for s in b))
            numpy = y.numpy()

            def check(y=y, b=b, numpy=numpy) -> None:
                assert y.sbp == tuple(_sbp(gv, s) for s in b)
                np.testing.assert_array_equal(numpy, truth)

            out[f"mesh {a}->{b}"] = _outcome(check)
    w = gv.randn(7, 4, placement=mesh, sbp=(gv.sbp.broadcast, gv.sbp.split(1)), seed=2)
    x = gv.tensor(truth, placement=mesh, sbp=(gv.sbp.split(0), gv.sbp.broadcast))
    m = x @ w  # data parallel on axis 0, model parallel on axis 1: no communication
    got, single = m.numpy(), gv.randn(7, 4, seed=2)

    def matmul() -> None:
        assert m.sbp == (gv.sbp.split(0), gv.sbp.split(1))
        np.testing.assert_allclose(got, truth @ single, rtol=1e-6)

    out["mesh matmul (S(0), B) x (B, S(1))"] = _outcome(matmul)
    return out


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_placement_changes_and_meshes_on_four_ranks(backend: str) -> None:
    assert run(mesh_job, 4, env=BACKENDS[backend], timeout=240)[0] == dict.fromkeys(MESH_SCENARIOS, "ok")


def _raises(exc, text, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert text in str(e), f"{text!r} not in {e}"
        return 1
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def edge_job() -> int:
    """Odd world size, uneven shapes, boxing inside operators, sub-placements and clear errors."""
    import commlib
    import globalview as gv

    S, p, me = gv.sbp, commlib.get_world_size(), commlib.get_rank()
    dev = _device(commlib)
    pl = gv.placement(dev, list(range(p)))
    n = 4 * p + 1
    at = gv.randn(n, 6, seed=21)
    a = gv.tensor(at, placement=pl, sbp=S.split(0))
    checks = 0
    for out, want in [
        (a.reshape(n * 6), at.reshape(n * 6)),  # pieces not contiguous in the new shape: boxed first
        (a.reshape(n, 2, 3), at.reshape(n, 2, 3)),
        (gv.matmul(a.to_global(sbp=S.split(1)), gv.tensor(at.T, placement=pl, sbp=S.split(0))), at @ at.T),
        (gv.where(a > 0, a, gv.zeros(n, 1, placement=pl, sbp=S.broadcast)), np.where(at > 0, at, 0)),
        (a.sum(0).max(), at.sum(0).max()),  # a partial sum into max: reduced first
        (a.mean(0), at.mean(0)),
        (a.max(1).min(), at.max(1).min()),
        (a[1:-1:2, ::2], at[1:-1:2, ::2]),
        (a[..., None], at[..., None]),
        (abs(-a), np.abs(at)),
        (a**2 / (1 + a * a), at**2 / (1 + at * at)),
    ]:
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
        checks += 1
    batch = gv.randn(4, 3, 5, placement=pl, sbp=S.split(0), seed=3)
    other = gv.randn(4, 5, 2, placement=pl, sbp=S.split(0), seed=4)
    prod = batch @ other
    assert prod.sbp == (S.split(0),)
    np.testing.assert_allclose(prod.numpy(), gv.randn(4, 3, 5, seed=3) @ gv.randn(4, 5, 2, seed=4), rtol=1e-5)
    for make, want in [
        (lambda: gv.arange(n, placement=pl, sbp=S.split(0)), np.arange(n)),
        (lambda: gv.ones(3, 2, placement=pl, sbp=S.partial_sum), np.ones((3, 2))),
        (lambda: gv.full((2, 2), 7, placement=pl, sbp=S.split(1)), np.full((2, 2), 7)),
        (lambda: gv.zeros(5, dtype=np.int32, placement=pl, sbp=S.partial_max), np.zeros(5, np.int32)),
    ]:
        np.testing.assert_array_equal(make().numpy(), want)
        checks += 1
    # a sub-placement: ranks outside hold nothing, but numpy() gives everyone the value
    sub = gv.placement(dev, [p - 1, 0])
    s = gv.tensor(at, placement=sub, sbp=S.split(1))
    assert (s.to_local().size == 0) == (me not in (0, p - 1))
    np.testing.assert_array_equal((s * 2).numpy(), at * 2)
    checks += 1
    # clear errors, raised the same way on every rank (no rank is left waiting)
    other_pl = gv.placement(dev, [0])
    checks += _raises(
        ValueError, "must share a placement", lambda: a + gv.zeros(n, 6, placement=other_pl, sbp=S.broadcast)
    )
    checks += _raises(TypeError, "global tensors or Python/numpy scalars", lambda: a + at)
    checks += _raises(ValueError, "splits dimension 2", a.to_global, sbp=S.split(2))
    checks += _raises(ValueError, "do not broadcast", lambda: a + gv.zeros(5, placement=pl, sbp=S.broadcast))
    checks += _raises(ValueError, "do not multiply", gv.matmul, a, a)
    wrong = "cpu" if dev == "cuda" else "cuda"
    if dev == "cpu":
        checks += _raises(
            ValueError, "needs the nccl backend", gv.zeros, 2, placement=gv.placement(wrong, [0]), sbp=S.broadcast
        )
    commlib.barrier()  # everyone is still in step after the errors
    np.testing.assert_array_equal((a + 1).numpy(), at + 1)
    return checks


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_edge_cases_on_three_ranks(backend: str) -> None:
    assert run(edge_job, 3, env=BACKENDS[backend], timeout=240)[0] >= 20
