"""Executing a boxing plan on this rank: one function per step kind.

Each takes this rank's local part and returns the new one. Uneven pieces are
padded to the largest, moved with one collective, and trimmed. ``xp`` is numpy
or cupy; buffers handed to commlib are always contiguous.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import commlib
from globalview import _groups, _memory
from globalview._layout import block, block_shape, split_range, split_sizes, without
from globalview._plan import Plan, Step

__all__ = ["execute", "identity", "empty_local"]

_OPS = {"sum": commlib.ReduceOp.SUM, "max": commlib.ReduceOp.MAX, "min": commlib.ReduceOp.MIN}


def identity(reduce: str, dtype: np.dtype) -> Any:
    """The value that does not change a ``reduce`` over ``dtype`` (0, or the lowest / highest value)."""
    dtype = np.dtype(dtype)
    if reduce == "sum" or dtype == np.bool_:
        return (reduce == "min") if dtype == np.bool_ else 0
    if dtype.kind == "f":
        return -np.inf if reduce == "max" else np.inf
    info = np.iinfo(dtype) if dtype.kind in "iu" else None
    if info is None:
        raise ValueError(f"globalview: partial_{reduce} is not defined for {dtype}")
    return info.min if reduce == "max" else info.max


def empty_local(xp: Any, dtype: np.dtype) -> Any:
    """The local part of a rank outside a tensor's placement."""
    return xp.empty((0,), dtype)


def _copy(xp: Any, x: Any) -> Any:
    """A contiguous copy of ``x`` (from the buffer pool): collectives reduce in place."""
    out = _memory.empty(xp, x.shape, x.dtype)
    out[...] = x
    return out


def _nbytes(a: Any) -> int:
    return int(a.size) * a.dtype.itemsize


class _Ctx:
    """What every step needs: the logical shape, this rank, its array module."""

    def __init__(self, plan: Plan, me: int, xp: Any) -> None:
        self.shape, self.dtype, self.me, self.xp = plan.shape, plan.dtype, me, xp


def _line(ctx: _Ctx, step: Step) -> tuple[Any, tuple[int, ...], int, int, tuple[int, ...]]:
    """(group, the block the line shares, line size, my coordinate on it, line ranks)."""
    pl, k = step.placement, step.axis
    group = _groups.line_group(pl, k, ctx.me)
    coords = pl.coords(ctx.me)
    t = block_shape(ctx.shape, pl.hierarchy, without(step.src, k), coords)
    return group, t, pl.hierarchy[k], coords[k], pl.line(coords, k)


def _blocks(xp, x, d: int) -> Any:
    """``x`` as ``(A, n, B)``: the dimensions before ``d`` merged, ``d``, the ones after merged (a view of a
    contiguous ``x``). A piece along ``d`` is then ``A`` runs of ``size * B`` contiguous elements: moving pieces
    copies whole runs, never element by element across a transposed array (20x slower for a last dimension)."""
    x = xp.ascontiguousarray(x)
    return x.reshape(math.prod(x.shape[:d]), x.shape[d], math.prod(x.shape[d + 1 :]))


def _with(shape: tuple[int, ...], d: int, n: int) -> tuple[int, ...]:
    return (*shape[:d], n, *shape[d + 1 :])


def _own_piece(ctx: _Ctx, x, d: int, sizes: list[int], c: int) -> Any:
    """This rank's piece ``x`` (piece ``c`` along ``d``) as ``(A, m, B)``, padded to the largest piece ``m`` (the
    padding is never read): what an all_gather or a gather sends."""
    xb = _blocks(ctx.xp, x, d)
    m = max(sizes)
    if sizes[c] == m:
        return xb
    send = _memory.empty(ctx.xp, (xb.shape[0], m, xb.shape[2]), ctx.dtype)
    send[:, : sizes[c]] = xb
    return send


def _assemble(ctx: _Ctx, out, shape: tuple[int, ...], d: int, sizes: list[int]) -> Any:
    """Every rank's piece, gathered as ``(p, A, m, B)`` in rank order, put side by side along ``d``: the whole
    block (``shape`` with ``d`` the sum of ``sizes``); ``out`` itself where the pieces already follow each other."""
    whole = _with(shape, d, sum(sizes))
    _, a, m, b = out.shape
    if a == 1 and all(k == m for k in sizes):
        return out.reshape(whole)
    res = _memory.empty(ctx.xp, (a, sum(sizes), b), ctx.dtype)
    off = 0
    for r, k in enumerate(sizes):
        res[:, off : off + k] = out[r, :, :k]
        off += k
    return res.reshape(whole)


def _all_gather(ctx: _Ctx, x, step: Step):
    group, t, p, c, ranks = _line(ctx, step)
    d = step.src[step.axis].dim
    sizes = split_sizes(t[d], p)
    send = _own_piece(ctx, x, d, sizes, c)
    out = _memory.empty(ctx.xp, (p, *send.shape), ctx.dtype)  # every rank's piece, in rank order
    _groups.collective(
        "all_gather",
        commlib.all_gather_into_tensor,
        out.reshape(-1),
        send.reshape(-1),
        group=group,
        ranks=ranks,
        nbytes=_nbytes(out),
    )
    return _assemble(ctx, out, tuple(x.shape), d, sizes)


def _reduced_then(ctx: _Ctx, buf, step: Step, c: int):
    """After an all_reduce: the B -> dst local step when dst is another partial kind."""
    return _zero(ctx, buf, step.dst[step.axis], c)


def _all_reduce(ctx: _Ctx, x, step: Step):
    group, _, _, c, ranks = _line(ctx, step)
    buf = _copy(ctx.xp, x)
    _groups.collective(
        "all_reduce", commlib.all_reduce, buf, _OPS[step.op], group=group, ranks=ranks, nbytes=_nbytes(buf)
    )
    return _reduced_then(ctx, buf, step, c)


def _reduce_scatter(ctx: _Ctx, x, step: Step):
    group, t, p, c, ranks = _line(ctx, step)
    d, xp = step.dst[step.axis].dim, ctx.xp
    sizes = split_sizes(t[d], p)
    m = max(sizes)
    xb = _blocks(xp, x, d)  # (A, t[d], B)
    a, b = xb.shape[0], xb.shape[2]
    if a == 1 and all(k == m for k in sizes):  # the pieces are in rank order already: sent as they are
        send = xb
    else:  # (p, A, m, B): rank r's piece, padded (the padding is never read)
        send = _memory.empty(xp, (p, a, m, b), ctx.dtype)
        off = 0
        for r, k in enumerate(sizes):
            send[r, :, :k] = xb[:, off : off + k]
            off += k
    out = _memory.empty(xp, (a, m, b), ctx.dtype)
    _groups.collective(
        "reduce_scatter",
        commlib.reduce_scatter_tensor,
        out.reshape(-1),
        send.reshape(-1),
        _OPS[step.op],
        group=group,
        ranks=ranks,
        nbytes=_nbytes(send),
    )
    mine = _with(tuple(x.shape), d, sizes[c])
    return out.reshape(mine) if sizes[c] == m else xp.ascontiguousarray(out[:, : sizes[c]]).reshape(mine)


def _all_to_all(ctx: _Ctx, x, step: Step):
    """S(d) -> S(e): rank r gets this rank's piece ``r`` along ``e``, and this rank's result is every rank's piece,
    in rank order along ``d``; runs of whole pieces copied (as :func:`_blocks`). Pieces of different sizes go
    with the all_to_all's split sizes (no padding)."""
    group, t, p, c, ranks = _line(ctx, step)
    d, e, xp = step.src[step.axis].dim, step.dst[step.axis].dim, ctx.xp
    sd, se = split_sizes(t[d], p), split_sizes(t[e], p)
    xb = _blocks(xp, x, e)  # (A, sum(se), B): piece r is [:, off_r : off_r + se[r]]
    a, b = xb.shape[0], xb.shape[2]
    if a == 1:
        send = xb.reshape(-1)  # the pieces follow each other already
    else:
        send = _memory.empty(xp, (xb.size,), ctx.dtype)
        off = 0
        for k in se:
            send[a * off * b : a * (off + k) * b].reshape(a, k, b)[...] = xb[:, off : off + k]  # one copy: a view
            off += k
    mine = _with(tuple(x.shape), e, se[c])  # every piece this rank gets: its size along e, each rank's along d
    outer, inner = math.prod(mine[:d]), math.prod(mine[d + 1 :])
    recv = _memory.empty(xp, (sum(sd) * outer * inner,), ctx.dtype)
    even = len(set(sd)) == 1 and len(set(se)) == 1
    splits = () if even else ([k * outer * inner for k in sd], [a * k * b for k in se])
    _groups.collective(
        "all_to_all", commlib.all_to_all_single, recv, send, *splits, group=group, ranks=ranks, nbytes=_nbytes(send)
    )
    whole = _with(mine, d, sum(sd))
    if outer == 1:
        return recv.reshape(whole)  # the pieces follow each other along d already
    res = _memory.empty(xp, (outer, sum(sd), inner), ctx.dtype)
    off = 0
    for k in sd:
        res[:, off : off + k] = recv[outer * off * inner : outer * (off + k) * inner].reshape(outer, k, inner)
        off += k
    return res.reshape(whole)


def _piece(ctx: _Ctx, step: Step, d: int) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """The block this rank holds before ``step``'s axis is split along ``d``, and the index of its piece in it."""
    pl, k = step.placement, step.axis
    coords = pl.coords(ctx.me)
    shape = block_shape(ctx.shape, pl.hierarchy, without(step.src, k), coords)
    lo, hi = split_range(shape[d], pl.hierarchy[k], coords[k])
    index = [slice(None)] * len(shape)
    index[d] = slice(lo, hi)
    return shape, tuple(index)


def _slice(ctx: _Ctx, x, step: Step):
    """B -> S(i): this rank's piece of the broadcast block."""
    _, index = _piece(ctx, step, step.dst[step.axis].dim)
    return ctx.xp.ascontiguousarray(x[index])


def _zero(ctx: _Ctx, x, target, c: int):
    """B -> P: for a sum one rank of the line keeps the value, the others hold 0; max/min keep it everywhere."""
    if not target.is_partial or target.reduce != "sum" or c == 0:
        return x
    return ctx.xp.zeros_like(x)


def _zero_step(ctx: _Ctx, x, step: Step):
    return _zero(ctx, x, step.dst[step.axis], step.placement.coords(ctx.me)[step.axis])


def _fill(ctx: _Ctx, x, step: Step):
    """S(i) -> P: this rank's piece in place, the reduction's identity elsewhere."""
    k = step.axis
    shape, index = _piece(ctx, step, step.src[k].dim)
    out = ctx.xp.full(shape, identity(step.dst[k].reduce, ctx.dtype), ctx.dtype)
    out[index] = x
    return out


def _gather(ctx: _Ctx, x, step: Step):
    """1-D S(i) to the root alone (a placement change to ranks that share none with the source)."""
    pl, xp = step.placement, ctx.xp
    group = _groups.line_group(pl, 0, ctx.me)
    c, p, ranks = pl.coords(ctx.me)[0], pl.hierarchy[0], pl.flat
    d = step.src[0].dim
    sizes = split_sizes(ctx.shape[d], p)
    send = _own_piece(ctx, x, d, sizes, c)
    out = _memory.empty(xp, (p, *send.shape), ctx.dtype) if ctx.me == step.root else None
    parts = [out[r] for r in range(p)] if out is not None else None
    _groups.collective(
        "gather", commlib.gather, send, parts, dst=step.root, group=group, ranks=ranks, nbytes=_nbytes(send) * p
    )
    return _assemble(ctx, out, tuple(x.shape), d, sizes) if out is not None else empty_local(xp, ctx.dtype)


def _reduce(ctx: _Ctx, x, step: Step):
    group = _groups.line_group(step.placement, 0, ctx.me)
    buf = _copy(ctx.xp, x)
    _groups.collective(
        "reduce",
        commlib.reduce,
        buf,
        dst=step.root,
        op=_OPS[step.op],
        group=group,
        ranks=step.placement.flat,
        nbytes=_nbytes(buf),
    )
    return buf if ctx.me == step.root else empty_local(ctx.xp, ctx.dtype)


def _broadcast(ctx: _Ctx, x, step: Step):
    group = _groups.subgroup(step.ranks)
    if ctx.me not in step.ranks:
        return x
    buf = ctx.xp.ascontiguousarray(x) if ctx.me == step.root else _memory.empty(ctx.xp, ctx.shape, ctx.dtype)
    _groups.collective(
        "broadcast", commlib.broadcast, buf, src=step.root, group=group, ranks=step.ranks, nbytes=_nbytes(buf)
    )
    return buf


def _send_recv(ctx: _Ctx, x, step: Step):
    """Same mesh and sbp on other ranks: the rank at each mesh position sends its part to its counterpart."""
    src, dst, xp = step.placement, step.to, ctx.xp
    ops, out = [], None
    for i, (s, d) in enumerate(zip(src.flat, dst.flat, strict=True)):
        if ctx.me not in (s, d):
            continue
        if s == d:
            out = x
            continue
        if ctx.me == s:
            ops.append(commlib.P2POp(commlib.isend, xp.ascontiguousarray(x), d))
        if ctx.me == d:
            coords = tuple(int(c) for c in np.unravel_index(i, dst.hierarchy))
            out = _memory.empty(xp, block_shape(ctx.shape, dst.hierarchy, step.dst, coords), ctx.dtype)
            ops.append(commlib.P2POp(commlib.irecv, out, s))
    if ops:
        nbytes = sum(_nbytes(op.tensor) for op in ops)
        _groups.collective("send_recv", _batch, ops, ranks=tuple(sorted({*src.flat, *dst.flat})), nbytes=nbytes)
    return out if out is not None else empty_local(xp, ctx.dtype)


def _batch(ops: list) -> None:
    for work in commlib.batch_isend_irecv(ops):
        work.wait()


_STEPS = {
    "all_gather": _all_gather,
    "all_reduce": _all_reduce,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "slice": _slice,
    "zero": _zero_step,
    "fill": _fill,
    "gather": _gather,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "send_recv": _send_recv,
    "relabel": lambda ctx, x, step: x,
}


def execute(plan: Plan, local: Any, me: int, xp: Any) -> Any:
    """Run ``plan`` on this rank's ``local`` part; returns the new local part.

    Every rank walks the same plan, so every rank asks for the same groups in the
    same order (``commlib.new_group`` is collective over the world)."""
    ctx = _Ctx(plan, me, xp)
    for step in plan.steps:
        if step.kind not in ("broadcast", "send_recv"):
            if step.is_collective:
                _groups.line_group(step.placement, step.axis, me)
            if me not in step.placement:
                continue
        local = _STEPS[step.kind](ctx, local, step)
    return local if me in plan.dst[0] else empty_local(xp, plan.dtype)


def local_block(shape, pl, sbp, me) -> list[tuple[int, int]] | None:
    """Index ranges of ``me``'s part, or None outside the placement."""
    coords = pl.coords(me)
    return None if coords is None else block(shape, pl.hierarchy, sbp, coords)


def local_size(shape, pl, sbp, me) -> int:
    ranges = local_block(shape, pl, sbp, me)
    return 0 if ranges is None else math.prod(hi - lo for lo, hi in ranges)
