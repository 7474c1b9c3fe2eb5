"""The one rule for timeouts everywhere in commlib: a ``datetime.timedelta`` or a number of seconds."""

from __future__ import annotations

import datetime
import math

__all__ = ["as_seconds"]


def as_seconds(timeout: object, where: str, *, zero_ok: bool = False) -> float:
    """``timeout`` (a ``datetime.timedelta`` or int/float seconds) as float seconds.

    Positive and finite (``zero_ok``: zero too, for calls that may just check, like a store's
    ``get``); otherwise ``TypeError``/``ValueError`` naming ``where``.
    """
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{where}: timeout must be a datetime.timedelta or seconds, got {timeout!r}")
    if not (seconds >= 0 if zero_ok else seconds > 0) or math.isinf(seconds):
        rule = ">= 0" if zero_ok else "positive"
        raise ValueError(f"{where}: timeout must be {rule} and finite, got {seconds} s")
    return seconds
