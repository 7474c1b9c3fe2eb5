"""torch.distributed names beyond the reference list that torch scripts use, so that switching the import
keeps them running: ``group.WORLD``/``GroupMember.WORLD``/``GroupMember.NON_GROUP_MEMBER``,
``send_object_list``/``recv_object_list``, ``new_subgroups``, ``new_subgroups_by_enumeration``,
``get_node_local_rank``, ``is_torchelastic_launched``, ``is_backend_available``, ``is_gloo_available``, ``Backend``,
``default_pg_timeout``, ``DistError``/``DistBackendError`` and the stores.

Each job returns ``{scenario: problem}`` (empty when every scenario held), so a failure names them.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from reference import BACKENDS

import commlib
import commlib.store
from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

NEW_NAMES = [
    "get_node_local_rank",
    "is_backend_available",
    "is_gloo_available",
    "is_torchelastic_launched",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv_object_list",
    "send_object_list",
]


@pytest.mark.parametrize("name", NEW_NAMES)
def test_signature_is_torchs(name: str) -> None:
    dist = pytest.importorskip("torch.distributed")
    ours, theirs = inspect.signature(getattr(commlib, name)), inspect.signature(getattr(dist, name))
    assert [(p.name, p.default) for p in ours.parameters.values()] == [
        (p.name, p.default) for p in theirs.parameters.values()
    ]
    assert name in commlib.__all__


@pytest.mark.parametrize("name", ["GLOO", "NCCL", "MPI", "UNDEFINED"])
def test_backend_constants_are_torchs(name: str) -> None:
    dist = pytest.importorskip("torch.distributed")
    assert getattr(commlib.Backend, name) == getattr(dist.Backend, name)
    assert commlib.Backend(name) == dist.Backend(name) == name.lower()
    assert type(commlib.Backend(name)) is str


def test_values_and_classes_torch_scripts_use() -> None:
    dist = pytest.importorskip("torch.distributed")
    problems = {}
    if commlib.default_pg_timeout != dist.default_pg_timeout:
        problems["default_pg_timeout"] = (commlib.default_pg_timeout, dist.default_pg_timeout)
    if commlib.is_gloo_available() != commlib.is_backend_available(commlib.Backend.GLOO):
        problems["is_gloo_available"] = commlib.is_gloo_available()
    for name in ("DistError", "DistBackendError"):  # an except clause of a torch script catches commlib's failures
        if not (
            issubclass(commlib.CommTimeoutError, getattr(commlib, name))
            and issubclass(getattr(commlib, name), RuntimeError)
        ):
            problems[name] = getattr(commlib, name).__mro__
    for name in ("Store", "TCPStore", "FileStore", "PrefixStore"):
        if getattr(commlib, name) is not getattr(commlib.store, name):
            problems[name] = getattr(commlib, name)
    with pytest.raises(ValueError, match="Backend: the name must be a str, got 3"):
        commlib.Backend(3)  # type: ignore[arg-type]
    assert problems == {}


def test_names_before_init() -> None:
    assert commlib.group.WORLD is None and commlib.GroupMember.WORLD is None
    assert commlib.is_backend_available("mpi") and commlib.is_backend_available("GLOO")
    assert not commlib.is_backend_available("ucc")
    assert commlib.is_backend_available("nccl") == commlib.is_nccl_available()
    assert commlib.get_node_local_rank(fallback_rank=5) == 5
    with pytest.raises(RuntimeError, match="fallback_rank"):
        commlib.get_node_local_rank()


def _check(problems: dict, name: str, got: Any, want: Any) -> None:
    if got != want:
        problems[name] = f"got {got!r}, want {want!r}"


def names_job() -> dict:
    import numpy as np

    import commlib as dist

    dist.init_process_group()
    r, n = dist.get_rank(), dist.get_world_size()
    problems: dict = {}
    _check(problems, "group.WORLD is the default group", dist.group.WORLD is dist.GroupMember.WORLD, True)
    t = np.ones(2, np.float32)
    dist.all_reduce(t, group=dist.group.WORLD)
    _check(problems, "all_reduce on group.WORLD", t.tolist(), [float(n)] * 2)
    _check(problems, "get_node_local_rank under mpiexec (one node)", dist.get_node_local_rank(), r)
    _check(problems, "is_torchelastic_launched under mpiexec", dist.is_torchelastic_launched(), False)

    # objects, point to point: 0 -> 1 by rank, then 2 -> 3 from any source
    objs = [{"rank": r}, "text", np.arange(3)]
    if r == 0:
        dist.send_object_list(objs, dst=1)
    elif r == 1:
        got = [None, None, None]
        sender = dist.recv_object_list(got, src=0)
        _check(
            problems,
            "recv_object_list src=0",
            (sender, got[0], got[1], got[2].tolist()),
            (0, {"rank": 0}, "text", [0, 1, 2]),
        )
    if r == 2:
        dist.send_object_list([r * 10], dst=3)
    elif r == 3 and dist.get_backend() == "mpi":
        got = [None]
        _check(problems, "recv_object_list from any rank", (dist.recv_object_list(got), got), (2, [20]))
    elif r == 3:  # NCCL has no receive from any source: said before anything moves
        try:
            dist.recv_object_list([None])
            problems["recv_object_list from any rank on nccl"] = "no error"
        except ValueError as e:
            _check(problems, "the any-source error names the call", "recv_object_list" in str(e), True)
        got = [None]
        _check(problems, "recv_object_list group_src=2", (dist.recv_object_list(got, group_src=2), got), (2, [20]))
    # a receiver whose list has another length: a clear error, its list untouched, both ranks still in step
    if r == 1:
        dist.send_object_list([1, 2], dst=0)
    elif r == 0:
        mine = ["untouched"]
        try:
            dist.recv_object_list(mine, src=1)
            problems["recv_object_list of another length"] = "no error"
        except ValueError as e:
            _check(problems, "the length error names both lengths", "1 entries" in str(e) and "sent 2" in str(e), True)
        _check(problems, "the list is left as it was", mine, ["untouched"])
    dist.barrier()

    cur, subgroups = dist.new_subgroups(2)
    _check(problems, "new_subgroups(2): groups", [dist.get_process_group_ranks(g) for g in subgroups], [[0, 1], [2, 3]])
    t = np.full(1, float(r), np.float32)
    dist.all_reduce(t, group=cur)
    _check(problems, "all_reduce in this rank's subgroup", t.tolist(), [1.0 if r < 2 else 5.0])
    per_node, _ = dist.new_subgroups()
    _check(problems, "new_subgroups(): one group per node", dist.get_process_group_ranks(per_node), list(range(n)))
    try:
        dist.new_subgroups(3)
        problems["new_subgroups(3) on 4 ranks"] = "no error"
    except ValueError as e:
        _check(problems, "the group_size error names the world size", "(4)" in str(e), True)
    _enumerations(problems, dist, r)
    dist.destroy_process_group()
    return problems


def _enumerations(problems: dict, dist: Any, r: int) -> None:
    """new_subgroups_by_enumeration, and new_subgroups of a group: a rank in no subgroup gets None."""
    import numpy as np

    from commlib._world import _state

    cur, groups = dist.new_subgroups_by_enumeration([[2, 0], [3]])
    _check(problems, "by_enumeration: groups", [dist.get_process_group_ranks(g) for g in groups], [[0, 2], [3]])
    _check(
        problems, "by_enumeration: this rank's", None if cur is None else cur.ranks, {1: None, 3: [3]}.get(r, [0, 2])
    )
    if cur is not None:
        t = np.full(1, float(r), np.float32)
        dist.all_reduce(t, group=cur)
        _check(problems, "by_enumeration: all_reduce in it", t.tolist(), [3.0] if r == 3 else [2.0])
    made = len(_state.groups)
    try:
        dist.new_subgroups_by_enumeration([[0, 1], [1, 2]])
        problems["a rank in two subgroups"] = "no error"
    except ValueError as e:
        _check(problems, "the refused call made no group", len(_state.groups), made)
        _check(
            problems,
            "the overlap error names the rank and both lists",
            "rank 1 is in two subgroups, [0, 1] and [1, 2]" in str(e),
            True,
        )
    g = dist.new_group([1, 2])
    outside = dist.GroupMember.NON_GROUP_MEMBER
    _check(problems, "group == NON_GROUP_MEMBER where this rank is not in it", g == outside, r not in (1, 2))
    _check(problems, "group != NON_GROUP_MEMBER where it is", g != outside, r in (1, 2))
    world = dist.group.WORLD
    _check(problems, "the world is not NON_GROUP_MEMBER", (world == outside, world != outside), (False, True))
    cur, groups = dist.new_subgroups(1, group=g)
    _check(problems, "new_subgroups of a group", [dist.get_process_group_ranks(s) for s in groups], [[1], [2]])
    _check(
        problems,
        "new_subgroups of a group: this rank's",
        None if cur is None else cur.ranks,
        [r] if r in (1, 2) else None,
    )


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_names_in_a_job(backend: str) -> None:
    for rank, problems in enumerate(run(names_job, 4, timeout=120, env=BACKENDS[backend])):
        assert problems == {}, f"rank {rank}: {problems}"
