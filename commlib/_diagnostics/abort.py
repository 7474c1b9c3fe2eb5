"""An uncaught exception on one rank ends the whole job at once, instead of leaving the others waiting.

:func:`install_excepthook` (at world creation) prints the traceback, dumps the flight recorder, reports the
failure through the job's store (the others' waits end naming this rank: ``_diagnostics.watchdog``) and ends
the job (MPI_Abort, or the process's exit where no MPI started it), once what this rank wrote has left its
output pipes. ``COMMLIB_ABORT_ON_EXCEPTION=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from commlib._diagnostics import flight as _flight
from commlib._diagnostics import jobstore
from commlib._diagnostics.watchdog import FAILED, REPORTED
from commlib._settings import value as setting

__all__ = ["install_excepthook", "raised_uncaught", "report_uncaught"]

_ACK_WAIT = 2.0  # how long a failed rank waits for the others to report, before MPI_Abort
_EXIT_WAIT = 3.0  # after a hook that wraps commlib's: how long the interpreter gets to exit before MPI_Abort
_DRAIN_WAIT = 1.0  # before MPI_Abort: how long the launcher gets to read what this rank wrote


class _State:
    def __init__(self) -> None:
        self.rank, self.size = 0, 1
        self.uncaught = False  # this rank's excepthook reported an uncaught exception
        self.hook: Any = None  # the current world's excepthook (an earlier world's, still in torch's chain, passes)


_state = _State()


def raised_uncaught() -> bool:
    """Whether commlib's excepthook reported an uncaught exception on this rank (the program did not end well)."""
    return _state.uncaught


def install_excepthook(abort: Callable[[], None] | None, rank: int, size: int) -> None:
    """An uncaught exception on one rank ends the whole job at once instead of leaving the others waiting.

    The traceback is printed, the flight recorder dumped and the failure published through the
    job's store (:func:`report_uncaught`, so the other ranks fail fast naming this rank), then
    ``abort()`` ends the job (MPI_Abort for an MPI world; None: the process just exits, which
    its launcher notices); when a hook installed later wraps this one (torch's), once that hook has
    written what this one printed (:func:`_abort_after_hooks`). ``COMMLIB_ABORT_ON_EXCEPTION=0``
    turns it off.
    """
    _state.rank, _state.size = rank, size
    if not setting("COMMLIB_ABORT_ON_EXCEPTION"):
        return
    previous = sys.excepthook
    if getattr(previous, "_commlib", False):
        previous = previous._previous  # type: ignore[attr-defined]

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        if issubclass(kind, KeyboardInterrupt) or _state.hook is not hook:  # not the world's: one hook aborts
            return
        sys.stdout.flush()
        if abort is not None:  # said before the wait below: MPI_Abort can cut off output written just before it
            sys.stderr.write(f"commlib: uncaught {kind.__name__} on rank {_state.rank}: aborting the job\n")
            sys.stderr.flush()
        with contextlib.suppress(BaseException):  # the job must end whatever happens
            report_uncaught(kind, value)
        _state.uncaught = True  # the program's end skips its closing checks: this error is the report
        if abort is None:
            return
        if sys.excepthook is hook:
            _end_job(abort)
        else:  # a hook installed later called this one (torch's); it writes what we printed once we return
            _abort_after_hooks(abort)

    hook._commlib = True  # type: ignore[attr-defined]
    hook._previous = previous  # type: ignore[attr-defined]
    sys.excepthook = _state.hook = hook


def _abort_after_hooks(abort: Callable[[], None]) -> None:
    """End the job once the calling hooks have returned: at interpreter exit, or after a few seconds at most.

    torch's ``init_process_group`` wraps the hook it finds (commlib's) in one that points
    ``sys.stderr`` at a buffer, calls it, and only then writes the buffer, prefixed with the rank,
    to the real stderr: aborting inside commlib's hook would lose the traceback. Python runs
    ``atexit`` functions once the hooks have returned and its other threads have ended (this one
    first: the last registered); the timer ends the job should the exit stall on a thread.
    """
    import atexit
    import threading

    once = threading.Lock()

    def end() -> None:
        if once.acquire(blocking=False):
            _end_job(abort)

    atexit.register(end)
    timer = threading.Timer(_EXIT_WAIT, end)
    timer.daemon = True
    timer.start()


def _end_job(abort: Callable[[], None]) -> NoReturn:
    """``abort()`` the job once what this rank wrote has left its output pipes, and run no more Python after.

    hydra stops forwarding a rank's output the moment it handles that rank's MPI_Abort, so lines still
    in the pipe (a traceback torch's hook wrote a millisecond earlier) would be lost. And MPICH's
    MPI_Abort returns under hydra (the job is killed a moment later): carrying on would run the
    program's exit handlers, the closing checks among them, against ranks that are going away.
    """
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
        _drain_output(_DRAIN_WAIT)
    try:
        abort()
    finally:
        os._exit(1)


def _drain_output(seconds: float) -> None:
    """Wait (at most ``seconds``) until the reader of this process's stdout and stderr pipes has read them."""
    import fcntl
    import stat
    import struct
    import termios

    pipes = [fd for fd in (1, 2) if stat.S_ISFIFO(os.fstat(fd).st_mode)]
    deadline = time.monotonic() + seconds
    while pipes and time.monotonic() < deadline:
        pipes = [fd for fd in pipes if struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0] > 0]
        if pipes:
            time.sleep(0.005)


def report_uncaught(kind: type[BaseException], value: BaseException) -> None:
    """Before MPI_Abort: dump the flight recorder and tell the other ranks which rank failed, and how.

    The first rank to fail waits (up to 2 s) until the others have reported that
    they saw it, so their errors reach the output before MPI_Abort stops them.
    """
    _flight.dump(f"uncaught {kind.__name__}: {value}")
    text = f"rank {_state.rank} failed with {kind.__name__}: {value}"[:2000]
    first = None if getattr(value, "commlib_peer_failure", False) else jobstore.request("compare_set", FAILED, "", text)
    if jobstore.dead() is not None:
        return  # no store to coordinate through: end the job now
    if first != text.encode():
        # Another rank failed first: it ends the job once everyone has reported (aborting here
        # as well would stop the ranks still writing their flight records).
        jobstore.request("add", REPORTED, 1)
        time.sleep(_ACK_WAIT + 1.0)
        return
    deadline = time.monotonic() + _ACK_WAIT
    while time.monotonic() < deadline and jobstore.dead() is None:
        reported = jobstore.request("add", REPORTED, 0)
        if reported is not None and reported >= _state.size - 1:
            return
        time.sleep(0.05)
