"""Large blocking calls, whose messages go on the caller's arrays (a stamp, then the data): every kind, from a
shape's first call (the backend makes the executor) and its second (the group layer's ready path finds it),
inputs that overlap the output and root lists that do not lie back to back (staged), send and recv, and a
timeout (fenced, forgotten, never rerun). The same job with the Python executor (``COMMLIB_NATIVE=0``) must
give the same results."""

from __future__ import annotations

import numpy as np
import pytest
from test_ready import _c_runner_built

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

K = 40 << 10  # elements of a chunk: 80 KiB of 2-byte floats, above the persistent operations' 64 KiB


def direct_job(native: bool) -> dict:
    """scenario -> problem, on every rank."""
    import commlib as dist
    from commlib._world import _state
    from commlib.arrays import bfloat16
    from commlib.backends import _native, _steps

    me, n = dist.get_rank(), dist.get_world_size()
    g = _state.world
    problems: dict = {}

    def check(name: str, got: object, want: object) -> None:
        if got != want:
            problems[name] = f"got {str(got)[:200]}, want {str(want)[:200]}"

    def same(name: str, got: np.ndarray, want: np.ndarray) -> None:
        if got.shape != want.shape or not np.array_equal(got.astype(np.float64), want.astype(np.float64)):
            problems[name] = f"got {got.reshape(-1)[:4]}... want {want.reshape(-1)[:4]}..."

    ramp = lambda r, step, dtype, size=K: (np.arange(size) % 50 + 100 * r + step).astype(dtype)  # noqa: E731
    for dtype in (np.float32, np.int64, np.float16, bfloat16):
        moves_only = dtype in (np.float16, bfloat16)  # their sums are rounded once (tests/test_steps.py)
        for step in range(2):  # the first call makes the executor, the second runs it through the ready path
            tag = f"{np.dtype(dtype)} #{step}"
            for root in range(n):
                b = ramp(me, step, dtype)
                dist.broadcast(b, src=root)
                same(f"broadcast {tag} src={root}", b, ramp(root, step, dtype))
            if not moves_only:
                x = ramp(me, step, dtype)
                dist.all_reduce(x)
                same(f"all_reduce {tag}", x, sum(ramp(r, step, dtype) for r in range(n)))
                for root in range(n):
                    x = ramp(me, step, dtype)
                    dist.reduce(x, dst=root)
                    want = sum(ramp(r, step, dtype) for r in range(n)) if me == root else ramp(me, step, dtype)
                    same(f"reduce {tag} dst={root}", x, want)
                rs = np.zeros(K, dtype)
                full = np.concatenate([ramp(me + k, step, dtype) for k in range(n)])
                dist.reduce_scatter_tensor(rs, full)
                same(f"reduce_scatter {tag}", rs, sum(ramp(r + me, step, dtype) for r in range(n)))
                inside = np.concatenate([ramp(me + k, step, dtype) for k in range(n)])  # output inside the input
                dist.reduce_scatter_tensor(inside[K // 2 : K // 2 + K], inside)
                same(f"reduce_scatter overlapping {tag}", inside[K // 2 : K // 2 + K], rs)
            whole = np.concatenate([ramp(r, step, dtype) for r in range(n)])
            out = np.zeros(n * K, dtype)
            dist.all_gather_into_tensor(out, ramp(me, step, dtype))
            same(f"all_gather {tag}", out, whole)
            inplace = np.zeros(n * K, dtype)
            inplace[me * K : (me + 1) * K] = ramp(me, step, dtype)
            dist.all_gather_into_tensor(inplace, inplace[me * K : (me + 1) * K])
            same(f"all_gather in place {tag}", inplace, whole)
            shifted = np.zeros(n * K + 1, dtype)  # the input at another offset of the output: staged
            shifted[1 : K + 1] = ramp(me, step, dtype)
            dist.all_gather_into_tensor(shifted[: n * K], shifted[1 : K + 1])
            same(f"all_gather overlapping {tag}", shifted[: n * K], whole)
            blocks = np.concatenate([ramp(10 * me + k, step, dtype) for k in range(n)])  # block k goes to rank k
            want = np.concatenate([ramp(10 * k + me, step, dtype) for k in range(n)])
            got = np.zeros(n * K, dtype)
            dist.all_to_all_single(got, blocks)
            same(f"all_to_all {tag}", got, want)
            dist.all_to_all_single(blocks, blocks)
            same(f"all_to_all in place {tag}", blocks, want)
            for root in range(n):
                mine = ramp(me, step, dtype)
                flat = np.full(n * K, -1, dtype)
                dist.gather(mine, list(flat.reshape(n, K)) if me == root else None, dst=root)  # packed list
                if me == root:
                    same(f"gather packed {tag} dst={root}", flat, whole)
                parts = [np.full(K, -1, dtype) for _ in range(n)] if me == root else None  # separate arrays
                dist.gather(mine, parts, dst=root)
                if parts is not None:
                    same(f"gather list {tag} dst={root}", np.concatenate(parts), whole)
                if me == root:  # the tensor is the root's own slot of the list
                    flat = np.full(n * K, -1, dtype)
                    views = list(flat.reshape(n, K))
                    views[me][:] = ramp(me, step, dtype)
                    dist.gather(views[me], views, dst=root)
                    same(f"gather in place {tag} dst={root}", flat, whole)
                else:
                    dist.gather(mine, None, dst=root)
                got = np.full(K, -1, dtype)
                sent = [ramp(k, step, dtype) for k in range(n)]
                dist.scatter(got, sent if me == root else None, src=root)
                same(f"scatter list {tag} src={root}", got, ramp(me, step, dtype))
                got = np.full(K, -1, dtype)
                dist.scatter(got, list(whole.copy().reshape(n, K)) if me == root else None, src=root)
                same(f"scatter packed {tag} src={root}", got, ramp(me, step, dtype))
                if me == root:  # the output is the root's own slot of the list
                    flat = whole.copy()
                    views = list(flat.reshape(n, K))
                    dist.scatter(views[me], views, src=root)
                    same(f"scatter in place {tag} src={root}", views[me], ramp(me, step, dtype))
                else:
                    got = np.full(K, -1, dtype)
                    dist.scatter(got, None, src=root)
                    same(f"scatter in place {tag} src={root}", got, ramp(me, step, dtype))
    for step in range(2):  # send and recv: a round trip between ranks 0 and 1
        buf = ramp(me, step, np.float32)
        if me == 0:
            dist.send(buf, dst=1, tag=3)
            check(f"recv returns the source #{step}", dist.recv(buf, src=1, tag=4), 1)
            same(f"send and recv #{step}", buf, ramp(0, step, np.float32) + 1)
        elif me == 1:
            dist.recv(buf, src=0, tag=3)
            same(f"recv #{step}", buf, ramp(0, step, np.float32))
            dist.send(buf + 1, dst=0, tag=4)
    kind = _steps.NativeSteps if native else _steps.Steps
    check("executor set up", _native.Steps is not None, native)
    large: dict[str, int] = {}
    for key, op in g.ready.items():  # the ready table's large entries, by kind (all_reduce's: by bytes alone)
        if isinstance(op, kind) and op.nbytes >= 2 * K:
            name = "all_reduce" if type(key) is int else key[0]
            large[name] = large.get(name, 0) + 1
    # entries by byte count: float32, int64, and float16 and bfloat16 sharing one (the first made)
    want_tables = {"broadcast": 3 * n, "reduce": 2 * n, "all_gather": 3, "reduce_scatter": 2, "all_to_all": 3}
    want_tables.update(gather=3 * n, scatter=3 * n, all_reduce=2)
    want_tables.update(dict.fromkeys(("send", "recv"), 1) if me < 2 else {})
    check("large entries", {k: v for k, v in large.items() if v}, want_tables)
    # a timeout on the ready path: fenced, forgotten, the executor never runs again
    sub = dist.new_group([0, 1], timeout=1.0)
    if me < 2:
        buf = np.zeros(K, np.float32)
        dist.broadcast(buf, src=1, group=sub)
        d = sub.ready.get(("broadcast", 4 * K, 1))
        check("executor in the subgroup", type(d).__name__, kind.__name__)
        if me == 0:  # rank 1 makes one call fewer
            try:
                dist.broadcast(buf, src=1, group=sub)
                problems["timeout"] = "no error"
            except dist.CommTimeoutError as e:
                check("timeout names the call", "broadcast" in str(e), True)
            check("fenced", sub.ready, None)
            if d is not None:
                check("forgotten", d in sub.backend.ops.values(), False)
                try:
                    d.go(buf, buf, 3)
                    problems["rerun"] = "an abandoned executor ran again"
                except RuntimeError as e:
                    check("never rerun", "abandoned" in str(e), True)
    dist.barrier()
    dist.destroy_process_group(sub)  # rank 0 made a call more on it: no closing check for it
    dist.destroy_process_group()
    return problems


@pytest.mark.parametrize(
    "n, native", [(2, True), (3, True), (2, False)], ids=["2-ranks-C", "3-ranks-C", "2-ranks-python"]
)
def test_large_blocking_calls_post_on_the_callers_arrays(n: int, native: bool) -> None:
    if native and not _c_runner_built():
        pytest.skip("commlib.backends._executor was not built (no C compiler when commlib was installed)")
    env = {"COMMLIB_NATIVE": "1" if native else "0"}
    for rank, problems in enumerate(run(direct_job, n, native, timeout=180, env=env)):
        assert problems == {}, f"rank {rank}: {problems}"
