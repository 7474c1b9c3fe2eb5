"""barrier and monitored_barrier (which names the ranks that did not arrive)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from commlib._diagnostics.debug import check as check_call
from commlib._diagnostics.flight import ring
from commlib._group import ProcessGroup, Work, as_seconds
from commlib._world import resolve
from commlib.backends._base import poll
from commlib.errors import CommTimeoutError

__all__ = ["barrier", "monitored_barrier"]


def barrier(
    group: ProcessGroup | None = None, async_op: bool = False, device_ids: Any = None, timeout: Any = None
) -> Work | None:
    """Wait until every rank of the group has called barrier (``timeout`` overrides the group's)."""
    g = resolve(group, "barrier")
    seconds = None if timeout is None else as_seconds(timeout, f"{g.label}barrier")  # checked before posting
    if g.detail:
        check_call(g, "barrier")
    handle = g.backend.barrier()
    if seconds is None or async_op:
        return g.run(handle, "barrier", async_op)
    if g.pending:
        g.drain(None, g.timeout)
    g.seq = seq = g.seq + 1
    g.finish(handle, "barrier", seq, ring.start(g, "barrier", None, 0, seq), seconds)
    return None


def monitored_barrier(group: ProcessGroup | None = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """A barrier that, on timeout, names the ranks that did not arrive (raised on group rank 0).

    Every rank reports to group rank 0 with its own message, so rank 0 knows
    exactly who is missing; it then releases the others. The missing ranks are
    all named whether or not ``wait_all_ranks`` is set (waiting for all costs
    nothing extra here).
    """
    call = "monitored_barrier"
    g = resolve(group, call)
    seconds = g.timeout if timeout is None else as_seconds(timeout, f"{g.label}{call}")
    if g.detail:
        check_call(g, call)
    g.seq += 1
    b, tag = g.backend, g.backend.max_tag + 1
    if g.size == 1:
        return
    if g.rank != 0:
        b.send(g.xp.zeros(1, np.uint8), 0, tag)
        if not b.recv(g.xp.zeros(1, np.uint8), 0, tag).wait(seconds):
            _fail(
                g,
                f"group rank 0 (global rank {g.ranks[0]}) did not release the barrier within {seconds:g} s; "
                "it may be waiting for a rank that did not arrive, or have failed",
            )
        return
    arrivals = {p: b.recv(g.xp.zeros(1, np.uint8), p, tag) for p in range(1, g.size)}
    deadline = time.monotonic() + seconds
    poll(lambda: all(h.test() for h in arrivals.values()), seconds)
    missing = [g.ranks[p] for p, h in arrivals.items() if not h.test()]
    if missing:
        waited = seconds - max(0.0, deadline - time.monotonic())
        _fail(
            g,
            f"ranks {missing} did not reach the barrier within {waited:.3g} s "
            f"(global ranks; {g.size - len(missing)} of {g.size} arrived)",
        )
    releases = [b.send(g.xp.zeros(1, np.uint8), p, tag) for p in range(1, g.size)]
    poll(lambda: all(h.test() for h in releases), seconds)


def _fail(g: ProcessGroup, what: str) -> None:
    err = CommTimeoutError(f"{g.label}monitored_barrier (call #{g.seq} on group {g.name!r}): {what}")
    g.mark_broken(err)
    raise err
