"""Running an operator: :func:`decide` (pure: the signature and boxing, by cost) apart from :func:`run`.

An operator first describes one call as an :class:`Op` (its operands, signature rule, local
function and output shape), checking its arguments; :func:`decide` turns an Op into a
:class:`~globalview._cost.Choice` without communicating (``globalview.explain`` stops there);
:func:`run` boxes the inputs as the choice says and runs the local function. Every operator is
collective (every rank runs it); ranks outside the placement compute nothing and get an empty part.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import commlib
from globalview import _cost
from globalview._cost import PREFER, Choice
from globalview._signatures import Rule
from globalview._tensor import GlobalTensor

__all__ = ["Op", "Preference", "Session", "decide", "label", "preference", "run", "session", "tensors"]

Scalar = (int, float, complex, bool, np.number, np.bool_)
WEIGHT_NAMES = ("weight", "bias")
_prefer: contextvars.ContextVar[str | None] = contextvars.ContextVar("globalview_prefer", default=None)


def label() -> str:
    """``[rank r/n] `` for messages."""
    return f"[rank {commlib.get_rank()}/{commlib.get_world_size()}] "


@dataclass(frozen=True)
class Op:
    """One operator call, described: nothing has run.

    ``fn`` maps the boxed local parts (and the scalars, in ``args`` order) to the local result;
    ``after(local, choice)``, when given, reshapes that result for the chosen output layout;
    ``names`` name the operands (``"weight"``/``"bias"`` mark weights); ``flops`` lets the cost
    model show the compute of matmul-like operators and ``chain`` price their output's next move
    (see ``_cost.choose``)."""

    call: str
    args: tuple
    rule: Rule
    fn: Callable[..., Any]
    out_shape: tuple[int, ...]
    dtype: Any = None
    names: tuple[str, ...] = ()
    after: Callable[[Any, Choice], Any] | None = None
    flops: tuple | None = None
    chain: bool = False  # a layer of a chain: price bringing the output back to the first input's layout


def tensors(call: str, args: Sequence[Any], names: Sequence[str] | None = None) -> list[GlobalTensor]:
    """The global tensors among ``args``, checked (before any communication) to share a placement and family."""
    names = list(names or ()) + [f"operand {i}" for i in range(len(names or ()), len(args))]
    for a, name in zip(args, names, strict=False):
        if not isinstance(a, (GlobalTensor, *Scalar)):
            raise TypeError(
                f"{label()}globalview.{call}: operands must be global tensors or Python/numpy scalars, {name} is "
                f"{type(a).__name__}; make a local array global with globalview.to_global(array, placement, sbp)"
            )
    found = [(a, n) for a, n in zip(args, names, strict=False) if isinstance(a, GlobalTensor)]
    first, first_name = found[0]
    for t, name in found[1:]:
        if t.placement != first.placement:
            raise ValueError(
                f"{label()}globalview.{call}: inputs must share a placement, got {first.placement} for {first_name} "
                f"and {t.placement} for {name}; move one with .to_global(placement=...)"
            )
        if t._family is not first._family:
            raise TypeError(f"globalview.{call}: inputs mix torch and numpy/cupy local parts; use one kind")
    return [t for t, _ in found]


def _tensor_names(op: Op) -> list[str]:
    names = list(op.names) + [f"operand {i}" for i in range(len(op.names), len(op.args))]
    return [n for a, n in zip(op.args, names, strict=True) if isinstance(a, GlobalTensor)]


def decide(op: Op, prefer: str | None = None, ts: list[GlobalTensor] | None = None, pin: Any = None) -> Choice:
    """The signature ``op`` runs with and each input's boxing, priced: no communication (pure, cached).
    ``ts``: ``op``'s global tensors, when the caller has checked them already; ``pin``: the signature
    ((each input's layout), output layout) to run, from an automatic plan (see ``_cost.choose``)."""
    ts = tensors(op.call, op.args, op.names) if ts is None else ts
    names = _tensor_names(op)
    params = [t.requires_grad and t.is_leaf for t in ts]
    return _cost.choose(
        op.call,
        [t.shape for t in ts],
        [t._dtype for t in ts],
        ts[0].placement,
        [t.sbp for t in ts],
        op.rule,
        grads=[t.requires_grad for t in ts],
        weights=[n in WEIGHT_NAMES or p for n, p in zip(names, params, strict=True)],
        params=params,
        prefer=_prefer.get() if prefer is None else prefer,
        flops=op.flops,
        chain=op.out_shape if op.chain else None,
        pin=pin,
    )


def _probe_dtype(op: Op, family: Any) -> Any:
    """The result dtype, from running ``fn`` on one-element stand-ins (ranks with no data)."""
    stand = [family.xp.ones((1,) * a.ndim, a._dtype) if isinstance(a, GlobalTensor) else a for a in op.args]
    with np.errstate(all="ignore"):
        out = op.fn(*stand)
    return family.dtype_of(family.xp.asarray(out))


class Session:
    """What watches operators run (``with session(s):``): a trace (``_trace``) or an automatic plan (``_auto``).

    ``choose`` gives the choice an operator runs with; ``compute`` wraps its local computation; ``ran`` sees
    its result. This base class changes nothing."""

    def choose(self, op: Op, ts: list[GlobalTensor]) -> Choice:
        return decide(op, None, ts)

    def compute(self, run: Callable[[], Any], local_args: list[Any]) -> Any:
        return run()

    def ran(self, op: Op, ts: list[GlobalTensor], choice: Choice, out: GlobalTensor) -> None:
        return None


_session: contextvars.ContextVar[Session | None] = contextvars.ContextVar("globalview_session", default=None)


@contextlib.contextmanager
def session(s: Session | None) -> Iterator[Session | None]:
    """Operators inside the block run under session ``s`` (None: as usual)."""
    token = _session.set(s)
    try:
        yield s
    finally:
        _session.reset(token)


def run(op: Op) -> GlobalTensor:
    """Run ``op``: decide, box the inputs, compute the local result."""
    ts = tensors(op.call, op.args, op.names)
    watcher = _session.get()
    choice = decide(op, None, ts) if watcher is None else watcher.choose(op, ts)
    first, me = ts[0], commlib.get_rank()
    family = first._family
    boxed, released = [], []
    for t, p, rel in zip(ts, choice.boxing, choice.released, strict=True):
        part, fetch = _box(family, t, p, me) if p.steps else (t._local, None)
        boxed.append(part)
        if rel:
            released.append((part, fetch))
    parts = iter(boxed)
    local_args = [next(parts) if isinstance(a, GlobalTensor) else a for a in op.args]
    if me in first.placement:
        compute = functools.partial(family.compute, op.fn, local_args, released)
        local = family.xp.asarray(compute() if watcher is None else watcher.compute(compute, local_args))
        if op.after is not None:
            local = op.after(local, choice)
        out_dtype = family.dtype_of(local) if op.dtype is None else op.dtype
    else:
        out_dtype = _probe_dtype(op, family) if op.dtype is None else op.dtype
        local = family.empty_result(local_args, family.empty(first.placement, np.dtype(out_dtype)))
    out = GlobalTensor(local, op.out_shape, out_dtype, first.placement, choice.output, family)
    if watcher is not None:
        watcher.ran(op, ts, choice, out)
    return out


def _box(family: Any, t: GlobalTensor, p: Any, me: int) -> tuple[Any, Callable[[], Any]]:
    """``t``'s part boxed by plan ``p``, and how backward gets it again if autograd releases it: a sharded
    parameter of a global module through its module's :class:`~globalview._weights.Gathers` (prefetched,
    gradients bucketed), anything else by the plan again."""
    gathers = getattr(t._local, "_gv_gathers", None)
    key = gathers.takes(t._local, p) if gathers is not None else None
    if key is not None:
        return gathers.gather(key), functools.partial(gathers.regather, key)
    return family.box(p, t._local, me), functools.partial(family.rebox, p, t._local, me)


def preference() -> str | None:
    """The plan preference in force (see :class:`Preference`), or None: the cheapest plan."""
    return _prefer.get()


class Preference:
    """``globalview.plan(prefer=...)``: pin the kind of plan operators choose (see ``_cost``).

    A context (``with gv.plan(prefer="move_weights"): loss = model(x)``), or per module: ``gv.plan(prefer=...)
    .pin(module)`` makes every forward of ``module`` choose so (inner pins and contexts win)."""

    def __init__(self, prefer: str | None) -> None:
        if prefer is not None and prefer not in PREFER:
            raise ValueError(
                f"globalview.plan: prefer must be one of {', '.join(map(repr, PREFER))} or None, got {prefer!r}"
            )
        self.prefer = prefer
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> Preference:
        self._tokens.append(_prefer.set(self.prefer))
        return self

    def __exit__(self, *exc: Any) -> None:
        _prefer.reset(self._tokens.pop())

    def pin(self, module: Any) -> Any:
        """Apply this preference to every forward of torch module ``module``; returns the module."""
        if not (hasattr(module, "register_forward_pre_hook") and hasattr(module, "register_forward_hook")):
            raise TypeError(
                f"globalview.plan(...).pin: module must be a torch.nn.Module, got {type(module).__qualname__}"
            )

        def before(m: Any, args: Any) -> None:
            self.__enter__()

        def after(m: Any, args: Any, out: Any) -> None:
            self.__exit__()

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after, always_call=True)  # also when forward raises
        return module

    def __repr__(self) -> str:
        return f"globalview.plan(prefer={self.prefer!r})"
