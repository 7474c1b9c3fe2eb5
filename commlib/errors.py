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
    "RankFailedError",
    "TransportError",
]


class CommError(RuntimeError):
    """A collective or point-to-point operation failed across ranks."""


class CommTimeoutError(CommError, TimeoutError):
    """An operation did not complete within its timeout (a peer died, hangs, or made another call)."""


class GroupBrokenError(CommError):
    """The group failed (e.g. a timeout, here or on a peer) and can no longer be used.

    ``__cause__`` is the original error of a group that failed here earlier. ``peer`` is the group rank of a
    peer whose group failed first, ``reason`` what it said (None when this rank's own group failed).
    """

    def __init__(self, message: str = "", *, peer: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.peer, self.reason = peer, reason
        self.context: str | None = None  # the group's call the message names (None: a backend's raw words)


class RankFailedError(GroupBrokenError):
    """A rank of the group died (its process ended without leaving the job, or its host or link went away), so
    the group can no longer be used; the survivors may go on without it (``commlib.shrink_group``).

    ``failed_ranks``: the failed ranks, as ranks of the group the call ran on, sorted; ``global_ranks``: the
    same processes as ranks of the default group they were in.
    """

    def __init__(
        self, message: str = "", *, failed_ranks: list[int] | None = None, global_ranks: list[int] | None = None
    ) -> None:
        failed = sorted(failed_ranks or [])
        super().__init__(message, peer=failed[0] if failed else None, reason="died")
        self.failed_ranks = failed
        self.global_ranks = sorted(global_ranks or [])
        self.detail = message  # what happened, in words, without the call (the group layer's calls add theirs)


class CollectiveMismatchError(CommError):
    """The ranks of a group were not making the same call; the message names the calls.

    ``peer``, ``theirs`` and ``mine``: the group rank whose call differs, its call and this rank's, in
    words, where one peer's call is known (a stamp, a digest); ``calls``: global rank -> call, where every
    rank's is (``COMMLIB_DEBUG=DETAIL``, a wait where every rank published its call).
    """

    def __init__(
        self,
        message: str = "",
        *,
        peer: int | None = None,
        theirs: str | None = None,
        mine: str | None = None,
        calls: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.peer, self.theirs, self.mine, self.calls = peer, theirs, mine, calls
        self.context: str | None = None  # the group's call the message names (None: a backend's raw words)


class TransportError(CommError):
    """The engine (MPI) reported an error inside an operation; commlib explains it as a mismatch."""


class BackendUnavailableError(CommError):
    """The requested backend cannot run here (missing package, no GPU, no MPI launcher)."""


#: torch.distributed's names: ``except dist.DistError`` (or ``dist.DistBackendError``) catches every failure
#: between ranks, as it does in a torch script (commlib's are all :class:`CommError`).
DistError = DistBackendError = CommError
