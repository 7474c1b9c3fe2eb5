"""Small immutable values (placements, sbp): fields set once, then every assignment refused."""

from __future__ import annotations

from typing import Any

__all__ = ["Frozen"]


class Frozen:
    """A base for immutable values; subclasses set their slots once with :meth:`_freeze`."""

    __slots__ = ()
    _what = "these values"  # for the error: "<_what> are immutable"

    def _freeze(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, f"_{name}", value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self._what} are immutable")
