"""Tensor lists that are back-to-back views of one buffer are used in place (no staging copy).

Each collective that takes a list (gather, scatter, all_gather, reduce_scatter, all_to_all) must
give the same result for such a list as for separate tensors, also when the input tensor is
itself one of the list's views (this rank's chunk, or another rank's).
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import BACKENDS

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

N = 20_000  # float32 elements per rank: lists of 160 KiB and more are used in place


def views(n: int, fill: float = 0.0) -> tuple[np.ndarray, list[np.ndarray]]:
    whole = np.full(n * N, fill, np.float32)
    return whole, [whole[i * N : (i + 1) * N] for i in range(n)]


def packed_job() -> list[str]:
    import commlib as dist
    from commlib.arrays import packed

    n, me = dist.get_world_size(), dist.get_rank()
    mine = np.arange(N, dtype=np.float32) + 10 * me
    every = np.concatenate([np.arange(N, dtype=np.float32) + 10 * r for r in range(n)])
    seen = []

    whole, parts = views(n)
    assert packed(parts) is not None and packed(parts[::-1]) is None and packed([p.copy() for p in parts]) is None
    dist.all_gather(parts, mine)
    np.testing.assert_array_equal(whole, every)
    seen.append("all_gather")

    whole, parts = views(n)  # in place: the input is this rank's own view
    parts[me][...] = mine
    dist.all_gather(parts, parts[me])
    np.testing.assert_array_equal(whole, every)
    seen.append("all_gather in place")

    whole, parts = views(n, 7.0)  # the input is another rank's view: read before it is overwritten
    other = (me + 1) % n
    parts[other][...] = mine
    dist.all_gather(parts, parts[other])
    np.testing.assert_array_equal(whole, every)
    seen.append("all_gather aliased")

    whole, parts = views(n) if me == 0 else (None, None)
    dist.gather(mine, parts, dst=0)
    if me == 0:
        np.testing.assert_array_equal(whole, every)
    seen.append("gather")

    out = np.zeros(N, np.float32)
    whole, parts = (every.copy(), None) if me != 0 else views(n)
    if me == 0:
        whole[...] = every
        parts = [whole[i * N : (i + 1) * N] for i in range(n)]
    dist.scatter(out, parts if me == 0 else None, src=0)
    np.testing.assert_array_equal(out, np.arange(N, dtype=np.float32) + 10 * me)
    seen.append("scatter")

    whole = np.concatenate([np.full(N, r + me, np.float32) for r in range(n)])  # chunk r goes to rank r
    parts = [whole[i * N : (i + 1) * N] for i in range(n)]
    out = np.zeros(N, np.float32)
    dist.reduce_scatter(out, parts)
    np.testing.assert_array_equal(out, np.full(N, n * me + sum(range(n)), np.float32))
    seen.append("reduce_scatter")

    send_whole = np.concatenate([np.full(N, 100 * me + r, np.float32) for r in range(n)])
    sends = [send_whole[i * N : (i + 1) * N] for i in range(n)]
    recv_whole, recvs = views(n)
    dist.all_to_all(recvs, sends)
    np.testing.assert_array_equal(recv_whole, np.concatenate([np.full(N, 100 * r + me, np.float32) for r in range(n)]))
    seen.append("all_to_all")

    same = np.concatenate([np.full(N, 100 * me + r, np.float32) for r in range(n)])  # output list is the input list
    both = [same[i * N : (i + 1) * N] for i in range(n)]
    dist.all_to_all(both, both)
    np.testing.assert_array_equal(same, np.concatenate([np.full(N, 100 * r + me, np.float32) for r in range(n)]))
    seen.append("all_to_all aliased")
    return seen


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_lists_of_views_of_one_buffer_give_the_same_results(backend: str, n: int) -> None:
    results = run(packed_job, n, timeout=120, env=BACKENDS[backend])
    assert results == [results[0]] * n and len(results[0]) == 8, results


@pytest.mark.parametrize(
    "scenario",
    [
        "a slice of a bigger buffer",
        "read-only memory",
        "rows of a strided root",
        "views of two arrays",
        "in reverse order",
        "views of two dtypes",
        "bfloat16",
    ],
)
def test_packed_is_a_view_of_exactly_the_parts(scenario: str) -> None:
    """packed() spans the parts and nothing else, and is writable only where the parts are."""
    from commlib.arrays import bfloat16, packed

    if scenario == "a slice of a bigger buffer":
        whole = np.arange(3 * N, dtype=np.float32)[N // 2 :]
        parts = [whole[:N], whole[N : 2 * N]]
    elif scenario == "read-only memory":
        whole = np.frombuffer(np.arange(2 * N, dtype=np.float32).tobytes(), np.float32)
        parts = [whole[:N], whole[N:]]
    elif scenario == "bfloat16":  # numpy exports no buffer for it: found from the arrays' addresses
        whole = np.arange(2 * N, dtype=np.float32).astype(bfloat16)
        parts = [whole[:N], whole[N:]]
    elif scenario == "rows of a strided root":  # the root is not contiguous: packed still finds the parts
        whole = np.arange(4 * N, dtype=np.float32).reshape(4, N)[::2]
        parts = [whole[0], whole[1]]
        assert packed(parts) is None  # rows 0 and 2 of the root: not back to back
        return
    elif scenario == "in reverse order":
        whole = np.arange(2 * N, dtype=np.float32)
        assert packed([whole[N:], whole[:N]]) is None
        return
    elif scenario == "views of two dtypes":  # back to back in one buffer, but not one element type
        whole = np.arange(2 * N, dtype=np.float32)
        assert packed([whole[:N], whole[N:].view(np.int32)]) is None
        return
    else:
        parts = [np.zeros(N, np.float32), np.zeros(N, np.float32)]
        assert packed(parts) is None
        return
    flat = packed(parts)
    assert flat is not None and flat.size == 2 * N and np.shares_memory(flat, parts[0])
    assert flat.dtype == parts[0].dtype
    np.testing.assert_array_equal(flat.astype(np.float32), np.concatenate(parts).astype(np.float32))
    assert flat.flags.writeable == parts[0].flags.writeable
