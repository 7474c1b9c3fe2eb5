"""The stamp: 32 bytes at the head of every message of the mpi backend, saying which call sent it.

A stamp carries what every rank agrees on about its call (:func:`commlib.backends._call.codes`: a send's and a
receive's message alike), the call's number and the message's step and size. Every receiver compares what it
receives with the stamp its own call would send, so ranks that disagree on a call (its kind, dtype, element
count, reduce op, root or sequence number, or a message's byte count) end in ``CollectiveMismatchError`` on
the receiving rank, never in wrong data. The layout (little-endian, as every rank of a job runs on one
architecture)::

    0  u32  MAGIC (the protocol and its version)
    4  u8   kind        5  u8  dtype        6  u8  op        7  u8  step (of the call)
    8  i32  root (a group rank; -1: none)
    12 u32  seq (the group's call number; 0 for sends and receives, which are not numbered)
    16 i64  count (elements every rank agrees on; 0: not agreed)
    24 i64  nbytes (this message's payload, after the stamp or in the data message that follows it)

The C executor (``_steps.c``) writes and reads the same bytes; :func:`describe` turns a stamp into words.
"""

from __future__ import annotations

import struct
from typing import Any

from commlib.backends._call import DTYPE_BY_CODE, KINDS, OP_BY_CODE, Call, codes
from commlib.backends._call import describe as describe_call

__all__ = ["MAGIC", "SIZE", "describe", "pack", "unpack"]

SIZE = 32
#: "CML" and the protocol version (2: a message's stamp names its dtype and count); a rank speaking another
#: version is refused when a group is made
MAGIC = 0x434D4C02
_LAYOUT = struct.Struct("<IBBBBiIqq")
assert _LAYOUT.size == SIZE


def pack(call: Call, step: int, seq: int, nbytes: int) -> bytes:
    """The stamp of a message of ``step`` (1-based) of call #``seq`` (0: a send or receive), ``nbytes`` long."""
    kind, dtype, op, root, count = codes(call)
    return _LAYOUT.pack(MAGIC, kind, dtype, op, step, root, seq, count, nbytes)


def unpack(raw: Any) -> tuple[int, ...]:
    """(magic, kind, dtype, op, step, root, seq, count, nbytes) of the stamp at the start of ``raw``."""
    return _LAYOUT.unpack_from(bytes(memoryview(raw)[:SIZE]))


def describe(raw: Any, got: int | None = None) -> str:
    """A stamp in words: ``all_reduce #5 (float32, 4 elements, SUM, 16 bytes)``; ``got``: bytes received (a
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
    call = Call(name, DTYPE_BY_CODE.get(dtype), count, OP_BY_CODE.get(op), root)
    return describe_call(call, seq, nbytes, step)
