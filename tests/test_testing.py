"""Tests of commlib.testing.run, the multi-rank test helper, with real mpiexec jobs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import commlib.testing
from commlib.launch._mpiexec import find_mpiexec, mpiexec_command
from commlib.testing import RankFailure, fresh_ranks, run, warm_ranks, world_sizes


@dataclass(frozen=True)
class Payload:
    """An argument whose class lives in this module, so the ranks must import it."""

    name: str
    size: int


def _rank_size_sum() -> tuple[int, int, int]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return comm.rank, comm.size, comm.allreduce(comm.rank + 1)


def _raise_on_rank_1() -> int:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.rank
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank * 10


def _raise_on_rank_1_before_allreduce() -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.rank == 1:
        raise ValueError("rank 1 gives up")
    return comm.allreduce(1)  # waits for rank 1 forever


def _sleep_on_rank_1_forever() -> int:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.rank
    if rank == 1:
        time.sleep(1000)
    return rank


def _sigkill_rank_1() -> int:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.rank
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def _linger_in_a_thread_on_rank_0() -> int:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.rank
    if rank == 0:  # a non-daemon thread: the interpreter waits for it at exit
        threading.Thread(target=time.sleep, args=(1000,)).start()
    return rank


def _echo(a: int, b: Payload, *, c: str = "", d: object = None) -> tuple:
    return int(os.environ["PMI_RANK"]), a, b, c, d, os.environ.get("COMMLIB_TEST_VAR")


def _numpy_loaded() -> bool:
    return "numpy" in sys.modules


def _alive(pid: int) -> bool:
    """Whether pid still runs; zombies awaiting an absent reaper count as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X")


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # the process ended in between
        return []


def _job_processes(spec_dir: Path) -> list[int]:
    """Pids of processes whose command line mentions the spec dir (mpiexec, ranks)."""
    needle = os.fsencode(spec_dir)
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return [pid for pid in found if _alive(pid)]


def _discard(err: RankFailure) -> None:
    """Remove the spec dir that run() keeps on failure (only once the test passed)."""
    assert err.spec_dir is not None
    shutil.rmtree(err.spec_dir)


def _recorded_pids(spec_dir: Path) -> set[int]:
    """Rank pids and their parents (hydra's proxy), as recorded by the workers."""
    pids: set[int] = set()
    for path in spec_dir.glob("pid.*"):
        pids.update(int(p) for p in path.read_text().split())
    return pids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", world_sizes)
def test_values_come_back_per_rank(n: int) -> None:
    expected_sum = n * (n + 1) // 2
    assert run(_rank_size_sum, n) == [(rank, n, expected_sum) for rank in range(n)]


@pytest.mark.timeout(60)
def test_args_kwargs_and_env_are_passed() -> None:
    payload = Payload("x", 3)
    got = run(_echo, 2, 7, payload, c="see", d={"k": [1, 2]}, env={"COMMLIB_TEST_VAR": "v"})
    assert got == [(rank, 7, payload, "see", {"k": [1, 2]}, "v") for rank in range(2)]


@pytest.mark.timeout(60)
def test_raising_rank_is_reported_and_others_results_kept() -> None:
    with pytest.raises(RankFailure) as info:
        run(_raise_on_rank_1, 3)
    err = info.value
    assert sorted(err.failures) == [1]
    assert "ValueError: boom from rank 1" in err.failures[1]
    assert "rank 1 raised" in str(err) and "boom from rank 1" in str(err)
    assert err.unfinished == []
    assert err.results == {0: 0, 2: 20}
    assert err.spec_dir is not None and str(err.spec_dir) in str(err)
    _discard(err)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_ranks_stuck_behind_a_failed_rank_are_killed_early() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(_raise_on_rank_1_before_allreduce, 2, timeout=50)
    elapsed = time.monotonic() - start
    err = info.value
    assert sorted(err.failures) == [1] and "rank 1 gives up" in err.failures[1]
    assert err.unfinished == [0]
    assert "_raise_on_rank_1_before_allreduce" in err.stacks[0]
    assert elapsed < 15, elapsed  # the grace period, not the 50 s deadline
    assert _job_processes(err.spec_dir) == []
    _discard(err)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_hanging_rank_is_killed_at_deadline_with_stack_dump() -> None:
    timeout = 5.0
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(_sleep_on_rank_1_forever, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    err = info.value
    assert timeout <= elapsed < timeout + 6, elapsed
    assert err.unfinished == [1] and err.failures == {}
    assert "_sleep_on_rank_1_forever" in err.stacks[1]
    assert "hung: killed after the 5 s deadline" in str(err)
    assert "_sleep_on_rank_1_forever" in str(err)
    recorded = _recorded_pids(err.spec_dir)
    assert len(recorded) >= 3  # two ranks and the proxy
    assert [pid for pid in recorded if _alive(pid)] == []
    assert _job_processes(err.spec_dir) == []
    _discard(err)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_job_lingering_after_all_ranks_returned_is_killed_with_a_warning() -> None:
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="every rank returned, but the job did not exit"):
        assert run(_linger_in_a_thread_on_rank_0, 2, timeout=50) == [0, 1]
    assert time.monotonic() - start < 15  # the grace period, not the 50 s deadline


@pytest.mark.timeout(60)
def test_rank_killed_by_signal_is_reported() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(_sigkill_rank_1, 3, timeout=50)
    err = info.value
    assert time.monotonic() - start < 15
    assert 1 in err.unfinished and 1 not in err.failures
    assert "rank 1 did not finish: exited without a result" in str(err)
    assert _job_processes(err.spec_dir) == []
    _discard(err)


_ORPHAN_SCRIPT = """
import sys
sys.path[:0] = sys.argv[1:]
from commlib.testing import run
from test_testing import _sleep_on_rank_1_forever
run(_sleep_on_rank_1_forever, 2, timeout=100, env={"COMMLIB_TEST_MARKER": "%s"})
"""


def _marked_processes(marker: bytes) -> list[int]:
    """Live pids whose environment holds the given marker."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker in Path(f"/proc/{entry}/environ").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return [pid for pid in found if _alive(pid)]


@pytest.mark.timeout(60)
def test_job_dies_with_a_killed_parent() -> None:
    marker = f"COMMLIB_TEST_MARKER=orphan-{os.getpid()}-{time.monotonic_ns()}".encode()
    here = str(Path(__file__).resolve().parent)
    script = _ORPHAN_SCRIPT % marker.decode().partition("=")[2]
    parent = subprocess.Popen([sys.executable, "-c", script, here, *sys.path])
    try:
        end = time.monotonic() + 20
        # mpiexec, the proxy and both ranks carry the marker once everything runs.
        while len(pids := _marked_processes(marker)) < 4:
            assert time.monotonic() < end and parent.poll() is None, "the job never started"
            time.sleep(0.05)
        # Read the command lines while the job surely runs: once the parent is killed it may vanish at once.
        argvs = [_cmdline(pid) for pid in pids]
    finally:
        parent.kill()
        parent.wait()
    # The killed parent could not remove its spec dir: the last argument of mpiexec and the ranks.
    spec_dir = Path(os.fsdecode(next(argv[-2] for argv in argvs if b"commlib.testing._worker" in argv)))
    end = time.monotonic() + 10
    while _marked_processes(marker):
        assert time.monotonic() < end, "the job outlived its killed parent"
        time.sleep(0.05)
    assert spec_dir.name.startswith("commlib-testing-")
    shutil.rmtree(spec_dir)


@pytest.mark.timeout(60)
def test_worker_imports_nothing_heavy_beyond_commlib() -> None:
    # The worker runs "-m commlib.testing._worker", which imports commlib itself;
    # anything beyond that would be the worker's fault.
    code = "import sys, commlib; print('numpy' in sys.modules)"
    by_commlib = (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "True"
    )
    assert run(_numpy_loaded, 1) == [by_commlib]


@pytest.mark.timeout(60)
def test_nested_functions_are_rejected() -> None:
    def local() -> None:
        pass

    with pytest.raises(TypeError, match="module-level"):
        run(local, 1)
    with pytest.raises(TypeError, match="module-level"):
        run(lambda: None, 1)


@pytest.mark.timeout(60)
def test_mpiexec_command_line() -> None:
    mpiexec = find_mpiexec()
    assert os.access(mpiexec, os.X_OK)
    assert mpiexec_command(3, ["python", "x.py"]) == [mpiexec, "-prepend-rank", "-n", "3", "python", "x.py"]
    assert mpiexec_command(1, ["a"], prepend_rank=False) == [mpiexec, "-n", "1", "a"]
    with pytest.raises(ValueError):
        mpiexec_command(0, ["a"])


UNGUARDED = """
from commlib.testing import run

def job():
    return 1

print(run(job, 2, timeout=60))
"""


def test_a_script_without_a_main_guard_gets_an_error_not_workers_without_end(tmp_path: Path) -> None:
    """Workers load the caller's script; its top-level run() must refuse instead of starting more workers."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "put the script's top-level calls under `if __name__ == '__main__':`" in proc.stderr, proc.stderr[-2000:]


# -- warm ranks: one job serves call after call --------------------------------------------------------------


def _pid_and_marker() -> tuple[int, str | None, bool]:
    """This rank's pid, then what an earlier call may have left behind (it must not be seen): a variable of the
    environment, a warning filter."""
    import warnings

    seen = os.environ.get("COMMLIB_TEST_LEFT_BEHIND")
    filtered = any(f[0] == "error" and f[2] is UserWarning for f in warnings.filters)
    warnings.simplefilter("error", UserWarning)
    return os.getpid(), seen, filtered


def _change_the_environment(where: str) -> int:
    os.environ["COMMLIB_TEST_LEFT_BEHIND"] = "yes"
    os.chdir(where)
    return os.getpid()


def _implicit_commlib_world(destroy: bool) -> tuple[int, bool, float]:
    """commlib joined implicitly by a first call, as in a new program; destroyed, or left to the program's end
    (then the reset destroys it)."""
    import numpy as np

    import commlib as dist

    x = np.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    if destroy:
        dist.destroy_process_group()
    return os.getpid(), dist.is_initialized(), float(x[0])


def _leave_a_thread() -> int:
    threading.Thread(target=time.sleep, args=(0.2,)).start()
    return os.getpid()


def _patch_commlib() -> int:
    import commlib

    commlib.get_rank = lambda group=None: 0  # a patch a fresh process would not have
    return os.getpid()


def _print_then(fail: bool) -> int:
    print(f"call that {'fails' if fail else 'passes'} on rank {os.environ['PMI_RANK']}", flush=True)
    if fail and os.environ["PMI_RANK"] == "1":
        raise ValueError("the second call fails")
    return os.getpid()


def _draw(seed: bool) -> list[float]:
    """Numbers from the generators of random, numpy and torch, seeded or as the process left them."""
    import random

    import numpy as np
    import torch

    if seed:
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
    return [random.random(), np.random.random(), torch.rand(1).item()]


def _warm_job_processes(pools: object) -> list[int]:
    """Live processes of the warm jobs (their directory is on their command lines)."""
    return [pid for pool in pools.jobs.values() for pid in _job_processes(pool.dir)]  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_warm_ranks_serve_call_after_call_each_as_in_a_new_process() -> None:
    with warm_ranks():
        first = run(_pid_and_marker, 2)
        second = run(_pid_and_marker, 2)
        assert [pid for pid, _, _ in first] == [pid for pid, _, _ in second]  # the same processes
        assert [(seen, filtered) for _, seen, filtered in second] == [(None, False)] * 2  # filters put back
        other = run(_pid_and_marker, 2, env={"COMMLIB_TEST_VAR": "another environment"})
        assert {pid for pid, _, _ in other}.isdisjoint(pid for pid, _, _ in first)  # a job of its own
        three = run(_pid_and_marker, 3)
        assert len({pid for pid, _, _ in three}) == 3
        for destroy in (True, False, True):  # commlib's default group: joined by a first call, every time
            got = run(_implicit_commlib_world, 2, destroy)
            assert [(init, total) for _, init, total in got] == [(not destroy, 3.0)] * 2
        assert [pid for pid, _, _ in got] == [pid for pid, _, _ in first]
        pools = commlib.testing._warm.pools
        assert pools.started == 3 and pools.retired == []
        running = _warm_job_processes(pools)
        assert len(running) >= 7  # 2 + 2 + 3 ranks, and hydra
    assert [pid for pid in running if _alive(pid)] == []  # the block's end stopped every job


@pytest.mark.timeout(120)
def test_warm_ranks_fresh_inside_and_argument_errors() -> None:
    with warm_ranks():
        first = run(_pid_and_marker, 1)
        with fresh_ranks():
            assert run(_pid_and_marker, 1)[0][0] != first[0][0]
        with pytest.raises(TypeError, match="picklable"):
            run(_pid_and_marker, 1, threading.Lock())
        assert run(_pid_and_marker, 1)[0][0] == first[0][0]  # the job still serves


@pytest.mark.timeout(120)
def test_a_warm_rank_that_cannot_be_put_back_retires() -> None:
    with warm_ranks():
        pools = commlib.testing._warm.pools
        changed = run(_change_the_environment, 2, "/")
        after_change = run(_pid_and_marker, 2)
        assert set(changed).isdisjoint(pid for pid, _, _ in after_change)
        assert [seen for _, seen, _ in after_change] == [None, None]
        thread = run(_leave_a_thread, 2)
        after_thread = run(_pid_and_marker, 2)
        assert set(thread).isdisjoint(pid for pid, _, _ in after_thread)
        patched = run(_patch_commlib, 2)
        after_patch = run(_pid_and_marker, 2)
        assert set(patched).isdisjoint(pid for pid, _, _ in after_patch)
        assert [why for _, ranks in pools.retired for why in ranks.values()] == (
            ["environment changed: COMMLIB_TEST_LEFT_BEHIND, (the working directory)"] * 2
            + ["non-daemon threads still running: Thread-1 (sleep)"] * 2
            + ["rebound: commlib.get_rank"] * 2
        )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_warm_job_left_lingering_is_killed_with_a_warning() -> None:
    with warm_ranks():
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match="every rank returned, but the job did not exit"):
            assert run(_linger_in_a_thread_on_rank_0, 2, timeout=50) == [0, 1]
        assert time.monotonic() - start < 15


@pytest.mark.timeout(120)
def test_a_warm_failure_is_reported_as_a_fresh_one_and_ends_the_job() -> None:
    with warm_ranks():
        passed = run(_print_then, 3, False)
        with pytest.raises(RankFailure) as info:
            run(_print_then, 3, True)
        err = info.value
        assert sorted(err.failures) == [1] and "ValueError: the second call fails" in err.failures[1]
        assert err.unfinished == [] and err.results == {0: passed[0], 2: passed[2]}
        assert "call that fails on rank 1" in err.output
        assert "call that passes" not in err.output  # the earlier call's output is not this one's
        assert err.spec_dir is not None and (err.spec_dir / "output.log").exists()
        _discard(err)
        assert set(run(_print_then, 3, False)).isdisjoint(passed)  # a new job


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_warm_ranks_hung_or_stuck_are_killed_with_stack_dumps() -> None:
    with warm_ranks():
        pools = commlib.testing._warm.pools
        run(_rank_size_sum, 2)
        job = next(iter(pools.jobs.values())).dir
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            run(_sleep_on_rank_1_forever, 2, timeout=5)
        elapsed = time.monotonic() - start
        err = info.value
        assert 5 <= elapsed < 11, elapsed
        assert err.unfinished == [1] and err.failures == {}
        assert "_sleep_on_rank_1_forever" in err.stacks[1]
        assert "hung: killed after the 5 s deadline" in str(err)
        assert _job_processes(job) == [] and not job.exists()
        _discard(err)

        run(_rank_size_sum, 2)
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            run(_raise_on_rank_1_before_allreduce, 2, timeout=50)
        err = info.value
        assert time.monotonic() - start < 15  # the grace period, not the 50 s deadline
        assert sorted(err.failures) == [1] and err.unfinished == [0]
        assert "_raise_on_rank_1_before_allreduce" in err.stacks[0]
        _discard(err)

        run(_rank_size_sum, 3)
        with pytest.raises(RankFailure) as info:
            run(_sigkill_rank_1, 3, timeout=50)
        err = info.value
        assert 1 in err.unfinished and "rank 1 did not finish: exited without a result" in str(err)
        _discard(err)
        assert pools.jobs == {} or all(p.usable() for p in pools.jobs.values())


@pytest.mark.timeout(300)
def test_warm_ranks_seed_their_generators_anew() -> None:
    pytest.importorskip("torch")
    with warm_ranks():
        seeded = run(_draw, 1, True)
        assert run(_draw, 1, True) == seeded
        after = run(_draw, 1, False)[0]  # not the sequence the last function seeded
        assert all(a != b for a, b in zip(after, seeded[0], strict=True)), (after, seeded)


_WARM_ORPHAN_SCRIPT = """
import sys
sys.path[:0] = sys.argv[1:]
from commlib.testing import run, warm_ranks
from test_testing import _rank_size_sum, _sleep_on_rank_1_forever
with warm_ranks():
    run(_rank_size_sum, 2, env={"COMMLIB_TEST_MARKER": "%s"})
    run(_sleep_on_rank_1_forever, 2, timeout=100, env={"COMMLIB_TEST_MARKER": "%s"})
"""


@pytest.mark.timeout(60)
def test_warm_job_dies_with_a_killed_parent() -> None:
    marker = f"COMMLIB_TEST_MARKER=warm-orphan-{os.getpid()}-{time.monotonic_ns()}".encode()
    here = str(Path(__file__).resolve().parent)
    value = marker.decode().partition("=")[2]
    parent = subprocess.Popen([sys.executable, "-c", _WARM_ORPHAN_SCRIPT % (value, value), here, *sys.path])
    try:
        end = time.monotonic() + 30
        while not any(p.endswith(b"call-1/pid.1") for p in _marked_files(marker)):  # the second call runs
            assert time.monotonic() < end and parent.poll() is None, "the job never started"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
    end = time.monotonic() + 10
    while _marked_processes(marker):
        assert time.monotonic() < end, "the warm job outlived its killed parent"
        time.sleep(0.05)


def _marked_files(marker: bytes) -> list[bytes]:
    """Names in the directories of the warm jobs of processes carrying ``marker``."""
    names: list[bytes] = []
    for pid in _marked_processes(marker):
        for arg in _cmdline(pid):
            if b"commlib-testing-warm-" in arg and os.path.isdir(arg):
                names += [os.fsencode(p) for p in Path(os.fsdecode(arg)).glob("call-*/*")]
    return names


class _IdleJob:
    """What ``Pools`` asks of an idle warm job: its size, its calls, its memory; stopping it."""

    def __init__(self, world_size: int, calls: int) -> None:
        self.world_size, self.calls, self.stopped = world_size, calls, False

    def memory(self) -> int:
        return 0

    def stop(self) -> None:
        self.stopped = True

    def reap(self, end: float) -> None:
        pass


def test_warm_jobs_most_tests_share_outlive_a_test_s_own() -> None:
    """Room is made by stopping the idle jobs that served the fewest calls (the least recently used of those),
    never the job just given back: a job of one test's own settings goes before the jobs every test reuses."""
    from commlib.testing._pool import Pools

    pools = Pools(max_ranks=8, max_memory=1 << 40)
    shared, own, other = _IdleJob(4, 9), _IdleJob(2, 1), _IdleJob(2, 5)
    pools.jobs.update({"shared": shared, "own": own, "other": other})  # least recently used first
    pools._make_room(2)  # 8 ranks idle, 2 more wanted: one 2-rank job goes
    assert (shared.stopped, own.stopped, other.stopped) == (False, True, False) and pools.evicted == 1
    new = _IdleJob(4, 1)
    pools.give_back("new", new)  # 10 ranks now: the least used but the one just given back
    assert (shared.stopped, other.stopped, new.stopped) == (False, True, False) and list(pools.jobs) == [
        "shared",
        "new",
    ]
