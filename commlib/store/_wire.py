"""Frame encoding and validation for the TCPStore wire protocol (the format is described in commlib.store).

Everything read from the network goes through :func:`parse_header`, :func:`split_fields` and
:func:`check_request` before it is used; nothing is ever unpickled or evaluated.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"CS"
VERSION = 1
HEADER = struct.Struct("!2sBBI")  # magic, version, op (request) or status (response), body length
FIELD = struct.Struct("!I")  # length prefix of every field
INT = struct.Struct("!q")  # integers travel as 8-byte big-endian signed fields
MAX_TOKEN = 1024
MAX_TIMEOUT_MS = 10**9  # ~11.6 days stands for "forever": poll() and socket timeouts overflow past ~24 days


class Op(enum.IntEnum):
    """Request codes."""

    HELLO = 1  # [token]                          -> OK [] | REJECTED []
    SET = 2  # [key, value]                       -> OK []
    GET = 3  # [key, timeout_ms]                  -> OK [value] | TIMEOUT [key]
    ADD = 4  # [key, amount]                      -> OK [total] | ERROR [message]
    CAS = 5  # [key, expected, desired]           -> OK [value now held]
    WAIT = 6  # [timeout_ms, key, ...]            -> OK [] | TIMEOUT [missing key, ...]
    CHECK = 7  # [key, ...]                       -> OK [b"\x01" | b"\x00"]
    DELETE = 8  # [key]                           -> OK [b"\x01" | b"\x00"]
    NUM_KEYS = 9  # []                            -> OK [count]
    JOIN = 10  # []                               -> OK [instances joined so far]


class Status(enum.IntEnum):
    """Response codes."""

    OK = 0
    TIMEOUT = 1
    ERROR = 2
    REJECTED = 3


class FrameError(ValueError):
    """Bytes that are not a valid frame: the connection that sent them is closed."""


@dataclass(frozen=True)
class Limits:
    """Size bounds that both ends enforce (configurable per TCPStore)."""

    max_key: int = 4096
    max_value: int = 64 << 20
    max_keys: int = 4096  # keys in one wait/check

    @property
    def max_body(self) -> int:
        """The largest body any valid request can have (CAS with two maximal values, or WAIT with many keys)."""
        per_field = FIELD.size
        cas = 3 * per_field + self.max_key + 2 * self.max_value
        wait = (self.max_keys + 1) * per_field + self.max_keys * self.max_key + INT.size
        return max(cas, wait, per_field + MAX_TOKEN)


# Field kinds per op: k = key, v = value, i = 8-byte int, t = token; then the kind of any repeated
# trailing fields ("" = none), so WAIT/CHECK carry a variable-length key list.
_SCHEMA: dict[Op, tuple[str, str]] = {
    Op.HELLO: ("t", ""),
    Op.SET: ("kv", ""),
    Op.GET: ("ki", ""),
    Op.ADD: ("ki", ""),
    Op.CAS: ("kvv", ""),
    Op.WAIT: ("i", "k"),
    Op.CHECK: ("", "k"),
    Op.DELETE: ("k", ""),
    Op.NUM_KEYS: ("", ""),
    Op.JOIN: ("", ""),
}


def encode(code: int, fields: Sequence[bytes]) -> bytes:
    """Return one frame: header, then each field as a 4-byte length and its bytes."""
    parts = [b""]
    for field in fields:
        parts.append(FIELD.pack(len(field)))
        parts.append(field)
    body_len = sum(len(p) for p in parts)
    parts[0] = HEADER.pack(MAGIC, VERSION, code, body_len)
    return b"".join(parts)


def pack_int(value: int) -> bytes:
    """Encode an int field (raises OverflowError outside int64)."""
    try:
        return INT.pack(value)
    except struct.error as exc:
        raise OverflowError(f"{value} does not fit in a signed 64-bit integer") from exc


def unpack_int(field: bytes) -> int:
    """Decode an int field."""
    if len(field) != INT.size:
        raise FrameError(f"integer field has {len(field)} bytes, not {INT.size}")
    value: int = INT.unpack(field)[0]
    return value


def parse_header(header: bytes, max_body: int) -> tuple[int, int]:
    """Return (code, body length) of a frame header, or raise FrameError."""
    magic, version, code, body_len = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version != VERSION:
        raise FrameError(f"unsupported protocol version {version}")
    if body_len > max_body:
        raise FrameError(f"frame body of {body_len} bytes exceeds the limit of {max_body}")
    return code, body_len


def split_fields(body: bytes, max_fields: int) -> list[bytes]:
    """Split a frame body into its length-prefixed fields, which must cover it exactly."""
    fields: list[bytes] = []
    pos, end = 0, len(body)
    while pos < end:
        if end - pos < FIELD.size or len(fields) >= max_fields:
            raise FrameError("truncated field header or too many fields")
        (size,) = FIELD.unpack_from(body, pos)
        pos += FIELD.size
        if size > end - pos:
            raise FrameError(f"field of {size} bytes overruns the frame body")
        fields.append(body[pos : pos + size])
        pos += size
    return fields


def check_request(code: int, fields: list[bytes], limits: Limits) -> Op:
    """Validate a request's op code and fields against the schema and limits; return the op."""
    try:
        op = Op(code)
    except ValueError:
        raise FrameError(f"unknown op code {code}") from None
    fixed, repeat = _SCHEMA[op]
    if len(fields) < len(fixed) or (not repeat and len(fields) != len(fixed)):
        raise FrameError(f"{op.name} takes {len(fixed)} fields, got {len(fields)}")
    if len(fields) > len(fixed) + limits.max_keys:
        raise FrameError(f"{op.name} names more than {limits.max_keys} keys")
    for index, field in enumerate(fields):
        _check_field(fixed[index] if index < len(fixed) else repeat, field, limits)
    return op


def _check_field(kind: str, field: bytes, limits: Limits) -> None:
    if kind == "k" and len(field) > limits.max_key:
        raise FrameError(f"key of {len(field)} bytes exceeds {limits.max_key}")
    if kind == "v" and len(field) > limits.max_value:
        raise FrameError(f"value of {len(field)} bytes exceeds {limits.max_value}")
    if kind == "t" and len(field) > MAX_TOKEN:
        raise FrameError(f"token of {len(field)} bytes exceeds {MAX_TOKEN}")
    if kind == "i":
        unpack_int(field)
