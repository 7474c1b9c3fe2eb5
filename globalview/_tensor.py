"""GlobalTensor: one logical array, held by every rank as (placement, sbp, local part)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import commlib
from commlib.arrays import DTYPES, as_array, numpy_dtype, to_host
from globalview import _groups, _memory
from globalview._family import Family, array_family, placement_family
from globalview._layout import block_shape, normalize_sbp
from globalview._placement import placement as Placement
from globalview._plan import Plan, plan
from globalview.sbp import SbpParallel, broadcast

__all__ = ["GlobalTensor", "to_global"]


class GlobalTensor:
    """A tensor that exists on every rank: its logical ``shape`` and ``dtype``, its ``placement``
    (which ranks hold data) and ``sbp`` (how: split, broadcast or partial), and this rank's
    local part (empty on ranks outside the placement).

    Treat local parts as read-only: operators and conversions make new arrays. The operators and
    tensor methods are registered in one place, ``globalview._methods``.
    """

    __slots__ = ("_dtype", "_family", "_local", "_placement", "_sbp", "_shape")
    __array_priority__ = 100  # numpy scalars defer to our operators
    __hash__ = None  # == is elementwise

    def __init__(
        self, local: Any, shape: tuple[int, ...], dtype: Any, pl: Placement, sbp: tuple, family: Family
    ) -> None:
        self._local, self._shape, self._dtype = local, tuple(shape), numpy_dtype(dtype)
        self._placement, self._sbp, self._family = pl, tuple(sbp), family

    # -- what it is --------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape."""
        return self._shape

    @property
    def dtype(self) -> Any:
        """numpy's dtype for numpy/cupy parts, torch's for torch parts."""
        return self._family.dtype(self._dtype)

    @property
    def is_torch(self) -> bool:
        """True when the local parts are torch tensors (then autograd works)."""
        return self._family.differentiable

    @property
    def _xp(self) -> Any:
        """The numpy-like namespace local operators run in (numpy, cupy, or torch's, ``_torchns``)."""
        return self._family.xp

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def sbp(self) -> tuple[SbpParallel, ...]:
        """One sbp value per placement axis (a tuple, as OneFlow's ``Tensor.sbp``)."""
        return self._sbp

    is_global = True
    is_local = False

    def __bool__(self) -> bool:
        raise TypeError(
            "the truth value of a global tensor is ambiguous (and would need communication): "
            "use .item() or .numpy() explicitly"
        )

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d global tensor")
        return self._shape[0]

    def __repr__(self) -> str:
        sbp = ", ".join(map(str, self._sbp))
        return (
            f"GlobalTensor(shape={self._shape}, dtype={self._dtype}, placement={self._placement}, sbp=({sbp}), "
            f"local shape={tuple(self._local.shape)})"
        )

    def _like(self, local: Any) -> GlobalTensor:
        """This tensor's shape, dtype, layout and family around another local part."""
        return GlobalTensor(local, self._shape, self._dtype, self._placement, self._sbp, self._family)

    # -- local and logical values -------------------------------------------------------------
    def to_local(self) -> Any:
        """This rank's part (numpy, cupy, or a torch tensor that keeps its autograd history); empty
        outside the placement. Its gradient, if it gets one, is this rank's part of the dual layout."""
        return self._local

    def numpy(self) -> np.ndarray:
        """The whole logical array, on every rank (collective: every rank must call it)."""
        me = commlib.get_rank()
        full = self if all(s.is_broadcast for s in self._sbp) else self.to_global(sbp=(broadcast,) * len(self._sbp))
        ranks = tuple(range(commlib.get_world_size()))
        local = self._family.as_array(full._local)
        if set(self._placement.flat) == set(ranks):
            return np.array(to_host(local), copy=True) if local is not full._local else to_host(local)
        root, xp = self._placement.flat[0], self._family.boxing_xp(self._placement)
        buf = local if me == root else _memory.empty(xp, self._shape, self._dtype)
        buf = xp.ascontiguousarray(buf)
        _groups.collective("broadcast", commlib.broadcast, buf, src=root, group=None, ranks=ranks, nbytes=buf.nbytes)
        return to_host(buf)

    def item(self) -> Any:
        if self.size != 1:
            raise ValueError(f"GlobalTensor.item: only a tensor of one element has an item, shape is {self._shape}")
        return self.numpy().reshape(()).item()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    # -- redistribution -----------------------------------------------------------------------
    def to_global(self, placement: Placement | None = None, sbp: Any = None, *, grad_sbp: Any = None) -> GlobalTensor:
        """The same logical tensor on ``placement`` with ``sbp`` (either may be left out: unchanged).

        Collective: every rank calls it. The communication is the cheapest plan
        (see :func:`globalview.explain`); with torch parts it is differentiable: backward boxes the
        gradient back (through ``grad_sbp`` first, when given)."""
        call = "GlobalTensor.to_global"
        pl = self._placement if placement is None else _check_placement(placement, call)
        if sbp is None:
            if pl.ndim != len(self._sbp):
                raise ValueError(f"{call}: the new placement has {pl.ndim} axes; say which sbp to use")
            sbp = self._sbp
        sbp = normalize_sbp(sbp, pl.ndim, self.ndim, call)
        if pl == self._placement and sbp == self._sbp:
            return self
        if grad_sbp is not None and self._family.differentiable:
            grad_sbp = normalize_sbp(grad_sbp, pl.ndim, self.ndim, call + " grad_sbp")
        p = self.plan_to(pl, sbp)
        family = self._family
        if pl.type != self._placement.type and not family.differentiable:
            family = placement_family(pl, call)
        local = self._family.box(p, self._local, commlib.get_rank(), grad_sbp)
        if family is not self._family:
            local = family.xp.asarray(to_host(local))
        return GlobalTensor(local, self._shape, self._dtype, pl, sbp, family)

    # -- autograd (torch parts) -------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        return self._family.requires_grad(self._local)

    def requires_grad_(self, requires_grad: bool = True) -> GlobalTensor:
        """Make this tensor a leaf that collects gradients (torch parts only); returns it."""
        self._family.requires_grad_(self, requires_grad)
        return self

    @property
    def is_leaf(self) -> bool:
        return self._family.is_leaf(self._local)

    @property
    def grad_fn(self) -> Any:
        """The torch autograd node that made this rank's local part (None for leaves)."""
        return self._family.grad_fn(self._local)

    @property
    def grad(self) -> GlobalTensor | None:
        """A leaf's accumulated gradient, laid out as the leaf (OneFlow's rule), or None."""
        g = self._family.grad(self._local)
        return None if g is None else self._like(g)

    def detach(self) -> GlobalTensor:
        """The same tensor without autograd history."""
        return self._like(self._family.detach(self._local))

    def backward(self, gradient: Any = None, retain_graph: bool | None = None, create_graph: bool = False) -> None:
        """Backpropagate from this tensor (collective). Without ``gradient`` it must have one element;
        its sbp may be anything (a broadcast loss seeds 1 on the first rank only, a partial one on all)."""
        self._family.backward(self, gradient, retain_graph, create_graph)

    def plan_to(self, placement: Placement, sbp: tuple[SbpParallel, ...]) -> Plan:
        """The boxing plan from this tensor's layout to (placement, sbp), without running it."""
        return plan(self._shape, self._dtype, (self._placement, self._sbp), (placement, sbp))


def _check_placement(pl: Any, call: str) -> Placement:
    if not isinstance(pl, Placement):
        raise TypeError(f"{call}: placement must be a globalview.placement, got {pl!r}")
    return pl


_MAXDIM = 16


def _exchange_meta(a: Any, member: bool, xp: Any, call: str) -> np.ndarray:
    """Every rank's (member, dtype, ndim, shape): one small all_gather over the world."""
    n = commlib.get_world_size()
    row = np.zeros(3 + _MAXDIM, np.int64)
    if member:
        if a.ndim > _MAXDIM:
            raise ValueError(f"{call}: at most {_MAXDIM} dimensions, got {a.ndim}")
        row[0], row[1], row[2] = 1, _dtype_code(a.dtype, call), a.ndim
        row[3 : 3 + a.ndim] = a.shape
    out = xp.zeros((n, row.size), np.int64)
    _groups.collective(
        "all_gather",
        commlib.all_gather_into_tensor,
        out,
        xp.asarray(row),
        group=None,
        ranks=tuple(range(n)),
        nbytes=out.nbytes,
    )
    return to_host(out)


_CODES = list(DTYPES)  # commlib's table: every dtype commlib moves has a code


def _dtype_code(dtype: Any, call: str) -> int:
    try:
        return _CODES.index(numpy_dtype(dtype))
    except TypeError as e:
        raise TypeError(f"{call}: {e}") from None


def _logical_shape(meta: np.ndarray, pl: Placement, sbp: tuple, call: str) -> tuple[tuple[int, ...], np.dtype]:
    rows = {r: meta[r] for r in pl.flat}
    kinds = {(int(m[1]), int(m[2])) for m in rows.values()}
    if len(kinds) != 1:
        listing = "; ".join(f"rank {r}: {_CODES[int(m[1])]} with {int(m[2])} dims" for r, m in rows.items())
        raise ValueError(f"{call}: every rank of the placement must pass the same dtype and number of dims: {listing}")
    code, ndim = kinds.pop()
    sbp = normalize_sbp(sbp, pl.ndim, ndim, call)
    shape = []
    for d in range(ndim):
        axes = [a for a, s in enumerate(sbp) if s.is_split and s.dim == d]
        owners = [r for r in pl.flat if all(pl.coords(r)[a] == 0 for a in range(pl.ndim) if a not in axes)]
        shape.append(sum(int(rows[r][3 + d]) for r in owners) if axes else int(rows[pl.flat[0]][3 + d]))
    shape = tuple(shape)
    bad = []
    for r in pl.flat:
        want = block_shape(shape, pl.hierarchy, sbp, pl.coords(r))
        got = tuple(int(x) for x in rows[r][3 : 3 + ndim])
        if want != got:
            bad.append(f"rank {r} has {got}, expected {want}")
    if bad:
        raise ValueError(
            f"{call}: the local parts do not form a {shape} tensor with sbp {', '.join(map(str, sbp))} "
            f"(uneven splits put one more element on the first ranks): " + "; ".join(bad)
        )
    return shape, _CODES[code]


def to_global(local: Any, placement: Placement, sbp: Any, *, grad_sbp: Any = None, xp: Any = None) -> GlobalTensor:
    """A global tensor from each rank's local part (collective: every rank calls it).

    ``split(d)``: the parts are concatenated along ``d``; ``broadcast``: the value of
    the placement's first rank (along each broadcast axis) is taken; ``partial_*``:
    the logical value is the sum (max, min) of the parts. Ranks outside the
    placement pass anything (it is ignored) and get an empty local part.

    torch tensors (every rank passes one) give torch parts and a differentiable cast: each
    rank's ``local`` receives its part of the gradient in the dual layout (S(d): S(d), B: P,
    P: B), or in ``grad_sbp`` when given.
    """
    call = "globalview.to_global"
    pl = _check_placement(placement, call)
    if type(local).__module__.startswith("torch"):
        return _torch_to_global(local, pl, sbp, grad_sbp, call)
    xp = placement_family(pl, call).xp if xp is None else xp
    me = commlib.get_rank()
    member = me in pl
    a = None
    if member:
        a = xp.ascontiguousarray(xp.asarray(local))
        normalize_sbp(sbp, pl.ndim, a.ndim, call)
    world = commlib.get_world_size()
    if max(pl.flat) >= world:
        raise ValueError(f"{call}: placement ranks {list(pl.flat)} do not all exist in a world of {world} ranks")
    meta = _exchange_meta(a, member, xp, call)
    shape, dtype = _logical_shape(meta, pl, sbp, call)
    sbp = normalize_sbp(sbp, pl.ndim, len(shape), call)
    copied = False
    for axis, s in enumerate(sbp):
        if not s.is_broadcast or pl.hierarchy[axis] == 1:
            continue
        # "broadcast" from local parts: coordinate 0's value on the axis (OneFlow takes rank 0's).
        mine = _groups.line_group(pl, axis, me)  # every rank makes the groups
        if member:
            if not copied:
                a, copied = a.copy(), True  # never write into the caller's array
            line = pl.line(pl.coords(me), axis)
            _groups.collective("broadcast", commlib.broadcast, a, src=line[0], group=mine, ranks=line, nbytes=a.nbytes)
    family = array_family(xp)
    if not member:
        return GlobalTensor(family.empty(pl, dtype), shape, dtype, pl, sbp, family)
    return GlobalTensor(a, shape, dtype, pl, sbp, family)


def _torch_to_global(local: Any, pl: Placement, sbp: Any, grad_sbp: Any, call: str) -> GlobalTensor:
    """:func:`to_global` of a torch tensor: the numpy/cupy cast on a zero-copy view, inside autograd."""
    from globalview._torchfamily import TORCH  # imports torch: only for torch parts

    xp = TORCH.boxing_xp(pl)
    src = local.detach().contiguous()
    made: list[GlobalTensor] = []

    def make() -> tuple:
        g = to_global(as_array(src), pl, sbp, xp=xp)
        made.append(g)
        want = None if grad_sbp is None else normalize_sbp(grad_sbp, pl.ndim, g.ndim, call + " grad_sbp")
        return g._local, g.shape, g._dtype, pl, g.sbp, want

    out = TORCH.from_local(local, src, make, xp)
    g = made[0]
    return GlobalTensor(out, g.shape, g._dtype, pl, g.sbp, TORCH)
