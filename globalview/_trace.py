"""Tracing one forward of a global module: the operators it runs, in order, and where each input comes from.

The trace is what the automatic planner (``_search``) searches over: every operator's description (its
signature rule, its local function, its shapes), each tensor input's source (a parameter, a buffer, a
forward input, an earlier operator's output, or a constant made inside forward), whether it needs a
gradient, and what torch kept of it for backward (the storage autograd saved, seen through
``saved_tensors_hooks``), which prices the activations' memory of every other layout.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from globalview._apply import Op, Session, session
from globalview._cost import Choice
from globalview._placement import placement as Placement
from globalview._tensor import GlobalTensor
from globalview.sbp import SbpParallel

__all__ = ["Node", "Trace", "trace"]

Layout = tuple[SbpParallel, ...]


@dataclass(frozen=True)
class Node:
    """One operator of the traced forward."""

    index: int
    op: Op  # its description as traced (rule, local function, scalars, output shape)
    sources: tuple[str, ...]  # per tensor input: "param:NAME", "buffer:NAME", "input:I", "node:K" or "const:K"
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    layouts: tuple[Layout, ...]  # each input's layout in the trace
    grads: tuple[bool, ...]  # each input needs a gradient
    params: tuple[bool, ...]  # each input is a parameter (a leaf that needs a gradient)
    weights: tuple[bool, ...]  # each input is a weight (a parameter, or named weight/bias)
    saved: tuple[bool, ...]  # torch kept this input (as the operator got it) for backward
    out_saved: bool  # torch kept the output for backward
    extra_saved: float  # bytes of other saved tensors (layer norm's statistics...) per output element
    out_dtype: np.dtype
    out_grad: bool  # the output needs a gradient
    module: str = ""  # the innermost module whose forward ran it

    @property
    def call(self) -> str:
        return self.op.call

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.op.out_shape


@dataclass(frozen=True)
class Tensor:
    """A tensor the trace starts from: a parameter, buffer, forward input or constant, and its traced layout."""

    shape: tuple[int, ...]
    dtype: np.dtype
    layout: Layout
    grad: bool


@dataclass
class Trace:
    """A traced forward: the operators, the tensors they start from, and the sources of the outputs."""

    placement: Placement
    nodes: list[Node]
    leaves: dict[str, Tensor]  # "param:NAME", "buffer:NAME", "input:I", "const:K" -> what it is
    outputs: list[str]
    users: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # source -> (node, input position)

    def __post_init__(self) -> None:
        for node in self.nodes:
            for i, src in enumerate(node.sources):
                self.users.setdefault(src, []).append((node.index, i))

    def params(self) -> list[str]:
        """The names of the parameters the forward used, in order of first use."""
        return [s.removeprefix("param:") for s in self.leaves if s.startswith("param:")]


class _Tracer(Session):
    """Records every operator (and keeps every tensor it saw alive, so ids stay unique)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names, self.nodes, self.leaves, self.keep = dict(names), [], {}, []
        self._packed: dict[int, int] = {}
        self._args: list[Any] = []
        self.module: list[str] = [""]  # the module running (forward hooks push and pop)

    def source(self, t: GlobalTensor) -> str:
        src = self.names.get(id(t._local))
        if src is None:
            src = self.names[id(t._local)] = f"const:{len(self.leaves)}"
            self.keep.append(t._local)
        if src not in self.leaves and not src.startswith("node:"):
            grad = src.startswith("param:") and t.requires_grad
            self.leaves[src] = Tensor(t.shape, t._dtype, t.sbp, grad)
        return src

    def compute(self, run: Callable[[], Any], local_args: list[Any]) -> Any:
        packed: dict[int, int] = {}  # storage -> bytes of the tensors autograd saved

        def pack(t: torch.Tensor) -> Any:
            packed[_storage(t)] = max(packed.get(_storage(t), 0), _nbytes(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        self._packed, self._args = packed, list(local_args)
        return out

    def ran(self, op: Op, ts: list[GlobalTensor], choice: Choice, out: GlobalTensor) -> None:
        sources = tuple(self.source(t) for t in ts)
        parts = [a for a, o in zip(self._args, op.args, strict=False) if isinstance(o, GlobalTensor)]
        packed = self._packed or {}
        saved = tuple(_storage(a) in packed for a in parts) if parts else (False,) * len(ts)
        local = out._local
        out_saved = _storage(local) in packed and _storage(local) not in {_storage(a) for a in parts}
        known = {_storage(a) for a in parts} | {_storage(local)}
        extra_bytes = sum(n for ptr, n in packed.items() if ptr not in known and ptr != -1)
        names = list(op.names) + [""] * len(op.args)
        tensor_names = [n for n, a in zip(names, op.args, strict=False) if isinstance(a, GlobalTensor)]
        params = tuple(t.requires_grad and t.is_leaf for t in ts)
        index = len(self.nodes)
        self.nodes.append(
            Node(
                index=index,
                op=op,
                sources=sources,
                shapes=tuple(t.shape for t in ts),
                dtypes=tuple(np.dtype(t._dtype) for t in ts),
                layouts=tuple(t.sbp for t in ts),
                grads=tuple(t.requires_grad for t in ts),
                params=params,
                weights=tuple(n in ("weight", "bias") or p for n, p in zip(tensor_names, params, strict=False)),
                saved=saved,
                out_saved=out_saved,
                extra_saved=extra_bytes / max(1, local.numel()),
                out_dtype=np.dtype(out._dtype),
                out_grad=out.requires_grad,
                module=self.module[-1],
            )
        )
        self.names[id(local)] = f"node:{index}"
        self.keep.append(local)
        self._packed, self._args = {}, []


def _storage(t: Any) -> int:
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return -1
    return t.untyped_storage().data_ptr()


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


def _enter(stack: list[str], name: str, module: Any, args: Any) -> None:
    stack.append(name)


def _leave(stack: list[str], module: Any, args: Any, out: Any) -> None:
    stack.pop()


def trace(module: torch.nn.Module, placement: Placement, inputs: Sequence[GlobalTensor]) -> Trace:
    """Run one forward of global ``module`` on ``inputs`` and record its operators (collective)."""
    names = {id(p): f"param:{n}" for n, p in module.named_parameters()}
    names |= {id(b): f"buffer:{n}" for n, b in module.named_buffers()}
    names |= {id(x._local): f"input:{i}" for i, x in enumerate(inputs)}
    tracer = _Tracer(names)
    for i, x in enumerate(inputs):
        tracer.leaves[f"input:{i}"] = Tensor(x.shape, np.dtype(x._dtype), x.sbp, x.requires_grad)
    with session(tracer), contextlib.ExitStack() as hooks:
        for name, sub in module.named_modules():
            hooks.callback(sub.register_forward_pre_hook(functools.partial(_enter, tracer.module, name)).remove)
            hooks.callback(sub.register_forward_hook(functools.partial(_leave, tracer.module), always_call=True).remove)
        out = module(*inputs)
    outs = out if isinstance(out, (tuple, list)) else [out]
    outputs = [tracer.names.get(id(o._local), "") for o in outs if isinstance(o, GlobalTensor)]
    del out, outs
    leaves = {k: v for k, v in tracer.leaves.items() if k.startswith(("param:", "buffer:", "input:", "const:"))}
    return Trace(placement, tracer.nodes, leaves, outputs)
