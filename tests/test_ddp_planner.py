"""ddp.planner: bucket assignment as plain functions, no processes."""

from __future__ import annotations

import pytest

from ddp.planner import MIB, Bucket, BucketPlan, ParamInfo, complete_order, plan_buckets


def f32(numel: int, device: str = "cpu", name: str = "") -> ParamInfo:
    return ParamInfo(numel, 4, "float32", device, name)


def members(plan: BucketPlan) -> list[list[int]]:
    return [list(b.params) for b in plan.buckets]


def test_reverse_registration_order_and_offsets() -> None:
    plan = plan_buckets([f32(3), f32(5), f32(2)])
    assert members(plan) == [[2, 1, 0]]
    (bucket,) = plan.buckets
    assert bucket.offsets == (0, 2, 7) and bucket.numel == 10 and bucket.nbytes == 40
    assert plan.location == ((0, 7), (0, 2), (0, 0))
    assert [plan.bucket_of(p) for p in range(3)] == [0, 0, 0]


def test_first_bucket_is_small_then_the_cap() -> None:
    quarter = f32(MIB // 16)  # 256 KiB each
    plan = plan_buckets([quarter] * 12, bucket_cap_mb=2)
    # Walk 11..0: the first bucket closes at 1 MiB (4 params), the next ones at 2 MiB (8 params).
    assert members(plan) == [[11, 10, 9, 8], [7, 6, 5, 4, 3, 2, 1, 0]]
    assert [b.nbytes for b in plan.buckets] == [MIB, 2 * MIB]


def test_a_bucket_closes_after_the_parameter_that_reaches_the_cap() -> None:
    plan = plan_buckets([f32(10), f32(3 * MIB // 4), f32(10)], bucket_cap_mb=1, first_bucket_mb=1)
    assert members(plan) == [[2, 1], [0]]  # the big one overflows its bucket rather than getting split


def test_default_cap_is_25_mib() -> None:
    plan = plan_buckets([f32(MIB)] * 9)  # 4 MiB each
    assert members(plan) == [[8], [7, 6, 5, 4, 3, 2, 1], [0]]  # 4 MiB >= 1 MiB; then 24 < 25 <= 28 MiB


def test_first_bucket_never_exceeds_the_cap() -> None:
    plan = plan_buckets([f32(100)] * 4, bucket_cap_mb=400 / MIB)
    assert members(plan) == [[3], [2], [1], [0]]


def test_dtypes_and_devices_never_share_a_bucket() -> None:
    params = [f32(4), ParamInfo(4, 8, "float64"), f32(4, "cuda:0"), f32(4), ParamInfo(4, 8, "float64")]
    plan = plan_buckets(params)
    keys = [(b.dtype, b.device) for b in plan.buckets]
    assert sorted(keys) == sorted({p.key for p in params})
    assert members(plan) == [[4, 1], [3, 0], [2]]  # ordered by their first parameter in the walk
    for b in plan.buckets:
        assert all(params[p].key == (b.dtype, b.device) for p in b.params)


def test_each_key_has_its_own_first_bucket() -> None:
    big32, big64 = f32(MIB // 4), ParamInfo(MIB // 8, 8, "float64")  # 1 MiB each
    plan = plan_buckets([big32, big64, big32, big64], bucket_cap_mb=10)
    # Each key's first bucket closes at 1 MiB; the second ones stay open (10 MiB cap) until the end.
    assert members(plan) == [[3], [2], [1], [0]]
    assert [b.dtype for b in plan.buckets] == ["float64", "float32", "float64", "float32"]


def test_explicit_order_rebuilds_from_ready_order() -> None:
    params = [f32(MIB // 8)] * 6  # 512 KiB each
    plan = plan_buckets(params, bucket_cap_mb=1, order=[0, 2, 4, 1, 3, 5])
    assert members(plan) == [[0, 2], [4, 1], [3, 5]]


def test_complete_order_appends_never_ready_in_reverse() -> None:
    assert complete_order([3, 1, 3], 5) == [3, 1, 4, 2, 0]
    assert complete_order([], 3) == [2, 1, 0]
    with pytest.raises(ValueError, match=r"complete_order: ready holds 7, not a parameter index in range\(3\)"):
        complete_order([7], 3)


def test_plans_are_values() -> None:
    params = [f32(3), f32(4)]
    assert plan_buckets(params) == plan_buckets(params)
    assert hash(plan_buckets(params)) == hash(plan_buckets(params))
    assert "float32@cpu" in str(plan_buckets(params))


def test_empty_and_zero_size_parameters() -> None:
    assert plan_buckets([]).buckets == ()
    plan = plan_buckets([f32(0), f32(2)])
    assert members(plan) == [[1, 0]] and plan.location == ((0, 2), (0, 0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_cap_mb": 0}, r"plan_buckets: bucket_cap_mb must be a positive number of MiB, got 0"),
        ({"bucket_cap_mb": -1.5}, r"bucket_cap_mb must be a positive number of MiB, got -1.5"),
        ({"first_bucket_mb": "1"}, r"first_bucket_mb must be a positive number of MiB, got '1'"),
        ({"order": [0, 0]}, r"order must be a permutation of range\(2\), got \[0, 0\]"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_buckets([f32(1), f32(1)], **kwargs)


def test_value_types_validate() -> None:
    with pytest.raises(ValueError, match=r"ParamInfo: numel must be an int >= 0, got -1"):
        ParamInfo(-1, 4, "float32")
    with pytest.raises(ValueError, match=r"ParamInfo: itemsize must be an int >= 1, got 0"):
        ParamInfo(1, 0, "float32")
    with pytest.raises(ValueError, match=r"Bucket: 2 params but 1 offsets"):
        Bucket(0, "float32", "cpu", (0, 1), (0,), 2, 8)
    with pytest.raises(ValueError, match=r"buckets must hold each of 2 parameters exactly once"):
        BucketPlan((Bucket(0, "float32", "cpu", (0,), (0,), 1, 4),), ((0, 0), (0, 1)))
    with pytest.raises(TypeError, match=r"plan_buckets: params must be ParamInfo objects"):
        plan_buckets([3])  # type: ignore[list-item]
