"""globalview.auto_parallel on real processes: the three models of examples/globalview/_models.py (a wide MLP,
a deep narrow MLP, a small GPT; float64, small sizes) planned at 2 ranks and on a 2 x 2 mesh, trained 20 AdamW
steps against single-process torch (rtol 1e-5); the plan explained, saved, loaded and applied to a fresh module
without searching; a memory budget; the errors; the example script (in the same ranks); the benchmark's smoke run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("wide mlp", "deep mlp", "gpt")
STEPS = 20
RTOL = 1e-5


def _setup(mesh: list) -> tuple:
    sys.path.insert(0, str(ROOT / "examples" / "globalview"))
    import _models
    import torch

    import commlib
    import globalview as gv

    torch.set_num_threads(1)
    pl = gv.placement("cpu", mesh)
    return torch, gv, commlib, _models, pl


def _train(torch, gv, pl, ref, net, batches, me) -> list[tuple[float, float]]:
    """Losses of ``ref`` (whole batches, local) and ``net`` (this rank's parts) over the batches, AdamW."""
    n = len(pl.flat)
    o1, o2 = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(net.parameters(), lr=1e-2)
    out = []
    for b in batches:
        l1 = ref(*b)
        o1.zero_grad(), l1.backward(), o1.step()
        parts = tuple(
            gv.to_global(t[me * (len(t) // n) : (me + 1) * (len(t) // n)], pl, (gv.sbp.split(0),) * pl.ndim) for t in b
        )
        l2 = net(*parts)
        o2.zero_grad(), l2.backward(), o2.step()
        out.append((l1.item(), l2.item()))
    return out


def _params_match(gv, commlib, ref, net) -> float:
    """The largest relative difference of every parameter's part from torch's (no communication)."""
    from globalview._layout import block

    worst = 0.0
    want = ref.state_dict()
    for name, value in gv.nn.state_dict(net).items():
        coords = value.placement.coords(commlib.get_rank())
        part = want[name].numpy()[
            tuple(slice(lo, hi) for lo, hi in block(value.shape, value.placement.hierarchy, value.sbp, coords))
        ]
        got = value.to_local().numpy()
        worst = max(worst, float(np.max(np.abs(got - part) / (np.abs(part) + 1e-3))))
    return worst


def trains_job(mesh: list, models: tuple[str, ...]) -> dict:
    """Each model: planned, 20 steps against torch; losses and parameters compared on every rank."""
    torch, gv, commlib, M, pl = _setup(mesh)
    me, out = commlib.get_rank(), {}
    for name in models:
        ref, net = M.make(name, "smoke", torch.float64), M.make(name, "smoke", torch.float64)
        batches = [M.batch(ref, 4 * len(pl.flat), s, torch.float64) for s in range(STEPS)]
        first = tuple(t[me * 4 : (me + 1) * 4] for t in batches[0])
        gv.auto_parallel(net, pl, first)
        losses = _train(torch, gv, pl, ref, net, batches, me)
        plan = gv.explain(net)
        out[name] = {"losses": losses, "params": _params_match(gv, commlib, ref, net), "layouts": plan.layouts}
    return out


def _check_trains(results: list[dict]) -> None:
    for r in results:
        for name, got in r.items():
            ref, net = np.array(got["losses"]).T
            np.testing.assert_allclose(net, ref, rtol=RTOL, err_msg=name)
            assert got["params"] < RTOL, (name, got["params"])
    assert all(r[n]["layouts"] == results[0][n]["layouts"] for r in results for n in r), "ranks planned differently"


def test_auto_parallel_trains_like_torch_at_2_ranks() -> None:
    results = run(trains_job, 2, [0, 1], MODELS, timeout=300)
    _check_trains(results)


def test_auto_parallel_trains_like_torch_on_a_2x2_mesh() -> None:
    results = run(trains_job, 4, [[0, 1], [2, 3]], MODELS, timeout=300)
    _check_trains(results)


def plan_job(tmp: str) -> dict:
    """The plan explained, saved, loaded and applied to a fresh module (no trace: the same losses);
    a budget below data parallel's memory; an impossible budget; the errors."""
    torch, gv, commlib, M, pl = _setup([0, 1])
    from globalview import _auto

    me, out = commlib.get_rank(), {}
    net = M.make("gpt", "smoke", torch.float64)
    batches = [M.batch(net, 8, s, torch.float64) for s in range(3)]
    sample = tuple(t[me * 4 : (me + 1) * 4] for t in batches[0])
    gv.auto_parallel(net, pl, sample)
    plan = gv.explain(net)
    out["report"] = str(plan)
    path = Path(tmp) / "plan.json"
    plan.save(path)
    traces = []
    original = _auto.trace
    _auto.trace = lambda *a: traces.append(a) or original(*a)
    fresh = gv.auto_parallel(M.make("gpt", "smoke", torch.float64), pl, None, plan=gv.AutoPlan.load(path))
    _auto.trace = original
    ref = M.make("gpt", "smoke", torch.float64)
    a = _train(torch, gv, pl, ref, net, batches, me)
    b = _train(torch, gv, pl, M.make("gpt", "smoke", torch.float64), fresh, batches, me)
    out["replayed"] = {"same losses": [x[1] for x in a] == [x[1] for x in b], "traced": len(traces)}
    dp = plan.alternatives["data parallel"]["memory"]
    tight = M.make("wide mlp", "smoke", torch.float64)
    first = tuple(t[me * 4 : (me + 1) * 4] for t in M.batch(tight, 8, 0, torch.float64))
    loose = gv.explain(gv.auto_parallel(M.make("wide mlp", "smoke", torch.float64), pl, first))
    budget = 0.9 * loose.alternatives["data parallel"]["memory"]
    chosen = gv.explain(gv.auto_parallel(tight, pl, first, budget))
    out["budget"] = {"fits": chosen.memory <= budget, "dp over": loose.alternatives["data parallel"]["memory"] > budget}
    out["budget numbers"] = (budget, chosen.memory, chosen.report)
    out["errors"] = _errors(torch, gv, pl, M, first)
    out["dp"] = dp
    out["example"] = _example()
    return out


def _example() -> list[str]:
    """examples/globalview/auto_parallel.py, run in these ranks (as the other examples' tests do)."""
    import contextlib
    import io
    import runpy

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        runpy.run_path(str(ROOT / "examples" / "globalview" / "auto_parallel.py"))
    return text.getvalue().splitlines()


def _errors(torch, gv, pl, M, first) -> dict[str, str]:
    out = {}
    cases = {
        "module": lambda: gv.auto_parallel("not a module", pl, first),
        "placement": lambda: gv.auto_parallel(M.make("wide mlp", "smoke"), [0, 1], first),
        "budget": lambda: gv.auto_parallel(M.make("wide mlp", "smoke"), pl, first, -5),
        "states": lambda: gv.auto_parallel(M.make("wide mlp", "smoke"), pl, first, optimizer_states=3),
        "input": lambda: gv.auto_parallel(M.make("wide mlp", "smoke"), pl, ("x",)),
        "impossible": lambda: gv.auto_parallel(M.make("wide mlp", "smoke", torch.float64), pl, first, 1000),
        "twice": lambda: gv.auto_parallel(gv.nn.to_global(M.make("wide mlp", "smoke"), pl), pl, first),
    }
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_plan_explained_saved_applied_budgeted(tmp_path: Path) -> None:
    got = run(plan_job, 2, str(tmp_path), timeout=300)[0]
    report = got["report"]
    assert "exact search over" in report and "blocks.0.q" in report, report
    for alt in ("automatic", "data parallel", "fully sharded", "tensor parallel"):
        assert alt in report, report
    assert got["replayed"] == {"same losses": True, "traced": 0}, got["replayed"]
    assert got["budget"] == {"fits": True, "dp over": True}, got["budget numbers"]
    e = got["errors"]
    assert e["module"].startswith("TypeError") and "must be a torch.nn.Module, got str" in e["module"]
    assert e["placement"].startswith("TypeError") and "globalview.placement" in e["placement"]
    assert e["budget"].startswith("ValueError") and "memory_per_rank must be a positive number" in e["budget"]
    assert e["states"].startswith("ValueError") and "optimizer_states must be 0, 1 or 2" in e["states"]
    assert e["input"].startswith("TypeError") and "item 0 is str" in e["input"]
    assert e["impossible"].startswith("ValueError") and "no plan fits memory_per_rank=1,000 bytes" in e["impossible"]
    assert e["twice"].startswith("ValueError") and "global already" in e["twice"]
    lines = got["example"]
    steps = [line.split() for line in lines if line.startswith("step ")]
    assert len(steps) == 5, lines
    for words in steps:  # "step i loss L single S"
        np.testing.assert_allclose(float(words[3]), float(words[5]), rtol=RTOL)
    assert any("exact search over" in line for line in lines) and "the saved plan" in lines[-1], lines
