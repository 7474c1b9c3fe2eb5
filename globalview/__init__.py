"""globalview: OneFlow-style global tensors on numpy/cupy arrays and torch tensors, over commlib.

A global tensor is one logical array that every rank holds: its ``placement`` says
which ranks keep data (a list or an nd mesh of ranks) and its ``sbp`` how
(``split(dim)``, ``broadcast``, ``partial_sum``/``partial_max``/``partial_min``).
Write single-device code over logical tensors; globalview inserts the
communication: ``x.to_global(placement, sbp)`` redistributes ("boxing") by the
cheapest plan, and operators infer their output's sbp from the inputs', choosing among
the plans they admit by the bytes each rank receives (forward and backward). :func:`explain`
shows the candidates, their bytes and why one won; :func:`plan` pins a kind of plan.

With torch local parts (a torch dtype, or ``to_global`` of torch tensors) everything is
differentiable: ``loss.backward()`` runs torch's autograd through the local operators and the
adjoint of every boxing step, and each leaf's gradient is laid out like the leaf (OneFlow's
rule). :mod:`globalview.nn` makes torch modules global (data, tensor, pipeline parallelism).

Every rank runs the same program (a global tensor's code is collective).
"""

from __future__ import annotations

from typing import Any

from globalview import _methods, sbp
from globalview._apply import Preference
from globalview._cost import Candidate, Choice
from globalview._create import arange, full, ones, rand, randn, tensor, zeros
from globalview._explain import explain
from globalview._groups import Call, record
from globalview._ops import OPERATORS, getitem, matmul, max, mean, min, neg, reshape, sum, transpose, where  # noqa: F401
from globalview._placement import placement
from globalview._plan import Plan, Step
from globalview._plan import plan as _boxing_plan
from globalview._random import manual_seed
from globalview._tensor import GlobalTensor, to_global
from globalview.sbp import SbpParallel

_methods.register()  # GlobalTensor's operators and methods: the one table in globalview._methods

__all__ = [
    "AutoPlan",
    "Call",
    "Candidate",
    "Choice",
    "GlobalTensor",
    "Plan",
    "Preference",
    "SbpParallel",
    "Step",
    "abs",
    "add",
    "arange",
    "auto_parallel",
    "cos",
    "div",
    "eq",
    "exp",
    "explain",
    "full",
    "ge",
    "gt",
    "is_global",
    "is_local",
    "le",
    "log",
    "lt",
    "manual_seed",
    "matmul",
    "max",
    "mean",
    "min",
    "mul",
    "ne",
    "neg",
    "ones",
    "placement",
    "plan",
    "pow",
    "rand",
    "randn",
    "record",
    "reshape",
    "sbp",
    "sin",
    "sqrt",
    "sub",
    "sum",
    "tanh",
    "tensor",
    "to_global",
    "transpose",
    "where",
    "zeros",
]

add, sub, mul, div, pow = (OPERATORS[n] for n in ("add", "sub", "mul", "div", "pow"))
eq, ne, lt, le, gt, ge = (OPERATORS[n] for n in ("eq", "ne", "lt", "le", "gt", "ge"))
exp, log, sqrt, abs, tanh, sin, cos = (OPERATORS[n] for n in ("exp", "log", "sqrt", "abs", "tanh", "sin", "cos"))


_TORCH_NAMES = {"auto_parallel": "globalview._auto", "AutoPlan": "globalview._autoplan"}


def __getattr__(name: str) -> Any:
    """``globalview.nn``, ``auto_parallel`` and ``AutoPlan`` (they import torch) are loaded on first use."""
    import importlib

    if name == "nn":
        return importlib.import_module("globalview.nn")
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module(_TORCH_NAMES[name]), name)
    raise AttributeError(f"module 'globalview' has no attribute {name!r}")


def is_local(x: Any) -> bool:
    """True for a local (numpy/cupy) array, False for a :class:`GlobalTensor`."""
    return not isinstance(x, GlobalTensor)


def is_global(x: Any) -> bool:
    """True for a :class:`GlobalTensor`, False for a local (numpy/cupy) array."""
    return isinstance(x, GlobalTensor)


def plan(*args: Any, prefer: str | None = None) -> Any:
    """``plan(prefer="move_weights")``: pin the kind of plan operators choose, as a context or per module.

    ``with gv.plan(prefer="move_weights"): ...`` (or ``"move_activations"``; None: the cheapest) makes
    the operators inside box only weights (FSDP's all-gather, reduce-scatter of the gradients) or only
    the other inputs, where such a plan exists; ``gv.plan(prefer=...).pin(module)`` does it for every
    forward of a torch module. :func:`explain` shows the candidates and why one won.
    ``plan(shape, dtype, src, dst)`` (positional) is the boxing planner: the :class:`Plan`.
    """
    if args:
        return _boxing_plan(*args)
    return Preference(prefer)
