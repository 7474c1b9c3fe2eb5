"""The exceptions commlib raises for failures that are not caller mistakes.

Caller mistakes (a wrong dtype, a wrong size, an out-of-range rank) raise the
built-in ``TypeError`` / ``ValueError``. Everything that goes wrong *between*
ranks is a :class:`CommError`.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "DistBackendError",
    "DistError",
    "GroupBrokenError",
    "TransportError",
]


class CommError(RuntimeError):
    """A collective or point-to-point operation failed across ranks."""


class CommTimeoutError(CommError, TimeoutError):
    """An operation did not complete within its timeout (a peer died, hangs, or made another call)."""


class GroupBrokenError(CommError):
    """The group failed earlier (e.g. a timeout) and can no longer be used; ``__cause__`` is the original error."""


class CollectiveMismatchError(CommError):
    """The ranks of a group were not making the same call.

    Raised on every rank by ``COMMLIB_DEBUG=DETAIL``'s checks (``calls``: rank -> call), and
    without them when the engine itself fails inside a call (truncation, a schedule error): the
    message then names the call, its number and this rank's byte count.
    """


class TransportError(CommError):
    """The engine (MPI) reported an error inside an operation; commlib explains it as a mismatch."""


class BackendUnavailableError(CommError):
    """The requested backend cannot run here (missing package, no GPU, no MPI launcher)."""


#: torch.distributed's names: ``except dist.DistError`` (or ``dist.DistBackendError``) catches every failure
#: between ranks, as it does in a torch script (commlib's are all :class:`CommError`).
DistError = DistBackendError = CommError
