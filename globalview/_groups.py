"""Process groups for placements, and every collective globalview runs.

Each collective goes through :func:`collective`, which can record it: the tests
use :func:`record` to assert exactly which collectives a conversion ran.
Groups come from ``commlib.groups.subgroup``, which makes each once per world
(and forgets them when the world is destroyed). Making one is collective over the
world, so every rank asks for the same groups in the same order; globalview
guarantees that because every rank runs the same plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import commlib
import commlib.groups
from globalview._placement import placement as Placement

__all__ = ["Call", "collective", "line_group", "record", "subgroup"]

_recorders: list[list[Call]] = []


@dataclass(frozen=True)
class Call:
    """One collective globalview issued: its name, the group's ranks and the bytes of its buffer(s)."""

    name: str
    ranks: tuple[int, ...]
    nbytes: int


def subgroup(ranks: tuple[int, ...]) -> Any:
    """The commlib group of ``ranks`` (in that order): the default group for the whole world in order."""
    world = commlib.get_world_size()
    bad = [r for r in ranks if r >= world]
    if bad:
        raise ValueError(f"globalview: placement ranks {bad} do not exist in a world of {world} ranks")
    return commlib.groups.subgroup(ranks)


def line_group(pl: Placement, axis: int, me: int) -> Any:
    """This rank's group along mesh ``axis`` of ``pl`` (every rank creates all the lines' groups)."""
    mine = None
    for line in pl.lines(axis):
        g = subgroup(line)
        if me in line:
            mine = g
    return mine


@contextlib.contextmanager
def record() -> Iterator[list[Call]]:
    """Collect the collectives globalview runs inside the block (on this rank)."""
    calls: list[Call] = []
    _recorders.append(calls)
    try:
        yield calls
    finally:
        _recorders.remove(calls)


def collective(name: str, fn: Callable[..., Any], *args: Any, ranks: tuple[int, ...], nbytes: int, **kw: Any) -> None:
    """Run the commlib collective ``fn`` and note it in every active recorder."""
    fn(*args, **kw)
    for calls in _recorders:
        calls.append(Call(name, ranks, nbytes))
