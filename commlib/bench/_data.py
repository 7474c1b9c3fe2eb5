"""Known inputs and exact expected outputs, so ``#wrong`` counts real mismatches (pure numpy).

Every element's value is a hash of (seed, rank, element index), so any rank can
compute any other rank's input, and so the expected result, locally. Values
are small integers chosen so that each reduction is exact in every datatype
whatever order the ranks are combined in (as nccl-tests' own inputs are):

- sum: |x| <= bound with nranks * bound exactly representable (bfloat16: 256).
- prod: per element, two ranks hold +-2 or +-3, the others +-1 (1 for unsigned).
- avg (floating types): per element, two ranks hold 1..100, the others 0.
- min, max and the collectives without a reduction: any value in -100..100
  (0..200 unsigned).

An element is wrong when its bits differ from the expected value's; for avg
on floating types, as in nccl-tests, up to 2 units in the last place are
tolerated (the division may round in another precision).
"""

from __future__ import annotations

import numpy as np

from commlib import ReduceOp

__all__ = ["count_wrong", "inputs", "reduced", "tolerance"]

_MASK = (1 << 64) - 1
_EXACT_INTEGERS = {"e": 1 << 11, "f": 1 << 24, "d": 1 << 53}  # float16/32/64: contiguous integers


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64's): neighbouring inputs give unrelated outputs."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
    """One stream key from small integers (seed, rank), computed in Python ints so nothing overflows."""
    key = 0x9E3779B97F4A7C15
    for p in parts:
        key = ((key ^ (p & _MASK)) * 0x100000001B3 + 0x632BE59BD9B4E019) & _MASK
    return np.uint64(key)


def _bits(seed: int, rank: int, start: int, count: int) -> np.ndarray:
    return _mix(np.arange(start, start + count, dtype=np.uint64) ^ _key(seed, rank))


def _special_ranks(seed: int, nranks: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Per element, two distinct ranks (one when nranks == 1) that carry the non-neutral prod/avg values."""
    h = _bits(seed, -1, start, count)
    a = h % np.uint64(nranks)
    if nranks == 1:
        return a, a
    step = np.uint64(1) + (h >> np.uint64(32)) % np.uint64(nranks - 1)
    return a, (a + step) % np.uint64(nranks)


def sum_bound(dtype: np.dtype, nranks: int) -> int:
    """Largest |input| for sum so that every partial sum of ``nranks`` inputs is exact and in range."""
    # Floating types: the largest run of exact integers; anything not listed is bfloat16 (8-bit significand).
    limit = int(np.iinfo(dtype).max) if dtype.kind in "iu" else _EXACT_INTEGERS.get(dtype.char, 1 << 8)
    return max(1, min(100, limit // nranks))


def _values(op: ReduceOp | None, dtype: np.dtype, seed: int, rank: int, nranks: int, start: int, count: int):
    """This rank's inputs as int64 (before the cast to ``dtype``)."""
    bits = _bits(seed, rank, start, count)
    signed = dtype.kind != "u"
    if op in (ReduceOp.PRODUCT, ReduceOp.AVG):
        a, b = _special_ranks(seed, nranks, start, count)
        special = (a == np.uint64(rank)) | (b == np.uint64(rank))
        if op is ReduceOp.AVG:  # two ranks' values summed stay in range (integer AVG sums in the dtype)
            top = 100 if dtype.kind not in "iu" else min(100, int(np.iinfo(dtype).max) // 2)
            return np.where(special, 1 + (bits % np.uint64(top)).astype(np.int64), 0)
        magnitude = np.where(special, 2 + (bits & np.uint64(1)).astype(np.int64), 1)
        negative = ((bits >> np.uint64(8)) & np.uint64(1)).astype(bool) & signed
        return np.where(negative, -magnitude, magnitude)
    bound = sum_bound(dtype, nranks) if op is ReduceOp.SUM else 100
    if signed:
        return (bits % np.uint64(2 * bound + 1)).astype(np.int64) - bound
    return (bits % np.uint64(bound + 1 if op is ReduceOp.SUM else 2 * bound + 1)).astype(np.int64)


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    # Through float64 for floating types: exact for these values, and a cast every dtype has.
    return values.astype(np.float64).astype(dtype) if dtype.kind not in "iu" else values.astype(dtype)


def inputs(
    op: ReduceOp | None, dtype: np.dtype, seed: int, rank: int, nranks: int, start: int, count: int
) -> np.ndarray:
    """Rank ``rank``'s input elements ``start .. start+count-1`` for a collective reducing with ``op``."""
    return _cast(_values(op, dtype, seed, rank, nranks, start, count), dtype)


def reduced(op: ReduceOp, dtype: np.dtype, seed: int, nranks: int, start: int, count: int) -> np.ndarray:
    """The exact result of reducing every rank's elements ``start .. start+count-1`` with ``op``."""
    exact = np.float64 if dtype.kind not in "iu" else np.int64
    acc = _values(op, dtype, seed, 0, nranks, start, count).astype(exact)
    for rank in range(1, nranks):
        v = _values(op, dtype, seed, rank, nranks, start, count).astype(exact)
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc += v
        elif op is ReduceOp.PRODUCT:
            acc *= v
        elif op is ReduceOp.MIN:
            np.minimum(acc, v, out=acc)
        else:
            np.maximum(acc, v, out=acc)
    if op is ReduceOp.AVG:  # integers as NCCL divides them: the sum, truncated toward zero
        acc = acc / nranks if dtype.kind not in "iu" else np.sign(acc) * (np.abs(acc) // nranks)
    return acc.astype(dtype)


def tolerance(op: ReduceOp | None, dtype: np.dtype) -> int:
    """Units in the last place an element may be off and still count as right (nccl-tests' rule)."""
    return 2 if op is ReduceOp.AVG and dtype.kind not in "iu" else 0


def count_wrong(got: np.ndarray, want: np.ndarray, tol: int = 0) -> int:
    """How many elements of ``got`` differ from ``want`` by more than ``tol`` units of their bit patterns."""
    if got.shape != want.shape:
        raise ValueError(f"count_wrong: got {got.shape} elements, expected {want.shape}")
    unsigned = np.dtype(f"u{got.dtype.itemsize}")
    g, w = got.view(unsigned), want.astype(got.dtype).view(unsigned)
    distance = np.where(g > w, g - w, w - g)
    return int(np.count_nonzero(distance > tol))


def corrupt(a: np.ndarray, how_many: int) -> np.ndarray:
    """A copy of ``a`` with its first ``how_many`` elements' second-highest bit flipped (tests the check)."""
    out = a.copy()
    bits = out.view(np.dtype(f"u{a.dtype.itemsize}"))
    k = min(how_many, bits.size)
    bits[:k] ^= np.array(1 << (8 * a.dtype.itemsize - 2), bits.dtype)
    return out
