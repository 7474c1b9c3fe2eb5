"""Hypothesis-driven comparison of collectives against the numpy reference.

Every rank runs the same derandomized hypothesis search (no shrinking, and no constants
taken from the modules each rank happens to have loaded, so the ranks never diverge),
so each drawn case is executed by all ranks together.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import ALL_DTYPES, BACKENDS, group_layouts, make, ops_for, reduce, same, search_settings

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

COLLECTIVES = [
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
]


def _case(dist, groups, layouts, me, case) -> bool:
    """Run one drawn case on this rank; False when the rank has no part in it."""
    name, dtype, op_index, shape, root_index, layout, async_op, salt = case
    ranks = layouts[layout]
    if me not in ranks:
        return False
    g, n, i = groups[layout], len(ranks), ranks.index(me)
    ops = ops_for(dtype, dist.get_backend())
    if name in ("all_reduce", "reduce", "reduce_scatter_tensor") and not ops:
        return False  # this backend cannot reduce this dtype (NCCL: 16-bit integers); tested in test_nccl_backend
    op = ops[op_index % len(ops)] if ops else "SUM"
    root = ranks[root_index % n]
    size = int(np.prod(shape))
    ins = [make(rk, size * n, dtype, salt).reshape(n * shape[0], *shape[1:]) for rk in ranks]
    mine = ins[i].copy()
    sent = mine  # held until the end: a dropped input is test_fuzz_api.test_async_input_outlives_the_caller's case
    what = f"{case}"
    if name == "all_reduce":
        w = dist.all_reduce(mine, getattr(dist.ReduceOp, op), group=g, async_op=async_op)
        want = reduce(ins, op)
    elif name == "reduce":
        w = dist.reduce(mine, dst=root, op=getattr(dist.ReduceOp, op), group=g, async_op=async_op)
        want = reduce(ins, op) if me == root else ins[i]
    elif name == "broadcast":
        w = dist.broadcast(mine, src=root, group=g, async_op=async_op)
        want = ins[ranks.index(root)]
    elif name == "all_gather_into_tensor":
        out = np.zeros((n, *mine.shape), dtype)
        w = dist.all_gather_into_tensor(out, mine, group=g, async_op=async_op)
        mine, want = out, np.stack(ins)
    elif name == "reduce_scatter_tensor":
        out = np.zeros((shape[0], *shape[1:]), dtype)
        w = dist.reduce_scatter_tensor(out, mine, getattr(dist.ReduceOp, op), group=g, async_op=async_op)
        mine, want = out, reduce(ins, op)[i * shape[0] : (i + 1) * shape[0]]
    else:
        out = np.zeros_like(mine)
        w = dist.all_to_all_single(out, mine, group=g, async_op=async_op)
        k = shape[0]
        mine, want = out, np.concatenate([a[i * k : (i + 1) * k] for a in ins])
    if async_op:
        w.wait()
    same(mine, want, what)
    if sent is not mine:  # an input that is not also the output must come back unchanged
        same(sent, ins[i], f"{what} input")
    return True


def property_job(max_examples: int) -> dict[str, int]:
    """Run the search; return how many cases were drawn and how many this rank took part in."""
    from hypothesis import given
    from hypothesis import strategies as st

    import commlib as dist

    n, me = dist.get_world_size(), dist.get_rank()
    layouts = group_layouts(n)
    groups = {k: None if k == "world" else dist.new_group(v) for k, v in layouts.items()}
    count = {"drawn": 0, "executed": 0}
    cases = st.tuples(
        st.sampled_from(COLLECTIVES),
        st.sampled_from(ALL_DTYPES),
        st.integers(0, 6),
        st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
        st.integers(0, 3),
        st.sampled_from(sorted(layouts)),
        st.booleans(),
        st.integers(0, 1000),
    )

    @search_settings(max_examples)
    @given(cases)
    def check(case) -> None:
        count["executed"] += _case(dist, groups, layouts, me, case)
        count["drawn"] += 1

    check()
    dist.destroy_process_group()
    return count


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_random_collectives_match_numpy(backend: str, n: int) -> None:
    counts = run(property_job, n, 300, timeout=240, env=BACKENDS[backend])
    print(f"\nproperty {backend} n={n}: {counts}")
    assert all(c["drawn"] == 300 and c["executed"] >= 150 for c in counts), counts
