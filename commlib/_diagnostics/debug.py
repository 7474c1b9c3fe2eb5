"""``COMMLIB_DEBUG=DETAIL``: before each collective, check that every rank of the group makes the same call.

Each rank describes its call (sequence number, op, dtype, shape or count, root,
reduce op) in a fixed-size record, and the group all-gathers the records on its
own communicator before the real operation is posted. Every rank of the group
makes this same all-gather whatever call it is about to make, so the check
itself always matches; when the records differ, every rank raises
:class:`~commlib.errors.CollectiveMismatchError` listing each rank's call, and
the group is fenced off. Off by default; when off the only cost is reading a
flag set when the group was created.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from commlib._diagnostics import flight
from commlib._settings import value as setting
from commlib.arrays import to_device, to_host
from commlib.errors import CollectiveMismatchError

__all__ = ["check", "describe", "detail"]

_DIGEST = 16
_RECORD = 256  # bytes per rank: a digest of the whole description, then as much of its text as fits


def detail() -> bool:
    """Whether ``COMMLIB_DEBUG`` asks for call checks (``DETAIL``, as torch's TORCH_DISTRIBUTED_DEBUG)."""
    return bool(setting("COMMLIB_DEBUG"))


def describe(call: str, seq: int, a: Any = None, op: Any = None, root: int | None = None, shape: Any = None) -> str:
    """One call as text, e.g. ``all_reduce(seq 3, float32[4], SUM)``; only what must agree across ranks."""
    parts = [f"seq {seq}"]
    if a is not None:
        dims = a.shape if shape is None else shape
        parts.append(f"{a.dtype}[{', '.join(str(d) for d in dims)}]")
    if op is not None:
        parts.append(getattr(op, "name", str(op)))
    if root is not None:
        parts.append(f"root {root}")
    return f"{call}({', '.join(parts)})"


def _record(text: str) -> np.ndarray:
    raw = text.encode()
    out = np.zeros(_RECORD, np.uint8)
    out[:_DIGEST] = np.frombuffer(hashlib.blake2b(raw, digest_size=_DIGEST).digest(), np.uint8)
    body = raw[: _RECORD - _DIGEST]
    out[_DIGEST : _DIGEST + len(body)] = np.frombuffer(body, np.uint8)
    return out


def check(g: Any, call: str, a: Any = None, op: Any = None, root: int | None = None, shape: Any = None) -> None:
    """All-gather this rank's call description over ``g``; raise on every rank if any rank's differs."""
    mine = describe(call, g.seq + 1, a, op, root, shape)
    if g.size == 1:
        return
    out = g.xp.zeros(g.size * _RECORD, np.uint8)
    handle = g.backend.all_gather(to_device(_record(mine), g.xp), out, g.seq + 1)
    g.complete(f"{call} (COMMLIB_DEBUG=DETAIL call check)", g.seq + 1, -1, g.timeout, handle.wait)
    table = to_host(out).reshape(g.size, _RECORD)
    digests = {bytes(row[:_DIGEST]) for row in table}
    if len(digests) == 1:
        return
    calls = [bytes(row[_DIGEST:]).rstrip(b"\0").decode(errors="replace") for row in table]
    listing = " / ".join(f"rank {g.ranks[p]}: {c}" for p, c in enumerate(calls))
    err = CollectiveMismatchError(
        f"{g.label}{call}: the ranks of group {g.name!r} are not making the same collective call "
        f"(COMMLIB_DEBUG=DETAIL): {listing}; the group is now unusable"
    )
    err.calls = {g.ranks[p]: c for p, c in enumerate(calls)}  # type: ignore[attr-defined]
    # the call never started, but a dump (and the launcher's summary) should say which one this rank was making
    slot = flight.ring.start(g, call, None if a is None else a.dtype, 0 if a is None else a.size, g.seq + 1)
    flight.ring.end(slot, g, g.seq + 1, ok=False)
    g.mark_broken(err)
    raise err
