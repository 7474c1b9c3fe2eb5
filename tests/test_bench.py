"""``python -m commlib.bench``: nccl-tests' table, its numbers, the #wrong check, the files, the flags.

The pure parts (layouts, formats, inputs) are checked in process against
nccl-tests' own numbers; the rest runs real jobs (2 to 4 ranks, small sizes,
few iterations). No test asserts a time.
"""

from __future__ import annotations

import csv
import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from commlib.bench import _data
from commlib.bench._cli import parse_args
from commlib.bench._report import Measure, Row, format_row, header_line, titles
from commlib.bench._specs import COLLECTIVES, DATATYPES, OPS, layout, parse_size, sweep
from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]

# nccl-tests' own lines (all_reduce_perf -b 8 -e 128M -f 2), as shared/reference/nccl-tests-output.md quotes them.
NCCL_TESTS = """\
# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 1 iters: 20 agg iters: 1 validation: 1 graph: 0
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1     5.63    0.00    0.00      0     5.20    0.00    0.00      0
     1048576        262144     float     sum      -1    105.9    9.90   17.33      0    105.7    9.92   17.37      0
"""  # noqa: E501
COLUMN_NAMES = ["size", "count", "type", "redop", "root", *["time", "algbw", "busbw", "#wrong"] * 2]
FACTORS = {"2(n-1)/n": lambda n: 2 * (n - 1) / n, "(n-1)/n": lambda n: (n - 1) / n, "1": lambda n: 1.0}
NCCL_FACTOR = {  # nccl-tests' PERFORMANCE.md
    "all_reduce": "2(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "all_gather": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "gather": "(n-1)/n",
    "scatter": "(n-1)/n",
    "broadcast": "1",
    "reduce": "1",
    "sendrecv": "1",
}


def _bench(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m commlib.bench ARGS`` as a user types it (it starts its own ranks)."""
    return subprocess.run(
        [sys.executable, "-m", "commlib.bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "COMMLIB_NCCL_EMULATOR": "0", **(env or {})},
    )


def _sections(stdout: str) -> dict[str, list[list[str]]]:
    """Table rows (split into fields) by collective; asserts each section's title lines are nccl-tests'."""
    lines, out, name = stdout.splitlines(), {}, None
    for i, line in enumerate(lines):
        if line.startswith("# Collective test: "):
            name = line.split()[3]
            assert lines[i + 1 : i + 4] == NCCL_TESTS.splitlines()[1:4]
            out[name] = []
        elif not line.startswith("#"):
            out[name].append(line.split())
    return out


# --- nccl-tests' layout, sizes and formats (in process) ---


def test_title_and_header_lines_are_nccl_tests() -> None:
    ref = NCCL_TESTS.splitlines()
    assert header_line(8, 128 << 20, 2, 1 << 20, 1, 20, 1) == ref[0]
    assert titles() == ref[1:4]
    assert titles()[1].split()[1:] == COLUMN_NAMES


def test_rows_are_formatted_as_nccl_tests() -> None:
    ref = NCCL_TESTS.splitlines()
    small = Row("all_reduce", 8, 2, "float", "sum", -1, Measure(5.63, 0.0, 0.0, 0), Measure(5.2, 0.0, 0.0, 0))
    oop, ip = Measure(105.9, 9.9, 17.33, 0), Measure(105.7, 9.92, 17.37, 0)
    big = Row("all_reduce", 1 << 20, 262144, "float", "sum", -1, oop, ip)
    assert [format_row(small), format_row(big)] == ref[4:6]
    slow = Row("gather", 0, 0, "bfloat16", "none", 3, Measure(12345.6, 0, 0, None), Measure(12.0, 0, 0, 7))
    want = (
        "           0             0  bfloat16    none       3"
        + "    12346    0.00    0.00    N/A    12.00    0.00    0.00      7"
    )
    assert format_row(slow) == want


@pytest.mark.parametrize(
    ("name", "nbytes", "itemsize", "n", "counts"),
    [  # (send, recv, param = the "count" column, in-place send offset, in-place recv offset), per nccl-tests
        ("all_reduce", 1 << 20, 4, 3, (262144, 262144, 262144, 0, 0)),
        ("all_gather", 1 << 20, 4, 3, (87380, 262140, 87380, 87380, 0)),
        ("all_gather", 8, 4, 2, (0, 0, 0, 0, 0)),
        ("reduce_scatter", 1 << 20, 2, 4, (524288, 131072, 131072, 0, 131072)),
        ("all_to_all", 1000, 8, 3, (120, 120, 40, 0, 0)),  # 125 elements: 41 per rank, even: 40
        ("gather", 4096, 1, 3, (1360, 4080, 1360, 1360, 0)),
        ("scatter", 4096, 1, 3, (4080, 1360, 1360, 0, 1360)),
        ("broadcast", 100, 8, 2, (12, 12, 12, 0, 0)),
        ("sendrecv", 64, 4, 4, (16, 16, 16, 0, 0)),
    ],
)
def test_buffer_layouts_follow_nccl_tests(name: str, nbytes: int, itemsize: int, n: int, counts: tuple) -> None:
    lay = layout(name, nbytes, itemsize, n)
    assert (lay.send_count, lay.recv_count, lay.param_count, lay.send_offset, lay.recv_offset) == counts


def test_sizes_sweep_and_suffixes() -> None:
    assert [parse_size(s) for s in ("8", "64K", "32M", "1G", "1.5k")] == [8, 65536, 32 << 20, 1 << 30, 1536]
    assert sweep(8, 128, 2, 0) == [8, 16, 32, 64, 128]
    assert sweep(1 << 20, 3 << 20, 1, 1 << 20) == [1 << 20, 2 << 20, 3 << 20]
    assert sweep(32 << 20, 32 << 20, 1, 1 << 20) == [32 << 20]  # the defaults: one size


def test_bus_factors_are_nccl_tests() -> None:
    for n in (1, 2, 3, 4, 8):
        assert {c: COLLECTIVES[c].bus_factor(n) for c in NCCL_FACTOR} == {
            c: FACTORS[f](n) for c, f in NCCL_FACTOR.items()
        }


# --- the check's inputs are exact and its comparison real (in process) ---


@pytest.mark.parametrize("tname", list(DATATYPES))
def test_reductions_of_the_inputs_are_exact_in_any_order(tname: str) -> None:
    """The dtype's own arithmetic, ranks combined last-to-first, gives ``reduced`` bit for bit."""
    dtype = DATATYPES[tname]
    for opname, op in OPS.items():
        for n in (1, 2, 3, 4):
            parts = [_data.inputs(op, dtype, 7, r, n, 100, 500) for r in reversed(range(n))]
            acc = parts[0].copy()
            for p in parts[1:]:
                acc = {"sum": acc + p, "avg": acc + p, "prod": acc * p, "max": np.maximum(acc, p)}.get(
                    opname, np.minimum(acc, p)
                ).astype(dtype)
            if opname == "avg":  # integers: truncated toward zero, as NCCL's
                acc = (acc.astype(np.float64) / n).astype(dtype) if dtype.kind not in "iu" else acc // n
            want = _data.reduced(op, dtype, 7, n, 100, 500)
            assert _data.count_wrong(acc, want, _data.tolerance(op, dtype)) == 0, (opname, n)


def test_count_wrong_counts_each_corrupted_element() -> None:
    for dtype in DATATYPES.values():
        want = _data.inputs(None, dtype, 3, 1, 2, 0, 64)
        assert _data.count_wrong(want.copy(), want) == 0
        assert _data.count_wrong(_data.corrupt(want, 5), want) == 5
        assert _data.count_wrong(_data.corrupt(want, 5), want, tol=2) == 5  # avg's tolerance still catches it


def test_inputs_differ_between_ranks_and_seeds() -> None:
    """Data sent to the wrong rank, or stale data from an earlier check, would be caught."""
    a = _data.inputs(None, np.dtype(np.float32), 5, 0, 2, 0, 1000)
    assert np.mean(a != _data.inputs(None, np.dtype(np.float32), 5, 1, 2, 0, 1000)) > 0.95
    assert np.mean(a != _data.inputs(None, np.dtype(np.float32), 6, 0, 2, 0, 1000)) > 0.95


# --- real jobs ---


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_collective_reports_nccl_tests_columns_and_bus_factor(n: int, tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = _bench("all", "--nproc", str(n), "-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    sections = _sections(proc.stdout)
    assert list(sections) == list(COLLECTIVES)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * len(COLLECTIVES)
    for i, (row, fields) in enumerate(zip(rows, [f for s in sections.values() for f in s], strict=True)):
        coll, lay = COLLECTIVES[row["collective"]], layout(row["collective"], (4096, 16384)[i % 2], 4, n)
        assert len(fields) == len(COLUMN_NAMES) and format_row(Row.from_flat(row)).split() == fields
        assert (row["size"], row["count"], row["type"]) == (lay.size_bytes(4), lay.param_count, "float")
        assert (row["redop"] == "none") != coll.reduces and (row["root"] == -1) != coll.rooted
        for half in ("oop", "ip"):
            assert row[f"{half}_busbw"] == pytest.approx(row[f"{half}_algbw"] * FACTORS[NCCL_FACTOR[coll.name]](n))
            assert row[f"{half}_algbw"] == pytest.approx(row["size"] / row[f"{half}_time_us"] / 1e3)
        assert row["oop_wrong"] == 0 and row["ip_wrong"] == (None if coll.name == "sendrecv" else 0)
    assert proc.stdout.count("# Out of bounds values : 0 OK") == len(COLLECTIVES)


@pytest.mark.parametrize("emulator", [False, True], ids=["mpi", "nccl-emulator"])
def test_wrong_results_are_counted_and_right_ones_are_not(emulator: bool) -> None:
    env = {"COMMLIB_NCCL_EMULATOR": "1" if emulator else "0"}
    every = ("all", "--nproc", "3", "-b", "1K", "-e", "1K", "-n", "1")
    bad = _bench(*every, "--corrupt", "2", env=env)
    assert bad.returncode == 1, bad.stderr
    for name, rows in _sections(bad.stdout).items():
        assert [r[8] for r in rows] == ["2"], name  # the last rank flipped 2 elements of its output
        assert [r[12] for r in rows] == ["N/A" if name == "sendrecv" else "2"], name
    # nccl-tests counts measurements with wrong values: here out-of-place and in-place on the last rank
    assert bad.stdout.count("# Out of bounds values : 2 FAILED") == len(COLLECTIVES) - 1
    assert bad.stdout.count("# Out of bounds values : 1 FAILED") == 1  # sendrecv: in-place is not checked
    good = _bench(*every[:2], "2", *every[3:], "-d", "all", "-o", "all", env=env)
    assert good.returncode == 0, good.stderr
    wrong = [r[i] for rows in _sections(good.stdout).values() for r in rows for i in (8, 12)]
    # 3 reducing collectives x 10 types x 5 ops (avg on integers too), 6 others x 10 types; 2 cells a row
    assert len(wrong) == 2 * (3 * 10 * 5 + 6 * 10) and set(wrong) == {"0", "N/A"}
    assert "nccl" in good.stderr if emulator else "emulator" not in good.stderr


def test_json_and_csv_hold_the_table_and_progress_stays_on_stderr(tmp_path: Path) -> None:
    j, c = tmp_path / "r.json", tmp_path / "r.csv"
    proc = _bench(
        "reduce",
        "gather",
        "--nproc",
        "2",
        "-b",
        "64",
        "-e",
        "4K",
        "-f",
        "4",
        "-n",
        "2",
        "-r",
        "1",
        "--progress",
        "on",
        "--json",
        str(j),
        "--csv",
        str(c),
    )
    assert proc.returncode == 0, proc.stderr
    table = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    doc = json.loads(j.read_text())
    assert [format_row(Row.from_flat(r)) for r in doc["rows"]] == table
    with open(c, newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == doc["columns"] and len(lines) == len(table) + 1
    assert [dict(zip(lines[0], v, strict=True)) for v in lines[1:]] == [
        {k: "N/A" if v is None else str(v) for k, v in r.items()} for r in doc["rows"]
    ]
    assert doc["nranks"] == 2 and doc["backend"] == "mpi" and len(doc["devices"]) == 2
    assert [s["out_of_bounds"] for s in doc["sections"]] == [0, 0]
    assert "[1/8] reduce float sum root 1: 64 B" in proc.stderr and "[8/8] gather float none root 1" in proc.stderr
    assert "\r" not in proc.stdout and "[1/" not in proc.stdout and "\x1b" not in proc.stdout


def test_progress_is_on_by_default_when_stderr_is_a_terminal() -> None:
    """The launcher sees the terminal (its ranks only see pipes) and turns progress on; stdout stays clean."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "commlib.bench", "-b", "1K", "-e", "4K", "-f", "4", "-n", "1"],
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ, "COMMLIB_NCCL_EMULATOR": "0"},
        )
        os.close(follower)
        terminal = b""
        while select.select([leader], [], [], 0.5)[0]:
            try:
                terminal += os.read(leader, 65536)
            except OSError:  # the other end is closed and drained
                break
    finally:
        os.close(leader)
    assert proc.returncode == 0
    assert b"[2/2] all_reduce float sum: 4096 B" in terminal
    assert "\r" not in proc.stdout and "[1/" not in proc.stdout and "# Avg bus bandwidth" in proc.stdout


def test_plot_is_a_png_or_a_clear_error(tmp_path: Path) -> None:
    png = tmp_path / "busbw.png"
    proc = _bench("all_reduce", "all_gather", "-b", "8", "-e", "64K", "-f", "8", "-n", "2", "--plot", str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert proc.returncode == 2 and "--plot: needs matplotlib" in proc.stderr and not png.exists()
    else:
        assert proc.returncode == 0, proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(SystemExit):
        parse_args(["--plot", "x.png"])
    assert "argument --plot: needs matplotlib, which is not installed" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-b", "lots"], "argument -b/--minbytes: expected a size like 8, 64K, 32M or 1G, got 'lots'"),
        (["-b", "1M", "-e", "1K"], "argument -b/--minbytes: 1048576 is larger than -e/--maxbytes 1024"),
        (["-b", "8", "-e", "1K", "-f", "1", "-i", "0"], "argument -i/--stepbytes: the sweep would never end"),
        (["-d", "float7"], "argument -d/--datatype: unknown datatype 'float7'; choose from int8,"),
        (["-o", "xor"], "argument -o/--op: unknown op 'xor'; choose from sum, prod, max, min, avg or all"),
        (["alltoallv"], "argument collective: unknown collective 'alltoallv'"),
        (["-n", "0"], "argument -n/--iters: must be at least 1, got 0"),
        (["-w", "x"], "argument -w/--warmup_iters: expected an integer, got 'x'"),
        (["-r", "2", "--nproc", "2"], "argument -r/--root: 2 is not a rank of 2 (--nproc)"),
        (["-a", "4"], "argument -a/--average: invalid choice: 4"),
        (["-g", "8"], "argument -g/--ngpus: commlib runs one rank per process"),
        (["--backend", "gloo"], "argument --backend: invalid choice: 'gloo'"),
        (["--json", "/no/such/dir/x.json"], "argument --json: directory of '/no/such/dir/x.json' does not exist"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_nccl_tests_names_and_aliases_are_accepted() -> None:
    ns = parse_args(["all_gather_perf", "--collective", "alltoall", "-d", "fp16", "-o", "all", "-r", "all", "-t", "1"])
    assert (ns.collective, ns.more, ns.datatype, ns.op, ns.root) == (["all_gather"], ["all_to_all"], "half", "all", -1)


def _bench_main(argv: list[str]) -> int:
    """One rank of a job started by someone else (here commlib.testing): the bench joins it."""
    from commlib.bench import main

    return main(argv)


def test_inside_a_launched_job_it_uses_that_job() -> None:
    assert run(_bench_main, 3, ["broadcast", "-b", "1K", "-e", "1K", "-n", "1", "-r", "all"], timeout=60) == [0] * 3
    assert run(_bench_main, 2, ["-r", "5"], timeout=60) == [2, 2]  # every rank refuses, none hangs
    assert run(_bench_main, 2, ["--nproc", "3"], timeout=60) == [2, 2]
