"""``COMMLIB_DEBUG=DETAIL``: before each collective, check that every rank of the group makes the same call.

Each rank writes its call's description (the public call and everything every rank must agree on about it:
kind, dtype, count, op, root; :func:`commlib.backends._call.codes`) in a fixed-size record, and the group
all-gathers the records on its own communicator before the real operation is posted. Every rank makes this
same all-gather whatever call it is about to make, so the check itself always matches; when the records
differ, every rank raises :class:`~commlib.errors.CollectiveMismatchError` listing each rank's call, and the
group is fenced off. Off by default; when off the only cost is reading a flag set when the group was created.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from commlib._diagnostics import flight
from commlib._settings import value as setting
from commlib.arrays import to_device, to_host
from commlib.backends._call import Call, codes, describe
from commlib.errors import CollectiveMismatchError

__all__ = ["check", "detail"]

_DIGEST = 16
_RECORD = 256  # bytes per rank: a digest of the whole description, then as much of its text as fits


def detail() -> bool:
    """Whether ``COMMLIB_DEBUG`` asks for call checks (``DETAIL``, as torch's TORCH_DISTRIBUTED_DEBUG)."""
    return bool(setting("COMMLIB_DEBUG"))


def _record(name: str, call: Call, seq: int) -> tuple[np.ndarray, str]:
    """This rank's record: the digest of everything the ranks must agree on, then the call in words."""
    text = f"{name} #{seq}" + describe(call).removeprefix(call.kind)
    out = np.zeros(_RECORD, np.uint8)
    agreed = repr((name, seq, codes(call))).encode()
    out[:_DIGEST] = np.frombuffer(hashlib.blake2b(agreed, digest_size=_DIGEST).digest(), np.uint8)
    body = text.encode()[: _RECORD - _DIGEST]
    out[_DIGEST : _DIGEST + len(body)] = np.frombuffer(body, np.uint8)
    return out, text


def check(g: Any, name: str, call: Call) -> None:
    """All-gather this rank's description of call ``name`` over ``g``; raise on every rank if any rank's differs."""
    if g.size == 1:
        return
    seq = g.seq + 1
    mine, _ = _record(name, call, seq)
    out = g.xp.zeros(g.size * _RECORD, np.uint8)
    record = Call("all_gather", out.dtype, _RECORD)
    handle = g.backend.start(record, to_device(mine, g.xp), out, seq)
    g.complete(f"{name} (COMMLIB_DEBUG=DETAIL call check)", seq, -1, g.timeout, handle.wait)
    table = to_host(out).reshape(g.size, _RECORD)
    if len({bytes(row[:_DIGEST]) for row in table}) == 1:
        return
    calls = [bytes(row[_DIGEST:]).rstrip(b"\0").decode(errors="replace") for row in table]
    listing = " / ".join(f"rank {g.ranks[p]}: {c}" for p, c in enumerate(calls))
    err = CollectiveMismatchError(
        f"{g.label}{name}: the ranks of group {g.name!r} are not making the same collective call "
        f"(COMMLIB_DEBUG=DETAIL): {listing}; the group is now unusable",
        calls={g.ranks[p]: c for p, c in enumerate(calls)},
    )
    # the call never started, but a dump (and the launcher's summary) should say which one this rank was making
    slot = flight.ring.start(g, name, call, seq)
    flight.ring.end(slot, g, seq, ok=False)
    g.mark_broken(err)
    raise err
