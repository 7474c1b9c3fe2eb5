"""Chrome-trace timelines (chrome://tracing, Perfetto) of backward passes and bucket all-reduces.

``COMMLIB_DDP_TRACE=run.json`` (or ``trace="run.json"`` on the reducer or DDP) makes each rank
write ``run.rank<r>.json``: a JSON array of complete events
``{"name", "ph": "X", "ts", "dur", "pid": rank, "tid"}`` with times in microseconds of wall
clock (so ranks on one machine line up); a second reducer or DDP object in the same process
writes ``run.rank<r>.2.json``, and so on. ``tid`` 0 is the compute thread (forward, backward,
finalize), ``tid`` 1 the communication (one span per bucket all-reduce, from the moment it is
issued until the moment its completion is seen). Load several ranks' files together to
compare them. The file is valid JSON after every flush, so a crashed run still leaves a trace.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import commlib

__all__ = ["COMPUTE", "COMM", "ENV_VAR", "Tracer", "rank_path", "tracer_for"]

ENV_VAR = "COMMLIB_DDP_TRACE"  # the setting's name (commlib.setting reads it)
COMPUTE, COMM = 0, 1
_opened: dict[Path, int] = {}  # trace files this process has written, and how many times


def rank_path(path: str | os.PathLike[str], rank: int) -> Path:
    """``run.json`` -> ``run.rank3.json`` (the suffix is kept; ``.json`` added when missing)."""
    p = Path(path)
    if p.suffix == ".json":
        return p.with_name(f"{p.stem}.rank{rank}.json")
    return p.with_name(f"{p.name}.rank{rank}.json")


def now_us() -> float:
    """Wall-clock time in microseconds (comparable across processes on one machine)."""
    return time.time_ns() / 1000.0


class Tracer:
    """Collects complete ("X") events and appends them to one rank's trace file on :meth:`flush`."""

    now = staticmethod(now_us)

    def __init__(self, path: str | os.PathLike[str], rank: int) -> None:
        self.path = Path(path)
        self.rank = rank
        self._pending: list[dict[str, Any]] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w+b")  # noqa: SIM115 - stays open for appends; close() closes it
        self._file.write(b"[\n]\n")
        self._file.flush()
        self._end = 1  # where the next events go: just after "[" (later: after the last event)
        self._sep = b"\n"

    def span(self, name: str, tid: int, start: float, end: float, **args: Any) -> None:
        """Record one complete event from ``start`` to ``end`` (microseconds, :meth:`now`)."""
        event: dict[str, Any] = {"name": name, "ph": "X", "ts": round(start, 1), "dur": round(max(end - start, 0.0), 1)}
        event.update(pid=self.rank, tid=tid)
        if args:
            event["args"] = args
        self._pending.append(event)

    def flush(self) -> None:
        """Append the recorded events to the file, leaving it a complete JSON array."""
        if not self._pending or self._file.closed:
            return
        body = b",\n".join(json.dumps(e, separators=(",", ":")).encode() for e in self._pending)
        self._pending.clear()
        self._file.seek(self._end)
        self._file.write(self._sep + body)
        self._end = self._file.tell()
        self._file.write(b"\n]\n")
        self._file.flush()
        self._sep = b",\n"

    def close(self) -> None:
        """Flush and close the file."""
        self.flush()
        self._file.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown the file object may be gone
            self.close()


def tracer_for(trace: str | os.PathLike[str] | None, rank: int) -> Tracer | None:
    """A tracer writing ``trace`` (or ``$COMMLIB_DDP_TRACE``) for ``rank``; None when neither is set."""
    path = trace if trace is not None else commlib.setting("COMMLIB_DDP_TRACE") or None
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"trace must be a file path (str or os.PathLike) or None, got {type(path).__name__}")
    target = rank_path(path, rank)
    count = _opened[target] = _opened.get(target, 0) + 1
    if count > 1:  # a second reducer in this process: run.rank0.json, then run.rank0.2.json, ...
        target = target.with_name(f"{target.stem}.{count}.json")
    return Tracer(target, rank)
