"""Caller mistakes: a clear TypeError/ValueError on the rank that made it, untouched buffers, and a
CommTimeoutError (never a hang) on the ranks that made the matching call; then the group fails fast."""

from __future__ import annotations

import time

import numpy as np
import pytest
from reference import BACKENDS

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

N = 3  # world size of the job; rank BAD makes the mistake, the others make the correct call
BAD = 1
TIMEOUT = 0.5


def _f32(n=4):
    return np.arange(n, dtype=np.float32)


def _readonly():
    x = _f32()
    x.setflags(write=False)
    return x


# name -> (bad call on rank BAD, correct call on the others, exception type, text the message must contain)
CASES = {
    "wrong dtype": (
        lambda d, g: d.all_reduce(np.array(["a", "b"]), group=g),
        lambda d, g: d.all_reduce(_f32(2), group=g),
        TypeError,
        "all_reduce: tensor has dtype <U1, which commlib cannot move",
    ),
    "not an array": (
        lambda d, g: d.all_reduce([1.0, 2.0], group=g),
        lambda d, g: d.all_reduce(_f32(2), group=g),
        TypeError,
        "all_reduce: tensor must be a numpy array or an object with __dlpack__",
    ),
    "wrong size": (
        lambda d, g: d.all_gather_into_tensor(np.zeros(10, np.float32), _f32(3), group=g),
        lambda d, g: d.all_gather_into_tensor(np.zeros(9, np.float32), _f32(3), group=g),
        ValueError,
        "all_gather_into_tensor: output_tensor must have 3*3=9 elements, got 10",
    ),
    "dtype mismatch": (
        lambda d, g: d.all_gather_into_tensor(np.zeros(9, np.float64), _f32(3), group=g),
        lambda d, g: d.all_gather_into_tensor(np.zeros(9, np.float32), _f32(3), group=g),
        TypeError,
        "output_tensor has dtype float64 but input_tensor has dtype float32",
    ),
    "non-contiguous": (  # an output that is not one of an in-place call's tensor: refused
        lambda d, g: d.all_gather_into_tensor(_f32(16)[::2], _f32(4)[:2], group=g),
        lambda d, g: d.all_gather_into_tensor(_f32(6), _f32(2), group=g),
        ValueError,
        "all_gather_into_tensor: output_tensor must be contiguous (C order), got shape (8,) with strides (8,)",
    ),
    "read-only output": (
        lambda d, g: d.all_reduce(_readonly(), group=g),
        lambda d, g: d.all_reduce(_f32(), group=g),
        ValueError,
        "all_reduce: tensor is read-only",
    ),
    "root out of range": (
        lambda d, g: d.broadcast(_f32(), src=7, group=g),
        lambda d, g: d.broadcast(_f32(), BAD, g),
        ValueError,
        "broadcast: src=7 is not a rank of group",
    ),
    "group root out of range": (
        lambda d, g: d.reduce(_f32(), group=g, group_dst=3),
        lambda d, g: d.reduce(_f32(), 0, group=g),
        ValueError,
        "reduce: group_dst=3 is out of range for a group of size 3",
    ),
    "peer out of range": (
        lambda d, g: d.send(_f32(), dst=9, group=g),
        lambda d, g: d.barrier(group=g),
        ValueError,
        "send: dst=9 is not a rank of group",
    ),
    "peer is self": (
        lambda d, g: d.send(_f32(), dst=BAD, group=g),
        lambda d, g: d.barrier(group=g),
        ValueError,
        "send: dst must be another rank",
    ),
    "AVG on bool": (
        lambda d, g: d.all_reduce(np.ones(2, np.bool_), d.ReduceOp.AVG, g),
        lambda d, g: d.all_reduce(np.ones(2, np.bool_), d.ReduceOp.SUM, g),
        TypeError,
        "op=ReduceOp.AVG is not defined for dtype bool: an average of true/false is not a bool",
    ),
    "bitwise on floats": (
        lambda d, g: d.all_reduce(_f32(), d.ReduceOp.BXOR, g),
        lambda d, g: d.all_reduce(_f32(), group=g),
        TypeError,
        "op=ReduceOp.BXOR is not defined for dtype float32: bitwise ops need an integer",
    ),
    "unknown op": (
        lambda d, g: d.all_reduce(_f32(), "median", g),
        lambda d, g: d.all_reduce(_f32(), group=g),
        ValueError,
        "all_reduce: op must be a ReduceOp (SUM, PRODUCT",
    ),
    "wrong list length": (
        lambda d, g: d.all_gather([_f32(2)] * 2, _f32(2), group=g),
        lambda d, g: d.all_gather([_f32(2) for _ in range(3)], _f32(2), group=g),
        ValueError,
        "all_gather: tensor_list must hold one tensor per rank (3), got 2",
    ),
    "gather_list on non-root": (
        lambda d, g: d.gather(_f32(), [_f32()] * 3, dst=0, group=g),
        lambda d, g: d.gather(_f32(), [_f32() for _ in range(3)] if d.get_rank() == 0 else None, dst=0, group=g),
        ValueError,
        "gather: gather_list must not be given on ranks other than the destination",
    ),
    "bad split sizes": (
        lambda d, g: d.all_to_all_single(_f32(3), _f32(3), [1, 1, 1], [1, 1, 2], group=g),
        lambda d, g: d.all_to_all_single(_f32(3), _f32(3), group=g),
        ValueError,
        "input_split_sizes must sum to dim 0 (3), got sum([1, 1, 2])=4",
    ),
}
# Non-root ranks of a gather or reduce may finish as soon as their data is sent; only the root must wait for rank BAD.
MUST_TIME_OUT = {"gather_list on non-root": [0], "group root out of range": [0]}


def mistakes_job() -> dict:
    """For each case: rank BAD's error, whether its buffers stayed untouched, and the others' timeout."""
    import commlib as dist
    from commlib.errors import CommTimeoutError, GroupBrokenError

    me, report = dist.get_rank(), {}
    for name, (bad, good, _, _) in CASES.items():
        g = dist.new_group(list(range(N)), timeout=TIMEOUT)
        if me == BAD:
            try:
                bad(dist, g)
                report[name] = ("no error", "", 0.0)
            except Exception as e:
                report[name] = (type(e).__name__, str(e), 0.0)
            dist.barrier()  # until the others timed out: then the group goes (no closing check for it)
            dist.destroy_process_group(g)
            continue
        start = time.monotonic()
        try:
            good(dist, g)
            report[name] = ("no error", "", 0.0)
        except CommTimeoutError as e:
            report[name] = ("CommTimeoutError", str(e), time.monotonic() - start)
            start = time.monotonic()
            try:
                dist.barrier(group=g)
            except GroupBrokenError as e:  # a later call on the broken group fails at once, naming the cause
                assert isinstance(e.__cause__, CommTimeoutError), e.__cause__
                assert time.monotonic() - start < 0.5
                report[name] += (str(e),)
        dist.barrier()
        dist.destroy_process_group(g)
    return report


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def reports(request: pytest.FixtureRequest) -> list[dict]:
    return run(mistakes_job, N, timeout=120, env=BACKENDS[request.param])


@pytest.mark.parametrize("case", sorted(CASES))
def test_mistake_on_one_rank(case: str, reports: list[dict]) -> None:
    _, _, exc_type, text = CASES[case]
    kind, message, _ = reports[BAD][case]
    assert kind == exc_type.__name__, (kind, message)
    assert message.startswith(f"[rank {BAD}/{N}] "), message
    assert text in message, message
    for rank in MUST_TIME_OUT.get(case, [r for r in range(N) if r != BAD]):
        kind, message, waited, *later = reports[rank][case]
        assert kind == "CommTimeoutError", (rank, kind, message)
        assert f"did not complete within {TIMEOUT:g} s" in message, message
        assert "a peer rank did not make the matching call" in message, message
        assert TIMEOUT <= waited < TIMEOUT + 5, waited
        assert later and "failed earlier and cannot be used" in later[0], later


def untouched_job() -> list[str]:
    """Buffers passed to a rejected call keep their contents (validation happens before any write)."""
    import commlib as dist

    problems = []
    out = np.full(10, 7.0, np.float32)
    lst = [np.full(2, 7.0, np.float32) for _ in range(2)]
    calls = [
        lambda: dist.all_gather_into_tensor(out, _f32(3)),
        lambda: dist.all_gather(lst, _f32(2)),  # list too short for a world of 3
        lambda: dist.reduce_scatter_tensor(out, _f32(3)),
        lambda: dist.all_to_all_single(out, _f32(10), [5, 5, 0], [4, 4, 4]),
        lambda: dist.scatter(out, [_f32(10)] * 2, src=dist.get_rank()),
    ]
    for call in calls:
        try:
            call()
            problems.append("no error")
        except (TypeError, ValueError):
            pass
        if not (out == 7).all() or not all((a == 7).all() for a in lst):
            problems.append(f"buffer changed by a rejected call: {out}, {lst}")
    dist.barrier()
    return problems


def test_rejected_calls_leave_buffers_untouched() -> None:
    assert run(untouched_job, 3, timeout=60) == [[], [], []]


def destroyed_group_job() -> str:
    import commlib as dist

    g = dist.new_group([0, 1])
    dist.destroy_process_group(g)
    try:
        dist.all_reduce(_f32(), group=g)
    except dist.CommError as e:
        return str(e)
    return "no error"


def test_destroyed_group_is_refused() -> None:
    for message in run(destroyed_group_job, 2, timeout=60):
        assert "group 'group1' has been destroyed" in message, message


def test_launcher_environment_without_mpi_launcher_is_explained() -> None:
    """RANK/WORLD_SIZE say 2 ranks, no MPI launcher started the process and no store is named: say what to do."""
    import subprocess
    import sys

    code = "import commlib as dist, numpy as np; dist.all_reduce(np.ones(2))"
    env = {"RANK": "1", "WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "rank 1 of 2 (RANK and WORLD_SIZE) was not started by an MPI launcher" in proc.stderr, proc.stderr
    assert "set MASTER_ADDR and MASTER_PORT" in proc.stderr and "mpiexec -n 2" in proc.stderr


def not_a_member_job() -> str:
    """Rank 1 calls a collective on a group of ranks 0 and 2; the members are not held up."""
    import commlib as dist

    g = dist.new_group([0, 2])
    x = np.ones(3)
    if dist.get_rank() == 1:
        try:
            dist.all_reduce(x, group=g)
        except ValueError as e:
            return str(e) if (x == 1).all() else "buffer changed"
        return "no error"
    dist.all_reduce(x, group=g)
    return str(x.tolist())


def test_rank_not_in_group() -> None:
    results = run(not_a_member_job, 3, timeout=60)
    assert results[1] == "[rank 1/3] all_reduce: this rank is not a member of group 'group1' (ranks [0, 2])"
    assert results[0] == results[2] == "[2.0, 2.0, 2.0]"


def implicit_init_job() -> tuple:
    """Before init_process_group nothing is initialised; the first call joins the job; explicit init after
    an implicit one is accepted when it agrees, and a second explicit init is refused."""
    import commlib as dist

    before = dist.is_initialized()
    rank = dist.get_rank()
    after = dist.is_initialized()
    dist.init_process_group(backend="mpi", world_size=2, rank=rank, timeout=5)
    try:
        dist.init_process_group()
        again = "no error"
    except RuntimeError as e:
        again = str(e)
    try:
        dist.destroy_process_group()
        dist.init_process_group(world_size=3)
        wrong = "no error"
    except ValueError as e:
        wrong = str(e)
    dist.init_process_group(world_size=2)  # the refused call left nothing behind
    return before, after, again, wrong


def test_implicit_and_explicit_initialisation() -> None:
    for before, after, again, wrong in run(implicit_init_job, 2, timeout=60):
        assert (before, after) == (False, True)
        assert "the default group is already initialised" in again
        assert wrong == "init_process_group: world_size=3, but the job has 2 ranks"


def _numpy_int_ranks_job() -> list[float]:
    import numpy as np

    import commlib as dist

    x = np.full(3, float(dist.get_rank()))
    dist.broadcast(x, src=np.int64(1))  # ranks as numpy integers, as torch accepts them
    y = np.full(2, 1.0)
    dist.reduce(y, dst=np.int32(0))
    return [float(x[0]), float(y[0])]


def test_ranks_may_be_numpy_integers() -> None:
    out = run(_numpy_int_ranks_job, 2)
    assert out == [[1.0, 2.0], [1.0, 1.0]]
