"""globalview's memory per rank, measured on real processes: what a split parameter's part holds (its own bytes,
not the whole tensor it was sliced from, on every rank). Fresh ranks: the jobs fix glibc's mmap threshold so
that freed arrays leave the resident set at once (the memory each step measures is the arrays alive)."""

from __future__ import annotations

import pytest

from commlib.testing import run

MIB = 1 << 20


def _anon() -> int:
    """Bytes of anonymous memory resident in this process (after the heap's free memory is given back)."""
    import ctypes
    import gc
    import re
    from pathlib import Path

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(re.search(r"RssAnon:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def split_part_job(rows: int, cols: int) -> dict:
    """A Linear laid out split(0) and split(1) in turn: the resident bytes its parameters add on this rank."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 16 << 10)  # M_MMAP_THRESHOLD: large arrays are their own maps
    import torch

    import globalview as gv

    pl = gv.placement("cpu", [0, 1])
    out = {}
    for sbp in (gv.sbp.split(0), gv.sbp.split(1), gv.sbp.split(0)):
        torch.manual_seed(0)
        module = torch.nn.Linear(cols, rows, bias=False).double()
        whole = module.weight.numel() * module.weight.element_size()
        before = _anon()  # the whole weight, as every rank made it
        gv.nn.to_global(module, pl, {"weight": sbp})
        part = module.weight.numel() * module.weight.element_size()
        out[str(sbp)] = {"added": _anon() - before, "whole": whole, "part": part}
        del module
    return out


@pytest.mark.fresh_ranks
def test_a_split_parameter_holds_its_part_only() -> None:
    """Each rank's part of a split weight owns its bytes: the whole weight (made on every rank, broadcast from the
    first) is freed once it is laid out, on the first rank and the others alike (the others used to keep the whole
    received weight alive behind a view of their rows: 2x the predicted memory of a fully sharded plan)."""
    results = run(split_part_job, 2, 1024, 512, timeout=120)
    for rank, got in enumerate(results):
        for sbp, m in got.items():
            assert m["part"] * 2 == m["whole"], (rank, sbp, m)
            # the whole weight freed, its part kept: - whole + part, give or take 1 MiB of the process's own
            assert abs(m["added"] - (m["part"] - m["whole"])) < MIB, (rank, sbp, m["added"] / MIB, m)
