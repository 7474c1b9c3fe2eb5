"""The hottest call's own lookup (``Backend.sums``): a blocking in-place SUM all_reduce reruns a ready persistent
operation by (shape, dtype). The lookup must follow the cache it mirrors (evictions, timeouts) and the group's
state (broken, destroyed, COMMLIB_DEBUG=DETAIL), or a call would start a freed or abandoned MPI request."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.testing import run


def lookup_job() -> list[str]:
    import commlib as dist
    from commlib._world import _state

    me, n = dist.get_rank(), dist.get_world_size()
    g = _state.world
    cache = g.backend.persistent
    assert g.sums is cache.sums
    seen = []
    # each shape and dtype gets its own entry; repeated calls reuse it and stay correct
    for shape, dtype in [((2,), np.float32), ((3, 2), np.int64), ((2,), np.float64), ((5,), np.float16)]:
        for step in range(3):
            x = np.full(shape, me + step, dtype)
            dist.all_reduce(x)
            np.testing.assert_array_equal(x, np.full(shape, sum(range(n)) + n * step, dtype))
        assert cache.sums[shape, np.dtype(dtype)] is cache.ops["all_reduce", shape, np.dtype(dtype), dist.ReduceOp.SUM]
        seen.append(f"{np.dtype(dtype).name}{list(shape)}")
    # other ops and out-of-place calls never enter the lookup
    y = np.full(2, me + 1, np.float32)
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    assert y.tolist() == [n, n] and len(cache.sums) == 4
    # eviction: a full cache frees its oldest operation and the lookup forgets it too
    cache.limit = len(cache.ops)
    oldest = next(iter(cache.ops))
    z = np.full(7, me, np.int32)
    dist.all_reduce(z)
    assert z.tolist() == [sum(range(n))] * 7
    assert oldest not in cache.ops and oldest[1:3] not in cache.sums
    assert set(cache.sums.values()) <= set(cache.ops.values())
    x = np.full(2, me, np.float32)  # the evicted shape again: made anew, correct
    dist.all_reduce(x)
    assert x.tolist() == [sum(range(n))] * 2 and ((2,), np.dtype(np.float32)) in cache.sums
    # a timeout abandons the operation: gone from the cache and the lookup, group fenced
    sub = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        sg = sub
        w = np.ones(3, np.float32)
        dist.all_reduce(w, group=sg)
        assert sg.sums[(3,), np.dtype(np.float32)] is not None
        if me == 0:  # rank 1 never makes this call
            try:
                dist.all_reduce(np.ones(4, np.float32), group=sg, async_op=False)
                dist.all_reduce(w, group=sg)
            except dist.CommError:
                seen.append("fenced")
            else:
                raise AssertionError("no timeout")
            assert sg.sums is None and ((4,), np.dtype(np.float32)) not in sg.backend.persistent.sums
            with pytest.raises(dist.CommError, match="failed earlier"):
                dist.all_reduce(w, group=sg)
    # the same on a call the lookup itself runs (its shape is ready): it times out, forgets, fences
    sub2 = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        v = np.ones(6, np.float32)
        dist.all_reduce(v, group=sub2)
        ready = sub2.sums[(6,), np.dtype(np.float32)]
        if me == 0:  # rank 1 makes one call fewer
            v[:] = 5
            with pytest.raises(dist.CommTimeoutError, match="all_reduce"):
                dist.all_reduce(v, group=sub2)
            assert v.tolist() == [5] * 6  # a failed call leaves the buffer untouched
            assert sub2.sums is None and ready not in sub2.backend.persistent.sums.values()
            seen.append("fast path fenced")
    dist.barrier()
    dist.destroy_process_group()
    assert g.sums is None
    return seen


@pytest.mark.parametrize("n", [2, 3])
def test_the_all_reduce_lookup_follows_its_cache_and_the_group(n: int) -> None:
    out = run(lookup_job, n, timeout=120)
    base = ["float32[2]", "int64[3, 2]", "float64[2]", "float16[5]"]
    assert out == [[*base, "fenced", "fast path fenced"]] + [base] * (n - 1)


def detail_job() -> bool:
    import commlib as dist
    from commlib._world import _state

    x = np.ones(2, np.float32)
    dist.all_reduce(x)
    assert x.tolist() == [dist.get_world_size()] * 2
    return _state.world.sums is None


def test_detail_mode_checks_every_call_so_it_has_no_lookup() -> None:
    assert run(detail_job, 2, timeout=60, env={"COMMLIB_DEBUG": "DETAIL"}) == [True, True]


def ready_job(native: bool) -> dict:
    """broadcast, reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single (even and
    uneven), gather, scatter, barrier, send and recv through Backend.residents, each run by the C runner
    (``native``) or in Python (COMMLIB_NATIVE=0): scenario -> problem."""
    import commlib as dist
    from commlib._world import _state
    from commlib.arrays import bfloat16
    from commlib.backends import _mpi

    me, n = dist.get_rank(), dist.get_world_size()
    g = _state.world
    problems: dict = {}

    def check(name: str, got: object, want: object) -> None:
        if got != want:
            problems[name] = f"got {got!r}, want {want!r}"

    # bfloat16: numpy exports no buffer of it, so the C runner copies it through numpy
    for dtype in (np.float32, np.int16, np.float16, bfloat16):
        for root in range(n):  # a second round runs the ready operations the first made
            for step in range(2):
                b = np.full((2, 3), me + 10 * step, dtype)
                dist.broadcast(b, src=root)
                check(
                    f"broadcast {np.dtype(dtype)} src={root} #{step}",
                    b.tolist(),
                    np.full((2, 3), root + 10 * step, dtype).tolist(),
                )
        for step in range(2):
            out = np.zeros(3 * n, dtype)
            dist.all_gather_into_tensor(out, np.full(3, me + step, dtype))
            check(
                f"all_gather {np.dtype(dtype)} #{step}",
                out.tolist(),
                [float(r + step) for r in range(n) for _ in range(3)],
            )
            inout = np.full(3 * n, -1, dtype)  # in place: this rank's chunk of the output is the input
            inout[3 * me : 3 * me + 3] = me + step
            dist.all_gather_into_tensor(inout, inout[3 * me : 3 * me + 3])
            check(f"all_gather in place {np.dtype(dtype)} #{step}", inout.tolist(), out.tolist())
            rs = np.zeros(2, dtype)
            dist.reduce_scatter_tensor(rs, np.arange(2 * n, dtype=dtype) + step)
            want = [float(n * (2 * me + k + step)) for k in range(2)]
            check(f"reduce_scatter {np.dtype(dtype)} #{step}", rs.tolist(), want)
            for root in range(n):
                r = np.full(3, me + step, dtype)
                dist.reduce(r, dst=root)
                want = [float(sum(range(n)) + n * step)] * 3 if me == root else [float(me + step)] * 3
                check(f"reduce {np.dtype(dtype)} dst={root} #{step}", r.tolist(), want)
            a2a = np.arange(2 * n, dtype=dtype) + 10 * me + step  # block k (2 elements) goes to rank k
            got = np.zeros(2 * n, dtype)
            dist.all_to_all_single(got, a2a)
            want = [float(10 * k + 2 * me + j + step) for k in range(n) for j in range(2)]
            check(f"all_to_all_single {np.dtype(dtype)} #{step}", got.tolist(), want)
            dist.all_to_all_single(a2a, a2a)  # in place: the input is copied in before anything moves
            check(f"all_to_all_single in place {np.dtype(dtype)} #{step}", a2a.tolist(), want)
            rows = lambda r, k: 1 + (r + k) % 2  # noqa: E731  # rows rank r sends rank k: uneven splits
            ins, outs = [rows(me, k) for k in range(n)], [rows(k, me) for k in range(n)]
            x = np.concatenate([np.full((rows(me, k), 2), 10 * me + k + step, dtype) for k in range(n)])
            want = [[float(10 * k + me + step)] * 2 for k in range(n) for _ in range(rows(k, me))]
            for again in range(2):  # the backend makes its ready operation at the second sighting
                got = np.full((sum(outs), 2), -1, dtype)
                dist.all_to_all_single(got, x, outs, ins)
                check(f"all_to_all_single uneven {np.dtype(dtype)} #{step}.{again}", got.tolist(), want)
            for root in range(n):
                mine = np.arange(4, dtype=dtype).reshape(2, 2) + 10 * me + step
                parts = [np.full((2, 2), -1, dtype) for _ in range(n)] if me == root else None
                dist.gather(mine, parts, dst=root)
                if me == root:
                    want = [(np.arange(4).reshape(2, 2) + 10 * k + step).tolist() for k in range(n)]
                    check(f"gather {np.dtype(dtype)} dst={root} #{step}", [a.tolist() for a in parts], want)
                sent = [np.arange(4, dtype=dtype).reshape(2, 2) + 10 * k + step for k in range(n)]
                got = np.full((2, 2), -1, dtype)
                dist.scatter(got, sent if me == root else None, src=root)
                want = (np.arange(4).reshape(2, 2) + 10 * me + step).tolist()
                check(f"scatter {np.dtype(dtype)} src={root} #{step}", got.tolist(), want)
    for step in range(2):  # root lists of strided views: no byte copies, numpy's (the C runner's fallback)
        mine = np.arange(4, dtype=np.float32).reshape(2, 2) + 10 * me + step
        wide = np.full((n, 2, 4), -1, np.float32)
        dist.gather(mine, [wide[k, :, ::2] for k in range(n)] if me == 0 else None, dst=0)
        if me == 0:
            want = [(np.arange(4).reshape(2, 2) + 10 * k + step).tolist() for k in range(n)]
            check(f"gather into strided views #{step}", [wide[k, :, ::2].tolist() for k in range(n)], want)
            check(f"gather leaves the gaps #{step}", wide[:, :, 1::2].tolist(), np.full((n, 2, 2), -1.0).tolist())
        wide = np.stack([np.full((2, 4), 10 * k + step, np.float32) for k in range(n)])
        got = np.full((2, 2), -1, np.float32)
        dist.scatter(got, [wide[k, :, ::2] for k in range(n)] if me == 0 else None, src=0)
        check(f"scatter from strided views #{step}", got.tolist(), np.full((2, 2), 10.0 * me + step).tolist())
    for _ in range(2):
        dist.barrier()
    for step in range(3):  # point to point: ranks 0 and 1, a round trip; ready from the third (see above)
        buf = np.full(3, step, np.float32)
        if me == 0:
            dist.send(buf, dst=1, tag=5)
            check(f"recv returns the source #{step}", dist.recv(buf, src=1, tag=6), 1)
            check(f"send and recv #{step}", buf.tolist(), [step + 1.0] * 3)
        elif me == 1:
            buf[:] = -1
            dist.recv(buf, src=0, tag=5)
            check(f"recv #{step}", buf.tolist(), [float(step)] * 3)
            dist.send(buf + 1, dst=0, tag=6)
    ready = g.ready
    want = {"broadcast": 4 * n, "reduce": 4 * n, "all_gather": 4, "reduce_scatter": 4, "all_to_all": 4}
    want.update(gather=4 * n, scatter=4 * n, barrier=1, all_to_all_v=4, send=int(me < 2), recv=int(me < 2))
    check("entries", {k: len(v) for k, v in ready.items()}, want)
    ops = [op for t in ready.values() for op in t.values()]
    runners = {type(op.go).__name__ for op in ops}
    check("runner", runners, {"builtin_function_or_method"} if native else {"method"})
    check("C runner set up", _mpi._Runner is not None, native)
    # the lookup stays a mirror of the cache: every entry is a live operation of it
    live = {*g.backend.persistent.ops.values(), *g.backend.p2p.ops.values()}
    check("mirror", all(op in live for t in ready.values() for op in t.values()), True)
    # a call that times out on the ready path: fenced, output untouched, operation forgotten
    sub = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        out = np.zeros(2 * 2, np.float32)
        dist.all_gather_into_tensor(out, np.ones(2, np.float32), group=sub)
        op = sub.ready["all_gather"][(2,), np.dtype(np.float32), (4,), np.dtype(np.float32)]
        if me == 0:  # rank 1 makes one call fewer
            out[:] = 7
            try:
                dist.all_gather_into_tensor(out, np.ones(2, np.float32), group=sub)
                problems["timeout"] = "no error"
            except dist.CommTimeoutError as e:
                check("timeout names the call", "all_gather_into_tensor" in str(e), True)
            check("output untouched", out.tolist(), [7.0] * 4)
            check("fenced", sub.ready, None)
            check("forgotten", op in sub.backend.persistent.ops.values(), False)
    # the same for an uneven all_to_all, whose ready operation is persistent sends and receives
    sub2 = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        x, got, splits = np.arange(3, dtype=np.float32), np.zeros(3, np.float32), ([1, 2], [2, 1])[me]
        for _ in range(2):
            dist.all_to_all_single(got, x, splits, splits, group=sub2)
        key = ((3,), np.dtype(np.float32), (3,), np.dtype(np.float32), (tuple(splits), tuple(splits)))
        op = sub2.ready["all_to_all_v"][key]
        if me == 0:  # rank 1 makes one call fewer
            got[:] = 7
            try:
                dist.all_to_all_single(got, x, splits, splits, group=sub2)
                problems["uneven timeout"] = "no error"
            except dist.CommTimeoutError as e:
                check("uneven timeout names the call", "all_to_all_single" in str(e), True)
            check("uneven output untouched", got.tolist(), [7.0] * 3)
            check("uneven fenced", sub2.ready, None)
            check("uneven forgotten", op in sub2.backend.p2p.ops.values(), False)
    # and for a receive on the ready path (ready from its third call): rank 1 sends one message fewer
    sub3 = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        buf = np.zeros(3, np.float32)
        for step in range(3):
            if me == 0:
                dist.recv(buf, src=1, tag=7, group=sub3)
            else:
                dist.send(np.full(3, step, np.float32), dst=0, tag=7, group=sub3)
        if me == 0:
            check("recv ready", len(sub3.ready["recv"]), 1)
            buf[:] = 7
            try:
                dist.recv(buf, src=1, tag=7, group=sub3)
                problems["recv timeout"] = "no error"
            except dist.CommTimeoutError as e:
                check("recv timeout names the call", "recv" in str(e), True)
            check("recv output untouched", buf.tolist(), [7.0] * 3)
            check("recv fenced", sub3.ready, None)
    dist.barrier()
    dist.destroy_process_group()
    check("destroyed", g.ready, None)
    return problems


def _c_runner_built() -> bool:
    try:
        import commlib.backends._ready  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    "n, native", [(2, True), (3, True), (2, False)], ids=["2-ranks-C", "3-ranks-C", "2-ranks-python"]
)
def test_collectives_run_ready_operations(n: int, native: bool) -> None:
    if native and not _c_runner_built():
        pytest.skip("commlib.backends._ready was not built (no C compiler when commlib was installed)")
    env = {"COMMLIB_NATIVE": "1" if native else "0"}
    for rank, problems in enumerate(run(ready_job, n, native, timeout=120, env=env)):
        assert problems == {}, f"rank {rank}: {problems}"


def test_the_c_runner_is_built_where_a_compiler_is() -> None:
    """pip builds commlib.backends._ready where it finds a C compiler; a build that silently failed would
    leave every small collective a few tenths of a microsecond slower."""
    import shutil
    import sysconfig

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here: commlib runs its ready operations in Python")
    assert _c_runner_built(), "a C compiler is here but commlib.backends._ready is not built: pip install -e . again"


def front_door_job() -> dict:
    """The C front doors of the small calls (commlib._collectives.rooted_c, paired_c, plain_c, peer_c): which
    calls they take (and run, numbered and recorded) and which they leave to the generic path, as ready_rooted,
    _plain, ready_paired and _p2p's fallback decide."""
    import commlib as dist
    from commlib import _collectives
    from commlib._diagnostics import flight
    from commlib._world import _state

    dist.init_process_group("mpi")
    g, me, n = _state.world, dist.get_rank(), dist.get_world_size()
    rooted = _collectives.rooted_c
    problems: dict = {}

    def check(what: str, got: object, want: object) -> None:
        if got != want:
            problems[what] = f"got {got!r}, want {want!r}"

    if rooted is None:
        return {"setup": "the C front door is not set up"}
    x, part = np.zeros(3, np.float32), np.zeros(3, np.float32)
    lists = [np.zeros(3, np.float32) for _ in range(n)]
    for _ in range(2):  # the generic path makes the ready operations
        dist.broadcast(x, 0)
        dist.reduce(x, 0)
        dist.gather(part, lists if me == 0 else None, 0)
        dist.scatter(part, lists if me == 0 else None, 0)
    # taken: it runs the call, numbers it and records it
    x[:] = me + 1
    seq = g.seq
    check("broadcast taken", rooted("broadcast", x, 0, None, None, False, 0, None), True)
    check("broadcast result", x.tolist(), [1.0] * 3)
    check("numbered", g.seq, seq + 1)
    last = max((e for e in flight.ring.starts if e is not None and e[0] is g), key=lambda e: e[4])
    check("recorded", (last[1], last[4]), ("broadcast", seq + 1))
    x[:] = me + 1
    check("reduce taken", rooted("reduce", x, 0, None, None, False, 0, None), True)
    check("reduce result", x.tolist(), [float(sum(range(1, n + 1))) if me == 0 else float(me + 1)] * 3)
    part[:] = me
    out = [np.full(3, -1, np.float32) for _ in range(n)]
    check("gather taken", rooted("gather", part, 0, None, None, False, 1, out if me == 0 else None), True)
    if me == 0:
        check("gather result", [a.tolist() for a in out], [[float(k)] * 3 for k in range(n)])
    src = [np.full(3, 10 + k, np.float32) for k in range(n)]
    check("scatter taken", rooted("scatter", part, 0, None, None, False, 2, src if me == 0 else None), True)
    check("scatter result", part.tolist(), [10.0 + me] * 3)
    # left to the generic path (nothing runs): on every rank alike
    strided = np.zeros(6, np.float32)[::2]
    frozen = np.zeros(3, np.float32)
    frozen.flags.writeable = False
    for name, args in {
        "async_op": ("broadcast", x, 0, None, None, True, 0, None),
        "group_src": ("broadcast", x, None, None, 0, False, 0, None),
        "a numpy integer root": ("broadcast", x, np.int64(0), None, None, False, 0, None),
        "a strided tensor": ("broadcast", strided, 0, None, None, False, 0, None),
        "a read-only tensor it writes": ("broadcast", frozen, 0, None, None, False, 0, None),
        "a shape not ready": ("broadcast", np.zeros(4, np.float32), 0, None, None, False, 0, None),
        "another dtype": ("broadcast", np.zeros(3, np.int32), 0, None, None, False, 0, None),
        "a subclass": ("broadcast", np.zeros(3, np.float32).view(np.matrix), 0, None, None, False, 0, None),
    }.items():
        check(name, rooted(*args), False)
    # gather's and scatter's lists the ready path does not take (on the root; the other ranks would run)
    if me == 0:
        read_only = [np.zeros(3, np.float32) for _ in range(n)]
        read_only[-1].flags.writeable = False
        for name, items in {
            "a tuple": tuple(np.zeros(3, np.float32) for _ in range(n)),
            "one tensor short": [np.zeros(3, np.float32) for _ in range(n - 1)],
            "an item of another dtype": [np.zeros(3, np.float32) for _ in range(n - 1)] + [np.zeros(3, np.int32)],
            "an item of another shape": [np.zeros(3, np.float32) for _ in range(n - 1)]
            + [np.zeros((3, 1), np.float32)],
            "a read-only item to write": read_only,
            "no list": None,
        }.items():
            check(f"gather: {name}", rooted("gather", part, 0, None, None, False, 1, items), False)
        check("scatter: a root not ready", rooted("scatter", part, 1, None, None, False, 2, None), False)
    else:  # off the root a list is a mistake the generic path explains
        check("gather: a list off the root", rooted("gather", part, 0, None, None, False, 1, lists), False)
    # the paired calls (all_gather, reduce_scatter, all_to_all, uneven all_to_all): _collectives.paired_c
    paired = _collectives.paired_c
    ins, outs = [1 + (me + k) % 2 for k in range(n)], [1 + (k + me) % 2 for k in range(n)]
    x2 = np.zeros((sum(ins), 2), np.float32)
    got2 = np.zeros((sum(outs), 2), np.float32)
    out, rs, a2a = np.zeros(3 * n, np.float32), np.zeros(3, np.float32), np.zeros(3 * n, np.float32)
    for _ in range(2):  # the generic path makes the ready operations (the uneven one at its second sighting)
        dist.all_gather_into_tensor(out, part)
        dist.reduce_scatter_tensor(rs, out)
        dist.all_to_all_single(a2a, out)
        dist.all_to_all_single(got2, x2, outs, ins)
    part[:] = me
    check("all_gather taken", paired("all_gather_into_tensor", "all_gather", out, part, None, False, None, None), True)
    check("all_gather result", out.tolist(), [float(k) for k in range(n) for _ in range(3)])
    check(
        "reduce_scatter taken",
        paired("reduce_scatter_tensor", "reduce_scatter", rs, out, None, False, None, None),
        True,
    )
    check("reduce_scatter result", rs.tolist(), [float(n * me)] * 3)
    check("all_to_all taken", paired("all_to_all_single", "all_to_all", a2a, out, None, False, None, None), True)
    check("all_to_all result", a2a.tolist(), [float(me)] * (3 * n))
    x2[:] = me
    uneven = ("all_to_all_single", "all_to_all_v", got2, x2, None, False, ins, outs)
    check("uneven taken", paired(*uneven), True)
    check("uneven result", got2[:, 0].tolist(), [float(k) for k in range(n) for _ in range(outs[k])])
    read_only = np.zeros(3 * n, np.float32)
    read_only.flags.writeable = False
    for name, args in {
        "async_op": ("all_gather_into_tensor", "all_gather", out, part, None, True, None, None),
        "a strided input": (
            "all_gather_into_tensor",
            "all_gather",
            out,
            np.zeros(6, np.float32)[::2],
            None,
            False,
            None,
            None,
        ),
        "a read-only output": ("all_gather_into_tensor", "all_gather", read_only, part, None, False, None, None),
        "a shape not ready": (
            "all_gather_into_tensor",
            "all_gather",
            np.zeros(4 * n, np.float32),
            np.zeros(4, np.float32),
            None,
            False,
            None,
            None,
        ),
        "splits as tuples": ("all_to_all_single", "all_to_all_v", got2, x2, None, False, tuple(ins), tuple(outs)),
        "numpy integer splits": ("all_to_all_single", "all_to_all_v", got2, x2, None, False, list(np.array(ins)), outs),
        "bool splits": ("all_to_all_single", "all_to_all_v", got2, x2, None, False, [True] * n, outs),
        "one split list": ("all_to_all_single", "all_to_all_v", got2, x2, None, False, ins, None),
        "splits not ready": ("all_to_all_single", "all_to_all_v", got2, x2, None, False, outs[::-1], ins[::-1]),
    }.items():
        check(f"paired: {name}", paired(*args), False)
    _summed_door(dist, _collectives.summed_c, g, me, n, check)
    # a barrier (no arrays): _collectives.plain_c
    dist.barrier()
    dist.barrier()  # ready from here
    seq = g.seq
    check("barrier taken", _collectives.plain_c("barrier", None), True)
    check("barrier numbered", g.seq, seq + 1)
    check("barrier: not a group", _collectives.plain_c("barrier", "world"), False)
    _peer_door(dist, _collectives.peer_c, g, me, check)
    dist.barrier()
    dist.destroy_process_group()
    return problems


def _summed_door(dist, summed, g, me: int, n: int, check) -> None:
    """all_reduce (_collectives.summed_c): a SUM of a numpy array whose ready operation exists, numbered and
    recorded; anything else left to the generic path, on every rank alike."""
    from commlib import ReduceOp
    from commlib._diagnostics import flight

    x = np.zeros(3, np.float32)
    for _ in range(2):  # the generic path makes the ready operation
        dist.all_reduce(x)
    x[:] = me + 1
    seq = g.seq
    check("all_reduce taken", summed(x, ReduceOp.SUM, None, False), True)
    check("all_reduce result", x.tolist(), [float(sum(range(1, n + 1)))] * 3)
    check("all_reduce numbered", g.seq, seq + 1)
    last = max((e for e in flight.ring.starts if e is not None and e[0] is g), key=lambda e: e[4])
    check("all_reduce recorded", (last[1], last[4]), ("all_reduce", seq + 1))
    check("all_reduce on the group given", summed(x, ReduceOp.SUM, g, False), True)
    strided, frozen = np.zeros(6, np.float32)[::2], np.zeros(3, np.float32)
    frozen.flags.writeable = False
    for name, args in {
        "async_op": (x, ReduceOp.SUM, None, True),
        "another op": (x, ReduceOp.MAX, None, False),
        "the op's name": (x, "sum", None, False),
        "a strided tensor": (strided, ReduceOp.SUM, None, False),
        "a read-only tensor": (frozen, ReduceOp.SUM, None, False),
        "a shape not ready": (np.zeros(4, np.float32), ReduceOp.SUM, None, False),
        "a list": ([1.0, 2.0, 3.0], ReduceOp.SUM, None, False),
        "not a group": (x, ReduceOp.SUM, "world", False),
    }.items():
        check(f"summed: {name}", summed(*args), False)
    check("summed: nothing ran", g.seq, seq + 2)


def _peer_door(dist, peer, g, me: int, check) -> None:
    """send and recv (_collectives.peer_c, ranks 0 and 1): taken once the ready operation exists (made at a
    shape's second call; neither numbered nor recorded), anything else left to the generic path."""
    from commlib import _p2p
    from commlib._diagnostics import flight

    check("send and recv go through the C door", _p2p._ran_ready is peer, True)
    if me > 1:
        return
    other, buf = 1 - me, np.zeros(3, np.float32)
    for _ in range(2):  # the generic path makes the ready operations (small sends: at the second sighting)
        for call in ("send", "recv") if me == 0 else ("recv", "send"):
            getattr(dist, call)(buf, other, tag=5)
    seq, ring = g.seq, list(flight.ring.starts)
    for call in ("send", "recv") if me == 0 else ("recv", "send"):
        buf[:] = me + 7
        check(f"{call} taken", peer(call, buf, other, None, 5, None), True)
        if call == "recv":
            check("recv result", buf.tolist(), [float(other + 7)] * 3)
    check("send and recv are not numbered", g.seq, seq)
    check("send and recv are not recorded", flight.ring.starts == ring, True)
    strided, frozen = np.zeros(6, np.float32)[::2], np.zeros(3, np.float32)
    frozen.flags.writeable = False
    for name, args in {
        "a numpy integer peer": ("send", buf, np.int64(other), None, 5, None),
        "a bool peer": ("send", buf, True, None, 5, None),
        "group_peer": ("send", buf, other, None, 5, other),
        "another tag": ("send", buf, other, None, 6, None),
        "a bool tag": ("send", buf, other, None, True, None),
        "a strided tensor": ("send", strided, other, None, 5, None),
        "a read-only tensor to receive into": ("recv", frozen, other, None, 5, None),
        "another shape": ("recv", np.zeros(4, np.float32), other, None, 5, None),
        "a list": ("send", [1.0, 2.0, 3.0], other, None, 5, None),
        "not a group": ("send", buf, other, "world", 5, None),
    }.items():
        check(f"peer: {name}", peer(*args), False)
    check("peer: a read-only tensor to send", peer("send", frozen, other, None, 5, None) if me == 0 else True, True)
    if me == 1:
        dist.recv(buf, 0, tag=5)
        check("the read-only tensor arrived", buf.tolist(), [0.0] * 3)


@pytest.mark.skipif(not _c_runner_built(), reason="commlib.backends._ready was not built (no C compiler)")
def test_the_c_front_door_takes_exactly_the_calls_the_ready_path_takes() -> None:
    for rank, problems in enumerate(run(front_door_job, 2, timeout=120, env={"COMMLIB_NATIVE": "1"})):
        assert problems == {}, f"rank {rank}: {problems}"


def test_numpy_arrays_are_read_where_the_c_module_is_built() -> None:
    """The C module reads an array's data, shape, flags and dtype from numpy's struct at offsets checked on
    real arrays (commlib.arrays._layout); a numpy that lays them out otherwise makes commlib fall back to the
    buffer protocol and the Python checks, which is correct but slower: say so here rather than silently."""
    from commlib.arrays._layout import struct_offsets

    if not _c_runner_built():
        pytest.skip("commlib.backends._ready was not built (no C compiler)")
    assert struct_offsets() is not None, f"numpy {np.__version__} lays out its arrays otherwise"
