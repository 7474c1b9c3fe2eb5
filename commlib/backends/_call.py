"""One description of a call, :class:`Call`: what every rank of a group must agree on about it, written once.

The public functions describe each call once, after validating its arguments; everything downstream reads that
description. The group layer numbers and records it (:meth:`commlib._group.ProcessGroup.call`); a backend runs
it (the mpi backend plans its messages from it and stamps each message with it, the nccl backend folds its
:func:`digest` into a running digest); ``COMMLIB_DEBUG=DETAIL`` compares it in full; errors say it in words
(:func:`describe`). Codes for the wire (stamps, digests) are the indexes of the tables below: they never
depend on a process's hash seed or on object ids, so every rank computes the same ones.

``count`` is the element count every rank of the call agrees on: the buffer of all_reduce, reduce, broadcast,
send and recv; one rank's chunk of all_gather, gather, scatter and reduce_scatter (its output); one block of
an even all_to_all (0 for an uneven one, whose ``splits`` are each rank's own); 0 for barrier.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import NamedTuple

import numpy as np

from commlib._ops import ReduceOp
from commlib.arrays import DTYPES

__all__ = [
    "DTYPE_CODES",
    "KINDS",
    "KIND_CODES",
    "OP_CODES",
    "Call",
    "codes",
    "describe",
    "digest",
    "message",
]

#: every kind of call, in the order of their codes (index + 1): collectives, a message, a group's closing exchange
KINDS = (
    *("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"),
    *("barrier", "send", "close", "recv"),
)
KIND_CODES = {k: i + 1 for i, k in enumerate(KINDS)}
#: dtype codes (index + 1), in commlib's dtype table's order
DTYPE_CODES = {d: i + 1 for i, d in enumerate(DTYPES)}
DTYPE_BY_CODE = {i: d for d, i in DTYPE_CODES.items()}
#: reduce op codes (index + 1), in ReduceOp's order
OP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}
OP_BY_CODE = {i: op for op, i in OP_CODES.items()}


class Call(NamedTuple):
    """A call as every rank of its group must agree on it (see the module docstring for ``count``)."""

    kind: str  #: one of :data:`KINDS`
    dtype: np.dtype | None  #: the elements' dtype; None: no data (barrier)
    count: int  # type: ignore[assignment]  #: the elements every rank agrees on (shadows tuple.count)
    op: ReduceOp | None = None  #: the reduction (all_reduce, reduce, reduce_scatter)
    root: int = -1  #: the root's group rank; a send's or receive's peer; -1: none
    tag: int = 0  #: a send's or receive's tag
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None  #: an uneven all_to_all's (send, receive) counts

    @property
    def p2p(self) -> bool:
        """A send or a receive (not numbered: its peer's matching call is its check)."""
        return self.kind in ("send", "recv")

    def nbytes(self) -> int:
        """The bytes of ``count`` elements."""
        return 0 if self.dtype is None else self.count * self.dtype.itemsize


def message(call: Call) -> Call:
    """What a message of a send or receive says, the same on both sides: its dtype and count (no peer, no tag)."""
    return Call("send", call.dtype, call.count)


def describe(call: Call, seq: int = 0, nbytes: int = -1, step: int = 1) -> str:
    """A call in words: ``reduce #5 (float32, 4 elements, SUM, root 1[, 16 bytes])``; a send or receive as its
    message: ``a message (float32, 4 elements, 16 bytes)``. ``seq`` 0: no number; ``nbytes``: a message's."""
    parts = []
    if call.dtype is not None:
        parts.append(str(call.dtype))
    if call.count or call.kind in ("send", "recv"):
        parts.append(f"{call.count} element{'s' if call.count != 1 else ''}")
    if call.op is not None:
        parts.append(call.op.name)
    if call.root >= 0 and not call.p2p:
        parts.append(f"root {call.root}")
    if nbytes >= 0:
        parts.append(f"{nbytes} bytes" + (f" in step {step}" if step > 1 else ""))
    head = "a message" if call.p2p else f"{call.kind} #{seq}" if seq else call.kind
    return head + (f" ({', '.join(parts)})" if parts else "")


_AGREED = struct.Struct("<BBBxiq")  # kind, dtype, op, root, count


def codes(call: Call) -> tuple[int, int, int, int, int]:
    """(kind, dtype, op, root, count) codes of what every rank agrees on: a send's and a receive's are their
    message's; an uneven all_to_all's splits are each rank's own (its messages' sizes are checked instead)."""
    if call.p2p:
        call = message(call)
    dtype = 0 if call.dtype is None else DTYPE_CODES[call.dtype]
    op = 0 if call.op is None else OP_CODES[call.op]
    return KIND_CODES[call.kind], dtype, op, call.root, call.count


@functools.lru_cache(maxsize=4096)
def digest(call: Call) -> int:
    """A 64-bit digest of what every rank agrees on about ``call`` (:func:`codes`), the same in every process."""
    return int.from_bytes(hashlib.blake2b(_AGREED.pack(*codes(call)), digest_size=8).digest(), "little")
