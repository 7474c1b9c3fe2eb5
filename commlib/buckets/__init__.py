"""Gradient buckets: the pure bucket planner and the framework-agnostic reducer, shared by ``ddp`` and ``globalview``.

- :mod:`commlib.buckets.planner` -- which gradient goes in which flat buffer (pure functions);
- :class:`Reducer` -- reduces gradients in flat buckets, each bucket's all-reduce started as soon
  as its last gradient is ready, overlapped with the rest of backward (numpy, cupy, torch, DLPack);
- :mod:`commlib.buckets.trace` -- Chrome-trace timelines of backward passes and bucket all-reduces.

Both data-parallel layers reuse them: ``ddp`` (torch's DDP) averages gradients, ``globalview``
sums the partial gradients of broadcast parameters (OneFlow's P -> B). ``ddp`` re-exports these
names under its historical modules (``ddp.planner``, ``ddp.reducer``, ``ddp.trace``).
"""

from __future__ import annotations

from commlib.buckets.planner import (
    DEFAULT_BUCKET_CAP_MB,
    FIRST_BUCKET_MB,
    MIB,
    Bucket,
    BucketPlan,
    ParamInfo,
    complete_order,
    plan_buckets,
)
from commlib.buckets.reducer import Comm, Reducer, average_all_reduce
from commlib.buckets.trace import Tracer, tracer_for

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "FIRST_BUCKET_MB",
    "MIB",
    "Bucket",
    "BucketPlan",
    "Comm",
    "ParamInfo",
    "Reducer",
    "Tracer",
    "average_all_reduce",
    "complete_order",
    "plan_buckets",
    "tracer_for",
]
