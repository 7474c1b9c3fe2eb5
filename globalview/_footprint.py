"""What a tensor of ``n`` bytes costs this process beside its bytes, measured once per process.

A tensor's storage is one allocation: glibc serves a small one from its heap (a header of 16 bytes, torch's
objects beside it), a large one from a memory map of its own, in whole pages plus one for the header (4 KiB
more than its bytes: 6% of a 64 KiB weight). Which one depends on the process (glibc's mmap threshold moves
with what was freed, and ``mallopt`` fixes it), so it is measured in this process, not cached with the
machine: :func:`overheads` allocates tensors of a few sizes and reads how much the resident memory grew.
The planner adds the overhead at the largest measured size at or below a tensor's bytes to each tensor it
counts (:meth:`globalview._price.Pricer.footprint`).

Each operator of a forward also keeps objects of its own until backward has run (the global tensor, torch's
tensor and autograd's node, the saved tensors' records): about 2 KiB, 0.1 MiB for a 50-operator MLP, which is
2% of a tight budget. :func:`per_operator` measures it on a chain of tiny operators kept for backward.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import re
from pathlib import Path
from typing import Any

__all__ = ["SIZES", "overheads", "per_operator"]

SIZES = ((1 << 10, 64), (64 << 10, 32), (1 << 20, 8))  # (bytes of each tensor, how many): 10 MiB at most
CHAIN = 200  # operator pairs (a product with a weight, a relu) in the chain per_operator measures


def _anon() -> int | None:
    """Resident anonymous bytes after the heap's free memory is given back (None: not on Linux with glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(r"RssAnon:\s+(\d+)", text)
    return int(m.group(1)) * 1024 if m else None


@functools.cache
def overheads() -> tuple[tuple[int, float], ...]:
    """(bytes, overhead bytes per tensor) at each of :data:`SIZES`, measured once per process (empty when the
    resident memory cannot be read)."""
    import torch

    out = []
    for nbytes, count in SIZES:
        gc.collect()
        before = _anon()
        tensors = [torch.ones(nbytes // 4) for _ in range(count)]  # written: their pages are resident
        after = _anon()
        del tensors
        if before is None or after is None:
            return ()
        out.append((nbytes, max(0.0, (after - before) / count - nbytes)))
    return tuple(out)


@functools.cache
def per_operator(pl: Any) -> float:
    """Bytes each operator of a forward keeps until backward besides its tensors' data (collective: every rank of
    ``pl`` runs the same local operators), measured once per process and placement (0 when unreadable)."""
    import torch

    from globalview._tensor import to_global
    from globalview.sbp import broadcast, split

    rows = 2 * len(pl.flat)
    w = to_global(torch.ones(rows, 4, requires_grad=True), pl, (broadcast,) * pl.ndim)
    y = to_global(torch.ones(rows // len(pl.flat), 4), pl, (split(0),) * pl.ndim)
    gc.collect()
    before = _anon()
    for _ in range(CHAIN):
        y = (y * w).relu()  # each keeps its inputs or output for backward, as a layer's operators do
    after = _anon()
    del y, w
    if before is None or after is None:
        return 0.0
    return max(0.0, (after - before) / (2 * CHAIN))
