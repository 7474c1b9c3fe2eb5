"""Supervising one run of the workers: notice the first failure, collect flight records, stop the rest.

Workers leave notes in the status folder (``rank<r>.pid``, ``.exit``, ``.flight``: see
``_bootstrap`` and the flight recorder); pidfds tell the moment a worker vanishes.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path

from commlib.launch._mpiexec import kill_group_or_process, pid_alive, send_signal

__all__ = ["supervise"]

_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for the other workers when one fails
# After a worker raised, how long the others get to fail by themselves before SIGTERM: they learn who failed
# through the job store within ~1 s, and the failed rank ends the job with MPI_Abort once they said so (up to
# 2 s), its output has been read (up to 1 s) and, under torch's hook, the interpreter has exited (up to 3 s).
# A SIGTERM earlier would cut off the tracebacks still on their way.
_SETTLE = 8.0
_DUMP_WAIT = 0.5  # how long the workers get to write their flight recorder dumps after SIGUSR1


def supervise(proc: subprocess.Popen, status: Path, n: int) -> tuple[int, tuple[int, int, str] | None]:
    """Wait for the job; when a worker fails, stop the others (SIGTERM, then SIGKILL after the grace).

    The moment a failure shows, every live worker is asked for its flight record (SIGUSR1), so
    the summary can say which call each was in even if MPI_Abort stops them a moment later. A
    worker that raised then gives the others up to ``_SETTLE`` s to fail by themselves (the job
    store tells them who failed); the survivors are asked again just before they are stopped.
    """
    failure: tuple[int, int, str] | None = None
    term_at: float | None = None
    kill_at: float | None = None
    gone: dict[int, float] = {}
    watch = _Exits(status, n)
    while (code := proc.poll()) is None:
        watch.wait(0.05, gone)
        if failure is None and (failure := _first_failure(status, n, gone)) is not None:
            _request_dumps(status, n)
            raised = failure[1] and "sys.exit(" not in failure[2]  # an exception: the others are told
            term_at = time.monotonic() + (_SETTLE if raised else 0.0)
        if term_at is not None and time.monotonic() >= term_at:
            if _request_dumps(status, n):
                time.sleep(_DUMP_WAIT)
            proc.send_signal(signal.SIGTERM)
            term_at, kill_at = None, time.monotonic() + _GRACE
        elif kill_at is not None and time.monotonic() > kill_at:
            _kill_workers(status, n)
            proc.kill()
            kill_at = None
    watch.wait(0, gone)
    watch.close()
    _kill_workers(status, n)  # whatever hydra left behind (ranks run in sessions of their own)
    return code, failure or _first_failure(status, n, gone)


def _request_dumps(status: Path, n: int) -> bool:
    """SIGUSR1 to the live workers that dump their flight recorder on it; whether any was asked."""
    asked = False
    for rank in range(n):
        note, pid = status / f"rank{rank}.flight", status / f"rank{rank}.pid"
        if note.exists() and pid.exists() and not (status / f"rank{rank}.exit").exists():
            worker = int(pid.read_text())
            if pid_alive(worker):
                asked = send_signal(worker, signal.SIGUSR1) or asked
    return asked


class _Exits:
    """Notices worker exits the moment they happen, through pidfds (the workers are hydra's children).

    When one worker is killed by a signal hydra SIGKILLs the rest within
    milliseconds; waking on the first exit is what tells the culprit apart.
    """

    def __init__(self, status: Path, n: int) -> None:
        self.status, self.n = status, n
        self.fds: dict[int, int | None] = {}

    def wait(self, timeout: float, gone: dict[int, float]) -> None:
        for rank in range(self.n):
            pid = self.status / f"rank{rank}.pid"
            if rank not in self.fds and pid.exists():
                try:
                    self.fds[rank] = os.pidfd_open(int(pid.read_text()))
                except (OSError, AttributeError, ValueError):
                    self.fds[rank] = None  # already gone, or no pidfd here: _first_failure polls the pid
        if len(self.fds) < self.n:
            timeout = min(timeout, 0.005)  # open every pidfd quickly: a rank that dies before is timed by polling
        ready, _, _ = select.select([fd for fd in self.fds.values() if fd is not None], [], [], timeout)
        now = time.monotonic()
        for rank, fd in self.fds.items():
            if fd in ready and not (self.status / f"rank{rank}.exit").exists():
                gone.setdefault(rank, now)

    def close(self) -> None:
        for fd in self.fds.values():
            if fd is not None:
                os.close(fd)


def _first_failure(status: Path, n: int, gone: dict[int, float]) -> tuple[int, int, str] | None:
    """(rank, exit code, reason) of the first worker that failed, from the workers' notes and pids.

    A worker that wrote no note died by a signal; hydra then SIGKILLs the others at
    once, so the culprit is the one that vanished first (``gone`` remembers when).
    """
    failed, now = [], time.monotonic()  # one time per scan: ranks found dead in the same scan tie
    for rank in range(n):
        note, pid = status / f"rank{rank}.exit", status / f"rank{rank}.pid"
        if note.exists():
            code, _, why = note.read_text().partition(" ")
            if code != "0":
                failed.append((note.stat().st_mtime, rank, int(code), f"exit code {code}: {why}"))
        elif pid.exists() and not pid_alive(int(pid.read_text())):
            gone.setdefault(rank, now)
    if failed:
        return min(failed)[1:]
    if gone:
        first = min(gone.values())
        ranks = sorted(r for r, t in gone.items() if t == first)
        if len(ranks) == 1:
            return ranks[0], 0, "it died without exiting normally, e.g. killed by a signal"
        # Seen dead together: hydra SIGKILLs the others the moment one dies, and on a busy machine the
        # launcher may only wake after that. Say so rather than guess (hydra's own report lists by rank).
        return ranks[0], 0, f"ranks {ranks} were found dead together; one was killed by a signal, then the others"
    return None


def _kill_workers(status: Path, n: int) -> None:
    for rank in range(n):
        pid = status / f"rank{rank}.pid"
        if pid.exists() and pid_alive(int(pid.read_text())):
            kill_group_or_process(int(pid.read_text()))
