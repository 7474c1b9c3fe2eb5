"""ddp.DistributedSampler: torch's partition rules, no processes."""

from __future__ import annotations

import pytest

from ddp import DistributedSampler


def shards(n: int, replicas: int, **kw) -> list[list[int]]:
    return [list(DistributedSampler(range(n), num_replicas=replicas, rank=r, **kw)) for r in range(replicas)]


@pytest.mark.parametrize("n", [0, 1, 7, 10, 12])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_indices_as_torch_without_shuffle(n: int, replicas: int, drop_last: bool) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    for rank in range(replicas):
        ours = DistributedSampler(range(n), replicas, rank, shuffle=False, drop_last=drop_last)
        theirs = torch_data.DistributedSampler(range(n), replicas, rank, shuffle=False, drop_last=drop_last)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_padding_repeats_from_the_start() -> None:
    assert shards(7, 3, shuffle=False) == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]
    assert shards(2, 5, shuffle=False) == [[0], [1], [0], [1], [0]]  # padding longer than the data


def test_drop_last_cuts_to_a_multiple() -> None:
    assert shards(7, 3, shuffle=False, drop_last=True) == [[0, 3], [1, 4], [2, 5]]


@pytest.mark.parametrize(("n", "replicas"), [(10, 3), (16, 4), (5, 2)])
def test_shuffle_partitions_a_permutation_identically_on_every_rank(n: int, replicas: int) -> None:
    parts = shards(n, replicas, seed=3)
    assert len({len(p) for p in parts}) == 1
    together = [i for p in parts for i in p]
    assert set(together) == set(range(n)) and len(together) == -(-n // replicas) * replicas
    assert parts == shards(n, replicas, seed=3)  # every rank computes the same permutation
    assert parts != shards(n, replicas, seed=4)


def test_set_epoch_reshuffles_deterministically() -> None:
    sampler = DistributedSampler(range(20), num_replicas=2, rank=1, seed=5)
    first = list(sampler)
    assert list(sampler) == first  # same epoch, same order
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    other = DistributedSampler(range(20), num_replicas=2, rank=1, seed=4)
    other.set_epoch(2)
    assert list(other) == second  # the seed of an epoch is seed + epoch


def test_works_as_a_dataloader_sampler() -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    data = list(range(10))
    loader = torch_data.DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 0, shuffle=False))
    assert [b.tolist() for b in loader] == [[0, 2], [4, 6], [8]]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((range(4), 0, 0), {}, ValueError, r"DistributedSampler: num_replicas must be >= 1, got 0"),
        ((range(4), 2, 2), {}, ValueError, r"DistributedSampler: rank must be in \[0, 1\], got 2"),
        ((range(4), 2, -1), {}, ValueError, r"rank must be in \[0, 1\], got -1"),
        ((range(4), 2.0, 0), {}, TypeError, r"DistributedSampler: num_replicas must be an int, got 2.0"),
        ((iter([1]), 2, 0), {}, TypeError, r"DistributedSampler: dataset must have a length, got list_iterator"),
        ((range(4), 2, 0), {"seed": None}, TypeError, r"DistributedSampler: seed must be an int, got None"),
    ],
)
def test_bad_arguments(args: tuple, kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        DistributedSampler(*args, **kwargs)


def test_set_epoch_checks_its_argument() -> None:
    with pytest.raises(TypeError, match=r"DistributedSampler: epoch must be an int, got '1'"):
        DistributedSampler(range(4), 2, 0).set_epoch("1")  # type: ignore[arg-type]
