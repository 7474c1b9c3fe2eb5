"""The mpi backend's two executors (C, ``_steps.c``; Python, ``commlib.backends._steps``) run the same plans:
the same results bit for bit on the same inputs, numpy's results, and ranks running different executors
work together. Every kind, small (stamps inline) and large (a stamp, then the data on the caller's arrays),
with the dtypes and ops the C executor reduces itself and those it hands to numpy (16-bit floats, bool,
complex products)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

SMALL = 4096


def executors_job(mode: str) -> dict:
    """Every kind on fresh executors (``mode``: "c", "python", or "mixed": C on even ranks); the outputs'
    digest per case, and the cases whose values differ from numpy's."""
    import ml_dtypes
    from mpi4py import MPI

    from commlib._ops import ReduceOp
    from commlib.backends import _native, _steps
    from commlib.backends._call import Call
    from commlib.backends._plans import plan as _plan

    def plan(
        kind, rank, size, dtype=None, count=0, op=None, root=-1, *, small, piece=0, counts=None, in_place=False, peer=-1
    ):  # type: ignore[no-untyped-def]
        call = Call(kind, dtype, count, op, peer if kind in ("send", "recv") else root, splits=counts)
        return _plan(call, rank, size, small=small, piece=piece, in_place=in_place)

    comm = MPI.COMM_WORLD.Dup()
    r, n = comm.Get_rank(), comm.Get_size()
    native = mode == "c" or (mode == "mixed" and r % 2 == 0)
    if native and _native.Steps is None:
        raise RuntimeError("the C executor is not built here")
    seq = 0
    digests: dict[str, str] = {}
    wrong: list[str] = []

    def call(kind: str, inp, out, *args, **kw):  # type: ignore[no-untyped-def]
        nonlocal seq
        seq += 1
        p = plan(kind, r, n, *args, small=SMALL, piece=1 << 20, **kw)
        ex = _steps.NativeSteps(p, comm, SMALL) if native else _steps.Steps(p, comm, SMALL)
        done = ex.go(inp, out, seq)
        assert done is not None, (kind, "the arrays are not the executor's")
        if not done:
            assert ex.wait(60), kind
        ex.finish(out)
        ex.free()

    def record(name: str, got: np.ndarray, want: np.ndarray) -> None:
        digests[name] = hashlib.blake2b(np.ascontiguousarray(got).tobytes(), digest_size=8).hexdigest()
        if got.dtype.kind == "f" or got.dtype == ml_dtypes.bfloat16:
            same = np.array_equal(got.astype(np.float64), want.astype(np.float64), equal_nan=True)
        else:
            same = np.array_equal(got, want)
        if not same:
            wrong.append(name)

    bf16 = np.dtype(ml_dtypes.bfloat16)
    dtypes = [np.dtype(d) for d in (np.float32, np.float64, np.int64, np.int8, np.uint16, np.float16)] + [bf16]
    for count in (1, 7, 1000, 300_001):
        for dtype in dtypes:
            base = [((np.arange(count) % 13) * (p + 1) - 3 * p).astype(np.float64) for p in range(n)]
            if count > 2:  # NaNs in floats: numpy's MIN/MAX pass them on
                for b in base:
                    b[2] = np.nan if dtype.kind == "f" or dtype == bf16 else b[2]
            xs = [b.astype(dtype) for b in base]
            wide = [
                x.astype(np.float32) if (dtype.itemsize == 2 and dtype.kind == "f") or dtype == bf16 else x for x in xs
            ]
            for op, fn in ((ReduceOp.SUM, np.add), (ReduceOp.MAX, np.maximum), (ReduceOp.MIN, np.minimum)):
                if count > 1000 and op is not ReduceOp.SUM:
                    continue
                want = wide[0].copy()
                for w in wide[1:]:
                    want = fn(want, w)
                want = want.astype(dtype)
                name = f"all_reduce {count} {dtype} {op.name}"
                x = xs[r].copy()
                call("all_reduce", x, x, dtype, count, op)
                record(name, x, want)
                root = (count + 1) % n
                x = xs[r].copy()
                call("reduce", x, x if r == root else None, dtype, count, op, root)
                record("re" + name, x, want if r == root else xs[r])
            if count > 1000 and dtype not in (np.dtype(np.float32), bf16):
                continue
            out = np.zeros(count, dtype)
            call("reduce_scatter", np.concatenate(xs[r : r + 1] * n), out, dtype, count, ReduceOp.SUM)
            want = wide[0].copy()
            for w in wide[1:]:
                want = want + w
            record(f"reduce_scatter {count} {dtype}", out, want.astype(dtype))
            for root in range(n):
                x = xs[r].copy()
                call("broadcast", x, x, dtype, count, None, root)
                record(f"broadcast {count} {dtype} {root}", x, xs[root])
            out = np.zeros(n * count, dtype)
            call("all_gather", xs[r], out, dtype, count)
            record(f"all_gather {count} {dtype}", out, np.concatenate(xs))
            parts = [np.zeros(count, dtype) for _ in range(n)] if r == n - 1 else None
            call("gather", xs[r], parts, dtype, count, None, n - 1)
            if parts is not None:
                record(f"gather {count} {dtype}", np.concatenate(parts), np.concatenate(xs))
            out = np.zeros(count, dtype)
            call("scatter", [xs[0] + p for p in range(n)] if r == 0 else None, out, dtype, count, None, 0)
            record(f"scatter {count} {dtype}", out, xs[0] + r)
            out = np.zeros(n * count, dtype)
            call("all_to_all", np.concatenate([xs[r] + t for t in range(n)]), out, dtype, count)
            record(f"all_to_all {count} {dtype}", out, np.concatenate([xs[p] + r for p in range(n)]))
    # bool, complex, bitwise: what the C executor reduces itself and what it hands to numpy
    flags = [np.array([p % 2 == 0, p == 1, True, False] * 3) for p in range(n)]
    for op, fn in ((ReduceOp.SUM, np.logical_or), (ReduceOp.PRODUCT, np.logical_and), (ReduceOp.BXOR, np.logical_xor)):
        x = flags[r].copy()
        call("all_reduce", x, x, x.dtype, x.size, op)
        want = flags[0]
        for f in flags[1:]:
            want = fn(want, f)
        record(f"all_reduce bool {op.name}", x, want)
    zs = [np.array([1 + 2j, -3 + 0.5j, 2 - 1j], np.complex64) * (p + 1) for p in range(n)]
    for op, fn in ((ReduceOp.SUM, np.add), (ReduceOp.PRODUCT, np.multiply)):
        z = zs[r].copy()
        call("all_reduce", z, z, z.dtype, z.size, op)
        want = zs[0]
        for w in zs[1:]:
            want = fn(want, w)
        record(f"all_reduce complex64 {op.name}", z, want)
    ints = [np.array([0x0F0F, -1, 1 << 40, 7], np.int64) + p for p in range(n)]
    for op, fn in ((ReduceOp.BAND, np.bitwise_and), (ReduceOp.BOR, np.bitwise_or), (ReduceOp.BXOR, np.bitwise_xor)):
        x = ints[r].copy()
        call("all_reduce", x, x, x.dtype, x.size, op)
        want = ints[0]
        for w in ints[1:]:
            want = fn(want, w)
        record(f"all_reduce int64 {op.name}", x, want)
    # uneven all_to_all, with empty blocks, and a send/receive ring (inline and large)
    sc = tuple((t * (r + 1)) % 3 for t in range(n))
    rc = tuple((r * (p + 1)) % 3 for p in range(n))
    sendb = np.concatenate([np.full(c, 10 * r + t, np.int32) for t, c in enumerate(sc)])
    out = np.zeros(sum(rc), np.int32)
    call("all_to_all", sendb, out, np.dtype(np.int32), 0, counts=(sc, rc))
    record("all_to_all uneven", out, np.concatenate([np.full(c, 10 * p + r, np.int32) for p, c in enumerate(rc)]))
    for count in (3, 100_000):
        x, y = np.full(count, r, np.float32), np.zeros(count, np.float32)
        f32 = np.dtype(np.float32)
        s = plan("send", r, n, f32, count, peer=(r + 1) % n, small=SMALL)
        v = plan("recv", r, n, f32, count, peer=(r - 1) % n, small=SMALL)
        make = _steps.NativeSteps if native else _steps.Steps
        recv, send = make(v, comm, SMALL, tag=5), make(s, comm, SMALL, tag=5)
        recv.start(None, y, 0)
        send.start(x, None, 0)
        assert send.wait(60) and recv.wait(60)
        record(f"send/recv {count}", y, np.full(count, (r - 1) % n, np.float32))
    call("barrier", None, None)
    return {"digests": digests, "wrong": wrong}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_both_executors_give_numpys_results_and_the_same_bits(n: int) -> None:
    c = run(executors_job, n, "c", timeout=240)
    py = run(executors_job, n, "python", timeout=240)
    for rank in range(n):
        assert c[rank]["wrong"] == [], c[rank]["wrong"]
        assert py[rank]["wrong"] == [], py[rank]["wrong"]
        differ = [k for k in c[rank]["digests"] if c[rank]["digests"][k] != py[rank]["digests"][k]]
        assert differ == [], (rank, differ)


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_running_different_executors_work_together(n: int) -> None:
    mixed = run(executors_job, n, "mixed", timeout=240)
    c = run(executors_job, n, "c", timeout=240)
    for rank in range(n):
        assert mixed[rank]["wrong"] == [], mixed[rank]["wrong"]
        assert mixed[rank]["digests"] == c[rank]["digests"]
