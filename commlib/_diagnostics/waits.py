"""Where each thread of this process waits: written by the group layer's one wait path, read by the slow path.

The group layer (:meth:`commlib._group.ProcessGroup.complete` and the ready path) enters a :class:`Waiting`
before it hands a wait to the backend and leaves it after; a wait that lasts (``backends.base.poll``'s slow
path, torch's Work too) reads :func:`current` to publish where this rank waits and to judge it. Nothing is
written on a call that completes without waiting.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

__all__ = ["Waiting", "current", "enter", "leave"]


class Waiting(NamedTuple):
    """A call this thread waits in."""

    group: Any  #: the ProcessGroup
    call: str  #: the public call (``recv``, ``all_gather_into_tensor``)
    desc: Any  #: its description (``commlib.backends._call.Call``), or None
    seq: int  #: its number on the group (0: a send or a receive, which are not numbered)
    peer: int = -1  #: a send's or receive's peer (group rank; -1: any rank, or none)
    nth: int = 0  #: which of this rank's sends to (receives from) the peer it is (1: the first; 0: unknown)


_local = threading.local()


def current() -> Waiting | None:
    """The call this thread waits in, or None."""
    return getattr(_local, "waiting", None)


def enter(waiting: Waiting) -> Waiting | None:
    """This thread now waits in ``waiting``; returns what it waited in before (for :func:`leave`)."""
    before = getattr(_local, "waiting", None)
    _local.waiting = waiting
    return before


def leave(before: Waiting | None) -> None:
    """The wait :func:`enter` began is over."""
    _local.waiting = before
