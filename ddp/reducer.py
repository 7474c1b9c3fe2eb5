"""The gradient reducer (moved to :mod:`commlib.buckets.reducer`, shared with globalview), re-exported."""

from __future__ import annotations

from commlib.buckets.reducer import Comm, Reducer, average_all_reduce

__all__ = ["Comm", "Reducer", "average_all_reduce"]
