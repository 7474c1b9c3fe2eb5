"""Warm jobs for :func:`commlib.testing.run` (the parent's side; the ranks' side is ``_worker.serve``).

A warm job is one mpiexec job whose ranks run one function after another. Its directory holds:

- ``output.log``: the output of every rank, all calls (each call's failure report shows its own part);
- ``bell.<rank>``: a FIFO per rank, written (one byte) whenever a rank has something new to look at;
- ``notify``: a FIFO the ranks write (one byte) whenever they wrote a result, or are ready or retiring;
- ``call-<k>/``: call ``k``, laid out as a fresh job's directory (spec, arguments, pid, stack dump and
  result per rank), plus ``reset`` (the parent's word that every rank returned: put the process back) and
  ``ready.<rank>`` or ``retire.<rank>`` (the rank's answer: the process is as new / it cannot be reused,
  with the reason);
- ``stop``: the parent's word to end: ranks waiting for a call or for the word on their last call return
  and exit as a fresh job's ranks do.

The FIFOs only wake the other side: the files are the truth, so a lost wake-up costs at most a poll
interval. Ranks also leave when the parent process is gone.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from commlib.launch._mpiexec import die_with_parent, mpiexec_command
from commlib.testing import (
    _ERROR,
    _GRACE,
    _LOG_FILE,
    _OK,
    _POLL_INTERVAL,
    _WORKER_MODULE,
    RankFailure,
    _Ending,
    _failure,
    _kill_job,
    _read_pids,
    _read_results,
    _read_text,
    _statuses,
    _stop,
    _write_spec,
)

__all__ = ["Pool", "Pools", "run_warm"]

#: After this many calls a job is replaced: each default group a function makes leaves things behind that
#: destroy_process_group() does not free (at 35ebcf2: the world's two MPI duplicates, of MPICH's ~2000
#: communicators; on world rank 0 the job monitor's store server, a thread and 4 descriptors; on the nccl
#: emulator ~5 threads and a few sockets per rank).
MAX_CALLS = 50
#: How long the ranks may take to put their processes back (milliseconds, as a rule; a destroy_process_group that
#: hangs is killed then, with a warning).
RESET_WAIT = 10.0
RESET, STOP, NOTIFY = "reset", "stop", "notify"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def bell_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"bell.{rank}"


def call_path(job_dir: Path, k: int) -> Path:
    return job_dir / f"call-{k}"


def answer_path(call_dir: Path, rank: int, ready: bool) -> Path:
    """Where a rank says it is ready for the next call (or why it is not: ``retire``)."""
    return call_dir / f"{'ready' if ready else 'retire'}.{rank}"


class Pool:
    """One warm mpiexec job of ``world_size`` ranks with environment ``env``."""

    def __init__(self, world_size: int, env: Mapping[str, str]) -> None:
        self.world_size = world_size
        self.calls = 0
        self.dir = Path(tempfile.mkdtemp(prefix="commlib-testing-warm-"))
        self.proc: subprocess.Popen | None = None
        self.notify = -1
        self.retired: dict[int, str] = {}  # rank -> why it could not be reused, once it said so
        self.pids: list[int] = []  # the ranks' pids, once known
        try:
            for rank in range(world_size):
                os.mkfifo(bell_path(self.dir, rank))
            os.mkfifo(self.dir / NOTIFY)
            # Read and write: never an end of file, and the ranks' opens for writing never fail while we live.
            self.notify = os.open(self.dir / NOTIFY, os.O_RDWR | os.O_NONBLOCK)
            argv = [sys.executable, "-m", _WORKER_MODULE, "--warm", str(self.dir), str(os.getpid())]
            with open(self.dir / _LOG_FILE, "wb") as log:
                self.proc = subprocess.Popen(
                    mpiexec_command(world_size, argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    start_new_session=True,
                    preexec_fn=die_with_parent(),
                )
        except BaseException:
            self._discard()
            raise

    # -- state ------------------------------------------------------------------------------------------------
    def memory(self) -> int:
        """The resident memory of the ranks, in bytes (0 before the first call)."""
        total = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * _PAGE
            except (OSError, ValueError, IndexError):
                continue
        return total

    def usable(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.calls < MAX_CALLS

    def _ring(self) -> None:
        """Wake every rank (one byte in its FIFO; a rank that is gone has no reader: nothing to wake)."""
        for rank in range(self.world_size):
            try:
                fd = os.open(bell_path(self.dir, rank), os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                os.write(fd, b"!")
            except OSError:
                pass
            finally:
                os.close(fd)

    def _sleep(self, seconds: float) -> None:
        """Until a rank rings (or ``seconds`` passed)."""
        if seconds <= 0:
            return
        ready, _, _ = select.select([self.notify], [], [], seconds)
        if ready:
            try:
                while os.read(self.notify, 4096):
                    pass
            except BlockingIOError:
                pass

    # -- one call ---------------------------------------------------------------------------------------------
    def call(
        self, spec: dict[str, Any], args: tuple, kwargs: dict, timeout: float
    ) -> tuple[list[Any] | None, RankFailure | None, bool]:
        """Run one function on every rank: (values, None, reusable) or (None, failure, False)."""
        assert self.proc is not None
        k, n = self.calls, self.world_size
        call_dir = call_path(self.dir, k)
        staging = self.dir / f".call-{k}"
        staging.mkdir()
        try:
            _write_spec(staging, spec, args, kwargs)  # TypeError for arguments that do not pickle: job unharmed
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.calls += 1
        offset = os.path.getsize(self.dir / _LOG_FILE)
        deadline = time.monotonic() + timeout
        staging.rename(call_dir)  # the ranks see the whole call or nothing
        self._ring()
        try:
            ending = self._await_results(call_dir, deadline, timeout)
        except BaseException:  # KeyboardInterrupt, pytest-timeout: leave nothing behind
            self._kill()
            self._discard()
            raise
        results = _read_results(call_dir, n)
        if not self.pids:
            self.pids = list(_read_pids(call_dir, n).values())
        if ending is None:  # every rank returned its value
            reusable = self._await_answers(spec, call_dir)
            shutil.rmtree(call_dir, ignore_errors=True)
            return [results[rank][1] for rank in range(n)], None, reusable
        failure = _failure(spec, n, self._keep(call_dir, offset), results, ending)
        self._discard()
        return None, failure, False

    def _await_results(self, call_dir: Path, deadline: float, timeout: float) -> _Ending | None:
        """None once every rank returned a value; else how the job ended (it has ended by then).

        As a fresh job's wait: a rank that failed ends the job (the others end as a fresh job's
        would, or are killed with a stack dump :data:`_GRACE` seconds later), so does the deadline.
        """
        assert self.proc is not None
        limit, stopped = deadline, False
        while True:
            statuses = _statuses(call_dir)
            if len(statuses) == self.world_size and all(s == _OK for s in statuses.values()):
                return None
            if not stopped and _ERROR in statuses.values():
                (self.dir / STOP).touch()  # the ranks that returned end now, those that return later too
                self._ring()
                limit, stopped = min(deadline, time.monotonic() + _GRACE), True
            code = self.proc.poll()
            if code is not None:
                return _Ending(code)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            self._sleep(min(remaining, _POLL_INTERVAL))
        failed = sorted(r for r, s in _statuses(call_dir).items() if s == _ERROR)
        reason = (
            f"hung: killed {_GRACE:g} s after rank(s) {failed} failed"
            if failed and limit < deadline
            else f"hung: killed after the {timeout:g} s deadline"
        )
        return _Ending(None, _stop(self.proc, call_dir, self.world_size, reason, job_dir=self.dir))

    def _await_answers(self, spec: dict[str, Any], call_dir: Path) -> bool:
        """Tell the ranks to put their process back; whether every one of them is ready for another call."""
        assert self.proc is not None
        (call_dir / RESET).touch()
        self._ring()
        end = time.monotonic() + RESET_WAIT
        ranks = range(self.world_size)
        while True:
            ready = [answer_path(call_dir, r, True).exists() for r in ranks]
            retiring = {r: _read_text(answer_path(call_dir, r, False)) for r in ranks}
            retiring = {r: why for r, why in retiring.items() if why}
            if all(ready[r] or r in retiring for r in ranks):
                break
            if self.proc.poll() is not None or time.monotonic() >= end:
                self._kill()
                warnings.warn(
                    f"{spec['module']}.{spec['qualname']}: every rank returned, but the ranks of the warm job "
                    f"were not ready for another function within {RESET_WAIT:g} s (stuck in commlib's or "
                    "torch's destroy_process_group?) and the job was killed",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self._discard()
                return False
            self._sleep(min(end - time.monotonic(), _POLL_INTERVAL))
        if not retiring:
            return True
        self.retired = retiring
        self._end_retiring(spec)
        return False

    def _end_retiring(self, spec: dict[str, Any]) -> None:
        """Stop a job whose ranks cannot be reused; warn as for a fresh job if it does not exit in time."""
        assert self.proc is not None
        (self.dir / STOP).touch()
        self._ring()
        try:
            self.proc.wait(timeout=_GRACE)
        except subprocess.TimeoutExpired:
            self._kill()
            warnings.warn(
                f"{spec['module']}.{spec['qualname']}: every rank returned, but the job did not exit "
                f"within {_GRACE:g} s (stuck in MPI_Finalize or in a non-daemon thread?) and was killed",
                RuntimeWarning,
                stacklevel=5,
            )
        self._discard()

    # -- the end ----------------------------------------------------------------------------------------------
    def _keep(self, call_dir: Path, offset: int) -> Path:
        """Move a failed call's directory out of the job's (which goes), with its part of the output."""
        with open(self.dir / _LOG_FILE, "rb") as log:
            log.seek(offset)
            (call_dir / _LOG_FILE).write_bytes(log.read())
        kept = Path(tempfile.mkdtemp(prefix="commlib-testing-"))
        kept.rmdir()
        call_dir.rename(kept)
        return kept

    def stop(self) -> None:
        """Ask the ranks to end (a fresh job's ranks' end: MPI_Finalize, exit handlers); kill what lingers."""
        if self.proc is not None and self.proc.poll() is None:
            (self.dir / STOP).touch()
            self._ring()

    def reap(self, until: float) -> None:
        """Wait for a stopped job until ``until`` (monotonic), then kill it; remove its directory."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.wait(timeout=max(until - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                self._kill()
        self._discard()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            ranks = set(self.pids) | set(_read_pids_of_all_calls(self.dir, self.world_size))
            _kill_job(self.proc, self.dir, ranks)

    def _discard(self) -> None:
        if self.notify >= 0:
            os.close(self.notify)
            self.notify = -1
        if self.proc is not None and self.proc.returncode is None:
            self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _read_pids_of_all_calls(job_dir: Path, world_size: int) -> list[int]:
    pids: set[int] = set()
    for entry in job_dir.glob("call-*"):
        pids.update(_read_pids(entry, world_size).values())
    return sorted(pids)


class Pools:
    """The warm jobs of one :func:`commlib.testing.warm_ranks` block, by (world size, environment, cwd)."""

    def __init__(self, max_ranks: int, max_memory: int) -> None:
        self.max_ranks = max_ranks
        self.max_memory = max_memory
        self.jobs: OrderedDict[tuple, Pool] = OrderedDict()  # idle jobs, least recently used first
        self.started = 0  # jobs started
        self.calls = 0  # functions run
        self.evicted = 0  # idle jobs stopped to make room
        self.retired: list[tuple[str, dict[int, str]]] = []  # (function, rank -> why) of the jobs that retired

    def take(self, world_size: int, env: Mapping[str, str]) -> tuple[tuple, Pool]:
        key = (world_size, tuple(sorted(env.items())), os.getcwd(), sys.executable)
        pool = self.jobs.pop(key, None)
        if pool is not None and not pool.usable():
            pool.stop()
            pool.reap(time.monotonic() + _GRACE)
            pool = None
        if pool is None:
            self._make_room(world_size)
            pool = Pool(world_size, env)
            self.started += 1
        return key, pool

    def give_back(self, key: tuple, pool: Pool) -> None:
        self.jobs[key] = pool
        self._make_room(0)

    def _make_room(self, world_size: int) -> None:
        """Stop idle jobs until a new one of ``world_size`` ranks fits (in ranks and memory): the jobs that served
        the fewest calls first, the least recently used of those first. A job of a test's own settings, used once,
        goes before the jobs most tests share (LRU alone stopped those each time one of its own came in)."""
        stopping = []
        while len(self.jobs) > (0 if world_size else 1) and (
            sum(p.world_size for p in self.jobs.values()) + world_size > self.max_ranks
            or sum(p.memory() for p in self.jobs.values()) > self.max_memory
        ):
            idle = list(self.jobs)[: None if world_size else -1]  # not the job just given back
            old = self.jobs.pop(min(idle, key=lambda k: self.jobs[k].calls))  # the first of the least used
            old.stop()
            stopping.append(old)
            self.evicted += 1
        end = time.monotonic() + _GRACE
        for old in stopping:
            old.reap(end)

    def close(self) -> None:
        jobs = list(self.jobs.values())
        self.jobs.clear()
        for pool in jobs:
            pool.stop()
        end = time.monotonic() + _GRACE
        for pool in jobs:
            pool.reap(end)


def run_warm(
    pools: Pools,
    spec: dict[str, Any],
    world_size: int,
    args: tuple,
    kwargs: dict,
    timeout: float,
    env: Mapping[str, str],
) -> list[Any]:
    """:func:`commlib.testing.run` on a warm job of ``pools``."""
    key, pool = pools.take(world_size, env)
    pools.calls += 1
    try:
        values, failure, reusable = pool.call(spec, args, kwargs, timeout)
    except BaseException:
        if pool.usable():  # refused before it started (arguments that do not pickle)
            pools.give_back(key, pool)
        raise
    if reusable:
        pools.give_back(key, pool)
    elif pool.retired:
        pools.retired.append((f"{spec['module']}.{spec['qualname']}", pool.retired))
    if failure is not None:
        raise failure
    assert values is not None
    return values
