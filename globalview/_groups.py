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
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import commlib
import commlib.groups
from globalview._placement import placement as Placement

__all__ = ["Call", "Recording", "collective", "line_group", "note", "phase", "record", "subgroup", "sub_mesh_group"]

_recorders: list[Recording] = []
_phase = contextvars.ContextVar("globalview_phase", default="forward")


@dataclass(frozen=True)
class Call:
    """One collective globalview issued: its name, the group's ranks, the bytes of its buffer(s), and
    whether the forward pass or backward (the adjoint boxing, the leaves' gradient reduction) ran it."""

    name: str
    ranks: tuple[int, ...]
    nbytes: int
    phase: str = "forward"


class Recording(list):
    """The :class:`Call` s a :func:`record` block ran on this rank (a list), with a readable summary."""

    def nbytes(self, phase: str | None = None) -> int:
        """Bytes of the calls (of one ``phase``, "forward" or "backward", when given)."""
        return sum(c.nbytes for c in self if phase is None or c.phase == phase)

    def names(self, phase: str | None = None) -> list[str]:
        """The collectives' names in issue order (of one ``phase`` when given)."""
        return [c.name for c in self if phase is None or c.phase == phase]

    def __str__(self) -> str:
        lines = [f"{len(self)} collective(s), {self.nbytes()} bytes"]
        for ph in ("forward", "backward"):
            calls = [c for c in self if c.phase == ph]
            if calls:
                lines.append(f"  {ph}: {len(calls)} collective(s), {self.nbytes(ph)} bytes")
                lines += [f"    {c.name} over ranks {list(c.ranks)}: {c.nbytes} bytes" for c in calls]
        return "\n".join(lines)


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


def sub_mesh_group(pl: Placement, axes: tuple[int, ...], me: int) -> tuple[Any, tuple[int, ...]]:
    """This rank's group over mesh ``axes`` of ``pl`` (the ranks sharing its other coordinates), and its ranks.

    Every rank makes every such group, in the same order (making one is collective)."""
    mesh = pl.ranks
    moved = np.moveaxis(mesh, axes, tuple(range(mesh.ndim - len(axes), mesh.ndim)))
    rows = moved.reshape(-1, int(np.prod([mesh.shape[a] for a in axes])))
    mine: tuple[Any, tuple[int, ...]] = (None, ())
    for row in rows:
        ranks = tuple(int(r) for r in row)
        g = subgroup(ranks)
        if me in ranks:
            mine = (g, ranks)
    return mine


@contextlib.contextmanager
def record() -> Iterator[Recording]:
    """Collect the collectives globalview runs inside the block (on this rank), backward included."""
    calls = Recording()
    _recorders.append(calls)
    try:
        yield calls
    finally:
        _recorders.remove(calls)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the collectives run inside the block as ``name`` ("backward" in the autograd functions)."""
    token = _phase.set(name)
    try:
        yield
    finally:
        _phase.reset(token)


def note(name: str, ranks: tuple[int, ...], nbytes: int) -> None:
    """Note a collective started elsewhere (the bucketed gradient reduction) in every active recorder."""
    for calls in _recorders:
        calls.append(Call(name, ranks, nbytes, _phase.get()))


def collective(name: str, fn: Callable[..., Any], *args: Any, ranks: tuple[int, ...], nbytes: int, **kw: Any) -> None:
    """Run the commlib collective ``fn`` and note it in every active recorder."""
    fn(*args, **kw)
    note(name, ranks, nbytes)
