"""Bucket plans (moved to :mod:`commlib.buckets.planner`, shared with globalview); the same names, re-exported."""

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

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "FIRST_BUCKET_MB",
    "MIB",
    "Bucket",
    "BucketPlan",
    "ParamInfo",
    "complete_order",
    "plan_buckets",
]
