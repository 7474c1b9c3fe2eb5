"""Bucket plans (moved to :mod:`commlib.buckets.planner`, shared with globalview); the same names, re-exported."""

from __future__ import annotations

from commlib.buckets import planner as _moved
from commlib.buckets.planner import *  # noqa: F403 (every public name of the module this one was)

__all__ = list(_moved.__all__)
