"""Chrome-trace timelines (moved to :mod:`commlib.buckets.trace`, shared with globalview), re-exported."""

from __future__ import annotations

from commlib.buckets.trace import COMM, COMPUTE, ENV_VAR, Tracer, now_us, rank_path, tracer_for

__all__ = ["COMM", "COMPUTE", "ENV_VAR", "Tracer", "now_us", "rank_path", "tracer_for"]
