"""Supervising one run of the workers under mpiexec: name the first failure, collect flight records, stop the rest.

Workers leave notes in the status folder (``rank<r>.pid``, ``.exit``, ``.after``, ``.flight``: see ``_bootstrap``
and the flight recorder). Which rank failed first is not which rank the launcher finds dead first: hydra
SIGKILLs every rank within milliseconds of one dying by a signal, a peer whose MPI call fails because a rank
vanished can end by itself, and a launcher on a busy machine may wake after all of that. Three facts name the
first one all the same:

- the workers' pidfds sit in one epoll set, and epoll lists ready descriptors in the order they became ready:
  the kernel's order of the processes' ends, however late the launcher reads it;
- a rank that raises or calls ``sys.exit(n)`` leaves a note at once, and with it the ranks of its node that
  were already on their way out (the kernel's word: gone, a zombie, or exiting): its failure came after
  theirs, so theirs is named;
- once hydra has reaped a rank, its pidfd says how the rank ended (Linux 6.15+), so the message says
  "killed by SIGKILL, signal 9" rather than guess.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from commlib.launch._mpiexec import describe_end, exit_status, kill_group_or_process, pid_alive, send_signal

__all__ = ["Failure", "supervise"]

_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for the other workers when one fails
# After a worker raised, how long the others get to fail by themselves before SIGTERM: they learn who failed
# through the job store within ~1 s, and the failed rank ends the job with MPI_Abort once they said so (up to
# 2 s), its output has been read (up to 1 s) and, under torch's hook, the interpreter has exited (up to 3 s).
# A SIGTERM earlier would cut off the tracebacks still on their way.
_SETTLE = 8.0
_DUMP_WAIT = 0.5  # how long the workers get to write their flight recorder dumps after SIGUSR1
# A failure noted after another rank began to end waits this long for that rank's end to show (milliseconds,
# as a rule); then the note is named after all.
_CAUSE_WAIT = 2.0


@dataclass(frozen=True, slots=True)
class Failure:
    """The worker that failed first: its rank, the exit code it chose (0 when it left no note: killed, or ended
    outside Python) and how it ended, in words."""

    rank: int
    code: int
    why: str


def supervise(proc: subprocess.Popen, status: Path, ranks: Sequence[int]) -> tuple[int, Failure | None]:
    """Wait for the job; when a worker fails, stop the others (SIGTERM, then SIGKILL after the grace).

    ``ranks``: this node's ranks (the status notes are named by global rank). The moment a failure shows,
    every live worker is asked for its flight record (SIGUSR1), so the summary can say which call each was
    in even if MPI_Abort stops them a moment later. A worker that raised then gives the others up to
    ``_SETTLE`` s to fail by themselves (the job store tells them who failed); the survivors are asked
    again just before they are stopped.
    """
    failure: Failure | None = None
    term_at: float | None = None
    kill_at: float | None = None
    exits = _Exits(status, ranks)
    while (code := proc.poll()) is None:
        exits.wait(0.05)
        if failure is None and (failure := _first_failure(status, ranks, exits)) is not None:
            _request_dumps(status, ranks)
            raised = failure.code and "sys.exit(" not in failure.why  # an exception: the others are told
            term_at = time.monotonic() + (_SETTLE if raised else 0.0)
        if term_at is not None and time.monotonic() >= term_at:
            if _request_dumps(status, ranks):
                time.sleep(_DUMP_WAIT)
            proc.send_signal(signal.SIGTERM)
            term_at, kill_at = None, time.monotonic() + _GRACE
        elif kill_at is not None and time.monotonic() > kill_at:
            _kill_workers(status, ranks)
            proc.kill()
            kill_at = None
    exits.wait(0)
    _kill_workers(status, ranks)  # whatever hydra left behind (ranks run in sessions of their own)
    failure = failure or _first_failure(status, ranks, exits, final=True)
    if failure is not None and not failure.why:  # it left no note: say how it ended, now that hydra reaped it
        failure = Failure(failure.rank, failure.code, exits.describe(failure.rank))
    exits.close()
    return code, failure


def _request_dumps(status: Path, ranks: Sequence[int]) -> bool:
    """SIGUSR1 to the live workers that dump their flight recorder on it; whether any was asked."""
    asked = False
    for rank in ranks:
        note, pid = status / f"rank{rank}.flight", status / f"rank{rank}.pid"
        if note.exists() and pid.exists() and not (status / f"rank{rank}.exit").exists():
            worker = int(pid.read_text())
            if pid_alive(worker):
                asked = send_signal(worker, signal.SIGUSR1) or asked
    return asked


class _Exits:
    """The workers' ends in the kernel's order: their pidfds in one epoll set (they are hydra's children, not
    ours), each reported once; and how each ended, where the kernel tells."""

    def __init__(self, status: Path, ranks: Sequence[int]) -> None:
        self.status, self.ranks = status, list(ranks)
        self.epoll = select.epoll()
        self.fds: dict[int, int | None] = {}  # rank -> pidfd; None: none could be opened (gone already), polled
        self.pids: dict[int, int] = {}
        self.rank_of: dict[int, int] = {}  # pidfd -> rank
        # the ranks whose end was seen, in order; a batch of several was found by polling, together, unordered
        self.batches: list[list[int]] = []
        self.codes: dict[int, int] = {}  # rank -> how it ended (Popen.returncode's form), once known

    def wait(self, timeout: float) -> None:
        """Watch the workers that wrote their pid since the last call; note the ends reported within ``timeout``."""
        for rank in self.ranks:
            if rank not in self.fds and (note := self.status / f"rank{rank}.pid").exists():
                try:
                    self.pids[rank] = int(note.read_text())
                    fd = self.fds[rank] = os.pidfd_open(self.pids[rank])
                except (OSError, AttributeError, ValueError):
                    self.fds[rank] = None
                    continue
                self.rank_of[fd] = rank
                self.epoll.register(fd, select.EPOLLIN | select.EPOLLONESHOT)
        if len(self.fds) < len(self.ranks):
            timeout = min(timeout, 0.005)  # open every pidfd quickly: a rank that dies before is timed by polling
        for fd, _ in self.epoll.poll(timeout):  # in the order the processes ended
            self.batches.append([self.rank_of[fd]])
            self._learn(self.rank_of[fd])  # while it may still be a zombie (kernels before 6.15 say it only then)
        seen = {rank for batch in self.batches for rank in batch}
        polled = [r for r, fd in self.fds.items() if fd is None and r in self.pids and r not in seen]
        if gone := [r for r in polled if not pid_alive(self.pids[r])]:
            self.batches.append(gone)

    def _learn(self, rank: int) -> None:
        fd = self.fds.get(rank)
        if rank not in self.codes and fd is not None and (code := exit_status(fd, self.pids[rank])) is not None:
            self.codes[rank] = code

    def describe(self, rank: int) -> str:
        """How ``rank``, which left no note, ended."""
        self._learn(rank)
        code = self.codes.get(rank)
        if code is None:
            return "it died without exiting normally, e.g. killed by a signal"
        if code < 0:
            return f"{describe_end(code)}, without exiting normally"
        return f"{describe_end(code)}, without exiting normally: os._exit, or C code such as MPI's abort"

    def close(self) -> None:
        for fd in self.fds.values():
            if fd is not None:
                os.close(fd)
        self.epoll.close()


@dataclass(frozen=True, slots=True, order=True)
class _Note:
    """A worker's note of its failure: when, which rank, its exit code, why, and the ranks already ending then."""

    written_ns: int
    rank: int
    code: int
    why: str
    after: tuple[int, ...]


def _notes(status: Path, ranks: Sequence[int]) -> list[_Note]:
    """The failure notes (non-zero exit codes) the workers left."""
    notes = []
    for rank in ranks:
        note = status / f"rank{rank}.exit"
        try:
            text, written = note.read_text(), note.stat().st_mtime_ns
        except OSError:
            continue
        code, _, why = text.partition(" ")
        if code != "0":
            try:  # written before the note, if at all
                after = tuple(int(r) for r in (status / f"rank{rank}.after").read_text().split())
            except OSError:
                after = ()
            notes.append(_Note(written, rank, int(code), f"exit code {code}: {why}", after))
    return notes


def _first_failure(status: Path, ranks: Sequence[int], exits: _Exits, final: bool = False) -> Failure | None:
    """The worker that failed first (``why`` empty: it left no note, :meth:`_Exits.describe` says how it ended).

    A note written while no other rank was ending came first: the earliest such note is named. Else the
    process that ended first with no note (killed, or ended outside Python), in the kernel's order. A note
    written after another rank began to end waits for that rank's end to show.
    """
    notes = _notes(status, ranks)
    if first := [n for n in notes if not n.after]:
        note = min(first)
        return Failure(note.rank, note.code, note.why)
    for batch in exits.batches:
        silent = [r for r in batch if not (status / f"rank{r}.exit").exists()]
        if len(silent) == 1:
            return Failure(silent[0], 0, "")
        if silent:  # polled, not watched: their pidfds could not be opened
            why = f"ranks {silent} were found dead together; one was killed by a signal, then the others"
            return Failure(silent[0], 0, why)
    if notes and (final or time.time_ns() - min(n.written_ns for n in notes) > _CAUSE_WAIT * 1e9):
        note = min(notes)
        ended = ", ".join(map(str, note.after))
        return Failure(note.rank, note.code, f"{note.why} (after rank {ended} began to end)")
    return None


def _kill_workers(status: Path, ranks: Sequence[int]) -> None:
    for rank in ranks:
        pid = status / f"rank{rank}.pid"
        if pid.exists() and pid_alive(int(pid.read_text())):
            kill_group_or_process(int(pid.read_text()))
