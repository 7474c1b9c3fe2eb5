"""globalview's pure parts, in-process: sbp and placement values, the uneven-split rule,
the boxing planner (which steps, which collectives, how many bytes), and the
counter-based random numbers. Multi-rank behaviour is in test_globalview_ranks.py."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest

import globalview as gv
from globalview import _random
from globalview._layout import block, split_range, split_sizes
from globalview._ops import _index_plan, _reshape_map
from globalview._plan import plan

S = gv.sbp
ONE_D = [S.broadcast, S.split(0), S.split(1), S.partial_sum]


def test_sbp_values_print_like_oneflow_and_are_immutable() -> None:
    assert [str(s) for s in ONE_D] == ["B", "S(0)", "S(1)", "P"]
    assert str(S.partial_max) == "Pmax" and str(S.partial_min) == "Pmin"
    assert repr(S.split(1)) == "globalview.sbp.split(dim=1)"
    assert S.split(0) == S.split(dim=0) and S.split(0) != S.split(1) and S.broadcast() is S.broadcast
    assert len({S.split(0), S.split(0), S.broadcast}) == 2
    assert pickle.loads(pickle.dumps(S.split(2))) == S.split(2)
    with pytest.raises(AttributeError):
        S.broadcast.dim = 3
    with pytest.raises(ValueError, match="non-negative int"):
        S.split(-1)


def test_placement_values() -> None:
    p = gv.placement("cuda", [[0, 1], [2, 3]])
    assert p.hierarchy == (2, 2) and p.type == "cuda" and p.flat == (0, 1, 2, 3)
    assert p.coords(2) == (1, 0) and p.coords(7) is None and 3 in p and 4 not in p
    assert p.lines(0) == [(0, 2), (1, 3)] and p.lines(1) == [(0, 1), (2, 3)]
    assert p == gv.placement("cuda", [[0, 1], [2, 3]]) and p != gv.placement("cpu", [[0, 1], [2, 3]])
    assert gv.placement("cpu", [1, 0]) != gv.placement("cpu", [0, 1])  # order matters: it is the mesh
    assert pickle.loads(pickle.dumps(p)) == p
    for bad in ([], [0, 0], [[0, 1], [2]], ["a"], [-1]):
        with pytest.raises(ValueError, match=r"globalview\.placement: ranks"):
            gv.placement("cpu", bad)
    with pytest.raises(ValueError, match="type must be one of"):
        gv.placement("tpu", [0])


def test_uneven_split_rule_first_ranks_hold_one_more() -> None:
    assert split_sizes(9, 4) == [3, 2, 2, 2]
    assert split_sizes(2, 4) == [1, 1, 0, 0]
    assert [split_range(9, 4, i) for i in range(4)] == [(0, 3), (3, 5), (5, 7), (7, 9)]
    # nested on a mesh: axis 0 cuts first, axis 1 cuts axis 0's piece
    assert block((9, 4), (2, 2), (S.split(0), S.split(0)), (1, 1)) == [(7, 9), (0, 4)]
    assert block((9, 4), (2, 2), (S.split(0), S.split(1)), (1, 0)) == [(5, 9), (0, 2)]


def _kinds(shape, p, a, b):
    pl = gv.placement("cpu", list(range(p)))
    return plan(shape, np.float32, (pl, (a,)), (pl, (b,)))


EXPECTED = {
    ("S", "B"): "all_gather",
    ("S", "S"): "all_to_all",
    ("P", "B"): "all_reduce",
    ("P", "S"): "reduce_scatter",
}


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", ["even", "uneven"])
def test_every_1d_conversion_is_one_collective_or_none(p: int, shape: str) -> None:
    dims = (4 * p, 6) if shape == "even" else (4 * p + 1, 2 * p + 3)
    for a, b in itertools.product(ONE_D, repeat=2):
        pl = _kinds(dims, p, a, b)
        want = [] if a == b or p == 1 else [EXPECTED[(a.kind, b.kind)]] if (a.kind, b.kind) in EXPECTED else []
        assert pl.collectives == want, f"{a} -> {b}: {pl}"
        assert len(pl.steps) <= 1


def test_bytes_follow_the_collectives_costs() -> None:
    t = 8 * 6 * 4  # an (8, 6) float32 tensor
    assert _kinds((8, 6), 4, S.split(0), S.broadcast).nbytes == 3 * t  # every rank receives the 3 others' pieces
    assert _kinds((8, 6), 4, S.partial_sum, S.broadcast).nbytes == 2 * 3 * t
    assert _kinds((8, 6), 4, S.partial_sum, S.split(0)).nbytes == 3 * t
    assert _kinds((8, 6), 4, S.partial_sum, S.split(1)).nbytes == 4 * 3 * 2 * 8 * 4  # 6 columns pad to 4 x 2
    assert _kinds((8, 8), 4, S.split(0), S.split(1)).nbytes == 3 * 8 * 8 * 4 // 4
    assert _kinds((8, 6), 4, S.broadcast, S.split(0)).nbytes == 0
    # uneven: pieces are padded to the largest and moved by one collective
    assert _kinds((9, 6), 4, S.split(0), S.broadcast).nbytes == 4 * 3 * 3 * 6 * 4


def test_explain_prints_the_plan() -> None:
    pl = gv.placement("cpu", [0, 1])
    text = str(gv.explain((4, 5), np.float32, (pl, S.split(0)), (pl, S.broadcast)))
    assert "all_gather over ranks [0, 1]: S(0) -> B, moves 80 bytes" in text
    with pytest.raises(TypeError, match="pair"):
        gv.explain((4, 5), np.float32, S.split(0), (pl, S.broadcast))
    with pytest.raises(ValueError, match="splits dimension 3"):
        gv.explain((4, 5), np.float32, (pl, S.split(3)), (pl, S.broadcast))
    with pytest.raises(ValueError, match="needs 2 value"):
        gv.explain((4, 5), np.float32, (gv.placement("cpu", [[0, 1], [2, 3]]), S.split(0)), (pl, S.broadcast))


def test_nd_conversions_go_axis_by_axis() -> None:
    mesh = gv.placement("cpu", [[0, 1], [2, 3]])

    def kinds(a, b):
        return plan((8, 8), np.float32, (mesh, a), (mesh, b)).collectives

    assert kinds((S.split(0), S.split(1)), (S.broadcast, S.broadcast)) == ["all_gather", "all_gather"]
    assert kinds((S.partial_sum, S.broadcast), (S.split(0), S.broadcast)) == ["reduce_scatter"]
    assert kinds((S.split(0), S.broadcast), (S.split(0), S.split(1))) == []  # a local slice
    # a later axis cutting the same dimension: gather it first, then re-slice
    assert kinds((S.split(0), S.split(0)), (S.broadcast, S.split(0))) == ["all_gather", "all_gather"]
    steps = plan((8, 8), np.float32, (mesh, (S.split(0), S.split(1))), (mesh, (S.broadcast,) * 2)).steps
    assert [s.axis for s in steps] == [1, 0]


def test_placement_changes_pick_the_cheap_route() -> None:
    a, b = gv.placement("cpu", [0, 1]), gv.placement("cpu", [2, 3])
    p = plan((4, 4), np.float32, (a, (S.split(0),)), (b, (S.broadcast,)))
    assert p.collectives == ["gather", "broadcast"] and p.steps[-1].ranks == (0, 2, 3)
    p = plan((4, 4), np.float32, (a, (S.split(0),)), (b, (S.split(0),)))
    assert p.collectives == ["send_recv"] and p.nbytes == 4 * 4 * 4
    p = plan((4, 4), np.float32, (gv.placement("cpu", [0, 1, 2]), (S.broadcast,)), (a, (S.split(1),)))
    assert p.collectives == []  # the target ranks already hold it


def test_random_values_depend_only_on_the_logical_index() -> None:
    k = _random.key(42)
    whole = _random.normal(np, k, (6, 7), [(0, 6), (0, 7)], np.float64)
    for ranges in ([(2, 5), (0, 7)], [(0, 6), (3, 4)], [(1, 2), (5, 7)]):
        part = _random.normal(np, k, (6, 7), ranges, np.float64)
        np.testing.assert_array_equal(part, whole[ranges[0][0] : ranges[0][1], ranges[1][0] : ranges[1][1]])
    assert not np.array_equal(whole, _random.normal(np, _random.key(43), (6, 7), [(0, 6), (0, 7)], np.float64))
    big = _random.normal(np, k, (200_000,), [(0, 200_000)], np.float64)
    assert abs(big.mean()) < 0.01 and abs(big.std() - 1) < 0.01
    u = _random.uniform(np, k, (200_000,), [(0, 200_000)], np.float64)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


def test_reshape_keeps_a_split_only_when_pieces_stay_whole() -> None:
    assert _reshape_map((4, 6), (24,), 0, 2) == 0  # rows 0-1 are elements 0-11
    assert _reshape_map((5, 6), (30,), 0, 2) is None  # 3 rows = 18 elements, but 30 splits as 15
    assert _reshape_map((4, 6), (4, 2, 3), 0, 2) == 0
    assert _reshape_map((4, 6), (4, 2, 3), 1, 2) == 1  # columns 0-2 are [:, 0, :]
    assert _reshape_map((2, 3, 4), (6, 4), 2, 2) == 1
    assert _reshape_map((4, 6), (6, 4), 0, 2) == 0  # 2 rows of 6 = 3 rows of 4
    assert _reshape_map((4, 6), (6, 4), 1, 2) is None  # a column block is not contiguous


def test_index_plan_maps_whole_dimensions() -> None:
    _, whole = _index_plan((4, 5, 6), (1, ..., slice(2, 4)))
    assert whole == {1: 0}
    _, whole = _index_plan((4, 5), (None, slice(None), 2))
    assert whole == {0: 1}
    with pytest.raises(TypeError, match="basic indexing"):
        _index_plan((4,), np.array([1, 2]))
    with pytest.raises(IndexError, match="too many"):
        _index_plan((4,), (1, 2))


def test_buffer_pool_reuses_memory_only_after_every_view_is_gone() -> None:
    import gc

    from globalview import _memory

    def addr(a):
        return a.__array_interface__["data"][0]

    a = _memory.empty(np, (512, 1024), np.float32)  # 2 MiB: pooled
    a[:] = 1
    where, view = addr(a), a[3:]
    del a
    gc.collect()
    b = _memory.empty(np, (512, 1024), np.float32)
    assert addr(b) != where  # a view of the first buffer is alive: its memory is not handed out again
    b[:] = 2
    assert (view == 1).all()
    other = addr(b)
    del view, b
    gc.collect()
    c = _memory.empty(np, (1024, 512), np.float32)  # same bytes, other shape: a pooled map comes back
    assert addr(c) in (where, other) and c.flags.c_contiguous and c.flags.writeable
    assert _memory.held_bytes() >= 0
    small = _memory.empty(np, (4,), np.float64)
    assert small.flags.owndata  # small buffers are plain numpy arrays
