"""``DistributedSampler``: each rank's share of a dataset's indices, torch's rules, no torch needed."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

import commlib

__all__ = ["DistributedSampler"]


def _int(value: Any, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"DistributedSampler: {arg} must be an int, got {value!r}")
    return int(value)


class DistributedSampler:
    """Yields rank ``rank``'s indices of ``dataset`` (anything with ``len()``), as torch's sampler.

    Every epoch the indices ``0..len(dataset)-1`` are shuffled (when ``shuffle``) with the seed
    ``seed + epoch`` -- identically on every rank -- then padded by repeating indices from the
    start until they divide evenly by ``num_replicas`` (or, with ``drop_last``, cut to a
    multiple), and rank ``r`` takes every ``num_replicas``-th index starting at ``r``. Call
    :meth:`set_epoch` before each epoch, or every epoch repeats the same order. Pass it to a
    ``torch.utils.data.DataLoader`` as ``sampler=``. The shuffle uses numpy's PCG64 generator,
    so the order differs from torch's sampler (the rules are the same).
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.num_replicas = commlib.get_world_size() if num_replicas is None else _int(num_replicas, "num_replicas")
        self.rank = commlib.get_rank() if rank is None else _int(rank, "rank")
        if self.num_replicas < 1:
            raise ValueError(f"DistributedSampler: num_replicas must be >= 1, got {self.num_replicas}")
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"DistributedSampler: rank must be in [0, {self.num_replicas - 1}], got {self.rank}")
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"DistributedSampler: dataset must have a length, got {type(dataset).__qualname__}")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = _int(seed, "seed")
        self.drop_last = bool(drop_last)
        self.epoch = 0
        n = len(dataset)
        if self.drop_last and n % self.num_replicas:
            # Drop the tail so that every rank gets the same number of samples.
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def indices(self) -> list[int]:
        """This rank's indices for the current epoch."""
        n = len(self.dataset)
        if self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(n).tolist()
        else:
            order = list(range(n))
        if not self.drop_last:
            missing = self.total_size - len(order)
            if missing > 0 and order:
                order += (order * math.ceil(missing / len(order)))[:missing]
        else:
            order = order[: self.total_size]
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use ``seed + epoch`` for the next shuffle (call it with the same epoch on every rank)."""
        self.epoch = _int(epoch, "epoch")
