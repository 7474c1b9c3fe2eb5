"""An automatic plan: every parameter's layout and every operator's signature, with what it is predicted to cost.

:class:`AutoPlan` is what ``globalview.auto_parallel`` chose. ``str(plan)`` (``globalview.explain(module)``)
prints it per layer next to the hand-written plans; :meth:`AutoPlan.save` / :meth:`AutoPlan.load` keep it as
JSON; :meth:`AutoPlan.apply` lays a fresh module out as planned and pins the operators' signatures (no trace,
no search): every forward of the module runs the planned signatures in order, and takes each rank's own batch
as plain torch tensors (each made the rank's part of a global batch, ``split(0)``) or as global tensors.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from globalview._apply import Session, decide, label, session
from globalview._placement import placement as Placement
from globalview.sbp import SbpParallel, broadcast, partial_max, partial_min, partial_sum, split

__all__ = ["AutoPlan", "parse_sbp"]

Layout = tuple[SbpParallel, ...]
Signature = tuple[str, tuple[Layout, ...], Layout]


def parse_sbp(text: str) -> SbpParallel:
    """``"S(0)"``, ``"B"``, ``"P"``, ``"Pmax"``, ``"Pmin"`` (sbp's short form) back to the value."""
    m = re.fullmatch(r"S\((\d+)\)", text)
    if m:
        return split(int(m.group(1)))
    known = {"B": broadcast, "P": partial_sum, "Pmax": partial_max, "Pmin": partial_min}
    if text not in known:
        raise ValueError(f"globalview.AutoPlan.load: unknown sbp {text!r}; one of S(d), B, P, Pmax, Pmin")
    return known[text]


def _lay(layout: Layout) -> list[str]:
    return [str(s) for s in layout]


def _unlay(items: list[str]) -> Layout:
    return tuple(parse_sbp(s) for s in items)


def fmt(layout: Layout) -> str:
    return str(layout[0]) if len(layout) == 1 else "(" + ", ".join(map(str, layout)) + ")"


@dataclass
class AutoPlan:
    """A plan for a global module (see the module docstring). Times are seconds per step; memory bytes per rank."""

    placement: Placement
    layouts: dict[str, Layout]  # every parameter and buffer of the module
    signatures: list[Signature]  # every operator of the forward, in order: (name, inputs' layouts, output's)
    time: float = 0.0  # predicted seconds per training step
    memory: float = 0.0  # predicted peak bytes per rank
    alternatives: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> layouts, time, memory
    report: str = ""  # the per-layer table (see __str__)
    stats: dict[str, Any] = field(default_factory=dict)  # planning seconds, search nodes, gap, budget

    def __str__(self) -> str:
        return self.report or f"AutoPlan on {self.placement}: {len(self.layouts)} layouts, {len(self.signatures)} ops"

    # -- persistence ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-ready data (sbp in their short form)."""
        return {
            "placement": {"type": self.placement.type, "ranks": self.placement.ranks.tolist()},
            "layouts": {n: _lay(lay) for n, lay in self.layouts.items()},
            "signatures": [[c, [_lay(x) for x in ins], _lay(out)] for c, ins, out in self.signatures],
            "time": self.time,
            "memory": self.memory,
            "alternatives": {
                k: {**v, "layouts": {n: _lay(lay) for n, lay in v["layouts"].items()}}
                for k, v in self.alternatives.items()
            },
            "report": self.report,
            "stats": self.stats,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AutoPlan:
        alts = {
            k: {**v, "layouts": {n: _unlay(lay) for n, lay in v["layouts"].items()}}
            for k, v in data.get("alternatives", {}).items()
        }
        return cls(
            Placement(data["placement"]["type"], data["placement"]["ranks"]),
            {n: _unlay(lay) for n, lay in data["layouts"].items()},
            [(c, tuple(_unlay(x) for x in ins), _unlay(out)) for c, ins, out in data["signatures"]],
            float(data.get("time", 0.0)),
            float(data.get("memory", 0.0)),
            alts,
            data.get("report", ""),
            dict(data.get("stats", {})),
        )

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (every rank may call it; it writes the same file). The file is replaced whole
        (written beside it, then renamed), so a rank that reads it while another writes it reads a whole plan."""
        path = Path(path)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | Path) -> AutoPlan:
        """A plan written by :meth:`save`."""
        return cls.from_json(json.loads(Path(path).read_text()))

    # -- applying it ----------------------------------------------------------------------------
    def apply(self, module: torch.nn.Module, *, bucket_cap_mb: float | None = None) -> torch.nn.Module:
        """Make ``module`` global as planned and pin its operators' signatures (collective); returns it."""
        from globalview.nn import _entries, check_module, globalize

        call = f"{label()}globalview.AutoPlan.apply"
        check_module(module, self.placement, call)
        names = {n: tuple(t.shape) for n, t, _ in _entries(module)}
        missing = sorted(n for n in names if n not in self.layouts)
        extra = sorted(n for n in self.layouts if n not in names)
        if missing or extra:
            raise ValueError(f"{call}: the plan is for another module: it lacks {missing} and has {extra}")
        globalize(module, self.placement, self.layouts, bucket_cap_mb)
        pinned = _Pinned(self.signatures)

        def enter(m: Any, args: tuple) -> tuple:
            pinned.enter()
            return tuple(_batch(a, self.placement) for a in args)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(lambda m, args, out: pinned.exit(), always_call=True)
        object.__setattr__(module, "_gv_plan", self)
        return module


def _batch(a: Any, pl: Placement) -> Any:
    """A forward argument that is a plain torch tensor is this rank's part of a batch: split(0) on every axis."""
    if not isinstance(a, torch.Tensor) or getattr(a, "_gv_layout", None) is not None:
        return a
    from globalview._tensor import to_global

    return to_global(a, pl, (split(0),) * pl.ndim)


class _Pinned(Session):
    """Runs the planned signatures, operator by operator, inside the module's forward."""

    def __init__(self, signatures: list[Signature]) -> None:
        self.signatures, self.cursor, self.tokens = signatures, 0, []

    def enter(self) -> None:
        self.cursor = 0
        self.tokens.append(session(self))
        self.tokens[-1].__enter__()

    def exit(self) -> None:
        self.tokens.pop().__exit__(None, None, None)

    def choose(self, op: Any, ts: list[Any]) -> Any:
        k, self.cursor = self.cursor, self.cursor + 1
        if k >= len(self.signatures):
            return decide(op, None, ts)  # more operators than planned: the cheapest, as without a plan
        call, inputs, output = self.signatures[k]
        if call != op.call:
            raise ValueError(
                f"{label()}globalview.auto_parallel: operator {k} of the planned forward is {call}, this forward "
                f"runs {op.call}: the module's forward differs from the one planned; plan it again"
            )
        return decide(op, None, ts, pin=(inputs, output))
