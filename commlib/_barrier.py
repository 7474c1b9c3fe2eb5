"""barrier and monitored_barrier (which names the ranks that did not arrive)."""

from __future__ import annotations

from typing import Any

from commlib._diagnostics.debug import check as check_call
from commlib._group import ProcessGroup, Work
from commlib._timeouts import as_seconds
from commlib._world import _state as _world
from commlib._world import resolve
from commlib.backends.base import MeetingTimeout
from commlib.errors import CommTimeoutError

__all__ = ["barrier", "monitored_barrier"]


def barrier(
    group: ProcessGroup | None = None, async_op: bool = False, device_ids: Any = None, timeout: Any = None
) -> Work | None:
    """Wait until every rank of the group has called barrier (``timeout`` overrides the group's)."""
    g = _world.world if group is None else group
    if (
        timeout is None
        and device_ids is None
        and not async_op
        and type(g) is ProcessGroup
        and (ready := g.ready) is not None
        and not g.pending
        and (p := ready["barrier"].get(())) is not None
        and g.run_ready("barrier", p, None, None)
    ):
        return None
    g, b = resolve(group, "barrier")
    seconds = None if timeout is None else as_seconds(timeout, f"{g.label}barrier")  # checked before posting
    if g.detail:
        check_call(g, "barrier")
    fused = g.fused.get("barrier") if g.host and not async_op else None
    if fused is None and (async_op or seconds is None):
        return g.issue("barrier", "barrier", (), async_op)
    g.run("barrier", None, 0, g.timeout if seconds is None else seconds, fused or _posted_barrier(b))
    return None


def _posted_barrier(b: Any) -> Any:
    """A barrier posted through its handle, waited for as :meth:`ProcessGroup.run` waits (``(seq, timeout)``)."""
    return lambda seq, timeout: b.barrier(seq).wait(timeout)


def monitored_barrier(group: ProcessGroup | None = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """A barrier that, on timeout, names the ranks that did not arrive (raised on group rank 0).

    Every rank reports to group rank 0 with its own message, so rank 0 knows
    exactly who is missing; it then releases the others. The missing ranks are
    all named whether or not ``wait_all_ranks`` is set (waiting for all costs
    nothing extra here).
    """
    call = "monitored_barrier"
    g, b = resolve(group, call)
    seconds = g.timeout if timeout is None else as_seconds(timeout, f"{g.label}{call}")
    if g.detail:
        check_call(g, call)
    g.seq += 1
    if g.size == 1:
        return
    try:
        b.rendezvous(list(range(g.size)), seconds, what=call)
    except MeetingTimeout as e:
        if e.missing is None:
            what = (
                f"group rank 0 (global rank {g.ranks[0]}) did not release the barrier within {seconds:g} s; "
                "it may be waiting for a rank that did not arrive, or have failed"
            )
        else:
            missing = [g.ranks[p] for p in e.missing]
            what = (
                f"ranks {missing} did not reach the barrier within {seconds:g} s "
                f"(global ranks; {g.size - len(missing)} of {g.size} arrived)"
            )
        err = CommTimeoutError(f"{g.label}{call} (call #{g.seq} on group {g.name!r}): {what}")
        g.mark_broken(err)
        raise err from None
