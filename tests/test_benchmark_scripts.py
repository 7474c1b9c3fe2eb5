"""Every script in benchmarks/ runs in its smoke mode: they are how speed is measured, so they must not rot.

The scripts are found in the folder: each runs with ``--smoke`` (a few sizes, one round, tiny models: seconds)
and must exit 0 and print every row ROWS says it promises, as many times as it says. A new script needs a smoke
mode and an entry in ROWS, or this test fails. Scripts that can write their rows to a file (``--json``) do it too.
Nothing here looks at a time.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from jobs import ROOT, clean_env, run_job
from ports import free_port

SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
SIZES = (8, 1 << 20)  # the smoke runs' sizes, in bytes
NUM = r"-?\d+\.\d+"  # a time or a ratio: any value
SOME = range(1, 100)  # as many lines as the script chooses, at least one

PAIRS = (  # collectives_vs_mpi4py.py's rows (barrier: its own)
    "all_reduce", "all_reduce_oop", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
    "all_to_all_uneven", "gather", "scatter", "send_recv",
)  # fmt: skip
CALLS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "all_to_all_uneven")  # compare.py
TORCH_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
EMULATED = ("all_reduce", "broadcast", "all_gather_into_tensor")
BOXING = (r"S\(0\) -> B", "P -> B", r"S\(0\) -> S\(1\)", r"P -> S\(0\)")
DDP = ("single process", r"single \+ all_reduce", "commlib DDP", r"torch DDP \(gloo\)")
TORCH_DDP = (r"torch DDP \(commlib\)", r"torch DDP \(gloo\)", "commlib ddp")
GV_TRAIN = ("single process", "commlib DDP", "gv data parallel", "gv tensor parallel")
GV_MODELS = ("wide mlp", "deep mlp", "gpt")
GV_PLANS = ("automatic", "data parallel", "fully sharded", "tensor parallel")

# script -> {a regular expression that whole lines of its output match: how many lines match it}
ROWS: dict[str, dict[str, int | range]] = {
    # "         8      51.82      56.23    4584.52    1.085x    81.5x": mpi4py, commlib, gloo; 2 ratios
    "allreduce_vs_mpi4py.py": {rf" +{size}( +{NUM}){{3}} +{NUM}x +{NUM}x": 1 for size in SIZES}
    | {rf"# at >= 1 MiB: worst commlib/mpi4py = {NUM}x over 1 sizes": 1},
    # "S(0) -> B             1.84        2.87      0.641x"
    "boxing.py": {rf"{name} +{NUM} +{NUM} +{NUM}x": 1 for name in BOXING},
    # "          all_reduce    1048576    30054.59   24099.42   0.802x"; the barrier once: it has no size
    "collectives_vs_mpi4py.py": {rf" *{name} +{size} +{NUM} +{NUM} +{NUM}x": 1 for name in PAIRS for size in SIZES}
    | {rf" *barrier +- +{NUM} +{NUM} +{NUM}x": 1, " *barrier .*": 1},
    # a block per collective, "## all_reduce" then "      8  51.82  56.23  4584.52  2079.15  1.085x  81.539x  36.979x"
    # (mpi4py, commlib, gloo, nccl-emu; 3 ratios), then the summary "#   all_reduce  commlib/mpi4py  1.085x  1.065x  -"
    "compare.py": {f"## {name}": 1 for name in CALLS}
    | {rf" +{size}( +{NUM}){{4}}( +{NUM}x){{3}}": len(CALLS) for size in SIZES}
    | {
        rf"#   {name} +{pair} +{NUM}x +{NUM}x +-": 1
        for name in CALLS
        for pair in ("commlib/mpi4py", "gloo/commlib", "nccl-emu/commlib")
    },
    # "commlib DDP             20.3      20.3    20.339x        0.568x", and where its step goes
    "ddp_step.py": {rf"{name} +{NUM} +{NUM} +{NUM}x +{NUM}x": 1 for name in DDP}
    | {rf"# commlib DDP breakdown \(rank 0, mean of 1 steps, ms\): forward {NUM}, .* during backward": 1},
    # "all_reduce                 1048576     4020.5     4351.7     4354.7        0": median, p99, max, stalls
    "emulator_latency.py": {rf"{name} +{size}( +{NUM}){{3}} +\d+": 1 for name in EMULATED for size in SIZES},
    # one line per path, then the --at block against HEAD: "device    path: this checkout  10.42 us, HEAD ..."
    "nccl_overhead.py": {
        rf"nccl backend host overhead per all_reduce, {path} path: median {NUM} us \(target <= 5 us\)": 1
        for path in ("emulated", "device")
    }
    | {rf"{path} +path: this checkout +{NUM} us, HEAD +{NUM} us, ratio {NUM}": 1 for path in ("emulated", "device")},
    # "all_reduce           1 MiB      660.2    10428.4        0.063x", "commlib ddp  9.9  0.707x of torch DDP (gloo)"
    "torch_backend.py": {rf"{op} +{size} +{NUM} +{NUM} +{NUM}x": 1 for op in TORCH_OPS for size in ("8 B", "1 MiB")}
    | {rf"{name} +{NUM} +{NUM}x of torch DDP \(gloo\)": 1 for name in TORCH_DDP},
    # " commlib      3      0.215      0.262       0.301  1/1" (api, ranks; detection, agreement, first good call);
    # "commlib shrink + warm spare, killed   41.20    1.93    0.2485  yes" (wall, lost, loss, same weights)
    "recovery.py": {rf" +{api} +3 +{NUM} +{NUM} +{NUM}  1/1": 1 for api in ("commlib", "torch")}
    | {rf"commlib shrink \+ warm spare, {run} +{NUM} +(-|{NUM}) +{NUM}  yes": 1 for run in ("uninterrupted", "killed")}
    | {rf"# commlib shrink \+ warm spare: final loss killed/uninterrupted = {NUM}x; walls u {NUM}, k {NUM}": 1}
    | {rf"# commlib shrink \+ warm spare: training loop {NUM} s uninterrupted, {NUM} s killed: -?{NUM} s lost": 1},
    # The globalview benchmarks (their smoke modes are their authors'): every method, every fully sharded batch
    "gv_train.py": {rf"{name} +{NUM} +{NUM} +{NUM}x +{NUM}x": 1 for name in GV_TRAIN}
    | {"# fully sharded .*": 1, rf"\d+ +{NUM} +{NUM} +{NUM}x +{NUM} +{NUM}x +{NUM}x .*": SOME, "# floor: .*": 1},
    # per model "## gpt (2 ranks, smoke): 8 samples per rank", a row per plan, the plan under a memory budget
    "gv_auto.py": {rf"## {model} \(2 ranks, smoke\): .*": 1 for model in GV_MODELS}
    | {rf"{plan} +{NUM} .*": SOME for plan in GV_PLANS}
    | {"budget .*": len(GV_MODELS), "# targets: .*": len(GV_MODELS)},
}
TORCH = {
    "allreduce_vs_mpi4py.py",
    "compare.py",
    "ddp_step.py",
    "torch_backend.py",
    "gv_train.py",
    "gv_auto.py",
    "recovery.py",
}
JSON = {"allreduce_vs_mpi4py.py", "collectives_vs_mpi4py.py", "compare.py", "ddp_step.py"}  # take --json FILE


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run_prints_every_row(script: str, tmp_path: Path) -> None:
    assert script in ROWS, f"benchmarks/{script}: add the rows its --smoke run prints to ROWS in {__file__}"
    if script in TORCH:
        pytest.importorskip("torch")
    argv = ["--smoke", *(["--json", str(tmp_path / "rows.json")] if script in JSON else [])]
    argv += ["--png", str(tmp_path / "compare.png")] if script == "compare.py" else []
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # this tree's packages
    env = clean_env(PYTHONPATH=path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = run_job([sys.executable, f"benchmarks/{script}", *argv], timeout=240, env=env)
    assert done.returncode == 0, done.tail()
    lines = done.stdout.splitlines()
    for pattern, want in ROWS[script].items():
        found = [line for line in lines if re.fullmatch(pattern, line)]
        assert len(found) in (want if isinstance(want, range) else [want]), (
            f"{len(found)} lines match {pattern!r}, expected {want}\n{done.tail()}"
        )
    if script in JSON:
        assert json.loads((tmp_path / "rows.json").read_text()), done.tail()
    if script == "compare.py":  # the plot: drawn, or a line saying why not
        assert (tmp_path / "compare.png").is_file() or "# no plot: matplotlib is not installed" in done.stdout
