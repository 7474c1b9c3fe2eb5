"""What nccl-tests defines, as plain data and pure functions: names, sizes, buffer layouts, bandwidth factors.

Nothing here communicates or allocates; every function is checked against
nccl-tests' numbers in ``tests/test_bench.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from commlib import ReduceOp
from commlib.arrays import bfloat16

__all__ = [
    "COLLECTIVES",
    "DATATYPES",
    "OPS",
    "Collective",
    "Layout",
    "bandwidths",
    "layout",
    "parse_size",
    "sweep",
]

#: nccl-tests' datatype names (its ``-d`` values), in its order, with the numpy dtype each means here.
DATATYPES: dict[str, np.dtype] = {
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32),
    "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64),
    "uint64": np.dtype(np.uint64),
    "half": np.dtype(np.float16),
    "float": np.dtype(np.float32),
    "double": np.dtype(np.float64),
    "bfloat16": np.dtype(bfloat16),
}

#: Other spellings people type for the same types (torch's and numpy's names).
DATATYPE_ALIASES = {
    "char": "int8",
    "float16": "half",
    "fp16": "half",
    "float32": "float",
    "fp32": "float",
    "float64": "double",
    "fp64": "double",
    "bf16": "bfloat16",
}

#: nccl-tests' reduction names (its ``-o`` values), in its order.
OPS: dict[str, ReduceOp] = {
    "sum": ReduceOp.SUM,
    "prod": ReduceOp.PRODUCT,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "avg": ReduceOp.AVG,
}


@dataclass(frozen=True, slots=True)
class Collective:
    """One benchmarked collective: its name, whether it reduces or has a root, and its busbw factor."""

    name: str
    reduces: bool
    rooted: bool
    factor: str  # "2(n-1)/n", "(n-1)/n" or "1", as nccl-tests' PERFORMANCE.md writes them
    per_rank: bool  # the sweep size is split into nranks equal, 16-byte aligned pieces

    def bus_factor(self, nranks: int) -> float:
        """busbw / algbw for ``nranks`` ranks."""
        if self.factor == "2(n-1)/n":
            return 2.0 * (nranks - 1) / nranks
        if self.factor == "(n-1)/n":
            return (nranks - 1) / nranks
        return 1.0


COLLECTIVES: dict[str, Collective] = {
    c.name: c
    for c in (
        Collective("all_reduce", reduces=True, rooted=False, factor="2(n-1)/n", per_rank=False),
        Collective("all_gather", reduces=False, rooted=False, factor="(n-1)/n", per_rank=True),
        Collective("reduce_scatter", reduces=True, rooted=False, factor="(n-1)/n", per_rank=True),
        Collective("broadcast", reduces=False, rooted=True, factor="1", per_rank=False),
        Collective("reduce", reduces=True, rooted=True, factor="1", per_rank=False),
        Collective("all_to_all", reduces=False, rooted=False, factor="(n-1)/n", per_rank=True),
        Collective("gather", reduces=False, rooted=True, factor="(n-1)/n", per_rank=True),
        Collective("scatter", reduces=False, rooted=True, factor="(n-1)/n", per_rank=True),
        Collective("sendrecv", reduces=False, rooted=False, factor="1", per_rank=False),
    )
}


@dataclass(frozen=True, slots=True)
class Layout:
    """Element counts of one measurement, as nccl-tests' getCollByteCount defines them.

    ``send_offset``/``recv_offset`` are the in-place offsets per rank: in place,
    rank r's input starts at ``recv + r * send_offset`` and its output at
    ``recv + r * recv_offset`` (one buffer).
    """

    send_count: int
    recv_count: int
    param_count: int  # the count passed to the NCCL call; the table's "count" column
    send_offset: int
    recv_offset: int

    def size_bytes(self, itemsize: int) -> int:
        """The table's "size" column: the larger of the send and receive buffers."""
        return max(self.send_count, self.recv_count) * itemsize


def layout(name: str, nbytes: int, itemsize: int, nranks: int) -> Layout:
    """The buffers for sweep size ``nbytes`` (nccl-tests' rules: per-rank pieces rounded down to 16 bytes)."""
    count = nbytes // itemsize
    if not COLLECTIVES[name].per_rank:
        return Layout(count, count, count, 0, 0)
    piece = (count // nranks) & -(16 // itemsize)  # nccl-tests aligns each rank's piece to 16 bytes
    whole = piece * nranks
    if name == "all_gather" or name == "gather":
        return Layout(piece, whole, piece, piece, 0)
    if name == "all_to_all":
        return Layout(whole, whole, piece, 0, 0)
    return Layout(whole, piece, piece, 0, piece)  # reduce_scatter, scatter


def bandwidths(name: str, nbytes: int, seconds: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes): size / time, and algbw times the collective's bus factor."""
    algbw = nbytes / 1e9 / seconds if seconds > 0 else 0.0
    return algbw, algbw * COLLECTIVES[name].bus_factor(nranks)


_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgG]?)\s*")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from nccl-tests' size syntax: a number with an optional K, M or G suffix (powers of 1024)."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"expected a size like 8, 64K, 32M or 1G, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def sweep(minbytes: int, maxbytes: int, stepfactor: int, stepbytes: int) -> list[int]:
    """The sizes nccl-tests visits: min, then times ``stepfactor`` (when > 1) or plus ``stepbytes``, up to max."""
    if stepfactor <= 1 and stepbytes <= 0 and minbytes < maxbytes:
        raise ValueError("the sweep would never end: give -f/--stepfactor > 1 or -i/--stepbytes > 0")
    sizes, size = [], minbytes
    while size <= maxbytes:
        sizes.append(size)
        size = size * stepfactor if stepfactor > 1 else size + stepbytes
        if size == sizes[-1]:  # -b 0 -f 2: nccl-tests would spin forever on 0
            break
    return sizes
