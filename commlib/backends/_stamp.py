"""The stamp: 32 bytes at the head of every message of the mpi backend, saying which call sent it.

Every rank of a group checks what it receives against the call it is making itself, so ranks that
disagree on a call (its kind, dtype, element count, reduce op, root or sequence number, or a message's
byte count) end in :class:`StampMismatch` on the receiving rank, never in wrong data. The layout
(little-endian, as every rank of a job runs on one architecture)::

    0  u32  MAGIC (the protocol and its version)
    4  u8   kind (KINDS)          5  u8  dtype (DTYPES)      6  u8  op (OPS)     7  u8  step (of the call)
    8  i32  root (a group rank; -1: none)
    12 u32  seq (the group's call number; 0 for sends and receives, which are not numbered)
    16 i64  count (elements every rank agrees on, e.g. all_gather's per-rank count; 0: not agreed)
    24 i64  nbytes (this message's payload, after the stamp or in the data message that follows it)

The C executor (``_steps.c``) writes and reads the same bytes; :func:`describe` turns a stamp into words.
"""

from __future__ import annotations

import struct
from typing import Any

from commlib._ops import ReduceOp
from commlib.arrays import DTYPES
from commlib.errors import TransportError

__all__ = [
    "DTYPE_CODES",
    "KINDS",
    "MAGIC",
    "OP_CODES",
    "SIZE",
    "StampMismatch",
    "describe",
    "pack",
    "unpack",
]

SIZE = 32
MAGIC = 0x434D4C01  # "CML" and the protocol version (1); a rank speaking another version is refused at creation
_LAYOUT = struct.Struct("<IBBBBiIqq")
assert _LAYOUT.size == SIZE

#: kind codes (index + 1): collectives, then a point-to-point message, then a group's closing exchange
KINDS = (
    *("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"),
    *("barrier", "send", "close"),
)
KIND_CODE = {k: i + 1 for i, k in enumerate(KINDS)}
#: dtype codes (index + 1), in commlib's dtype table's order
DTYPE_CODES = {d: i + 1 for i, d in enumerate(DTYPES)}
_DTYPE_BY_CODE = {i: d for d, i in DTYPE_CODES.items()}
#: reduce op codes (index + 1)
OP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}
_OP_BY_CODE = {i: op for op, i in OP_CODES.items()}


def pack(kind: int, dtype: int, op: int, step: int, root: int, seq: int, count: int, nbytes: int) -> bytes:
    """A stamp's 32 bytes."""
    return _LAYOUT.pack(MAGIC, kind, dtype, op, step, root, seq, count, nbytes)


def unpack(raw: Any) -> tuple[int, ...]:
    """(magic, kind, dtype, op, step, root, seq, count, nbytes) of the stamp at the start of ``raw``."""
    return _LAYOUT.unpack_from(bytes(memoryview(raw)[:SIZE]))


def describe(raw: Any, got: int | None = None) -> str:
    """A stamp in words: ``all_reduce #5 (float32, 4 elements, SUM; 16 bytes)``; ``got``: bytes received (a
    message shorter than a stamp is no stamp)."""
    if got is not None and got < SIZE:
        return f"a message of {got} bytes, too short to be commlib's"
    magic, kind, dtype, op, step, root, seq, count, nbytes = unpack(raw)
    if magic != MAGIC:
        version = magic & 0xFF if magic >> 8 == MAGIC >> 8 else None
        return "a message that is not commlib's" if version is None else f"a message of commlib protocol {version}"
    name = KINDS[kind - 1] if 0 < kind <= len(KINDS) else f"kind {kind}"
    if name == "close":
        calls = f"{seq} collective call{'s' if seq != 1 else ''}"
        if count == 1:
            return f"the end of its calls on this group, where the group had failed (after {calls})"
        return f"the end of its calls on this group (after {calls})"
    if name == "send":
        return f"a message of {nbytes} bytes (send)"
    return call_text(name, seq, _DTYPE_BY_CODE.get(dtype), _OP_BY_CODE.get(op), root, count, nbytes, step)


def call_text(
    kind: str, seq: int, dtype: Any, op: ReduceOp | None, root: int, count: int, nbytes: int = -1, step: int = 1
) -> str:
    """A call in the words of its stamps: ``reduce #5 (float32, 4 elements, SUM, root 1[, 16 bytes])``."""
    parts = []
    if dtype is not None:
        parts.append(str(dtype))
    if count:
        parts.append(f"{count} element{'s' if count != 1 else ''}")
    if op is not None:
        parts.append(op.name)
    if root >= 0:
        parts.append(f"root {root}")
    if nbytes >= 0:
        parts.append(f"{nbytes} bytes" + (f" in step {step}" if step > 1 else ""))
    return f"{kind} #{seq}" + (f" ({', '.join(parts)})" if parts else "")


class PeerGaveUp(TransportError):
    """Group rank ``peer`` gave up on the group (its ``reason``): a wait that would never end ends now."""

    def __init__(self, peer: int, reason: str) -> None:
        self.peer, self.reason = peer, reason
        super().__init__(f"group rank {peer} gave up on the group: {reason}")


class StampMismatch(TransportError):
    """A message that another call sent: ``peer`` (a group rank) sent ``got`` (in words) where this rank's call
    expects ``wanted`` (in words); :meth:`ProcessGroup.mismatch` names both calls."""

    def __init__(self, peer: int, got: str, wanted: str) -> None:
        self.peer, self.got, self.wanted = peer, got, wanted
        super().__init__(f"group rank {peer} sent {got}, where this rank's call expects {wanted}")
