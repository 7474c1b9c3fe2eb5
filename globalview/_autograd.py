"""Autograd for global tensors with torch local parts: torch's own engine runs backward.

A global tensor wraps a torch tensor; local operators are plain torch ops on it, so torch
records them. What crosses ranks is a ``torch.autograd.Function`` here: a boxing plan whose
backward runs the plan's adjoint (``_plan.adjoint``, itself a pure plan), the local -> global
cast, and the empty stand-in a rank outside a placement computes (so every rank's graph has
the same shape and backward issues the same collectives in the same order on every rank).

The convention that makes local autograd correct: the gradient of a tensor of layout ``sbp``
lives in the local graph in layout ``dual(sbp)`` (S -> S, B -> P, P -> B), OneFlow's rule.
Every local operator's backward maps dual layouts to dual layouts (it is linear in the
output's gradient), every boxing step's adjoint does too, and the seed of ``backward()``
is the dual of the loss's layout (a broadcast loss seeds 1 on the first rank and 0 elsewhere).
"""

from __future__ import annotations

from typing import Any

import torch

import commlib
from commlib.arrays import as_array, from_array
from globalview import _groups
from globalview._boxing import execute
from globalview._plan import Plan, adjoint, dual, plan

__all__ = ["box", "empty_result", "ensure_groups", "from_local", "label", "run_backward", "seed"]


def label() -> str:
    """``[rank r/n] `` for messages."""
    return f"[rank {commlib.get_rank()}/{commlib.get_world_size()}] "


def ensure_groups(p: Plan, me: int) -> None:
    """Make the groups plan ``p`` will use (collective over the world: in forward, never mid-backward)."""
    for step in p.steps:
        if step.kind == "broadcast":
            _groups.subgroup(step.ranks)
        elif step.is_collective and step.kind != "send_recv":
            _groups.line_group(step.placement, int(step.axis or 0), me)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def run_plans(plans: tuple[Plan, ...], local: torch.Tensor, me: int, xp: Any) -> torch.Tensor:
    """Run ``plans`` on a torch part through commlib's zero-copy array view; a new tensor comes back."""
    src = local.detach().contiguous()
    a = as_array(src)
    for p in plans:
        a = execute(p, a, me, xp)
    return to_torch(xp.ascontiguousarray(a), src)


def to_torch(a: Any, like: torch.Tensor) -> torch.Tensor:
    """numpy/cupy array ``a`` as a torch tensor on ``like``'s device, never sharing ``like``'s memory."""
    out = from_array(a, like=like)
    if out.device != like.device:
        out = out.to(like.device)
    return out.clone() if _same_memory(out, like) else out


class _Boxing(torch.autograd.Function):
    """One conversion: forward runs the plan, backward the adjoint plans."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, fwd: Plan, back: tuple[Plan, ...], me: int, xp: Any) -> torch.Tensor:
        ctx.back, ctx.me, ctx.xp = back, me, xp
        return run_plans((fwd,), local, me, xp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        with _groups.phase("backward"):
            return run_plans(ctx.back, grad, ctx.me, ctx.xp), None, None, None, None


def box(p: Plan, local: torch.Tensor, me: int, xp: Any, grad_sbp: Any = None) -> torch.Tensor:
    """``local`` converted by plan ``p``; differentiable (through the adjoint) when it requires grad."""
    if not (torch.is_grad_enabled() and local.requires_grad):
        return run_plans((p,), local, me, xp)
    back = adjoint(p, grad_sbp)
    for q in (p, *back):
        ensure_groups(q, me)
    return _Boxing.apply(local, p, back, me, xp)


class _Empty(torch.autograd.Function):
    """The empty part a rank outside the placement computes, still linked to the inputs."""

    @staticmethod
    def forward(ctx: Any, like: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.specs = [(t.shape, t.dtype, t.device) for t in inputs]
        return torch.empty((0,), dtype=like.dtype, device=like.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (None, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.specs))


def empty_result(inputs: list[Any], like: torch.Tensor) -> torch.Tensor:
    """An empty part of ``like``'s dtype, in the graph of the ``inputs`` that require grad."""
    tracked = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if tracked and torch.is_grad_enabled():
        return _Empty.apply(like, *tracked)
    return like


class _FromLocal(torch.autograd.Function):
    """local -> global: forward runs ``make`` (the collective cast), backward gives each rank its
    part of the gradient in the dual layout, or in ``grad_sbp`` (OneFlow's ``grad_sbp``)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, make: Any, me: int, xp: Any) -> torch.Tensor:
        out, shape, dtype, pl, sbp, grad_sbp = make()
        ctx.input = (local.shape, local.dtype, local.device)
        ctx.me, ctx.xp, ctx.member = me, xp, me in pl
        ctx.plan = None
        if grad_sbp is not None and tuple(grad_sbp) != dual(sbp):
            ctx.plan = plan(shape, dtype, (pl, dual(sbp)), (pl, tuple(grad_sbp)))
            ensure_groups(ctx.plan, me)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        with _groups.phase("backward"):
            if ctx.plan is not None:
                grad = run_plans((ctx.plan,), grad, ctx.me, ctx.xp)
        shape, dtype, device = ctx.input
        if not ctx.member or tuple(grad.shape) != tuple(shape):
            grad = torch.zeros(shape, dtype=dtype, device=device) if not ctx.member else grad.reshape(shape)
        return grad, None, None, None


def from_local(local: torch.Tensor, make: Any, me: int, xp: Any) -> torch.Tensor:
    """The local part of ``local`` made global by ``make()``, differentiable when ``local`` requires grad."""
    if torch.is_grad_enabled() and local.requires_grad:
        return _FromLocal.apply(local, make, me, xp)
    return make()[0]


def seed(t: Any) -> torch.Tensor:
    """The gradient of a one-element tensor with respect to itself, in the dual layout of its sbp:
    along a broadcast axis only the first rank holds the 1 (the shares sum to 1)."""
    local = t._local
    coords = t.placement.coords(commlib.get_rank())
    if coords is None:
        return torch.zeros_like(local)
    first = all(coords[a] == 0 for a, s in enumerate(t.sbp) if s.is_broadcast)
    return torch.ones_like(local) if first else torch.zeros_like(local)


def run_backward(t: Any, gradient: Any, retain_graph: Any, create_graph: bool) -> None:
    """``t.backward(gradient)`` for global tensor ``t``: checks (no collective before they pass), the
    seed (or ``gradient`` in the dual layout), torch's engine."""
    call = f"{label()}GlobalTensor.backward"
    if not t._local.requires_grad:
        raise RuntimeError(f"{call}: the tensor does not require grad and has no grad_fn")
    if gradient is None:
        if t.size != 1:
            raise RuntimeError(
                f"{call}: a gradient can be created implicitly only for a one-element tensor; this one has shape "
                f"{t.shape}: pass gradient=, a global tensor of that shape"
            )
        grad = seed(t)
    else:
        grad = _explicit(t, gradient, call)
    torch.autograd.backward(t._local, grad, retain_graph=retain_graph, create_graph=create_graph)


def _explicit(t: Any, gradient: Any, call: str) -> torch.Tensor:
    if getattr(gradient, "is_global", False) is not True or gradient.shape != t.shape:
        got = gradient.shape if getattr(gradient, "is_global", False) is True else type(gradient).__name__
        raise TypeError(f"{call}: gradient must be a global tensor of shape {t.shape}, got {got}")
    if gradient.placement != t.placement:
        raise ValueError(f"{call}: gradient is on {gradient.placement}, the tensor on {t.placement}")
    g = gradient.detach().to_global(sbp=dual(t.sbp))
    return g.to_local().to(dtype=t._local.dtype)
