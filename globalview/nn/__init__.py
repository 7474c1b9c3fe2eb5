"""Global torch modules: ``globalview.nn.to_global(module, placement, sbp)`` (OneFlow's ``module.to_global``).

The module stays a ``torch.nn.Module``: each parameter and buffer becomes this rank's part of
a global tensor (a torch tensor tagged with its layout), so ``module.parameters()`` feeds any
torch optimizer that works elementwise (SGD, Adam, AdamW), ``module.state_dict()`` gives the
local parts (OneFlow's ``to_local`` per rank), and forward takes and returns global tensors
(torch's functions dispatch to globalview's operators). :func:`state_dict` gives the global
tensors; :func:`load_state_dict` takes either form.

Gradients follow OneFlow's rule: each parameter's accumulated gradient is converted to the
parameter's layout; broadcast parameters' partial gradients are summed in flat buckets,
overlapped with backward (``commlib.buckets.Reducer``, ddp's reducer): data parallelism.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

import commlib
from globalview._dispatch import as_global
from globalview._layout import normalize_sbp
from globalview._leaf import Leaf, LeafGrads
from globalview._placement import placement as Placement
from globalview._tensor import GlobalTensor
from globalview._tensor import to_global as _to_global
from globalview._weights import Gathers
from globalview.nn import functional
from globalview.sbp import SbpParallel, broadcast

__all__ = ["functional", "load_state_dict", "state_dict", "to_global"]


def _entries(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) for every parameter and buffer, shared ones once."""
    params = [(n, p, True) for n, p in module.named_parameters()]
    return params + [(n, b, False) for n, b in module.named_buffers()]


def _layouts(entries: list, pl: Placement, sbp: Any, call: str) -> dict[str, tuple[SbpParallel, ...]]:
    """Every entry's sbp, checked before anything moves: unknown names and impossible splits are named."""
    names = [n for n, _, _ in entries]
    if isinstance(sbp, Mapping):
        unknown = sorted(set(sbp) - set(names))
        if unknown:
            raise ValueError(f"{call}: sbp names {unknown}, which are not parameters or buffers; they are {names}")
    default = (broadcast,) * pl.ndim
    out = {}
    for name, t, _ in entries:
        want = sbp.get(name, default) if isinstance(sbp, Mapping) else (default if sbp is None else sbp)
        try:
            out[name] = normalize_sbp(want, pl.ndim, t.ndim, f"{call}: parameter {name!r} of shape {tuple(t.shape)}")
        except (TypeError, ValueError) as e:
            raise type(e)(str(e)) from None
    return out


def _set(module: torch.nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if is_param:
        owner._parameters[attr] = value  # type: ignore[assignment]
    else:
        owner._buffers[attr] = value


def to_global(
    module: torch.nn.Module, placement: Placement, sbp: Any = None, *, bucket_cap_mb: float | None = None
) -> torch.nn.Module:
    """Make ``module`` global on ``placement`` (collective); returns the same module.

    ``sbp``: one layout for every parameter and buffer (default broadcast), or a mapping from
    parameter/buffer name to layout (missing names: broadcast), e.g. LiBai's column parallel
    ``{"fc1.weight": split(0), "fc1.bias": split(0)}`` and row parallel ``{"fc2.weight": split(1)}``
    (torch's Linear weight is (out, in)). The logical values are the placement's first rank's
    parameters, laid out as asked (a broadcast, then local slices). Broadcast parameters'
    gradients are summed in buckets of ``bucket_cap_mb`` (default 25) during backward.
    """
    call = f"[rank {commlib.get_rank()}/{commlib.get_world_size()}] globalview.nn.to_global"
    check_module(module, placement, call)
    return globalize(module, placement, _layouts(_entries(module), placement, sbp, call), bucket_cap_mb)


def check_module(module: Any, placement: Any, call: str) -> None:
    """A torch module that is not global yet, and a placement: else the TypeError/ValueError naming them."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{call}: module must be a torch.nn.Module, got {type(module).__qualname__}")
    if not isinstance(placement, Placement):
        raise TypeError(f"{call}: placement must be a globalview.placement, got {placement!r}")
    if any(getattr(t, "_gv_layout", None) is not None for _, t, _ in _entries(module)):
        raise ValueError(f"{call}: the module is global already")


def globalize(
    module: torch.nn.Module, placement: Placement, layouts: Mapping[str, tuple], bucket_cap_mb: float | None = None
) -> torch.nn.Module:
    """Make ``module`` global with ``layouts`` (every parameter and buffer's checked sbp), in place.

    Broadcast parameters' gradients go to the bucketed all-reduce (``_leaf``); parameters split(0) along
    a mesh axis are gathered for the operators that need them whole by ``_weights.Gathers`` (prefetched,
    gradients reduce-scattered in buckets)."""
    leaves = []
    for name, t, is_param in _entries(module):
        g = _to_global(t.detach(), placement, (broadcast,) * placement.ndim).to_global(sbp=layouts[name])
        local = g.to_local()
        if not all(x.is_broadcast for x in layouts[name]):
            local = local.clone()
        new = torch.nn.Parameter(local, requires_grad=t.requires_grad) if is_param else local
        setattr(new, "_gv_layout", (g.shape, g._dtype, placement, layouts[name]))  # noqa: B010 - a tag on a tensor
        _set(module, name, new, is_param)
        if is_param and new.requires_grad:
            leaves.append(Leaf(name, new, g.shape, g._dtype, placement, layouts[name]))
    grads = LeafGrads(leaves, bucket_cap_mb=bucket_cap_mb) if leaves else None
    object.__setattr__(module, "_gv_grads", grads)  # the hooks' owner lives as long as the module
    sharded = [leaf for leaf in leaves if any(s.is_split and s.dim == 0 for s in leaf.sbp)]
    gathers = Gathers(sharded, commlib.get_rank()) if sharded else None
    for leaf in sharded:
        setattr(leaf.param, "_gv_gathers", gathers)  # noqa: B010 - operators find the schedule on the parameter
    if gathers is not None:
        hook = module.register_forward_pre_hook(lambda m, args: gathers.begin_forward())
        object.__setattr__(module, "_gv_gathers", (gathers, hook))
    return module


def localize(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`globalize` on a module whose parameters and buffers are all broadcast: plain torch tensors
    again (new parameter objects, without the gradient hooks), each rank holding the whole value."""
    for name, t, is_param in _entries(module):
        layout = getattr(t, "_gv_layout", None)
        if layout is not None and not all(s.is_broadcast for s in layout[3]):
            raise ValueError(f"globalview.nn: {name!r} is laid out {layout[3]}, not broadcast")
        plain = t.detach()
        new = torch.nn.Parameter(plain, requires_grad=t.requires_grad) if is_param else plain
        _set(module, name, new, is_param)
    hooked = module.__dict__.pop("_gv_gathers", None)
    if hooked is not None:
        hooked[1].remove()
    module.__dict__.pop("_gv_grads", None)
    return module


def state_dict(module: torch.nn.Module) -> OrderedDict[str, Any]:
    """The global module's state as global tensors (detached), keyed like ``module.state_dict()``."""
    out: OrderedDict[str, Any] = OrderedDict()
    for name, t in module.state_dict(keep_vars=True).items():
        g = as_global(t)
        out[name] = g.detach() if g is not None else t.detach()
    return out


def load_state_dict(module: torch.nn.Module, state: Mapping[str, Any], strict: bool = True) -> None:
    """Load global tensors (converted to each parameter's layout) or local parts (this rank's pieces)."""
    call = f"[rank {commlib.get_rank()}/{commlib.get_world_size()}] globalview.nn.load_state_dict"
    own = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"{call}: missing keys {missing}, unexpected keys {unexpected}")
    for name in own:
        if name not in state:
            continue
        target, value = own[name], state[name]
        if isinstance(value, GlobalTensor):
            g = as_global(target)
            if g is None or value.shape != g.shape:
                raise ValueError(f"{call}: {name!r} is a global tensor of shape {value.shape}, which does not fit")
            value = value.to_global(placement=g.placement, sbp=g.sbp).to_local()
        if tuple(value.shape) != tuple(target.shape):
            want, got = tuple(target.shape), tuple(value.shape)
            raise ValueError(f"{call}: {name!r} must be this rank's part of shape {want}, got {got}")
        with torch.no_grad():
            target.copy_(value)
