"""Run a function on several real MPI ranks (via the MPICH wheel's mpiexec) in tests."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from commlib._settings import current
from commlib.launch._mpiexec import (
    die_with_parent,
    kill_group_or_process,
    mpiexec_command,
    pid_alive,
    process_tree,
    send_signal,
)

__all__ = ["RankFailure", "fresh_ranks", "run", "warm_ranks", "world_sizes"]

#: World sizes worth testing on a small machine, e.g. ``@pytest.mark.parametrize("n", world_sizes)``.
world_sizes: tuple[int, ...] = (1, 2, 3, 4)

_POLL_INTERVAL = 0.05
# Once a rank has failed, the others often wait for it forever in a collective;
# give them this long to finish before killing them instead of waiting out the
# deadline. Likewise once every rank has returned: only shutdown is left.
_GRACE = 3.0
_STACK_WAIT = 1.0
_HYDRA_EXIT_WAIT = 1.0
_OUTPUT_TAIL = 4000
_WORKER_MODULE = "commlib.testing._worker"
# Spec dir layout, shared with the worker. This package is imported by every rank
# (runpy imports it before "-m commlib.testing._worker"), so it stays stdlib-only
# and must not import _worker itself.
_SPEC_FILE = "spec.pkl"
_ARGS_FILE = "args.pkl"
_LOG_FILE = "output.log"
WORKER_ENV = "COMMLIB_TESTING_WORKER"  # "loading" while a worker imports the function's module, then "1"
_OK, _ERROR = "ok", "error"


def _pid_path(spec_dir: Path, rank: int) -> Path:
    """File holding "<pid> <parent pid>" of a rank."""
    return spec_dir / f"pid.{rank}"


def _stack_path(spec_dir: Path, rank: int) -> Path:
    """File receiving a rank's faulthandler stack dumps."""
    return spec_dir / f"stack.{rank}.txt"


def _result_path(spec_dir: Path, rank: int, status: str) -> Path:
    """File holding a rank's pickled (status, payload); the status is in the name too."""
    return spec_dir / f"result.{rank}.{status}"


# Where the running commlib lives, so that "-m commlib.testing._worker" finds the same one.
_COMMLIB_ROOT = str(Path(__file__).resolve().parents[2])


class RankFailure(AssertionError):
    """Raised by :func:`run` when a rank raised, crashed or did not finish in time."""

    def __init__(
        self,
        message: str,
        failures: dict[int, str] | None = None,
        unfinished: list[int] | None = None,
        stacks: dict[int, str] | None = None,
        output: str = "",
        results: dict[int, Any] | None = None,
        spec_dir: Path | None = None,
    ) -> None:
        super().__init__(message)
        self.failures = failures or {}  # rank -> traceback text
        self.unfinished = unfinished or []  # ranks that wrote no result
        self.stacks = stacks or {}  # rank -> faulthandler dump
        self.output = output  # combined output of all ranks (and hydra)
        self.results = results or {}  # rank -> value, for the ranks that succeeded
        self.spec_dir = spec_dir  # kept for inspection

    def __reduce__(self) -> tuple:
        """Pickle with all attributes (the default would keep only the message)."""
        attributes = (self.failures, self.unfinished, self.stacks, self.output, self.results, self.spec_dir)
        return (type(self), (str(self), *attributes))


class _Ending:
    """How the job ended: mpiexec's exit code, or why we killed each unfinished rank."""

    def __init__(self, exit_code: int | None, killed: dict[int, str] | None = None) -> None:
        self.exit_code = exit_code
        self.killed = killed or {}  # rank -> why, for the ranks killed while unfinished


def run(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` MPI ranks; return the values by rank."""
    if current("COMMLIB_TESTING_WORKER") == "loading":
        raise RuntimeError(
            "commlib.testing.run: called while a worker was importing the module of the function under test, "
            "which would start workers without end; put the script's top-level calls under "
            "`if __name__ == '__main__':`"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    spec = _describe(fn)
    # Warm jobs only from the main thread: Linux ends a job when the thread that started it ends (die_with_parent).
    if _warm.pools is not None and not _warm.fresh and threading.current_thread() is threading.main_thread():
        from commlib.testing._pool import run_warm

        return run_warm(_warm.pools, spec, world_size, args, kwargs, timeout, _environment(env))
    spec_dir = Path(tempfile.mkdtemp(prefix="commlib-testing-"))
    try:
        _write_spec(spec_dir, spec, args, kwargs)
        with open(spec_dir / _LOG_FILE, "wb") as log:
            proc = _start(spec_dir, world_size, env, log)
    except BaseException:
        shutil.rmtree(spec_dir, ignore_errors=True)
        raise
    try:
        ending = _wait(proc, spec_dir, world_size, timeout)
    except BaseException:  # e.g. KeyboardInterrupt or pytest-timeout: leave nothing behind
        _kill_job(proc, spec_dir, _read_pids(spec_dir, world_size).values())
        shutil.rmtree(spec_dir, ignore_errors=True)
        raise
    results = _read_results(spec_dir, world_size)
    if len(results) == world_size and all(s == _OK for s, _ in results.values()):
        shutil.rmtree(spec_dir, ignore_errors=True)
        if ending.exit_code is None:
            message = (
                f"{spec['module']}.{spec['qualname']}: every rank returned, but the job did not exit "
                f"within {_GRACE:g} s (stuck in MPI_Finalize or in a non-daemon thread?) and was killed"
            )
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return [results[rank][1] for rank in range(world_size)]
    raise _failure(spec, world_size, spec_dir, results, ending)


class _Warm:
    """Whether :func:`run` reuses warm jobs (inside :func:`warm_ranks`, not inside :func:`fresh_ranks`)."""

    pools: Any = None  # the running jobs (a commlib.testing._pool.Pools) while warm_ranks() is open
    fresh = False


_warm = _Warm()


@contextlib.contextmanager
def warm_ranks(max_ranks: int = 32, max_memory: float = 6.0) -> Iterator[Any]:
    """Inside: :func:`run` reuses one job of warm ranks per (world size, environment, working directory).

    The ranks of a warm job run one function after another: each function's module is imported once (torch
    with it, if the module imports it), MPI is initialised once. After a function returned on every rank, each
    rank puts its process back as a fresh one would be for the next function (see
    :mod:`commlib.testing._reset`: the default groups destroyed, the environment, working directory, signal
    handlers and other process-wide settings set back, the random generators seeded anew). A rank that finds
    what it cannot put back (a non-daemon thread still running, a global of commlib, ddp, globalview or the
    function's module rebound, a teardown that raised) ends its job after that function: the next call starts
    a new one. A job is never reused after a failure, a timeout or a kill: the failure is reported as for a
    fresh job (each rank's traceback, stack dumps of the ranks killed at the deadline), and the job ends.

    ``max_ranks``, ``max_memory``: idle jobs are stopped (those that served the fewest calls first) to keep at
    most this many warm ranks, using at most this many GiB of memory (resident) in all (but the job last used).
    Every job is stopped when the block ends; a block inside another (or inside :func:`fresh_ranks`) has jobs of
    its own. The block's value counts the calls, the jobs started and the
    jobs that could not be reused (``calls``, ``started``, ``retired``). Use :func:`fresh_ranks` for calls that
    need processes of their own: a function that tests what a process decides once (at import, on first use),
    or how a program ends.
    """
    from commlib.testing._pool import Pools

    outer = _warm.pools, _warm.fresh  # a block inside another (or inside fresh_ranks()) has jobs of its own
    pools = _warm.pools = Pools(max_ranks, int(max_memory * 2**30))
    _warm.fresh = False
    try:
        yield pools
    finally:
        _warm.pools, _warm.fresh = outer
        pools.close()


@contextlib.contextmanager
def fresh_ranks() -> Iterator[None]:
    """Inside: :func:`run` starts a job of new processes for every call, even within :func:`warm_ranks`."""
    before, _warm.fresh = _warm.fresh, True
    try:
        yield
    finally:
        _warm.fresh = before


def _describe(fn: Callable[..., Any]) -> dict[str, Any]:
    """Where the worker finds ``fn``: its module name, source file and qualified name."""
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not callable(fn) or not qualname or not module:
        raise TypeError(f"run() needs a module-level function, got {fn!r}")
    if "<" in qualname:  # "<locals>", "<lambda>"
        raise TypeError(
            f"run() needs a module-level function, got {module}.{qualname}: the ranks "
            "import it by name, so define it at module level and pass data as arguments"
        )
    import inspect  # only the parent needs it; the ranks import this package too

    try:
        file = inspect.getsourcefile(fn)
    except TypeError:
        file = None
    if file is not None:
        file = os.path.abspath(file)
    # "" on sys.path means the parent's cwd; the ranks start there too, but be explicit.
    sys_path = [os.path.abspath(p) if p == "" else p for p in sys.path]
    if file is not None:
        sys_path.insert(0, os.path.dirname(file))
    return {"module": module, "qualname": qualname, "file": file, "sys_path": sys_path}


def _write_spec(spec_dir: Path, spec: dict[str, Any], args: tuple, kwargs: dict) -> None:
    try:
        payload = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"run(): the arguments of {spec['qualname']} must be picklable") from exc
    (spec_dir / _ARGS_FILE).write_bytes(payload)
    (spec_dir / _SPEC_FILE).write_bytes(pickle.dumps(spec))


def _environment(extra: Mapping[str, str] | None) -> dict[str, str]:
    """Environment of the ranks: ours minus pytest's own variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.setdefault("OMP_NUM_THREADS", "1")  # 4 ranks on 2 cores: no thread pools each
    env["PYTHONUNBUFFERED"] = "1"  # output of a rank that hangs or dies is not lost
    env["PYTHONPATH"] = os.pathsep.join([_COMMLIB_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


def _start(spec_dir: Path, world_size: int, env: Mapping[str, str] | None, log: Any) -> subprocess.Popen:
    argv = [sys.executable, "-m", _WORKER_MODULE, str(spec_dir)]
    return subprocess.Popen(
        mpiexec_command(world_size, argv),
        stdin=subprocess.DEVNULL,  # hydra forwards stdin to rank 0; give it nothing
        stdout=log,
        stderr=subprocess.STDOUT,
        env=_environment(env),
        start_new_session=True,  # our own process group, killable as a whole
        preexec_fn=die_with_parent(),  # run()'s thread waits for the job
    )


def _statuses(spec_dir: Path) -> dict[int, str]:
    """rank -> "ok"/"error" for the ranks that wrote a result (read from file names)."""
    found: dict[int, str] = {}
    for name in os.listdir(spec_dir):
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "result" and parts[1].isdigit():
            found[int(parts[1])] = parts[2]
    return found


def _wait(proc: subprocess.Popen, spec_dir: Path, world_size: int, timeout: float) -> _Ending:
    """Wait for the job to exit; kill it at the deadline, or soon after a rank failed
    or after all ranks returned (then only MPI_Finalize or interpreter exit can hang)."""
    deadline = time.monotonic() + timeout
    limit, grace = deadline, False
    while (remaining := limit - time.monotonic()) > 0:
        try:
            return _Ending(proc.wait(timeout=min(remaining, _POLL_INTERVAL)))
        except subprocess.TimeoutExpired:
            pass
        if not grace and _grace_due(spec_dir, world_size):
            limit, grace = min(deadline, time.monotonic() + _GRACE), True
    failed = sorted(r for r, s in _statuses(spec_dir).items() if s == _ERROR)
    reason = (
        f"hung: killed {_GRACE:g} s after rank(s) {failed} failed"
        if failed and limit < deadline
        else f"hung: killed after the {timeout:g} s deadline"
    )
    return _Ending(None, _stop(proc, spec_dir, world_size, reason))


def _grace_due(spec_dir: Path, world_size: int) -> bool:
    """Whether a rank failed or all ranks returned: the job should end soon now."""
    statuses = _statuses(spec_dir)
    return _ERROR in statuses.values() or len(statuses) == world_size


def _stop(
    proc: subprocess.Popen, spec_dir: Path, world_size: int, reason: str, job_dir: Path | None = None
) -> dict[int, str]:
    """Dump the stacks of the unfinished ranks, then kill the job; say why each died.

    ``job_dir``: the directory named on the ranks' command lines, when not ``spec_dir`` (a warm job's)."""
    pids = _read_pids(spec_dir, world_size)
    done = _statuses(spec_dir)
    killed: dict[int, str] = {}
    for rank in range(world_size):
        if rank in done:
            continue
        pid = pids.get(rank)
        if pid is None:
            killed[rank] = f"{reason} (before it recorded its pid)"
        elif pid_alive(pid) and send_signal(pid, signal.SIGUSR1):  # faulthandler dumps the stack
            killed[rank] = reason
        else:
            killed[rank] = "exited without a result"
    _await_stacks(spec_dir, [r for r, why in killed.items() if why == reason])
    _kill_job(proc, job_dir or spec_dir, pids.values())
    return killed


def _await_stacks(spec_dir: Path, ranks: list[int]) -> None:
    # faulthandler writes synchronously in the signal handler, so a non-empty file
    # is (nearly) complete; a rank that cannot run the handler costs the full wait.
    end = time.monotonic() + _STACK_WAIT
    while time.monotonic() < end:
        if all(_read_text(_stack_path(spec_dir, r)) for r in ranks):
            time.sleep(_POLL_INTERVAL)  # let a multi-thread dump complete
            return
        time.sleep(0.01)


def _kill_job(proc: subprocess.Popen, spec_dir: Path, rank_pids: Iterable[int]) -> None:
    """SIGKILL the ranks (and their children), then hydra if it lingers; reap mpiexec."""
    # Hydra's proxy and the ranks are outside mpiexec's process group (setsid), so
    # killing that group alone would orphan them. Collect the whole tree first,
    # while parent links still lead to it. Until we reap mpiexec its pid
    # (and so its tree) cannot belong to anybody else.
    tree = process_tree(proc.pid) if proc.returncode is None else {}
    # Ranks already reparented are recognised by the spec dir in their command
    # line, so that a recycled pid is never hit.
    ranks = {pid for pid in rank_pids if _runs_in(pid, spec_dir)}
    leaves = ranks | {pid for pid, ppid in tree.items() if ppid != proc.pid}
    for pid in leaves:
        kill_group_or_process(pid)
    # Killing only the ranks lets hydra reap them and exit by itself; killing the
    # proxy as well would leave them as zombies for an init that may never reap them.
    try:
        proc.wait(timeout=_HYDRA_EXIT_WAIT)
    except subprocess.TimeoutExpired:
        for pid in tree:
            kill_group_or_process(pid)
        kill_group_or_process(proc.pid)
        proc.wait()
    _await_death(set(tree) | ranks)


def _await_death(pids: set[int]) -> None:
    # kill() returns before the target is gone; callers promise that nothing is left.
    end = time.monotonic() + _STACK_WAIT
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.01)


def _runs_in(pid: int, spec_dir: Path) -> bool:
    """Whether ``pid`` is a live worker of the job in ``spec_dir``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.fsencode(spec_dir) in f.read().split(b"\0")
    except FileNotFoundError:
        return not os.path.isdir("/proc") and pid_alive(pid)
    except OSError:
        return False


def _read_pids(spec_dir: Path, world_size: int) -> dict[int, int]:
    pids: dict[int, int] = {}
    for rank in range(world_size):
        try:
            pids[rank] = int(_pid_path(spec_dir, rank).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return pids


def _read_results(spec_dir: Path, world_size: int) -> dict[int, tuple[str, Any]]:
    results: dict[int, tuple[str, Any]] = {}
    for rank, status in _statuses(spec_dir).items():
        if rank >= world_size:
            continue
        try:
            with open(_result_path(spec_dir, rank, status), "rb") as f:
                results[rank] = pickle.load(f)
        except Exception as exc:  # e.g. a value whose class won't import here
            results[rank] = (_ERROR, f"its result could not be unpickled: {exc!r}")
    return results


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _failure(
    spec: dict[str, Any],
    world_size: int,
    spec_dir: Path,
    results: dict[int, tuple[str, Any]],
    ending: _Ending,
) -> RankFailure:
    failures = {r: str(p) for r, (s, p) in sorted(results.items()) if s != _OK}
    unfinished = [r for r in range(world_size) if r not in results]
    stacks = {r: t for r in unfinished if (t := _read_text(_stack_path(spec_dir, r))).strip()}
    output = _read_text(spec_dir / _LOG_FILE)
    lines = [f"{spec['module']}.{spec['qualname']} failed on {world_size} rank(s):"]
    for rank, text in failures.items():
        lines += [f"--- rank {rank} raised:", text.rstrip()]
    for rank in unfinished:
        lines.append(f"--- rank {rank} did not finish: {_why_unfinished(rank, ending)}")
        if rank in stacks:
            lines += ["stack dump:", stacks[rank].rstrip()]
    tail = output[-_OUTPUT_TAIL:].rstrip()
    lines.append(f"--- output of all ranks (last {len(tail)} characters):" if tail else "--- no output")
    lines += [tail] if tail else []
    lines.append(f"--- files kept in {spec_dir}")
    ok = {r: p for r, (s, p) in results.items() if s == _OK}
    return RankFailure("\n".join(lines), failures, unfinished, stacks, output, ok, spec_dir)


def _why_unfinished(rank: int, ending: _Ending) -> str:
    if rank in ending.killed:
        return ending.killed[rank]
    return (
        f"exited without a result (mpiexec exit code {ending.exit_code}): it died or "
        "exited early, or hydra killed it after another rank died"
    )
