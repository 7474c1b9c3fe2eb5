"""Timing operators: a traced operator's local function, forward and backward, at the local shapes a plan gives it.

Every rank times the same operators at once (as a training step runs them) and the slowest rank's time is
kept, so every rank prices with the same numbers; results join the machine's cache (``_machine``). An
operator's time is the median of its runs in CPU seconds (:func:`_machine.clock`: other jobs' time slices are
not counted in them): the least of them priced the wide MLP's matrix products 5-8% under their usual time,
and every plan's step under its measured time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import commlib
from commlib.arrays import torch_dtype
from globalview import _machine
from globalview._tensor import GlobalTensor

__all__ = ["key", "time_all"]

BUDGET_S = 0.05  # seconds of repeats per operator after its first run
MAX_REPEATS = 7


def key(node: Any, shapes: Sequence[tuple[int, ...]]) -> str:
    """What an operator's time depends on: its kind and parameters, its local shapes and dtypes, its gradients."""
    scalars = tuple(a for a in node.op.args if not isinstance(a, GlobalTensor))
    dtypes = ",".join(str(d) for d in node.dtypes)
    return f"{node.call}|{node.op.rule.key!r}|{tuple(shapes)}|{dtypes}|{node.grads}|{scalars!r}"


def time_all(machine: _machine.Machine, requests: Mapping[str, tuple[Any, Sequence[tuple[int, ...]]]]) -> None:
    """Time every requested operator the machine has not timed yet (collective: the same requests everywhere)."""
    missing = sorted(k for k in requests if k not in machine.ops)
    if not missing:
        return
    base = _machine.engine()
    times = np.array([_time(*requests[k]) for k in missing], np.float64).reshape(len(missing), 2)
    times[:, 1] = np.maximum(times[:, 1] - base, times[:, 1] * 0.1)  # one backward runs every operator's
    commlib.all_reduce(times, op=commlib.ReduceOp.MAX)
    machine.ops.update({k: (float(f), float(b)) for k, (f, b) in zip(missing, times, strict=True)})
    _machine.save(machine)


def _inputs(node: Any, shapes: Sequence[tuple[int, ...]]) -> list[Any]:
    """Stand-ins for the operator's arguments: random floats (zeros for indices), as leaves where it needs grads."""
    args, i = [], 0
    gen = torch.Generator().manual_seed(0)
    for a in node.op.args:
        if not isinstance(a, GlobalTensor):
            args.append(a)
            continue
        dtype = torch_dtype(node.dtypes[i])
        if dtype.is_floating_point:
            t = torch.randn(shapes[i], generator=gen, dtype=dtype).requires_grad_(node.grads[i])
        else:
            t = torch.zeros(shapes[i], dtype=dtype)
        args.append(t)
        i += 1
    return args


def _once(fn: Any, args: list[Any]) -> tuple[float, float]:
    start = _machine.clock()
    out = fn(*args)
    mid = _machine.clock()
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.backward(torch.ones_like(out))
    return mid - start, _machine.clock() - mid


def _time(node: Any, shapes: Sequence[tuple[int, ...]]) -> tuple[float, float]:
    """The least seconds of the forward and the backward (0 without gradients) of ``node`` at ``shapes``."""
    try:
        args = _inputs(node, shapes)
        first = _once(node.op.fn, args)
    except (RuntimeError, ValueError, IndexError, TypeError):
        return 0.0, 0.0  # a function that does not run at these shapes: priced by its boxing alone
    runs, spent = [], 0.0
    while len(runs) < MAX_REPEATS and (spent < BUDGET_S or len(runs) < 3) and sum(first) < 1.0:
        runs.append(_once(node.op.fn, args))
        spent += sum(runs[-1])
    runs = runs or [first]
    return float(np.median([r[0] for r in runs])), float(np.median([r[1] for r in runs]))
