"""Large all_reduce on the mpi backend runs as pieces (COMMLIB_MPI_PIECE_BYTES; each piece's second step shares
a step with the next one's first): same results, blocking and asynchronous, both executors."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

PIECE = 4096  # bytes: small pieces, so a modest buffer splits into many (the last one partial)


def pieces_job() -> list[str]:
    import commlib as dist
    from commlib._world import _state
    from commlib.backends._call import Call
    from commlib.backends._plans import plan

    n, me = dist.get_world_size(), dist.get_rank()
    checked = []
    backend = _state.world.backend
    assert backend.piece == PIECE and backend.small < PIECE, (backend.piece, backend.small)
    for dtype in (np.float64, np.int32, np.float32):
        x = np.arange(10_001, dtype=dtype) + me  # 10,001 elements: 10-20 pieces, the last partial
        p = plan(Call("all_reduce", x.dtype, x.size, dist.ReduceOp.SUM), me, n, small=backend.small, piece=PIECE)
        assert len(p.steps) > 4 + 1, (dtype, len(p.steps))
        expect = n * np.arange(10_001, dtype=dtype) + sum(range(n))
        dist.all_reduce(x)  # blocking
        np.testing.assert_array_equal(x, expect)
        y = np.arange(10_001, dtype=dtype) + me
        work = dist.all_reduce(y, async_op=True)  # asynchronous: completed by tests, piece after piece
        while not work.is_completed():
            pass
        np.testing.assert_array_equal(y, expect)
        checked.append(np.dtype(dtype).name)
    # AVG: each piece's sum divided as it is reduced, in its dtype (integers truncating toward zero); 2-D
    for dtype in (np.float32, np.float64, np.int32):
        parts = [(np.random.default_rng(r).standard_normal((101, 99)) * 1000).astype(dtype) for r in range(n)]
        z = parts[me].copy()
        dist.all_reduce(z, op=dist.ReduceOp.AVG)
        total = sum(parts[1:], parts[0].copy())
        want = (total - np.fmod(total, n)) // n if dtype is np.int32 else total / dtype(n)
        if n == 2 or dtype is np.int32:  # two parts add alike in any order: the same bits
            np.testing.assert_array_equal(z, want)
        else:
            np.testing.assert_allclose(z, want, rtol=1e-5, atol=1e-3)  # three parts: another order of sums
    h = np.full(50_000, 1.0, np.float16)  # 16-bit floats: summed in float32, rounded once, in pieces too
    dist.all_reduce(h)
    np.testing.assert_array_equal(h, float(n))
    return checked


@pytest.mark.parametrize(("n", "native"), [(2, "1"), (3, "1"), (2, "0")])
def test_a_large_all_reduce_in_pieces_gives_the_same_result_blocking_and_async(n: int, native: str) -> None:
    env = {"COMMLIB_MPI_PIECE_BYTES": str(PIECE), "COMMLIB_MPI_PERSISTENT_MAX": "512", "COMMLIB_NATIVE": native}
    assert run(pieces_job, n, timeout=120, env=env) == [["float64", "int32", "float32"]] * n
