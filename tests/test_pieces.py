"""Large all_reduce on the mpi backend runs as pieces (COMMLIB_MPI_PIECE_BYTES): same results, every path."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.testing import run

PIECE = 4096  # bytes: small pieces, so a modest buffer splits into many (the last one partial)


def pieces_job() -> list[str]:
    import commlib as dist
    from commlib.backends._mpi import pieces

    n, me = dist.get_world_size(), dist.get_rank()
    checked = []
    for dtype in (np.float64, np.int32, np.float32):
        x = np.arange(10_001, dtype=dtype) + me  # 10,001 elements: 10-20 pieces, the last partial
        parts = pieces(x)
        assert parts is not None and len(parts) > 4 and parts[-1].size < parts[0].size, (dtype, parts and len(parts))
        expect = n * np.arange(10_001, dtype=dtype) + sum(range(n))
        dist.all_reduce(x)  # blocking
        np.testing.assert_array_equal(x, expect)
        y = np.arange(10_001, dtype=dtype) + me
        work = dist.all_reduce(y, async_op=True)  # asynchronous: completed by tests, piece after piece
        while not work.is_completed():
            pass
        np.testing.assert_array_equal(y, expect)
        checked.append(np.dtype(dtype).name)
    z = np.full((101, 99), float(me + 1))  # 2-D, AVG (divides once, after the last piece)
    dist.all_reduce(z, op=dist.ReduceOp.AVG)
    np.testing.assert_allclose(z, (n + 1) / 2)
    assert pieces(np.zeros((400, 40))[:, ::2]) is None  # not contiguous (all_reduce refuses it anyway)
    h = np.full(50_000, 1.0, np.float16)  # 16-bit floats: reduced in a float32 scratch, not in pieces
    dist.all_reduce(h)
    np.testing.assert_array_equal(h, float(n))
    return checked


@pytest.mark.parametrize("n", [2, 3])
def test_a_large_all_reduce_in_pieces_gives_the_same_result_blocking_and_async(n: int) -> None:
    env = {"COMMLIB_MPI_PIECE_BYTES": str(PIECE)}
    assert run(pieces_job, n, timeout=120, env=env) == [["float64", "int32", "float32"]] * n
