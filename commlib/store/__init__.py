"""Rendezvous stores with torch.distributed's Store API: :class:`TCPStore`, :class:`FileStore`, :class:`PrefixStore`,
:class:`HashStore`.

The package: ``_client`` (TCPStore, PrefixStore), ``_server`` (the selector thread that serves a
TCPStore), ``_wire`` (frame encoding and validation), ``_file`` (FileStore), ``_base`` (the
:class:`Store` contract and argument checks).

TCPStore wire format (version 1). Every message, request or response, is one frame::

    header  = magic b"CS" | version u8 (=1) | code u8 | body_length u32     (8 bytes, big-endian)
    body    = field*                                                          (exactly body_length bytes)
    field   = length u32 | bytes

``code`` is an op in a request and a status in a response (OK=0, TIMEOUT=1, ERROR=2, REJECTED=3).
Integers (amounts, counts, timeouts in ms) are 8-byte big-endian signed fields; keys and values are
raw bytes. Requests and their fields (see ``commlib.store._wire.Op`` for the replies)::

    HELLO=1 [token]    SET=2 [key, value]    GET=3 [key, timeout_ms]    ADD=4 [key, amount]
    CAS=5 [key, expected, desired]    WAIT=6 [timeout_ms, key...]    CHECK=7 [key...]
    DELETE=8 [key]    NUM_KEYS=9 []    JOIN=10 []

A connection must open with HELLO carrying the client's token (empty if none). A server started with
a token compares it with ``hmac.compare_digest`` and on a mismatch answers REJECTED and closes; a
server without a token accepts any. Frames on a connection are answered strictly in order, one at a
time; a GET/WAIT whose keys are missing is parked (the server keeps serving everyone else) and
answered when the keys arrive or with TIMEOUT after ``timeout_ms`` (clamped to 0..10**9).

The server checks each frame before using it: magic and version; body length against the limits
(keys 4 KiB, values 64 MiB by default, at most 4096 keys per WAIT/CHECK; before HELLO only a
token-sized body); fields covering the body exactly; the field count and kinds the op takes. Any
violation closes that connection alone. Nothing received is ever unpickled or evaluated. ``add``
keeps counters as decimal ASCII, like torch, so ``get`` of a counter returns e.g. ``b"42"``.
"""

from __future__ import annotations

from commlib.store._base import Store, StoreProtocolError, StoreTokenError
from commlib.store._client import PrefixStore, TCPStore
from commlib.store._file import FileStore
from commlib.store._foreign import as_store
from commlib.store._hash import HashStore

__all__ = [
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Store",
    "StoreProtocolError",
    "StoreTokenError",
    "TCPStore",
    "as_store",
]
