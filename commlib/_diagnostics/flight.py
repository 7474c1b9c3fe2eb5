"""The flight recorder: a per-process ring of the last N collectives, dumped as JSON when things go wrong.

Each collective writes one tuple when it starts and one integer when it ends
(preallocated lists, no formatting, no locks: about 0.1 us). A slot's state is
read from its times: end >= start means completed, -end >= start failed,
else it was still running. A blocking call that a backend's ready operation
completes at once (most small calls on the mpi backend) is recorded by the
backend instead, with no Python object made per call (``commlib.backends._steps.executed``:
the operation's label, the call's number and time), and shows here the same way,
completed with no duration. ``COMMLIB_FLIGHT_RECORDER_SIZE`` (default 2000) sets N; 0
turns the dumps off.

Dumps go to ``$COMMLIB_FLIGHT_DIR/rank<r>.json`` (the launcher sets it to
``<logdir>/flight`` or a folder of its own), else to
``$TMPDIR/commlib-flight-<job id>/rank<r>.json``; they are written on a
timeout, on an uncaught exception and on SIGUSR1.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from commlib._settings import current
from commlib._settings import value as setting

__all__ = [
    "COMPLETED",
    "FAILED",
    "STARTED",
    "GroupTag",
    "Record",
    "dump",
    "entries",
    "install_signal",
    "now",
    "ring",
    "summarize",
]

STARTED, COMPLETED, FAILED = "started", "completed", "failed"
EXIT_REASON = "the program ended (normal exit)"  # the launcher removes these dumps after a job that succeeded
now = time.perf_counter_ns
_EPOCH_NS = time.time_ns() - now()  # converts perf_counter_ns readings to wall-clock ns


def _size() -> int:
    return int(setting("COMMLIB_FLIGHT_RECORDER_SIZE"))


class Record(NamedTuple):
    """A collective's start in the ring. Written as a plain tuple of these fields, in this order (the blocking
    hot path writes its literal: :meth:`commlib._group.ProcessGroup.run_ready`), read as a Record."""

    group: Any  #: the ProcessGroup
    call: str  #: the public call (``all_gather_into_tensor``)
    desc: Any  #: its description (``commlib.backends._call.Call``), or None
    seq: int  #: its number on the group
    start: int  #: :func:`now` at its start


class GroupTag(NamedTuple):
    """A group as a record names it (the ready operations' labels: no reference to the group itself)."""

    name: str
    ranks: tuple[int, ...]


class Ring:
    """The preallocated ring: ``starts[i]`` a :class:`Record`'s fields, ``ends[i] = t1`` or ``-t1``.

    A slot is not cleared when it is reused: an end older than the start belongs to
    the slot's previous occupant, so the new one is still running.
    """

    __slots__ = ("ends", "size", "slots", "starts")

    def __init__(self, size: int) -> None:
        self.size = size
        self.starts: list[Any] = [None] * max(size, 1)
        self.ends: list[int] = [0] * max(size, 1)
        self.slots = itertools.cycle(range(self.size or 1))  # next(slots): the slot to write (no modulo)

    def start(self, group: Any, call: str, desc: Any, seq: int) -> int:
        """Record a collective that starts now; return its slot (for :meth:`end`)."""
        i = next(self.slots)
        self.starts[i] = (group, call, desc, seq, now())
        return i

    def record(self, slot: int) -> Record | None:
        """What ``slot`` holds (None: nothing yet)."""
        entry = self.starts[slot]
        return None if entry is None else Record(*entry)

    def end(self, slot: int, group: Any, seq: int, ok: bool = True) -> None:
        """Record the end of the collective in ``slot`` (unless the ring has moved past it)."""
        entry = self.record(slot)
        if entry is not None and entry.group is group and entry.seq == seq:
            self.ends[slot] = now() if ok else -now()


ring = Ring(_size() or 1)
enabled = _size() > 0
_meta: dict[str, Any] = {"rank": None, "world_size": None, "job": None}


def _state(t0: int, t1: int) -> str:
    return COMPLETED if t1 >= t0 else FAILED if -t1 >= t0 else STARTED


def _records() -> list[tuple[Record, int]]:
    """Every record (the ring's, and the ready operations' runs a backend recorded), with its end time."""
    out = [(r, ring.ends[i]) for i in range(len(ring.starts)) if (r := ring.record(i)) is not None]
    steps = sys.modules.get("commlib.backends._steps")  # the mpi backend's executors, if it was ever loaded
    for (group, call, desc), seq, t in steps.executed() if steps is not None else ():
        out.append((Record(group, call, desc, seq, t), t))
    return out


def entries() -> list[dict[str, Any]]:
    """The recorded collectives, oldest first, as plain dicts."""
    out: list[dict[str, Any]] = []
    for r, t1 in _records():
        t0, desc = r.start, r.desc
        state = _state(t0, t1)
        out.append(
            {
                "group": getattr(r.group, "name", str(r.group)),
                "ranks": list(getattr(r.group, "ranks", [])),
                "op": r.call,
                "dtype": None if desc is None or desc.dtype is None else str(desc.dtype),
                "count": 0 if desc is None else desc.count,
                "reduce_op": None if desc is None or desc.op is None else desc.op.name,
                "root": None if desc is None or desc.root < 0 else desc.root,
                "seq": r.seq,
                "state": state,
                "start_ns": t0 + _EPOCH_NS,
                "end_ns": abs(t1) + _EPOCH_NS if state != STARTED else None,
                "duration_us": (t1 - t0) / 1e3 if state == COMPLETED else None,
            }
        )
    out.sort(key=lambda e: e["start_ns"])
    return out[-ring.size :] if ring.size else out


def set_job(rank: int, world_size: int, job: str) -> None:
    """Remember who this process is, for the dump's header and file name."""
    _meta.update(rank=rank, world_size=world_size, job=job)


def dump_dir() -> Path:
    """Where dumps go: ``COMMLIB_FLIGHT_DIR``, else ``$TMPDIR/commlib-flight-<job id>``."""
    folder = current("COMMLIB_FLIGHT_DIR")
    if folder:
        return Path(folder)
    return Path(tempfile.gettempdir()) / f"commlib-flight-{_meta['job'] or os.getpid()}"


def dump(reason: str) -> Path | None:
    """Write the ring as JSON to ``dump_dir()/rank<r>.json``; return the path (None if it could not be written)."""
    if not enabled:
        return None
    rank = _meta["rank"] if _meta["rank"] is not None else os.environ.get("RANK", "x")
    doc = {
        "rank": rank,
        "world_size": _meta["world_size"],
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "reason": reason,
        "time_ns": time.time_ns(),
        "entries": entries(),
    }
    try:
        folder = dump_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{rank}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(path)
        _meta["dumped"] = True
        return path
    except OSError as e:
        print(f"commlib: could not write the flight recorder dump: {e}", file=sys.stderr, flush=True)
        return None


def install_signal() -> None:
    """Dump on SIGUSR1 unless ``COMMLIB_FLIGHT_SIGNAL=0`` or someone else already handles it; under
    ``commlib.launch``, also at a normal exit (a rank that finished is then in the summary of a failed job)."""
    if not enabled:
        return
    if setting("COMMLIB_LAUNCH_STATUS") and not _meta.get("atexit"):
        _meta["atexit"] = True
        atexit.register(_dump_at_exit)  # runs before MPI_Finalize (atexit is last in, first out)
    if not setting("COMMLIB_FLIGHT_SIGNAL"):
        return
    try:
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            return
        signal.signal(signal.SIGUSR1, lambda *_: dump("SIGUSR1"))
    except (ValueError, OSError, AttributeError):  # not the main thread, or no SIGUSR1 here
        return
    _note_launcher()


def _dump_at_exit() -> None:
    if not _meta.get("dumped"):  # a dump that says why (an error, a timeout) is worth more than this one
        dump(EXIT_REASON)


def _note_launcher() -> None:
    """Tell commlib.launch that this rank dumps on SIGUSR1 (it sends it only to ranks that do)."""
    folder = setting("COMMLIB_LAUNCH_STATUS")
    if folder:
        with contextlib.suppress(OSError):
            Path(folder, f"rank{os.environ.get('RANK', 'x')}.flight").write_text(str(os.getpid()))


def summarize(folder: Path, n: int, since_ns: int = 0) -> str:
    """One summary of the ranks' dumps in ``folder``: who is stuck in which op and seq, who moved on."""
    lines, stuck, silent = [], {}, []
    last: dict[int, dict[str, Any]] = {}
    for rank in range(n):
        try:
            doc = json.loads((folder / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            lines.append(f"  rank {rank}: no flight record (it died, or was stopped, before writing one)")
            silent.append(rank)
            continue
        if doc.get("time_ns", 0) < since_ns:
            lines.append(f"  rank {rank}: no flight record from this run")
            continue
        done = [e for e in doc["entries"] if e["state"] == COMPLETED]
        open_ = [e for e in doc["entries"] if e["state"] != COMPLETED]
        if done:
            last[rank] = done[-1]
        if open_:
            e = open_[0]
            waited = (doc["time_ns"] - e["start_ns"]) / 1e9
            stuck[rank] = e
            lines.append(
                f"  rank {rank}: {e['state']} in {e['op']} #{e['seq']} on group {e['group']!r} "
                f"({waited:.1f} s before its dump: {_short(doc['reason'])})"
            )
        elif done:
            e = done[-1]
            lines.append(f"  rank {rank}: not in a collective; last completed {e['op']} #{e['seq']} on {e['group']!r}")
        else:
            lines.append(f"  rank {rank}: no collective recorded ({_short(doc['reason'])})")
    verdict = _verdict(stuck, last)
    if verdict and silent:
        verdict[0] += f"; ranks {silent} left no record (dead or stopped?)"
    return "\n".join([*verdict, *lines])


def _verdict(stuck: dict[int, dict[str, Any]], last: dict[int, dict[str, Any]]) -> list[str]:
    """The headline: the call the stuck ranks wait in, which ranks never reached it, which moved on."""
    if not stuck:
        return []
    first = min(stuck.values(), key=lambda e: (e["seq"], e["start_ns"]))
    group, seq = first["group"], first["seq"]
    at = {r: e for r, e in stuck.items() if e["group"] == group and e["seq"] == seq}
    calls = sorted({e["op"] for e in at.values()})
    if len(calls) > 1:  # the same call number, different calls: a mismatched program
        each = "; ".join(f"ranks {sorted(r for r, e in at.items() if e['op'] == op)} in {op}" for op in calls)
        return [f"mismatched calls at #{seq} on group {group!r}: {each}"]
    waiting = sorted(at)
    behind = [r for r, e in last.items() if r not in stuck and e["group"] == group and e["seq"] < seq]
    behind = sorted(behind + [r for r, e in stuck.items() if e["group"] == group and e["seq"] < seq])
    ahead = sorted(r for r, e in last.items() if r not in stuck and e["group"] == group and e["seq"] >= seq)
    later = {r: e for r, e in stuck.items() if e["group"] == group and e["seq"] > seq}
    text = f"ranks {waiting} did not complete {first['op']} #{seq} on group {group!r}"
    if behind:
        text += f"; ranks {behind} never reached it"
    if ahead:
        text += f"; ranks {ahead} moved on past it"
    if later:
        where = ", ".join(f"rank {r} in {e['op']} #{e['seq']}" for r, e in sorted(later.items()))
        text += f"; ranks {sorted(later)} moved on past it ({where}): a mismatched program?"
    return [text]


def _short(reason: str) -> str:
    """A dump's reason in one line of at most 160 characters (an MPI error stack is many)."""
    line = reason.splitlines()[0] if reason else ""
    return line if len(line) <= 160 else line[:157] + "..."
