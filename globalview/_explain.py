"""``globalview.explain``: how globalview would do something, priced, without doing it (no communication)."""

from __future__ import annotations

from typing import Any

from globalview._apply import decide
from globalview._cost import Choice
from globalview._layout import normalize_sbp
from globalview._ops import PREPARE
from globalview._placement import placement
from globalview._plan import Plan, plan

__all__ = ["NN_OPERATORS", "explain"]

NN_OPERATORS = ("linear",)  # globalview.nn.functional's operators explain knows (they import torch)


def explain(what: Any, *args: Any, prefer: str | None = None, **kwargs: Any) -> Plan | Choice:
    """How globalview would do something, without doing it (no communication).

    ``explain(module)``, a module made by :func:`globalview.auto_parallel`: its :class:`AutoPlan` (printed: per
    layer the layouts, bytes each rank receives, predicted time and memory, next to the hand-written plans).
    ``explain(shape, dtype, src, dst)``, with ``src``/``dst`` each ``(placement, sbp)``:
    the boxing :class:`Plan` (its ``steps`` and the bytes each moves).
    ``explain("add", x, y)`` (any operator name, or ``"linear"``, and its arguments): the
    :class:`Choice` of signature: every admissible plan with the bytes it moves per rank (forward
    and backward), the one that would run and why, and each input's boxing. ``prefer`` explains
    the choice under ``globalview.plan(prefer=...)``.
    """
    if isinstance(what, str):
        return decide(_describe(what, args, kwargs), prefer)
    if hasattr(what, "named_parameters"):  # a torch module: its automatic plan
        auto = getattr(what, "_gv_plan", None)
        if auto is None or args or kwargs or prefer is not None:
            raise TypeError(
                f"globalview.explain: a module explains its automatic plan, and {type(what).__qualname__} has none "
                "(make one with globalview.auto_parallel(module, placement, sample_input)); no further arguments"
            )
        return auto
    if prefer is not None or kwargs:
        raise TypeError("globalview.explain: prefer= and keyword arguments explain operators, not boxing plans")
    shape, dtype, src, dst = what, *args
    return plan(shape, dtype, _layout(src, len(shape), "src"), _layout(dst, len(shape), "dst"))


def _describe(name: str, args: tuple, kwargs: dict) -> Any:
    if name in PREPARE:
        return PREPARE[name](*args, **kwargs)
    if name in NN_OPERATORS:
        from globalview._functional import PREPARE as NN  # imports torch

        return NN[name](*args, **kwargs)
    known = ", ".join(sorted([*PREPARE, *NN_OPERATORS]))
    raise ValueError(f"globalview.explain: unknown operator {name!r}; one of {known}")


def _layout(pair: Any, ndim: int, arg: str) -> tuple:
    if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], placement)):
        raise TypeError(f"globalview.explain: {arg} must be a (placement, sbp) pair, got {pair!r}")
    return pair[0], normalize_sbp(pair[1], pair[0].ndim, ndim, "globalview.explain")
