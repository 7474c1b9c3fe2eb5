"""Hypothesis over the public API, on real ranks and both backends.

Valid cases (every collective and point-to-point call; the world, overlapping and non-contiguous
sub-groups; several async calls outstanding, waited in a random order) must give the numpy reference
result, and a rank outside the group gets a clear error. Invalid cases (wrong dtype, size, layout,
read-only output, root/peer/tag out of range, an op the dtype or backend cannot reduce, bad lists and
split sizes) must raise a TypeError/ValueError naming the rank, the call and the argument on every
rank, leave every buffer untouched, and leave the group working. Every rank runs the same
derandomized search, so each drawn case is made by all ranks together; one test gives the invalid
input to one rank only, to check the timeout contract of tests/test_errors.py under fuzzing.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from reference import ALL_DTYPES, BACKENDS, group_layouts, make, ops_for, reduce, same, search_settings

from commlib.testing import RankFailure, run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

# -- shared helpers -------------------------------------------------------------------------------------------------


def layouts(n: int) -> dict[str, list[int]]:
    """group_layouts plus non-contiguous groups: [0, 2] from 3 ranks; [0, 3] and [1, 3] from 4."""
    out = group_layouts(n)
    if n >= 3:
        out["evens"] = list(range(0, n, 2))
    if n >= 4:
        out["ends"], out["odds"] = [0, n - 1], list(range(1, n, 2))
    return out


def _make_groups(dist: Any, lay: dict[str, list[int]]) -> dict[str, Any]:
    return {k: None if k == "world" else dist.new_group(v) for k, v in sorted(lay.items())}


def snapshot(obj: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """(array, copy) for every numpy array in ``obj`` (nested lists, tuples, dicts and P2POps)."""
    if isinstance(obj, np.ndarray):
        return [(obj, obj.copy())]
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif hasattr(obj, "tensor") and hasattr(obj, "peer"):  # a P2POp
        obj = [obj.tensor]
    if isinstance(obj, (list, tuple)):
        return [pair for item in obj for pair in snapshot(item)]
    return []


def changed(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[str]:
    """The arrays of a snapshot whose contents differ from their copy."""
    return [
        f"buffer #{i} changed: {a!r} (was {b!r})"
        for i, (a, b) in enumerate(pairs)
        if a.dtype != b.dtype or a.shape != b.shape or a.tolist() != b.tolist()
    ]


def expect_rejected(fn: Any, exc: type, texts: list[str], pairs: list, prefix: str) -> str | None:
    """Call ``fn``; return what is wrong (None when it raised ``exc`` with ``prefix`` and every text)."""
    try:
        fn()
    except (TypeError, ValueError) as e:
        message = f"{type(e).__name__}: {e}"
        if type(e) is not exc or not str(e).startswith(prefix) or not all(t in str(e) for t in texts):
            return f"wanted {exc.__name__} starting {prefix!r} containing {texts}, got {message}"
    else:
        return "no error"
    bad = changed(pairs)
    return "; ".join(bad) if bad else None


# -- valid cases ----------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """One drawn call as seen by one rank: its group, group index (0 for non-members), dtype and sizes."""

    dist: Any
    g: Any
    ranks: list[int]
    i: int
    dtype: np.dtype
    op: str
    shape: tuple[int, ...]
    root: int  # a group index
    salt: int

    @property
    def n(self) -> int:
        return len(self.ranks)

    def data(self, r: int, rows: int, extra: int = 0) -> np.ndarray:
        shape = (rows, *self.shape[1:])
        return make(self.ranks[r], int(np.prod(shape)), self.dtype, self.salt * 101 + extra).reshape(shape)

    def zeros(self, rows: int) -> np.ndarray:
        return np.zeros((rows, *self.shape[1:]), self.dtype)

    def count(self, src: int, dst: int) -> int:
        """Rows group rank ``src`` sends to ``dst`` in the uneven all-to-alls (0 to 3)."""
        return (self.salt + 7 * src + 3 * dst) % 4

    @property
    def rop(self) -> Any:
        return getattr(self.dist.ReduceOp, self.op)


# A built call: its API name, issue(async_op) -> works, [(got, want)], the arrays passed.
Call = tuple[str, Any, list[tuple[np.ndarray, np.ndarray]], list[np.ndarray]]


def _works(*ws: Any) -> list:
    return [w for w in ws if w is not None]


def _rooted(c: Ctx, name: str) -> Call:
    d, rows = c.dist, c.shape[0]
    ins = [c.data(r, rows) for r in range(c.n)]
    t, root, me_root = ins[c.i].copy(), c.ranks[c.root], c.i == c.root
    if name == "all_reduce":
        return name, lambda a: _works(d.all_reduce(t, c.rop, group=c.g, async_op=a)), [(t, reduce(ins, c.op))], [t]
    if name == "reduce":
        want = reduce(ins, c.op) if me_root else ins[c.i]
        return name, lambda a: _works(d.reduce(t, root, c.rop, group=c.g, async_op=a)), [(t, want)], [t]
    return name, lambda a: _works(d.broadcast(t, root, group=c.g, async_op=a)), [(t, ins[c.root])], [t]


def _gathers(c: Ctx, name: str) -> Call:
    d, rows, n = c.dist, c.shape[0], c.n
    ins = [c.data(r, rows) for r in range(n)]
    t = ins[c.i].copy()
    if name == "all_gather_into_tensor":
        out = c.zeros(n * rows)
        call = lambda a: _works(d.all_gather_into_tensor(out, t, group=c.g, async_op=a))  # noqa: E731
        return name, call, [(out, np.concatenate(ins)), (t, ins[c.i])], [out, t]
    if name == "all_gather":
        outs = [c.zeros(rows) for _ in range(n)]
        call = lambda a: _works(d.all_gather(outs, t, group=c.g, async_op=a))  # noqa: E731
        return name, call, list(zip(outs, ins, strict=True)), [outs, t]
    is_root = c.i == c.root
    outs = [c.zeros(rows) for _ in range(n)] if is_root else None
    call = lambda a: _works(d.gather(t, outs, c.ranks[c.root], group=c.g, async_op=a))  # noqa: E731
    return name, call, (list(zip(outs, ins, strict=True)) if outs else []) + [(t, ins[c.i])], [outs, t]


def _scatters(c: Ctx, name: str) -> Call:
    d, rows, n = c.dist, c.shape[0], c.n
    whole = [c.data(r, n * rows) for r in range(n)]
    out = c.zeros(rows)
    if name == "reduce_scatter_tensor":
        inp, want = whole[c.i].copy(), np.split(reduce(whole, c.op), n)[c.i]
        call = lambda a: _works(d.reduce_scatter_tensor(out, inp, c.rop, group=c.g, async_op=a))  # noqa: E731
        return name, call, [(out, want), (inp, whole[c.i])], [out, inp]
    if name == "reduce_scatter":
        ins, want = [x.copy() for x in np.split(whole[c.i], n)], np.split(reduce(whole, c.op), n)[c.i]
        call = lambda a: _works(d.reduce_scatter(out, ins, c.rop, group=c.g, async_op=a))  # noqa: E731
        return name, call, [(out, want)], [out, ins]
    src = [c.data(c.root, rows, 100 + j) for j in range(n)]
    lst = [x.copy() for x in src] if c.i == c.root else None
    call = lambda a: _works(d.scatter(out, lst, c.ranks[c.root], group=c.g, async_op=a))  # noqa: E731
    return name, call, [(out, src[c.i])] + (list(zip(lst, src, strict=True)) if lst else []), [out, lst]


def _all_to_alls(c: Ctx, name: str) -> Call:
    d, n = c.dist, c.n
    ins = [[c.data(s, c.count(s, t), t) for t in range(n)] for s in range(n)]  # ins[src][dst]
    want = [ins[s][c.i] for s in range(n)]
    if name == "all_to_all":
        lst, outs = [x.copy() for x in ins[c.i]], [c.zeros(c.count(s, c.i)) for s in range(n)]
        call = lambda a: _works(d.all_to_all(outs, lst, group=c.g, async_op=a))  # noqa: E731
        return name, call, list(zip(outs, want, strict=True)), [outs, lst]
    inp, out = np.concatenate(ins[c.i]), np.concatenate([c.zeros(w.shape[0]) for w in want])
    sc, rc = [c.count(c.i, t) for t in range(n)], [c.count(s, c.i) for s in range(n)]
    call = lambda a: _works(d.all_to_all_single(out, inp, rc, sc, group=c.g, async_op=a))  # noqa: E731
    return name, call, [(out, np.concatenate(want))], [out, inp]


def _p2p(c: Ctx, name: str) -> Call:
    d, rows, n = c.dist, c.shape[0], c.n
    ins = [c.data(r, rows) for r in range(n)]
    t, buf = ins[c.i].copy(), c.zeros(rows)
    if name == "batch_isend_irecv":  # a ring: send to i+k, receive from i-k
        k = 1 + c.root % max(1, n - 1)
        to, frm = c.ranks[(c.i + k) % n], c.ranks[(c.i - k) % n]
        ops = [d.P2POp(d.isend, t, to, c.g), d.P2POp(d.irecv, buf, frm, c.g)][:: 1 - 2 * (c.salt % 2)]

        def ring(a: bool) -> list:
            works = d.batch_isend_irecv(ops)
            if a:
                return works
            for w in works:
                w.wait()
            return []

        return name, ring, [(buf, ins[(c.i - k) % n]), (t, ins[c.i])], [ops]
    partner = c.i ^ 1  # pairs (0, 1), (2, 3): the lower rank sends first
    if partner >= n:
        return name, lambda a: [], [], [t, buf]
    peer = c.ranks[partner]

    def pair(a: bool) -> list:
        if a:
            return [d.isend(t, peer, c.g), d.irecv(buf, peer, c.g)][:: 1 if c.i < partner else -1]
        if c.i < partner:
            d.send(t, peer, c.g)
            assert d.recv(buf, peer, c.g) == peer
        else:
            assert d.recv(buf, peer, c.g) == peer
            d.send(t, peer, c.g)
        return []

    return name, pair, [(buf, ins[partner]), (t, ins[c.i])], [t, buf]


def _barrier(c: Ctx, name: str) -> Call:
    return name, lambda a: _works(c.dist.barrier(group=c.g, async_op=a)), [], []


BUILDERS = {
    "all_reduce": _rooted,
    "reduce": _rooted,
    "broadcast": _rooted,
    "all_gather_into_tensor": _gathers,
    "all_gather": _gathers,
    "gather": _gathers,
    "reduce_scatter_tensor": _scatters,
    "reduce_scatter": _scatters,
    "scatter": _scatters,
    "all_to_all": _all_to_alls,
    "all_to_all_single": _all_to_alls,
    "send_recv": _p2p,
    "batch_isend_irecv": _p2p,
    "barrier": _barrier,
}
REDUCING = {"all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter"}


def _build(dist: Any, groups: dict, lay: dict, spec: tuple) -> tuple[Ctx, Call]:
    name, dtype, op_index, shape, root_index, layout, salt = spec
    ranks, me = lay[layout], dist.get_rank()
    ops = ops_for(dtype, dist.get_backend())
    if name in REDUCING and not ops:  # nccl cannot reduce 16-bit integers (see test_nccl_backend)
        dtype, ops = np.dtype(np.float32), ops_for(np.float32)
    if name in ("send_recv", "batch_isend_irecv") and len(ranks) == 1:
        name = "barrier"  # no peer to talk to
    i = ranks.index(me) if me in ranks else 0
    c = Ctx(dist, groups[layout], ranks, i, dtype, ops[op_index % len(ops)] if ops else "SUM", shape, 0, salt)
    c.root = root_index % c.n
    return c, BUILDERS[name](c, name)


def _mix(dist: Any, groups: dict, lay: dict, case: tuple, corrupt: bool) -> tuple[int, int]:
    """Issue the case's calls (async or not) in order, wait in a random order, compare; (calls, refusals)."""
    specs, flags, seed = case
    me, label = dist.get_rank(), f"[rank {dist.get_rank()}/{dist.get_world_size()}] "
    works, checks, calls, refusals = [], [], 0, 0
    for spec, async_op in zip(specs, flags[: len(specs)], strict=True):
        c, (name, issue, pairs, bufs) = _build(dist, groups, lay, spec)
        if me not in c.ranks:  # torch warns and returns; commlib refuses clearly (see test_errors)
            call = ("isend" if async_op else "send") if name == "send_recv" else name
            text = f"{label}{call}: this rank is not a member of group"
            problem = expect_rejected(lambda: issue(async_op), ValueError, [text], snapshot(bufs), label)  # noqa: B023
            assert problem is None, (spec, problem)
            refusals += 1
            continue
        works += issue(async_op)
        checks += [(spec, async_op, got, want) for got, want in pairs]
        calls += 1
    random.Random(seed * 31 + me).shuffle(works)  # each rank waits in its own order
    for w in works:
        assert w.wait() is True and w.is_completed()
    for spec, async_op, got, want in checks:
        if corrupt and spec[0] in EVERYONE_GETS and spec[5] == "world" and all(spec[3]):  # so every rank fails
            got.view(np.uint8).reshape(-1)[0] ^= 1
        same(got, want, f"{spec} async={async_op}")
    return calls, refusals


EVERYONE_GETS = {"all_reduce", "broadcast", "all_gather_into_tensor", "all_gather"}  # a result on every rank


def valid_job(max_examples: int, corrupt: bool = False) -> dict[str, int]:
    """Run the valid-call search; return how many examples ran, in how many this rank made calls
    (cases), how many calls it made and how many it had refused as a non-member."""
    from hypothesis import given
    from hypothesis import strategies as st

    import commlib as dist

    lay = layouts(dist.get_world_size())
    groups = _make_groups(dist, lay)
    spec = st.tuples(
        st.sampled_from(sorted(BUILDERS)),
        st.sampled_from(ALL_DTYPES),
        st.integers(0, 6),
        st.lists(st.integers(0, 3), min_size=1, max_size=3).map(tuple),
        st.integers(0, 3),
        st.sampled_from(sorted(lay)),
        st.integers(0, 1000),
    )
    case = st.tuples(st.lists(spec, min_size=1, max_size=4), st.lists(st.booleans(), min_size=4, max_size=4))
    counts = {"examples": 0, "cases": 0, "calls": 0, "refusals": 0}

    @search_settings(max_examples)
    @given(case, st.integers(0, 2**16))
    def check(c: tuple, seed: int) -> None:
        calls, refusals = _mix(dist, groups, lay, (*c, seed), corrupt)
        counts["examples"] += 1
        counts["cases"] += calls > 0
        counts["calls"] += calls
        counts["refusals"] += refusals

    check()
    dist.barrier()
    return counts


VALID_RUNS = [("mpi", 2, 90), ("mpi", 3, 90), ("mpi", 4, 40), ("nccl", 2, 90), ("nccl", 3, 90), ("nccl", 4, 40)]


@pytest.mark.parametrize("backend,n,examples", VALID_RUNS)
def test_valid_calls_match_numpy(backend: str, n: int, examples: int) -> None:
    counts = run(valid_job, n, examples, timeout=240, env=BACKENDS[backend])
    print(f"\nvalid {backend} n={n}: {counts}")
    # Whether a rank takes part in an example depends on the groups drawn (the search's seed comes from this
    # file's source): every rank made calls in a third of the examples at least, the ranks together in two thirds.
    assert all(c["examples"] == examples and c["cases"] >= examples // 3 for c in counts), counts
    assert sum(c["cases"] for c in counts) >= n * examples * 2 // 3, counts
    assert all(c["calls"] >= examples for c in counts), counts
    assert sum(c["refusals"] for c in counts) > 0, counts  # non-members were exercised


def test_valid_fuzz_catches_a_corrupted_result() -> None:
    """The oracle is not vacuous: one flipped bit in a result fails the job."""
    with pytest.raises(RankFailure, match=r"\n got  array\("):
        run(valid_job, 2, 90, True, timeout=60)


# -- invalid cases: every rank makes the same mistake ---------------------------------------------------------------

UNSUPPORTED = [np.dtype("<U1"), np.dtype(object), np.dtype("datetime64[s]"), np.dtype("V4"), np.dtype("S2")]
OTHER = {np.dtype(np.float32): np.dtype(np.float64)}  # a supported dtype that differs, for mismatches

# Arguments by role: o = output array (written), i = input array, O/I = list of outputs/inputs, r = root,
# p = peer, t = tag, op = reduce op, s = split sizes.  "size" marks the arrays whose element count is checked.
SIGNATURES: dict[str, dict[str, str]] = {
    "all_reduce": {"tensor": "o", "op": "op"},
    "reduce": {"tensor": "o", "dst": "r", "op": "op"},
    "broadcast": {"tensor": "o", "src": "r"},
    "all_gather_into_tensor": {"output_tensor": "o size", "input_tensor": "i"},
    "reduce_scatter_tensor": {"output": "o", "input": "i size", "op": "op"},
    "all_gather": {"tensor_list": "O size", "tensor": "i"},
    "reduce_scatter": {"output": "o", "input_list": "I size", "op": "op"},
    "all_to_all_single": {"output": "o", "input": "i", "output_split_sizes": "s", "input_split_sizes": "s"},
    "all_to_all": {"output_tensor_list": "O", "input_tensor_list": "I"},
    "gather": {"tensor": "i", "dst": "r"},
    "scatter": {"tensor": "o", "src": "r"},
    "send": {"tensor": "i", "dst": "p", "tag": "t"},
    "isend": {"tensor": "i", "dst": "p", "tag": "t"},
    "recv": {"tensor": "o", "src": "p", "tag": "t"},
    "irecv": {"tensor": "o", "src": "p", "tag": "t"},
    "batch_isend_irecv": {"tensor": "i", "peer": "p", "tag": "t"},
}
DEFECTS = {
    "o": ["dtype", "not_array", "noncontig", "readonly", "mismatch"],
    "i": ["dtype", "not_array", "noncontig", "mismatch"],
    "O": ["list_len", "not_list", "dtype", "not_array", "noncontig", "readonly", "mismatch"],
    "I": ["list_len", "not_list", "dtype", "not_array", "noncontig", "mismatch"],
    "r": ["outside", "group_out_of_range", "not_int", "both"],
    "p": ["outside", "self", "group_out_of_range", "not_int"],
    "t": ["bad_tag"],
    "op": ["wrong_op", "unknown_op"],
    "s": ["bad_splits", "indivisible"],
}
# Message names that differ from the argument's name.
ALIASES = {("batch_isend_irecv", "tensor"): "p2p_op_list[0].tensor", ("batch_isend_irecv", "peer"): "peer"}
# Which array a mismatch is measured against is named "tensor" in these calls' messages (see the xfail below).
NO_MISMATCH = {("reduce_scatter", "output")}
# In-place calls take a non-contiguous tensor, as torch's backends do (a contiguous copy, and the copy back).
STRIDED_OK = {(call, "tensor") for call in ("all_reduce", "reduce", "broadcast", "send", "isend", "recv", "irecv")}
ARRAY_ROLES = {"o", "i", "O", "I"}


def invalid_cases() -> list[tuple[str, str, str]]:
    """Every (call, argument, defect) the all-ranks search draws from."""
    out = []
    for call, sig in SIGNATURES.items():
        for arg, role in sig.items():
            role, *flags = role.split()
            defects = DEFECTS[role] + (["size"] if "size" in flags else [])
            pair = sum(r.split()[0] in ARRAY_ROLES for r in sig.values()) >= 2  # mismatch needs two arrays
            out += [
                (call, arg, d)
                for d in defects
                if (d != "mismatch" or (pair and (call, arg) not in NO_MISMATCH))
                and (d != "noncontig" or (call, arg) not in STRIDED_OK)
            ]
    return out


def _valid_kwargs(dist: Any, call: str, g: Any, ranks: list[int], i: int, dtype: np.dtype, k: int) -> dict:
    n = len(ranks)
    kw: dict[str, Any] = {"group": g}
    for arg, role in SIGNATURES[call].items():
        role, *flags = role.split()
        size = n * k if "size" in flags or (arg in ("output", "input") and call == "all_to_all_single") else k
        if role in ("o", "i"):
            kw[arg] = np.zeros(size, dtype) if role == "o" else make(ranks[i], size, dtype, size)
        elif role in ("O", "I"):
            kw[arg] = [np.zeros(k, dtype) if role == "O" else make(ranks[i], k, dtype, j) for j in range(n)]
        else:
            scalars = {"r": ranks[0], "p": ranks[(i + 1) % n], "t": 0, "op": dist.ReduceOp.SUM, "s": [k] * n}
            kw[arg] = scalars[role]
    return kw


def _bad_array(defect: str, like: np.ndarray, v: int) -> Any:
    if defect == "dtype":
        return np.zeros(like.shape, UNSUPPORTED[v % len(UNSUPPORTED)])
    if defect == "not_array":
        return like.tolist()
    if defect == "noncontig":
        m = max(2, like.size)
        return np.zeros((2 * m,), like.dtype)[::2] if v % 2 else np.zeros((2, m), like.dtype).T
    if defect == "readonly":
        like.setflags(write=False)
        return like
    if defect == "size":
        return np.zeros(like.size + 1 + v % 3, like.dtype)
    return np.zeros(like.shape, OTHER.get(like.dtype, np.dtype(np.float32)))  # mismatch


def _apply(
    dist: Any, kw: dict, call: str, arg: str, defect: str, ranks: list[int], i: int, v: int
) -> tuple[type, list[str]]:
    """Apply ``defect`` to ``kw[arg]`` in place; return the expected exception and message texts."""
    n, name, value = len(ranks), ALIASES.get((call, arg), arg), kw[arg]
    world = dist.get_world_size()
    if isinstance(value, list) and defect in ("list_len", "not_list"):
        if defect == "not_list":
            kw[arg] = np.zeros(n, value[0].dtype)
            return TypeError, [f"{arg} must be a list of {n}"]
        kw[arg] = value[: n - 1] if n > 1 and v % 2 else value + value[: 1 + v % 2]
        return ValueError, [f"{arg} must hold one tensor per rank ({n}), got {len(kw[arg])}"]
    texts = {
        "dtype": (TypeError, f"NAME has dtype {UNSUPPORTED[v % len(UNSUPPORTED)]}, which commlib cannot move"),
        "not_array": (TypeError, "NAME must be a numpy array"),
        "noncontig": (ValueError, "NAME must be contiguous (C order)"),
        "readonly": (ValueError, "NAME is read-only"),
        "size": (ValueError, "NAME must have"),
        "mismatch": (TypeError, "NAME has dtype"),
    }
    if defect not in texts:
        return _apply_scalar(dist, kw, call, arg, name, defect, ranks, i, v, world)
    if isinstance(value, list):  # an element of a list of tensors
        j = 1 + v % (n - 1) if defect == "mismatch" and n > 1 else v % n
        value[j], name = _bad_array(defect, value[j], v), f"{arg}[{j}]"
    else:
        kw[arg] = _bad_array(defect, value, v)
    return texts[defect][0], [texts[defect][1].replace("NAME", name)]


def _apply_scalar(
    dist: Any, kw: dict, call: str, arg: str, name: str, defect: str, ranks: list, i: int, v: int, world: int
) -> tuple[type, list[str]]:
    n, group_arg = len(ranks), "group_peer" if arg == "peer" else f"group_{arg}"
    if defect == "outside":
        bad = [r for r in range(world) if r not in ranks] + [world + v % 3, -1 - v % 2]
        kw[arg] = bad[v % len(bad)]
        return ValueError, [f"{name}={kw[arg]} is not a rank of group"]
    if defect == "group_out_of_range":
        kw[group_arg], kw[arg] = (n + v % 3 if v % 2 else -1), None
        return ValueError, [f"{group_arg}={kw[group_arg]} is out of range for a group of size {n}"]
    if defect == "not_int":
        kw[arg] = [float(kw[arg]), str(kw[arg]), True, [kw[arg]]][v % 4]
        return TypeError, [f"{name} must be an int rank, got {kw[arg]!r}"]
    if defect == "both":
        kw[group_arg] = 0
        return ValueError, [f"give {name} (a global rank) or {group_arg}, not both"]
    if defect == "self":
        kw[arg] = ranks[i]
        return ValueError, [f"{name} must be another rank"]
    if defect == "bad_tag":
        kw[arg] = [-1 - v, 2**40, 1.5, True, "0"][v % 5]
        return ValueError, [f"tag must be an int in [0, {2**31 - 3 if dist.get_backend() == 'nccl' else ''}"]
    if defect == "wrong_op":
        dtype = np.asarray(kw.get("tensor", kw.get("output"))).dtype
        bad = _wrong_ops(dist, dtype)
        kw[arg] = getattr(dist.ReduceOp, bad[v % len(bad)])
        return TypeError, [f"op={kw[arg]} ", f"dtype {dtype}"]
    if defect == "unknown_op":
        kw[arg] = ["median", 3, None, "SUMM", 1.0][v % 5]
        return ValueError, [f"op must be a ReduceOp (SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR), got {kw[arg]!r}"]
    if defect == "bad_splits":
        k = kw[arg][0]
        kw[arg] = [[k] * (n + 1), [-1] + [k] * (n - 1), [k] * (n - 1) + [k + 1], [1.5] * n, [True] * n][v % 5]
        return ValueError, [f"{arg} must"]
    kw["output"] = np.zeros(kw["output"].size + 1, kw["output"].dtype)  # indivisible, no split sizes
    kw["input"] = np.zeros(kw["output"].size, kw["output"].dtype)
    kw["input_split_sizes"] = kw["output_split_sizes"] = None
    return ValueError, [f"dim 0 of input ({kw['input'].shape[0]}) must divide evenly by the group size {n}"]


def _invoke(dist: Any, call: str, kw: dict) -> Any:
    if call != "batch_isend_irecv":
        return lambda: getattr(dist, call)(**kw)
    peer = {"peer": kw["peer"], "group_peer": kw.get("group_peer")}
    ops = [dist.P2POp(dist.isend, kw["tensor"], group=kw["group"], tag=kw["tag"], **peer)]
    ops.append(dist.P2POp(dist.irecv, np.zeros(3), group=kw["group"], **peer))
    return lambda: dist.batch_isend_irecv(ops)


def _wrong_ops(dist: Any, dtype: np.dtype) -> list[str]:
    """The reductions the backend refuses on ``dtype`` (none for integers on mpi: every op is defined)."""
    allowed = ops_for(dtype, dist.get_backend())
    return [op for op in ("AVG", "BAND", "BOR", "BXOR", "MIN", "MAX", "PRODUCT") if op not in allowed]


def _usable(call: str, defect: str, n: int, k: int) -> bool:
    """Whether the drawn defect is meaningful for a group of ``n`` ranks and ``k`` elements."""
    p2p = call in ("send", "isend", "recv", "irecv", "batch_isend_irecv")
    return not (
        (p2p and n == 1)  # the valid peer would be this rank
        or (defect == "indivisible" and n == 1)
        or (defect == "mismatch" and n == 1 and call == "all_to_all")  # the reference is the changed array
    )


def _invalid(dist: Any, groups: dict, lay: dict, case: tuple) -> str:
    """Make the drawn mistake on this rank; return 'refused', 'rejected' or 'skipped' (asserting the contract)."""
    (call, arg, defect), dtype, k, layout, v = case
    ranks, me, g = lay[layout], dist.get_rank(), groups[layout]
    if not _usable(call, defect, len(ranks), k) or (defect == "wrong_op" and not _wrong_ops(dist, dtype)):
        return "skipped"
    label = f"[rank {me}/{dist.get_world_size()}] "
    i = ranks.index(me) if me in ranks else 0
    kw = _valid_kwargs(dist, call, g, ranks, i, dtype, k)
    exc, texts = _apply(dist, kw, call, arg, defect, ranks, i, v)
    pairs = snapshot(kw)
    fn = _invoke(dist, call, kw)
    if me not in ranks:
        texts, exc = [f"{label}{call}: this rank is not a member of group"], ValueError
    problem = expect_rejected(fn, exc, texts, pairs, f"{label}{call}: ")
    assert problem is None, (case, problem)
    if me not in ranks:
        return "refused"
    x = np.full(2, me + 1, np.int64)  # the group still works
    dist.all_reduce(x, group=g)
    assert x.tolist() == [sum(ranks) + len(ranks)] * 2, (case, x)
    return "rejected"


def invalid_job(max_examples: int) -> dict[str, int]:
    """Run the invalid-call search; return how many cases this rank saw rejected, refused or skipped."""
    from hypothesis import given
    from hypothesis import strategies as st

    import commlib as dist

    lay = layouts(dist.get_world_size())
    groups = _make_groups(dist, lay)
    counts = {"rejected": 0, "refused": 0, "skipped": 0}
    case = st.tuples(
        st.sampled_from(invalid_cases()),
        st.sampled_from([np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.complex64), np.dtype(np.bool_)]),
        st.integers(0, 4),
        st.sampled_from(sorted(lay)),
        st.integers(0, 1000),
    )

    @search_settings(max_examples)
    @given(case)
    def check(c: tuple) -> None:
        counts[_invalid(dist, groups, lay, c)] += 1

    check()
    x = np.ones(1)
    dist.all_reduce(x)
    assert x[0] == dist.get_world_size()
    return counts


INVALID_RUNS = [("mpi", 2, 120), ("mpi", 3, 120), ("nccl", 2, 120), ("nccl", 3, 120)]


@pytest.mark.parametrize("backend,n,examples", INVALID_RUNS)
def test_invalid_calls_are_rejected_everywhere(backend: str, n: int, examples: int) -> None:
    counts = run(invalid_job, n, examples, timeout=240, env=BACKENDS[backend])
    print(f"\ninvalid {backend} n={n}: {counts}")
    for c in counts:
        assert c["rejected"] + c["refused"] + c["skipped"] == examples, c
        assert c["rejected"] >= examples // 3, c  # members of the drawn group: depends on the draws
    assert sum(c["rejected"] for c in counts) >= n * examples // 2, counts


def test_untouched_check_detects_a_write() -> None:
    """The buffer check is not vacuous: a write into any array passed, even inside a list, is reported."""
    a, b = np.zeros(3, np.float32), [np.zeros(2, np.int8), np.zeros(2, np.int8)]
    pairs = snapshot({"a": a, "b": b})
    assert changed(pairs) == []
    b[1][0] = 1
    assert len(changed(pairs)) == 1
    assert expect_rejected(lambda: None, ValueError, [], [], "") == "no error"
    assert "wanted" in str(expect_rejected(lambda: int("x"), ValueError, ["[rank 0/2]"], [], ""))


def test_every_defect_applies_to_every_call() -> None:
    """The search space covers each role's defects (a guard against silently dropping a call)."""
    drawn = {(call, defect) for call, _, defect in invalid_cases()}
    assert {call for call, _ in drawn} == set(SIGNATURES)
    assert len(invalid_cases()) >= 90, len(invalid_cases())
    for op in ("wrong_op", "unknown_op"):
        assert {c for c, d in drawn if d == op} == {"all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter"}


# -- invalid input on one rank only: the others time out, then fail fast --------------------------------------------

BAD_TIMEOUT = 0.3
ALL_NEED_EVERYONE = {
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
}
COLLECTIVE_CASES = [
    c for c in invalid_cases() if c[0] not in ("send", "isend", "recv", "irecv", "batch_isend_irecv") and c[2] != "self"
]


def _must_time_out(call: str, me: int, root: int, bad: int) -> bool:
    """Whether rank ``me`` cannot finish without rank ``bad``'s part (others may finish, or time out)."""
    if call in ALL_NEED_EVERYONE:
        return True
    if call in ("broadcast", "scatter"):
        return root == bad
    return me == root  # reduce, gather: the root needs everyone


def one_bad_rank_job(max_examples: int) -> dict[str, Any]:
    """One rank makes the drawn mistake; the others make the valid call on a fresh group with a short timeout."""
    from hypothesis import given
    from hypothesis import strategies as st

    import commlib as dist
    from commlib.errors import CommTimeoutError, GroupBrokenError

    n, me = dist.get_world_size(), dist.get_rank()
    counts: dict[str, Any] = {"cases": 0, "timed_out": 0, "completed": 0, "waited": []}

    @search_settings(max_examples)
    @given(st.sampled_from(COLLECTIVE_CASES), st.integers(0, n - 1), st.integers(1, 3), st.integers(0, 1000))
    def check(case: tuple, bad: int, k: int, v: int) -> None:
        call, arg, defect = case
        ranks, dtype = list(range(n)), np.dtype(np.float32)
        g = dist.new_group(ranks, timeout=BAD_TIMEOUT)
        kw = _valid_kwargs(dist, call, g, ranks, me, dtype, k)
        if me == bad:
            exc, texts = _apply(dist, kw, call, arg, defect, ranks, me, v)
            label = f"[rank {me}/{n}] {call}: "
            problem = expect_rejected(_invoke(dist, call, kw), exc, texts, snapshot(kw), label)
            assert problem is None, (case, problem)
        else:
            if call == "gather" and me == 0:
                kw["gather_list"] = [np.zeros(k, dtype) for _ in range(n)]
            if call == "scatter" and me == 0:
                kw["scatter_list"] = [np.ones(k, dtype) for _ in range(n)]
            start = time.monotonic()
            try:
                _invoke(dist, call, kw)()
                assert not _must_time_out(call, me, 0, bad), (case, bad, "completed without the bad rank")
                counts["completed"] += 1
            except CommTimeoutError as e:
                waited = time.monotonic() - start
                assert BAD_TIMEOUT <= waited < BAD_TIMEOUT + 5 and call in str(e), (case, waited, e)
                with pytest.raises(GroupBrokenError, match="failed earlier and cannot be used"):
                    dist.barrier(group=g)
                counts["timed_out"] += 1
                counts["waited"].append(round(waited, 2))
        counts["cases"] += 1

    check()
    x = np.ones(1)
    dist.all_reduce(x)  # the default group was never involved: it still works
    assert x[0] == n
    return counts


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_invalid_input_on_one_rank(backend: str) -> None:
    counts = run(one_bad_rank_job, 3, 6, timeout=120, env=BACKENDS[backend])
    print(f"\none bad rank {backend}: {counts}")
    assert all(c["cases"] == 6 for c in counts), counts
    assert sum(c["timed_out"] for c in counts) >= 6, counts


# -- found by the fuzz: an async call whose input the caller no longer holds ---------------------------------------

DROPPED_INPUT_CALLS = ["reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "isend"]
HELD_INPUT_CALLS = ["reduce_scatter_tensor float16", "reduce_scatter bfloat16", "reduce_scatter float32"]


def dropped_input_job() -> dict[str, list[int]]:
    """Start each async call, drop the only reference to its input, reuse the memory, then wait: as in torch,
    the Work must keep the input alive. Returns, per call, the sizes whose result was wrong."""
    import commlib as dist

    n, me = dist.get_world_size(), dist.get_rank()
    bad: dict[str, list[int]] = {call: [] for call in DROPPED_INPUT_CALLS}
    for call in DROPPED_INPUT_CALLS:
        for rows in (1024, 4096, 1 << 16):
            out_rows, in_rows = {
                "reduce_scatter_tensor": (1, n),
                "all_gather_into_tensor": (n, 1),
                "isend": (1, 1),
            }.get(call, (n, n))
            out, inp = np.zeros(out_rows * rows, np.float32), np.full(in_rows * rows, 7.0, np.float32)
            if call == "isend":
                works = [dist.isend(inp, (me + 1) % n), dist.irecv(out, (me - 1) % n)]
            else:
                works = [getattr(dist, call)(out, inp, async_op=True)]
            del inp
            junk = [np.full(n * rows, 99, np.float32) for _ in range(8)]  # reuses the freed input's memory
            for w in works:
                w.wait()
            want = 7.0 * n if call == "reduce_scatter_tensor" else 7.0
            if not (out == want).all():
                bad[call].append(rows)
            del junk
    for case in HELD_INPUT_CALLS:  # the caller keeps every array; commlib's own scratch must live on too
        call, dtype = case.split()
        rows, bad[case] = 1 << 14, []
        out = np.zeros(rows, dtype)
        ins = [np.full(rows, 3.0, dtype) for _ in range(n)]
        arg = ins if call == "reduce_scatter" else np.concatenate(ins)
        w = getattr(dist, call)(out, arg, async_op=True)
        junk = [np.full(n * rows, 99, np.float32) for _ in range(8)]
        w.wait()
        if not (out.astype(np.float32) == 3.0 * n).all():
            bad[case].append(rows)
        del junk
    return bad


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def dropped_input(request: pytest.FixtureRequest) -> tuple[str, dict[str, list[int]]]:
    return request.param, run(dropped_input_job, 2, timeout=60, env=BACKENDS[request.param])[0]


@pytest.mark.parametrize("call", DROPPED_INPUT_CALLS + HELD_INPUT_CALLS)
def test_async_input_outlives_the_caller(call: str, dropped_input: tuple[str, dict[str, list[int]]]) -> None:
    """Found by the fuzz (fixed): the mpi backend's handles now hold every buffer MPI uses until completion."""
    backend, bad = dropped_input
    assert bad[call] == [], f"{backend} {call}: wrong results for sizes {bad[call]}"


# -- found by the fuzz: messages that do not name the rank or the argument ------------------------------------------


def vague_messages_job() -> dict[str, str]:
    import commlib as dist

    x, out = np.ones(4, np.float32), np.zeros(2, np.float32)
    calls = {
        "group is not a ProcessGroup": lambda: dist.all_reduce(x, group="world"),
        "batch of no ops": lambda: dist.batch_isend_irecv([]),
        "negative barrier timeout": lambda: dist.barrier(timeout=-1),
        "reduce_scatter dtype mismatch": lambda: dist.reduce_scatter(out, [np.ones(2)] * 2),
    }
    messages = {}
    for name, fn in calls.items():
        try:
            fn()
            messages[name] = "no error"
        except (TypeError, ValueError) as e:
            messages[name] = str(e)
    return messages


# What each message should contain: the rank, the call, and the argument by its name.
VAGUE = {
    "group is not a ProcessGroup": ["[rank 1/2] all_reduce: group must be a ProcessGroup"],
    "batch of no ops": ["[rank 1/2] batch_isend_irecv: p2p_op_list"],
    "negative barrier timeout": ["[rank 1/2] barrier: timeout"],
    "reduce_scatter dtype mismatch": ["[rank 1/2] reduce_scatter: ", "output has dtype float32"],
}


@pytest.fixture(scope="module")
def vague_messages() -> dict[str, str]:
    return run(vague_messages_job, 2, timeout=60)[1]


@pytest.mark.parametrize("case", sorted(VAGUE))
def test_message_names_rank_call_and_argument(case: str, vague_messages: dict[str, str]) -> None:
    """Found by the fuzz (fixed): these messages lacked the rank, or named the wrong reference argument."""
    message = vague_messages[case]
    assert all(text in message for text in VAGUE[case]), message
