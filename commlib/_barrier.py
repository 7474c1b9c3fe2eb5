"""barrier and monitored_barrier (which names the ranks that did not arrive)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from commlib._diagnostics.debug import check
from commlib._group import ProcessGroup, Work
from commlib._timeouts import as_seconds
from commlib._world import _state as _world
from commlib._world import resolve
from commlib.backends._call import Call
from commlib.backends.base import MeetingTimeout
from commlib.errors import CommTimeoutError

__all__ = ["barrier", "monitored_barrier"]

_BARRIER = Call("barrier", None, 0)


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
        and (p := ready.get(("barrier",))) is not None
        and g.run_ready("barrier", p, None, None)
    ):
        return None
    g, _ = resolve(group, "barrier")
    if timeout is None:
        return g.call("barrier", _BARRIER, None, None, async_op, None, ("barrier",))
    seconds = as_seconds(timeout, f"{g.label}barrier")  # checked before posting
    with _timeout(g, seconds):
        return g.call("barrier", _BARRIER, None, None, async_op, None, ("barrier",))


@contextlib.contextmanager
def _timeout(g: ProcessGroup, seconds: float) -> Iterator[None]:
    """``g``'s timeout is ``seconds`` meanwhile (a barrier's own ``timeout=``)."""
    before, g.timeout = g.timeout, seconds
    try:
        yield
    finally:
        g.timeout = before


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
        check(g, call, _BARRIER)
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
