"""Numpy oracles for the collective tests: deterministic per-rank inputs and reduced results.

Inputs are small integers or quarters, so every sum and product below is exact
in every dtype and the distributed result must equal the reference bit for bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
INTS = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
FLOATS = [np.float16, BF16, np.float32, np.float64]
COMPLEX = [np.complex64, np.complex128]
ALL_DTYPES = [np.dtype(d) for d in [*INTS, *FLOATS, *COMPLEX, np.bool_]]
LOW = {np.dtype(np.float16), BF16}

OPS_BY_KIND = {
    "i": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"],
    "u": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"],
    "f": ["SUM", "PRODUCT", "MIN", "MAX", "AVG"],
    "c": ["SUM", "PRODUCT", "AVG"],
    "b": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"],
}


def kind(dtype: np.dtype) -> str:
    return "f" if dtype == BF16 else np.dtype(dtype).kind


# What NCCL can reduce (it has no 16-bit integers, no bitwise ops, no complex product; bool is
# reduced as uint8 with max/min).
NCCL_OPS = {
    "i": ["SUM", "PRODUCT", "MIN", "MAX", "AVG"],
    "u": ["SUM", "PRODUCT", "MIN", "MAX", "AVG"],
    "f": ["SUM", "PRODUCT", "MIN", "MAX", "AVG"],
    "c": ["SUM", "AVG"],
    "b": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR"],
}
BACKENDS = {"mpi": {}, "nccl": {"COMMLIB_NCCL_EMULATOR": "1"}}  # backend -> environment of the ranks


def ops_for(dtype: np.dtype, backend: str = "mpi") -> list[str]:
    """The reductions ``backend`` defines for ``dtype``."""
    if backend == "nccl":
        return [] if np.dtype(dtype).itemsize == 2 and kind(dtype) in "iu" else NCCL_OPS[kind(dtype)]
    return OPS_BY_KIND[kind(dtype)]


def make(rank: int, size: int, dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: ``size`` deterministic, small, exactly representable values."""
    rng = np.random.default_rng([rank, size, salt, 12345])
    k = kind(dtype)
    if k == "b":
        return rng.integers(0, 2, size).astype(bool)
    if k == "u":
        return rng.integers(0, 4, size).astype(dtype)
    if k == "i":
        return rng.integers(-2, 4, size).astype(dtype)
    if k == "c":
        return (rng.integers(-3, 4, size) + 1j * rng.integers(-3, 4, size)).astype(dtype)
    return (rng.integers(-8, 9, size) / 4).astype(np.float32).astype(dtype)


def reduce(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """The reduction of ``arrays`` (one per rank) the way commlib defines it."""
    dtype = arrays[0].dtype
    if dtype == np.bool_:
        fn = {"SUM": np.any, "MAX": np.any, "BOR": np.any, "PRODUCT": np.all, "MIN": np.all, "BAND": np.all}
        stack = np.stack(arrays)
        if op == "BXOR":
            return np.bitwise_xor.reduce(stack, axis=0)
        return fn[op](stack, axis=0)
    work = [a.astype(np.float32) for a in arrays] if dtype in LOW else arrays
    stack = np.stack(work)
    ufunc = {
        "SUM": np.add,
        "AVG": np.add,
        "PRODUCT": np.multiply,
        "MIN": np.minimum,
        "MAX": np.maximum,
        "BAND": np.bitwise_and,
        "BOR": np.bitwise_or,
        "BXOR": np.bitwise_xor,
    }[op]
    out = ufunc.reduce(stack, axis=0, dtype=stack.dtype)
    if op == "AVG" and kind(dtype) in "iu":  # NCCL's: the sum divided, truncating toward zero (C's division)
        return np.array([truncated(int(v), len(arrays)) for v in out.ravel()], dtype).reshape(out.shape)
    if op == "AVG":  # one real division per component, complex numbers included
        n = np.asarray(len(arrays), dtype=out.real.dtype)
        out = out.real / n + 1j * (out.imag / n) if out.dtype.kind == "c" else out / n
    return out.astype(dtype)


def truncated(total: int, n: int) -> int:
    """``total / n`` rounded toward zero, in Python integers (exact at any width)."""
    return abs(total) // n * (1 if total >= 0 else -1)


def group_layouts(n: int) -> dict[str, list[int]]:
    """The world, a group that excludes rank 0, and one that excludes the last rank (they overlap for n >= 3)."""
    layouts = {"world": list(range(n))}
    if n > 1:
        layouts["tail"] = list(range(1, n))
        layouts["head"] = list(range(n - 1))
    return layouts


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Assert bit-equal arrays (NaN-free inputs), with a readable message."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if not np.array_equal(got, want):
        raise AssertionError(f"{what}:\n got  {got!r}\n want {want!r}")


def same_search_on_every_rank() -> None:
    """Make a derandomized hypothesis search draw the same cases on every rank.

    Hypothesis mixes into its draws constants it finds in the local modules loaded so far; ranks
    load different modules (rank 0 alone serves the store), so their searches drift apart and
    deadlock. Call this in each rank before the search: it turns that source of constants off.
    """
    from hypothesis.internal.conjecture import providers

    if hasattr(providers, "_get_local_constants"):
        empty = providers.Constants()
        providers._get_local_constants = lambda: empty
        providers.CONSTANTS_CACHE.cache.clear()


def search_settings(max_examples: int, shrink: bool = False):
    """The hypothesis settings of every fuzz and property test: derandomized (the same cases on every rank,
    see :func:`same_search_on_every_rank`), no example database, no deadline (ranks share two cores), no
    health checks; multi-rank searches never shrink (a shrinking rank would leave the others waiting)."""
    from hypothesis import HealthCheck, Phase, settings

    same_search_on_every_rank()
    phases = list(Phase) if shrink else [Phase.generate]
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
