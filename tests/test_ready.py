"""The group layer's ready path: a blocking call reruns the backend's executor of its description, found in
``Backend.ready`` by the key its public function builds from its arguments (the hottest call, a SUM all_reduce, by
its byte count). The table must follow the backend's cache (evictions, timeouts) and the group's state (broken,
destroyed, COMMLIB_DEBUG=DETAIL), or a call would start a freed or abandoned executor; and the executor in C and
in Python must both serve it."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)


def lookup_job() -> list[str]:
    import commlib as dist
    from commlib._world import _state
    from commlib.backends._call import Call

    me, n = dist.get_rank(), dist.get_world_size()
    g = _state.world
    cache = g.backend
    assert g.ready is cache.ready
    seen = []
    # each shape and dtype gets its own entry; repeated calls reuse it and stay correct
    for shape, dtype in [((2,), np.float32), ((3, 2), np.int64), ((2,), np.float64), ((5,), np.float16)]:
        for step in range(3):
            x = np.full(shape, me + step, dtype)
            dist.all_reduce(x)
            np.testing.assert_array_equal(x, np.full(shape, sum(range(n)) + n * step, dtype))
        call = Call("all_reduce", np.dtype(dtype), int(np.prod(shape)), dist.ReduceOp.SUM)
        assert cache.ready[call.nbytes()] is cache.ops[call, False]
        seen.append(f"{np.dtype(dtype).name}{list(shape)}")
    # other ops and out-of-place calls never enter the lookup
    y = np.full(2, me + 1, np.float32)
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    assert y.tolist() == [n, n] and len([k for k in cache.ready if type(k) is int]) == 4
    # eviction: a full cache frees its oldest operation and the lookup forgets it too
    cache.limit = len(cache.ops)
    oldest = next(iter(cache.ops))
    z = np.full(7, me, np.int32)
    dist.all_reduce(z)
    assert z.tolist() == [sum(range(n))] * 7
    assert oldest not in cache.ops and oldest[0].nbytes() not in cache.ready
    assert set(cache.ready.values()) <= set(cache.ops.values())
    x = np.full(2, me, np.float32)  # the evicted shape again: made anew, correct
    dist.all_reduce(x)
    assert x.tolist() == [sum(range(n))] * 2 and 8 in cache.ready  # (by byte count)
    # a timeout abandons the operation: gone from the cache and the lookup, group fenced
    sub = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        sg = sub
        w = np.ones(3, np.float32)
        dist.all_reduce(w, group=sg)
        assert sg.ready[12] is not None
        if me == 0:  # rank 1 never makes this call
            try:
                dist.all_reduce(np.ones(4, np.float32), group=sg, async_op=False)
                dist.all_reduce(w, group=sg)
            except dist.CommError:
                seen.append("fenced")
            else:
                raise AssertionError("no timeout")
            assert sg.ready is None and 16 not in sg.backend.ready
            with pytest.raises(dist.CommError, match="failed earlier"):
                dist.all_reduce(w, group=sg)
    # the same on a call the lookup itself runs (its shape is ready): it times out, forgets, fences
    sub2 = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        v = np.ones(6, np.float32)
        dist.all_reduce(v, group=sub2)
        ready = sub2.ready[24]
        if me == 0:  # rank 1 makes one call fewer
            v[:] = 5
            with pytest.raises(dist.CommTimeoutError, match="all_reduce"):
                dist.all_reduce(v, group=sub2)
            assert v.tolist() == [5] * 6  # a failed call leaves the buffer untouched
            assert sub2.ready is None and ready not in sub2.backend.ready.values()
            seen.append("fast path fenced")
    dist.barrier()
    for left in (sub, sub2):  # rank 0 made a call more on each: tear them down without their closing check
        dist.destroy_process_group(left)
    dist.destroy_process_group()
    assert g.ready is None
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
    return _state.world.ready is None


def test_detail_mode_checks_every_call_so_it_has_no_lookup() -> None:
    assert run(detail_job, 2, timeout=60, env={"COMMLIB_DEBUG": "DETAIL"}) == [True, True]


def ready_job(native: bool) -> dict:
    """broadcast, reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single (even and
    uneven), gather, scatter, barrier, send and recv through Backend.ready, each run by the C executor
    (``native``) or in Python (COMMLIB_NATIVE=0): scenario -> problem."""
    import commlib as dist
    from commlib._world import _state
    from commlib.arrays import bfloat16
    from commlib.backends import _native, _steps

    me, n = dist.get_rank(), dist.get_world_size()
    g = _state.world
    problems: dict = {}

    def check(name: str, got: object, want: object) -> None:
        if got != want:
            problems[name] = f"got {got!r}, want {want!r}"

    # bfloat16: numpy exports no buffer of it (the C executor reads the array through numpy's C API)
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
            for again in range(2):  # the second call reruns the executor the first made
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
    for step in range(2):  # root lists of strided views: the generic path stages them
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
    for step in range(3):  # point to point: ranks 0 and 1, a round trip
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
    # entries by byte count: float32 (24 bytes) and the three 16-bit dtypes (12 bytes, one entry: the first made;
    # a call of another dtype of that size is not its executor's, and takes the generic path)
    want = {"broadcast": 2 * n, "reduce": 2 * n, "all_gather": 2, "reduce_scatter": 2, "all_to_all": 2}
    want.update(gather=2 * n, scatter=2 * n, barrier=1, all_to_all_v=2)
    want.update({"send": 1, "recv": 1} if me < 2 else {})  # ranks 0 and 1 exchange messages
    check("entries", _tables(ready), want)
    ops = list(ready.values())
    runners = {type(op).__name__ for op in ops}
    check("executor", runners, {"NativeSteps"} if native else {"Steps"})
    check("C executor set up", _native.Steps is not None, native)
    check("the executors' own type", all(isinstance(op, (_steps.Steps, _steps.NativeSteps)) for op in ops), True)
    # the lookup stays a mirror of the cache: every entry is a live operation of it
    live = set(g.backend.ops.values())
    check("mirror", all(op in live for op in ready.values()), True)
    # a call that times out on the ready path: fenced, output untouched, operation forgotten
    sub = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        out = np.zeros(2 * 2, np.float32)
        dist.all_gather_into_tensor(out, np.ones(2, np.float32), group=sub)
        op = sub.ready[("all_gather", 8, 16)]
        if me == 0:  # rank 1 makes one call fewer
            out[:] = 7
            try:
                dist.all_gather_into_tensor(out, np.ones(2, np.float32), group=sub)
                problems["timeout"] = "no error"
            except dist.CommTimeoutError as e:
                check("timeout names the call", "all_gather_into_tensor" in str(e), True)
            check("output untouched", out.tolist(), [7.0] * 4)
            check("fenced", sub.ready, None)
            check("forgotten", op in sub.backend.ops.values(), False)
    # the same for an uneven all_to_all
    sub2 = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        x, got, splits = np.arange(3, dtype=np.float32), np.zeros(3, np.float32), ([1, 2], [2, 1])[me]
        for _ in range(2):
            dist.all_to_all_single(got, x, splits, splits, group=sub2)
        key = ("all_to_all", 12, 12, tuple(splits), tuple(splits))  # by byte counts, and the splits
        op = sub2.ready[key]
        if me == 0:  # rank 1 makes one call fewer
            got[:] = 7
            try:
                dist.all_to_all_single(got, x, splits, splits, group=sub2)
                problems["uneven timeout"] = "no error"
            except dist.CommTimeoutError as e:
                check("uneven timeout names the call", "all_to_all_single" in str(e), True)
            check("uneven output untouched", got.tolist(), [7.0] * 3)
            check("uneven fenced", sub2.ready, None)
            check("uneven forgotten", op in sub2.backend.ops.values(), False)
    # and for a receive on the ready path: rank 1 sends one message fewer
    sub3 = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        buf = np.zeros(3, np.float32)
        for step in range(3):
            if me == 0:
                dist.recv(buf, src=1, tag=7, group=sub3)
            else:
                dist.send(np.full(3, step, np.float32), dst=0, tag=7, group=sub3)
        if me == 0:
            check("recv ready", _tables(sub3.ready).get("recv"), 1)
            buf[:] = 7
            try:
                dist.recv(buf, src=1, tag=7, group=sub3)
                problems["recv timeout"] = "no error"
            except dist.CommTimeoutError as e:
                check("recv timeout names the call", "recv" in str(e), True)
            check("recv output untouched", buf.tolist(), [7.0] * 3)
            check("recv fenced", sub3.ready, None)
    dist.barrier()
    for left in (sub, sub2, sub3):  # rank 0 made a call more on each: tear them down without their closing check
        dist.destroy_process_group(left)
    dist.destroy_process_group()
    check("destroyed", g.ready, None)
    return problems


def _tables(ready: dict) -> dict[str, int]:
    """How many entries of each kind the ready table has (an uneven all_to_all: ``all_to_all_v``)."""
    out: dict[str, int] = {}
    for key in ready:
        kind = "all_reduce" if type(key) is int else "all_to_all_v" if len(key) == 5 else key[0]
        out[kind] = out.get(kind, 0) + 1
    return out


def _c_runner_built() -> bool:
    try:
        import commlib.backends._executor  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    "n, native", [(2, True), (3, True), (2, False)], ids=["2-ranks-C", "3-ranks-C", "2-ranks-python"]
)
def test_collectives_run_ready_operations(n: int, native: bool) -> None:
    if native and not _c_runner_built():
        pytest.skip("commlib.backends._executor was not built (no C compiler when commlib was installed)")
    env = {"COMMLIB_NATIVE": "1" if native else "0"}
    for rank, problems in enumerate(run(ready_job, n, native, timeout=120, env=env)):
        assert problems == {}, f"rank {rank}: {problems}"


def test_the_c_executor_is_built_where_a_compiler_is() -> None:
    """pip builds commlib.backends._executor where it finds a C compiler; a build that silently failed would
    leave every call slower (the Python executor)."""
    import shutil
    import sysconfig

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here: commlib runs its plans in Python")
    assert _c_runner_built(), "a C compiler is here but commlib.backends._executor is not built: pip install -e . again"
