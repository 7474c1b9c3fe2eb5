"""The job monitor: who arrived at a collective that timed out, and which rank failed first.

MPI and NCCL cannot say which peer is missing, so commlib keeps a small key-value
store per job for that: the launcher's (``COMMLIB_MONITOR_STORE=host:port``, set
by ``commlib.launch``), else one that world rank 0 serves, its address sent to
the others over MPI once at initialisation (cost: well under a millisecond).

Nothing is written on the hot path. A wait that has lasted more than 0.25 s
(``backends.base.poll``'s slow path) publishes ``rank r waiting in <op> #seq``
once, and then every half second checks whether a rank has reported a failure; a rank
whose exception is uncaught reports it before MPI_Abort ends the job. A blocking send or
receive is not numbered: a long one publishes ``rank r waiting in recv from rank p`` (found
on the slow path from the waiting call's frame, :data:`P2P_WAITS`; nothing on the fast path). On a
timeout the waiting rank reads every rank's progress to say who arrived.
``COMMLIB_MONITOR=0`` turns all of this off.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from commlib._diagnostics import flight as _flight
from commlib.errors import CollectiveMismatchError, CommError, GroupBrokenError

__all__ = ["arrival", "raised_uncaught", "report_uncaught", "setup", "watchdog"]

_PREFIX = "commlib/mon"
_FAILED = f"{_PREFIX}/failed"
_REPORTED = f"{_PREFIX}/reported"
_STORE_TIMEOUT = 1.0  # the store is an aid: a slow or vanished store must not stall a rank for long
_GRACE = 1.0  # after a timeout, how long (at most a quarter of the timeout) late ranks get to publish
_ACK_WAIT = 2.0  # how long a failed rank waits for the others to report, before MPI_Abort
_EXIT_WAIT = 3.0  # after a hook that wraps commlib's: how long the interpreter gets to exit before MPI_Abort
_DRAIN_WAIT = 1.0  # before MPI_Abort: how long the launcher gets to read what this rank wrote
_MISSING = "\x00missing"
_PAYLOAD = 256
_COUNTS_MAX = 4096  # the longest list of posted sends and receives a rank publishes with its call


class _State:
    def __init__(self) -> None:
        self.address: tuple[str, int, str] | None = None  # host, port, token
        self.client: Any = None
        self.dead: str | None = None  # why the store is not used any more
        self.server: Any = None  # the StoreServer when this process serves it (world rank 0)
        self.rank, self.size = 0, 1
        self.published: dict[str, str] = {}  # progress key -> the value this rank last wrote there
        self.worlds = 0  # worlds made by this process: the progress keys of an earlier one are never read
        self.mine: dict[tuple[str, int], str] = {}  # (group, seq) -> this rank's call in its stamps' words
        self.failure_raised = False
        self.uncaught = False  # this rank's excepthook reported an uncaught exception
        self.hook: Any = None  # the current world's excepthook (an earlier world's, still in torch's chain, passes)


_state = _State()

#: The code objects of the calls that wait for one peer (the group layer's ``send``, ``recv`` and ``Work.wait``
#: register theirs) -> a function of that frame's locals giving (group, call, its description, ("send" or "recv",
#: the peer's group rank, the call's index among this rank's sends to or receives from it) once the call is
#: counted, else None) or None. A long wait finds the one it is in by
#: walking up its frames: the fast path writes nothing.
P2P_WAITS: dict[Any, Callable[[dict[str, Any]], tuple[Any, str, str, tuple[str, int, int] | None] | None]] = {}


def setup(backend: Any, timeout: float, store: Any = None) -> None:
    """At world creation, on every rank: find the job's store (the launcher's, the rendezvous ``store`` the job
    already shares, or one world rank 0 serves)."""
    from commlib.backends import base as _base

    _state.rank, _state.size = backend.rank, backend.size
    _state.published.clear()
    _state.mine.clear()
    _state.worlds += 1
    _state.failure_raised = False
    job = os.environ.get("COMMLIB_JOB_ID", "")
    if os.environ.get("COMMLIB_MONITOR", "1") == "0" or backend.size == 1:
        _flight.set_job(backend.rank, backend.size, job or str(os.getpid()))
        return
    given = os.environ.get("COMMLIB_MONITOR_STORE")
    if given:
        host, _, port = given.rpartition(":")
        _state.address = (host, int(port), os.environ.get("COMMLIB_MONITOR_TOKEN", ""))
    elif store is not None:
        from commlib.store import PrefixStore

        _state.client, _state.dead = PrefixStore("monitor", store), None  # the prefix store never closes the store
    else:
        job = _serve_and_share(backend, timeout) or job
    _flight.set_job(backend.rank, backend.size, job or "unknown")
    _base.watchdog = watchdog


def _serve_and_share(backend: Any, timeout: float) -> str:
    """World rank 0 serves a store; its address, token and a job id reach the others by one broadcast."""
    buf = np.zeros(_PAYLOAD, np.uint8)
    if backend.rank == 0:
        text = ""
        try:
            text = _serve()
        except OSError as e:
            print(f"commlib: no job monitor store ({e}); timeouts will not name the missing ranks", file=sys.stderr)
        raw = text.encode()[:_PAYLOAD]
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    if not backend.broadcast(buf, 0, 0).wait(timeout):
        return ""
    fields = buf.tobytes().rstrip(b"\0").decode().split()
    if len(fields) == 4:
        _state.address = (fields[0], int(fields[1]), fields[2])
        return fields[3]
    return ""


def _serve() -> str:
    from commlib.store._server import StoreServer
    from commlib.store._wire import Limits

    token = secrets.token_hex(16)
    _state.server = StoreServer("0.0.0.0", 0, token.encode(), Limits(), None)
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        host = "127.0.0.1"
    return f"{host} {_state.server.port} {token} {os.getpid()}"


def _client() -> Any:
    """The store client, connected on first use; None once the store proved unusable."""
    if _state.client is None and _state.dead is None:
        if _state.address is None:
            _state.dead = "no job store (COMMLIB_MONITOR=0, or it could not be started)"
            return None
        from commlib.store import TCPStore

        host, port, token = _state.address
        try:
            _state.client = TCPStore(host, port, timeout=_STORE_TIMEOUT, token=token or None)
        except CommError as e:
            _dead(f"the job store at {host}:{port} is unreachable ({e})")
    return _state.client


def _dead(why: str) -> None:
    _state.dead = why
    if _state.client is not None:
        with contextlib.suppress(CommError):
            _state.client.close()
    _state.client = None


def _call(method: str, *args: Any) -> Any:
    """One store request; on failure the store is given up (it must not stall every later wait)."""
    client = _client()
    if client is None:
        return None
    try:
        return getattr(client, method)(*args)
    except (CommError, OSError, ValueError) as e:
        host, port, _ = _state.address or ("?", 0, "")
        _dead(f"the job store at {host}:{port} stopped answering ({type(e).__name__}: {e})")
        return None


def _progress_key(g: Any, group_rank: int) -> str:
    return f"{_PREFIX}/progress/{_state.worlds}/{g.name}/{group_rank}"


def _counts(g: Any) -> str:
    """The sends and receives this rank has posted on ``g``, by peer: ``s1:3,2:1;r0:2;a0`` (the ones not
    zero; ``a``: receives from any rank). A peer blocked in a send or receive reads them (:func:`_unmatched`)."""
    if g.tagged:  # messages of other tags may overtake: a count cannot say what matches
        return ""
    sent = ",".join(f"{p}:{n}" for p, n in enumerate(g.sent) if n)
    received = ",".join(f"{p}:{n}" for p, n in enumerate(g.received) if n)
    text = f"s{sent};r{received};a{g.any_received}"
    return text if len(text) <= _COUNTS_MAX else ""  # a huge group with many peers: no early verdict


def _pairs(text: str) -> dict[int, int]:
    return {int(p): int(n) for p, n in (x.split(":") for x in text.split(",") if x)}


def _parse_counts(text: str) -> tuple[dict[int, int], dict[int, int], int] | None:
    parts = text.split(";")
    if len(parts) != 3 or parts[0][:1] != "s" or parts[1][:1] != "r" or parts[2][:1] != "a":
        return None
    try:
        sent, received = (_pairs(part[1:]) for part in parts[:2])
        return sent, received, int(parts[2][1:])
    except ValueError:
        return None


def _publish(g: Any, call: str, seq: int, what: str | None = None) -> None:
    """Tell the others this rank waits in call #``seq`` (``what``: the call in the words of its stamps)."""
    if what is not None:
        _state.mine[(g.name, seq)] = what  # said once in these words, kept when a later call says fewer
    key = _progress_key(g, g.rank)
    value = f"{seq} {call}\t{_state.mine.get((g.name, seq), '')}\t{_counts(g)}"
    if _state.published.get(key) != value:  # once per call (again if its sends and receives changed)
        _state.published[key] = value
        _call("set", key, value)


def watchdog(waited: float, what: str | None = None) -> None:
    """The slow path of every wait (after 0.25 s, then every 0.5 s): publish progress, fail fast on a peer's
    failure. ``what``: the waiting operation's own description (the backend's), published with the call."""
    if _state.dead is not None or _state.failure_raised:
        return
    p2p = _p2p_waiting() if P2P_WAITS else None
    if p2p is not None:
        g, call, text, link = p2p
        if g.rank >= 0:
            key = _progress_key(g, g.rank)
            _state.published[key] = f"0 {call}\t{text}"
            _call("set", key, _state.published[key])  # every time: not numbered, not deduplicated
            if link is not None and waited >= 0.5:
                _unmatched(g, call, text, *link)
    elif (running := _flight.waiting()) is not None and running[0].rank >= 0:
        _publish(*running, what)
        if what is not None and waited >= 0.5:  # every rank waits in call #seq: are they all the same call?
            _compare(*running, what)
    failure = _call("compare_set", _FAILED, _MISSING, _MISSING)
    if failure is None or failure.decode(errors="replace") == _MISSING:
        return
    _state.failure_raised = True
    where = ""
    if p2p is not None:
        where = f"{p2p[0].label}{p2p[2]} (on group {p2p[0].name!r}): "
    elif (running := _flight.waiting()) is not None:
        g, call, seq = running
        where = f"{g.label}{call} (call #{seq} on group {g.name!r}): "
    err = GroupBrokenError(
        f"{where}{failure.decode(errors='replace')} (reported through the job's store after this rank had "
        f"waited {waited:.1f} s); the group is now unusable"
    )
    err.commlib_peer_failure = True  # type: ignore[attr-defined]
    raise err


def _p2p_waiting() -> tuple[Any, str, str, tuple[str, int, int] | None] | None:
    """(group, call, description, (``"send"`` or ``"recv"``, the peer's group rank, which of this rank's sends to
    (receives from) it this is) or None when not known) of the send or receive this thread waits in, from its
    frames (the outermost: ``recv`` rather than the ``Work.wait`` it runs); else None."""
    frame: Any = sys._getframe(2)
    found = None
    for _ in range(40):
        if frame is None:
            break
        describe = P2P_WAITS.get(frame.f_code)
        if describe is not None:
            found = describe(frame.f_locals) or found
        frame = frame.f_back
    return found


def _unmatched(g: Any, call: str, text: str, kind: str, q: int, needed: int) -> None:
    """A send to (or receive from) group rank ``q``, this rank's ``needed``-th to (from) it, waited for 0.5 s: when
    ``q`` waits in a collective of ``g`` that this rank has not reached, having posted fewer receives from (sends
    to) this rank than ``needed``, neither call can ever complete: raise ``CollectiveMismatchError`` now, naming
    both, instead of at the timeout.

    Sound whatever the timing: ``q`` cannot leave collective #k before this rank makes it, and while it waits
    there it posts nothing (its counts were published with the call, again whenever they changed); messages
    between two ranks meet their receives in order (MPI's and NCCL's rule), unless tags let them overtake: a
    group on which either rank used a tag other than 0 gets no verdict.
    """
    if g.tagged:
        return  # this rank used tags: its n-th send to q need not meet q's n-th receive
    s = _progress(g, q)
    if s is None or s[0] <= g.seq or s[3] is None:
        return  # q is not in a collective this rank has still to make (or did not say)
    counts = _parse_counts(s[3])
    if counts is None:
        return
    sent, received, anywhere = counts
    if kind == "send":
        posted = received.get(g.rank, 0) + anywhere
        theirs = f"posted {received.get(g.rank, 0)} receives from this rank" + (
            f" and {anywhere} from any rank" if anywhere else ""
        )
        mine = f"this is this rank's send #{needed} to it"
    else:
        posted = sent.get(g.rank, 0)
        theirs, mine = f"posted {posted} sends to this rank", f"this is this rank's receive #{needed} from it"
    if posted >= needed:
        return  # it may still match: q's posted operation completes while q waits
    raise CollectiveMismatchError(
        f"{g.what(text, 0)}: the ranks are not making matching calls: "
        f"rank {g.ranks[q]} waits in {s[2] or f'{s[1]} #{s[0]}'}, which this rank has not reached "
        f"(it made {g.seq} collective calls on the group), and has {theirs} ({mine}): neither call can complete; "
        "the group is now unusable" + g.dumped(f"mismatch in {call}")
    )


def _seen(s: tuple[int, str, str | None, str | None]) -> str:
    """A rank's published progress in words: ``all_reduce #3``, or a send's or receive's description."""
    return (s[2] or s[1]) if s[0] == 0 else f"{s[1]} #{s[0]}"


def _compare(g: Any, call: str, seq: int, what: str) -> None:
    """A long wait in call #``seq`` of ``g``: when every other rank has published that it waits in call #``seq``
    too, in other words (another kind, size, root, op: stamps that will never meet), no rank can go on: raise
    ``CollectiveMismatchError`` now, listing each rank's call, instead of at the timeout."""
    others = {}
    for p in range(g.size):
        if p == g.rank:
            continue
        s = _progress(g, p)
        if s is None or s[0] != seq or s[2] is None:
            return  # a rank elsewhere (or silent): only the timeout can tell
        others[g.ranks[p]] = s[2]
    if all(w == what for w in others.values()):
        return
    calls = "; ".join([f"this rank (rank {g.ranks[g.rank]}): {what}", *(f"rank {r}: {w}" for r, w in others.items())])
    raise CollectiveMismatchError(
        f"{g.what(call, seq)}: the ranks are not making the same call: every rank waits in call #{seq}, but their "
        f"calls differ: {calls}; the group is now unusable"
    )


def arrival(g: Any, call: str, seq: int, timeout: float) -> tuple[str, bool]:
    """Which ranks of ``g`` reached call #``seq`` and what they call there (from their published progress), as
    text for the error; and whether every rank arrived but their calls differ (a mismatched program)."""
    if g.rank < 0:
        return "", False
    if seq == 0:  # a send or a receive (not numbered): where the others are
        places = [
            f"rank {g.ranks[p]} was last seen waiting in {_seen(s)}"
            for p in range(g.size)
            if p != g.rank and (s := _progress(g, p))
        ]
        return (f" ({'; '.join(places)})" if places else ""), False
    _publish(g, call, seq)
    deadline, seen = time.monotonic() + min(_GRACE, timeout / 4), None
    while _state.dead is None:
        reading = {p: _progress(g, p) for p in range(g.size) if p != g.rank}
        if _state.dead is not None:  # the store went away mid-reading (e.g. its host rank exited)
            break
        seen = reading
        if all(s is not None and s[0] >= seq for s in seen.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if seen is None:
        return f"; which ranks arrived is unknown: {_state.dead}", False
    mine = _state.mine.get((g.name, seq))
    arrived, missing, other, notes = [g.ranks[g.rank]], [], {}, []
    for p, s in seen.items():
        rank = g.ranks[p]
        if s is None or s[0] < seq:
            missing.append(rank)
            seen_at = "never reported waiting" if s is None else f"was last seen waiting in {_seen(s)}"
            notes.append(f"rank {rank} {seen_at}")
        elif s[0] == seq and (s[1] != call or (mine is not None and s[2] is not None and s[2] != mine)):
            other[rank] = s[2] or f"{s[1]} #{s[0]}"  # the same call number, another call: a mismatched program
        else:
            arrived.append(rank)
            if s[0] > seq:
                notes.append(f"rank {rank} is in {s[1]} #{s[0]}")
    me = f"this rank (rank {g.ranks[g.rank]}): {mine or f'{call} #{seq}'}"
    if other and not missing:
        calls = "; ".join([me, *(f"rank {r}: {c}" for r, c in sorted(other.items()))])
        same = f" ({', '.join(f'rank {r}' for r in sorted(arrived) if r != g.ranks[g.rank])} as this rank)"
        return f"; every rank arrived at call #{seq}, but their calls differ: {calls}" + (
            same if len(arrived) > 1 else ""
        ), True
    text = f"; arrived: ranks {sorted(arrived)}; not arrived: ranks {missing}"
    if other:
        text += f"; in a different call (mismatched program?): ranks {sorted(other)}"
        notes += [f"rank {r} is in {c}, {me}" for r, c in sorted(other.items())]
    elif not missing:
        text += f" (every rank arrived at this call{f': {mine}' if mine else ''})"
    return text + (f" ({'; '.join(notes)})" if notes else ""), False


def _progress(g: Any, p: int) -> tuple[int, str, str | None, str | None] | None:
    """Group rank ``p``'s published progress on ``g``: (call number, 0 for a send or receive; the call; the call in
    its stamps' words, or a send's or receive's description; its posted sends and receives, see :func:`_counts`)."""
    raw = _call("compare_set", _progress_key(g, p), _MISSING, _MISSING)
    if raw is None or raw.decode(errors="replace") == _MISSING:
        return None
    head, _, rest = raw.decode(errors="replace").partition("\t")
    what, _, counts = rest.partition("\t")
    seq, _, call = head.partition(" ")
    return (int(seq), call, what or None, counts or None) if seq.isdigit() else None


def raised_uncaught() -> bool:
    """Whether commlib's excepthook reported an uncaught exception on this rank (the program did not end well)."""
    return _state.uncaught


def install_excepthook(abort: Callable[[], None] | None) -> None:
    """An uncaught exception on one rank ends the whole job at once instead of leaving the others waiting.

    The traceback is printed, the flight recorder dumped and the failure published through the
    job's store (:func:`report_uncaught`, so the other ranks fail fast naming this rank), then
    ``abort()`` ends the job (MPI_Abort for an MPI world; None: the process just exits, which
    its launcher notices); when a hook installed later wraps this one (torch's), once that hook has
    written what this one printed (:func:`_abort_after_hooks`). ``COMMLIB_ABORT_ON_EXCEPTION=0``
    turns it off.
    """
    if os.environ.get("COMMLIB_ABORT_ON_EXCEPTION", "1") == "0":
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
    first = None if getattr(value, "commlib_peer_failure", False) else _call("compare_set", _FAILED, "", text)
    if _state.dead is not None:
        return  # no store to coordinate through: end the job now
    if first != text.encode():
        # Another rank failed first: it ends the job once everyone has reported (aborting here
        # as well would stop the ranks still writing their flight records).
        _call("add", _REPORTED, 1)
        time.sleep(_ACK_WAIT + 1.0)
        return
    deadline = time.monotonic() + _ACK_WAIT
    while time.monotonic() < deadline and _state.dead is None:
        reported = _call("add", _REPORTED, 0)
        if reported is not None and reported >= _state.size - 1:
            return
        time.sleep(0.05)
