"""Reading frames off a socket through a buffer, so that a small frame costs one recv() and no allocation."""

from __future__ import annotations

import socket
import struct

__all__ = ["HEADER", "Reader"]

HEADER = struct.Struct("<QB3xIQQ")  # communicator id, kind, tag, sequence, payload length: 32 bytes
_READ_AHEAD = 1 << 16  # one recv() usually brings a small frame whole, header and payload


class Reader:
    """The receiving end of one connection; one thread at a time may use it (see Link's read role)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_READ_AHEAD)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the unread bytes are _buf[_start:_end]

    def has_header(self) -> bool:
        """Whether a whole header is buffered (then reading a frame needs no wait for the socket)."""
        return self._end - self._start >= HEADER.size

    def fill_nowait(self) -> bool:
        """Buffer whatever the socket has without blocking; False if it had nothing (EOFError at its end)."""
        self._compact()
        try:
            k = self._sock.recv_into(self._view[self._end :], 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if k == 0:
            raise EOFError
        self._end += k
        return True

    def header(self) -> tuple[int, int, int, int, int]:
        """The next frame's header fields (blocking until they arrived); EOFError if the peer closed."""
        if not self.has_header():
            self._compact()
            while self._end - self._start < HEADER.size:
                k = self._sock.recv_into(self._view[self._end :])
                if k == 0:
                    raise EOFError
                self._end += k
        fields = HEADER.unpack_from(self._buf, self._start)
        self._start += HEADER.size
        return fields

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` with the next bytes: first from the buffer, the rest straight from the socket."""
        n, have = len(view), min(len(view), self._end - self._start)
        if have:
            view[:have] = self._view[self._start : self._start + have]
            self._start += have
        got = have
        while got < n:  # a large payload goes straight into its destination, not through the buffer
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise EOFError
            got += k

    def _compact(self) -> None:
        """Move the unread bytes (a partial frame at most) to the front, making room behind them."""
        tail = self._end - self._start
        if tail and self._start:
            self._buf[:tail] = bytes(self._view[self._start : self._end])
        self._start, self._end = 0, tail
