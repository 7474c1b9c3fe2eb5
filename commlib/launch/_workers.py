"""Workers as plain processes (``--on-failure continue`` or ``replace``): one worker's end does not end the others.

Under mpiexec, hydra stops every rank a moment after one dies. Here the launcher starts each worker itself and
is its parent. The workers form their job through the rendezvous store the launcher of node 0 serves at
--master_addr:--master_port (``COMMLIB_STORE_SERVED=host:port``: rank 0 connects to it rather than serving it;
each worker is its own MPI world until commlib joins them, as under torchrun; MASTER_PORT is another port, for
torch's own store), so the store outlives any worker. What
mpiexec gave is kept: output lines prefixed with the rank (``[2] ``, as hydra's ``-prepend-rank``) or per-rank
files under ``--logdir``; Ctrl-C or SIGTERM stops every worker; a worker dies with the launcher
(PR_SET_PDEATHSIG), and whatever it started in its session dies with it; 128 + N for a death by signal N.

A worker that fails gets one line (its rank, how it ended) and the job goes on; ``replace`` also starts a
process that takes the rank over: the dead worker's command and environment plus ``COMMLIB_JOIN=1`` and
``COMMLIB_REPLACES=<rank>``, at most ``--max_replacements`` times per rank. ``--spares N`` starts N processes
of that kind with the job (``COMMLIB_SPARE=1``, no rank yet): warm, they wait until the job takes them in
(``grow_group``), so that a replacement costs no start; a failure under ``replace`` is covered by a waiting
spare, while there is one, before a new process is started. A spare never taken in exits 0 at the job's end.

The job's exit code: 0 when every worker still running once one had finished exited 0 (the job completed
despite its losses); else the first of those that failed; when no worker finished, the first failure's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from commlib.launch._cli import log_path, program, rank_variables
from commlib.launch._mpiexec import describe_end, die_with_parent

__all__ = ["run_workers"]

_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when the job is stopped
_DRAIN = 1.0  # after the last worker ended, how long output still open (a grandchild holds it) is read
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
_NOT_MPI_LAUNCHED = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_")  # an outer launcher's: not these workers'


def run_workers(args: argparse.Namespace, env: dict[str, str], status: Path, stopped: list[int]) -> tuple[int, bool]:
    """Run this node's workers as plain processes until every one has ended; return the job's exit code and
    whether every worker failed (not stopped)."""

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    job = _Job(args, env, status)
    try:
        job.start()
        return job.run(stopped)
    finally:
        job.close()


class _Relay:
    """Passes a worker's stream on line by line, each line prefixed with its rank (hydra's ``-prepend-rank``)."""

    def __init__(self, pipe: IO[bytes], prefix: bytes, out: IO[bytes]) -> None:
        self.pipe, self.prefix, self.out, self.tail = pipe, prefix, out, b""
        os.set_blocking(pipe.fileno(), False)

    def pump(self) -> bool:
        """Pass on what can be read now; False at the stream's end."""
        try:
            data = os.read(self.pipe.fileno(), 1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self._write(self.tail + b"\n" if self.tail else b"")
            self.tail = b""
            return False
        head, newline, self.tail = (self.tail + data).rpartition(b"\n")
        if newline:
            self._write(head + newline)
        return True

    def _write(self, lines: bytes) -> None:
        if lines:
            with contextlib.suppress(OSError):  # a reader that went away (| head) loses the rest, the job does not
                self.out.write(b"".join(self.prefix + line for line in lines.splitlines(keepends=True)))
                self.out.flush()


@dataclass
class _Worker:
    """One process of a rank: the one started with the job (``replacement`` 0) or its k-th replacement."""

    rank: int
    proc: subprocess.Popen[bytes]
    env: dict[str, str]
    replacement: int
    log: str  # where its stderr goes, for messages
    spare: int | None = None  # a spare's number: started with the job, waiting to be taken in
    pidfd: int | None = None
    relays: list[_Relay] = field(default_factory=list)

    @property
    def name(self) -> str:
        if self.spare is not None:
            return f"spare {self.spare}"
        return f"rank {self.rank}" + (f" (replacement {self.replacement})" if self.replacement else "")


class _Job:
    """This node's workers: started, watched (their ends in the kernel's order, through pidfds in one epoll set),
    their output relayed, a failure reported and, with ``replace``, its rank taken over."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], status: Path) -> None:
        self.args, self.status, self.n = args, status, args.nproc_per_node
        self.selector = selectors.DefaultSelector()  # epoll on Linux: ready pidfds in the order they ended
        self.live: dict[int, _Worker] = {}  # by rank (a spare: by the RANK it was given, past the job's)
        self.replaced: dict[int, int] = {}
        self.spares = args.spares  # spares no failure has counted on yet
        self.losses: list[tuple[int, int]] = []  # (rank, code) of each failure before any worker finished
        self.finished = False  # a worker exited 0: the job is ending, a failure now is the job's
        self.code: int | None = None  # the first failure after that
        self.env = {k: v for k, v in env.items() if not k.startswith(_NOT_MPI_LAUNCHED)}

    def start(self) -> None:
        """Start this node's workers."""
        for local in range(self.n):
            variables = rank_variables(self.args, local)
            self._start(int(variables["RANK"]), self.env | variables, 0)
        for k in range(self.args.spares):  # no rank yet: the store's address only (a key past the ranks')
            spare = self.args.node_rank * self.args.spares + k
            variables = {v: rank_variables(self.args, 0)[v] for v in ("MASTER_ADDR", "MASTER_PORT", "NNODES")}
            variables |= {"COMMLIB_JOIN": "1", "COMMLIB_SPARE": str(spare)}
            env = {k: v for k, v in self.env.items() if k not in _RANK_VARIABLES}
            self._start(self.n * self.args.nnodes + spare, env | variables, 0, spare=spare)

    def _start(self, rank: int, env: dict[str, str], replacement: int, spare: int | None = None) -> None:
        name = f"rank{rank}" + (f".replacement{replacement}" if replacement else "")
        name = name if spare is None else f"spare{spare}"
        streams: list[Any] = [subprocess.PIPE, subprocess.PIPE]
        if self.args.redirect_stdout_and_stderr:
            folder = Path(self.args.logdir or "log").resolve()
            folder.mkdir(parents=True, exist_ok=True)
            streams = [open(folder / f"{name}.{kind}", "wb") for kind in ("stdout", "stderr")]  # noqa: SIM115
        first = rank == 0 and not replacement and spare is None  # stdin goes to rank 0, as under hydra
        try:
            proc = subprocess.Popen(
                program(self.args), env=env, stdin=None if first else subprocess.DEVNULL, stdout=streams[0],
                stderr=streams[1], start_new_session=True, preexec_fn=die_with_parent(signal.SIGKILL),
            )  # fmt: skip
        except OSError as e:  # --no_python with a program that is not there, or not executable
            raise SystemExit(f"commlib.launch: cannot start rank {rank}'s worker {program(self.args)}: {e}") from None
        finally:
            for stream in streams:
                if stream is not subprocess.PIPE:
                    stream.close()
        worker = _Worker(rank, proc, env, replacement, log_path(self.args, f"{name}.stderr"), spare=spare)
        prefix = f"[{rank}] " if spare is None else f"[spare {spare}] "
        for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            if pipe is not None:
                relay = _Relay(pipe, prefix.encode(), out.buffer)
                worker.relays.append(relay)
                self.selector.register(pipe, selectors.EVENT_READ, relay)
        with contextlib.suppress(OSError, AttributeError):  # no pidfds here: its end is polled
            worker.pidfd = os.pidfd_open(proc.pid)
            self.selector.register(worker.pidfd, selectors.EVENT_READ, worker)
        self.live[rank] = worker

    def run(self, stopped: list[int]) -> tuple[int, bool]:
        """Relay, watch and replace until every worker has ended; the exit code, and whether the job failed."""
        kill_at: float | None = None
        worker: _Worker
        while self.live:
            for key, _ in self.selector.select(0.1):
                if isinstance(key.data, _Relay):
                    if not key.data.pipe.closed:
                        self._pump(key.data)
                elif (worker := key.data) is self.live.get(worker.rank):  # not one that ended in this round
                    self._ended(worker, stopped)
            for polled in [w for w in self.live.values() if w.pidfd is None and _has_ended(w.proc)]:
                self._ended(polled, stopped)
            if stopped and kill_at is None:
                self._say(f"{signal.Signals(stopped[0]).name}: stopping every worker")
                self._signal_all(signal.SIGTERM)
                kill_at = time.monotonic() + _GRACE
            elif kill_at is not None and time.monotonic() > kill_at:
                self._signal_all(signal.SIGKILL)
                kill_at = float("inf")
        self._drain()
        if stopped:
            return 128 + stopped[0], False
        return self._outcome()

    def _pump(self, relay: _Relay) -> None:
        if not relay.pump():
            self.selector.unregister(relay.pipe)
            relay.pipe.close()

    def _ended(self, worker: _Worker, stopped: list[int]) -> None:
        """A worker's process ended: pass on its last output, reap it and its session, report, replace."""
        for relay in worker.relays:
            for _ in range(64):  # what it wrote last; a grandchild writing on is not waited for
                if relay.pipe.closed or not _readable(relay.pipe):
                    break
                self._pump(relay)
        with contextlib.suppress(OSError):  # what it started in its session; its pid is not free before the reap
            os.killpg(worker.proc.pid, signal.SIGKILL)
        code = worker.proc.wait()
        if worker.pidfd is not None:
            self.selector.unregister(worker.pidfd)
            os.close(worker.pidfd)
        del self.live[worker.rank]
        note = self._forget_notes(f"rank{worker.rank}" if worker.spare is None else f"spare{worker.spare}")
        if code == 0:
            self.finished = self.finished or worker.spare is None  # a spare sent home: not the job's end
        elif not stopped:
            self._failed(worker, code, note)

    def _failed(self, worker: _Worker, code: int, note: str) -> None:
        """Report a failure, and decide what becomes of its rank."""
        how = describe_end(code) + (f": {note}" if note else "")
        said = f"{worker.name} failed ({how}); log: {worker.log}"
        status = _status(code)
        if self.finished:  # the job was ending: this failure is the job's
            self.code = status if self.code is None else self.code
            left = (
                f"the job continues with {self._count()} and will exit"
                if self.live
                else "no worker is left: the job exits"
            )
            self._say(f"{said}; {left} {self.code}")
            return
        self.losses.append((worker.rank, status))
        if self.args.on_failure == "replace" and worker.spare is None and self.spares > 0:
            self.spares -= 1
            waiting = sum(w.spare is not None for w in self.live.values())
            self._say(f"{said}; a spare takes its place when the job grows ({waiting} spare(s) running)")
            return
        if self.args.on_failure == "replace":
            done = self.replaced.get(worker.rank, 0)
            if done < self.args.max_replacements:
                self.replaced[worker.rank] = done + 1
                self._say(
                    f"{said}; starting replacement {done + 1} of {self.args.max_replacements} for rank {worker.rank}"
                )
                replacement_env = worker.env | {"COMMLIB_JOIN": "1", "COMMLIB_REPLACES": str(worker.rank)}
                self._start(worker.rank, replacement_env, done + 1, worker.spare)
                return
            times = f"{done} time" + "s" * (done != 1)
            said += f"; not replaced: rank {worker.rank} was replaced {times} already (--max_replacements {done})"
        if self.live:
            self._say(f"{said}; the job continues with {self._count()}")
        else:
            self._say(f"{said}; no worker is left")

    def _outcome(self) -> tuple[int, bool]:
        """The job's exit code once every worker ended, and whether every worker failed (then the flight
        recorder's summary is printed: after a recovery, the survivors' records would tell of calls they left)."""
        lost = sorted({rank for rank, _ in self.losses})
        if self.code is not None:
            return self.code, False
        if self.finished:
            if lost:
                self._say(f"the job completed despite the failure of rank{'s' * (len(lost) > 1)} {_list(lost)}")
            return 0, False
        rank, code = self.losses[0]
        self._say(f"every worker failed; the job exits {code}, as the first failure did (rank {rank})")
        return code, True

    def _count(self) -> str:
        return f"{len(self.live)} of {self.n} workers" + (" on this node" if self.args.nnodes > 1 else "")

    def _forget_notes(self, name: str) -> str:
        """The reason the worker's bootstrap noted for a failure (its exception), and its notes removed: the
        next process of its rank writes its own."""
        why = ""
        with contextlib.suppress(OSError):
            code, _, why = (self.status / f"{name}.exit").read_text().partition(" ")
            why = "" if code == "0" else why
        for kind in ("pid", "exit", "after", "flight"):
            with contextlib.suppress(OSError):
                (self.status / f"{name}.{kind}").unlink()
        return why

    def _signal_all(self, signum: int) -> None:
        for worker in self.live.values():
            with contextlib.suppress(OSError):
                os.killpg(worker.proc.pid, signum)  # its session's group: what it started goes too

    def _drain(self) -> None:
        """Pass on the output still in the pipes; give up on streams a grandchild keeps open."""
        until = time.monotonic() + _DRAIN
        while self.selector.get_map() and time.monotonic() < until:
            for key, _ in self.selector.select(until - time.monotonic()):
                self._pump(key.data)

    def _say(self, text: str) -> None:
        print(f"commlib.launch: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop whatever is left (an error in the launcher itself) and let go of the pipes."""
        for worker in self.live.values():
            with contextlib.suppress(OSError):
                os.killpg(worker.proc.pid, signal.SIGKILL)
            worker.proc.wait()
        for key in list(self.selector.get_map().values()):
            if isinstance(key.data, _Relay):
                key.data.pipe.close()
            else:
                os.close(key.fd)
        self.selector.close()


def _readable(pipe: IO[bytes]) -> bool:
    return bool(select.select([pipe], [], [], 0)[0])


def _has_ended(proc: subprocess.Popen[bytes]) -> bool:
    """Whether ``proc`` ended, leaving it unreaped (its pid, the group of its session, stays ours until then)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _status(code: int) -> int:
    """A process's end as a shell exit code: 128 + N for death by signal N."""
    return 128 - code if code < 0 else code


def _list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
