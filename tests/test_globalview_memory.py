"""globalview's memory per rank, measured on real processes: what a split parameter's part holds (its own bytes,
not the whole tensor it was sliced from, on every rank). Fresh ranks: the jobs fix glibc's mmap threshold so
that freed arrays leave the resident set at once (the memory each step measures is the arrays alive)."""

from __future__ import annotations

import pytest

from commlib.testing import run

MIB = 1 << 20
NOISE = 0.02  # one plan's measured peak from process to process (heap, MPI's buffers): up to 1% seen


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


def _status(field: str) -> int:
    import re
    from pathlib import Path

    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _peak(build, parts: list, steps: int = 2) -> float:
    """Bytes a module's training steps hold at most above what the process held before building it (the largest
    rank), as benchmarks/gv_auto.py measures it: two batches (this rank's ``parts``, made global) kept across
    steps, two warm-up steps, the heap trimmed, the resident set's high water mark over the next steps."""
    import ctypes
    import gc
    from pathlib import Path

    import numpy as np
    import torch

    import commlib
    import globalview as gv

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _status("VmRSS")
    model = build()
    pl = gv.placement("cpu", [0, 1])
    data = [tuple(gv.to_global(t, pl, (gv.sbp.split(0),)) for t in part) for part in parts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(2 + steps):
        if i == 2:
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")  # the high water mark starts again from here
        loss = model(*data[i % 2])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        del loss
    peak = np.array([float(_status("VmHWM") - base)])
    del model, optimizer, data
    commlib.all_reduce(peak, op=commlib.ReduceOp.MAX)
    return float(peak[0])


def budget_job(rows: int) -> dict:
    """The deep narrow MLP (16 Linear layers of 128, float32, ``rows`` samples per rank): data parallel's measured
    peak, then the plan auto_parallel chooses under 80% of it, measured the same way, beside their predictions."""
    import ctypes
    import sys
    from pathlib import Path

    ctypes.CDLL("libc.so.6").mallopt(-3, 16 << 10)  # M_MMAP_THRESHOLD: freed tensors leave the resident set
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "globalview"))
    import _models
    import torch

    import commlib
    import globalview as gv

    torch.set_num_threads(1)
    pl, me = gv.placement("cpu", [0, 1]), commlib.get_rank()
    make = lambda: _models.make("deep mlp", "bench")  # noqa: E731
    parts = [_models.batch(make(), rows, seed=2 * b + me) for b in range(2)]
    plan = gv.explain(gv.auto_parallel(make(), pl, parts[0]))
    layouts = plan.alternatives["data parallel"]["layouts"]
    dp = lambda: gv.nn.to_global(make(), pl, layouts)  # noqa: E731
    _peak(dp, parts)  # the process's own first-time allocations, not a plan's
    dp_peak = min(_peak(dp, parts) for _ in range(2))
    budget = 0.8 * dp_peak
    tight = gv.explain(gv.auto_parallel(make(), pl, parts[0], budget))
    peak = min(_peak(lambda: tight.apply(make()), parts) for _ in range(2))
    return {
        "dp": (dp_peak, plan.alternatives["data parallel"]["memory"]),
        "budget": budget,
        "chosen": (peak, tight.memory),
        "report": tight.report,
    }


@pytest.mark.fresh_ranks
def test_a_plan_chosen_under_a_budget_fits_it_when_measured() -> None:
    """Issue 37: with a budget below data parallel's measured peak, the plan chosen fits it, measured, and its
    measured peak is within 15% of the predicted one. The deep narrow MLP's plan used to hold 9.5 MiB against a
    budget of 8.7 (predicted 8.7, 9% over): the model left out the second batch the loop keeps, an operator's
    output and boxed input alive together in forward, the allocator's overhead per tensor (a page each above
    glibc's mmap threshold) and each operator's own objects. The search fills the budget to within 1%, and one
    plan's measured peak differs by up to 1% from process to process (data parallel's: 10.86-10.98 MiB), so the
    measured peak may exceed the budget by NOISE (far less than the 9% it used to)."""
    got = run(budget_job, 2, 512, timeout=300)[0]
    (dp, dp_predicted), budget, (peak, predicted) = got["dp"], got["budget"], got["chosen"]
    numbers = f"dp {dp / MIB:.2f} MiB (predicted {dp_predicted / MIB:.2f}), budget {budget / MIB:.2f}, chosen plan "
    numbers += f"{peak / MIB:.2f} (predicted {predicted / MIB:.2f})\n{got['report']}"
    assert predicted <= budget, numbers
    assert peak <= budget * (1 + NOISE), numbers
    assert 0.85 <= peak / predicted <= 1.15, numbers
    assert 0.85 <= dp / dp_predicted <= 1.15, numbers
