"""Ranks that disagree on a call never end silently: every mismatched program ends in an error naming the call.

The matrix: every collective and send/recv, x every disagreement (the size both ways and by one element, an extra
call on the root and on another rank, two calls in another order, the root, the dtype with the same and with other
byte counts, the reduce op) x 8 B, 64 KiB and 4 MiB x 2 and 4 ranks, on the mpi backend and on the nccl backend
(through the emulator). One job per world size runs every scenario on a group of its own, then the group's closing
check (what the program's end runs), on default settings. Each scenario must end with an error on at least one rank
that names the call, within the group's timeout + 5 s; none may end with every rank finished and the check passed
(an exit 0).

Separate jobs then run the programs the issue found ending with exit 0 (a recv into a larger buffer, a float32[2n]
against float64[n] sum, SUM against MAX, different roots, one extra 8-byte call, scatter against gather, two ranks
of four broadcasting once more): each must exit non-zero, naming the call.

``python tests/test_mismatch.py 2 [mpi|nccl]`` prints the matrix's table for 2 ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from commlib.testing import run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import BACKENDS

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

TIMEOUT = 2.0
SIZES = (8, 64 << 10, 4 << 20)
KINDS = (
    *("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"),
    *("barrier", "send_recv"),
)
#: the public call each kind makes (what an error must name)
CALLS = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_to_all": "all_to_all_single",
    "send_recv": "recv",
}
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
DISAGREEMENTS = (
    *("size up", "size down", "size +1", "extra on root", "extra on other", "order", "root"),
    *("dtype same bytes", "dtype other bytes", "op"),
)


def applies(kind: str, what: str) -> bool:
    """Whether a disagreement is one a call of ``kind`` can have."""
    if kind == "barrier":
        return what in ("extra on root", "extra on other", "order")
    if what == "root":
        return kind in ROOTED
    if what == "op":
        return kind in REDUCING
    return True


def _one(dist, g, kind: str, nbytes: int, dtype=np.float32, root: int = 0, op=None, scale: float = 1.0) -> None:  # type: ignore[no-untyped-def]
    """One call of ``kind`` on group ``g``: a buffer of about ``nbytes * scale`` bytes of ``dtype`` per rank."""
    n, r = g.size, dist.get_rank(g)
    dtype = np.dtype(dtype)
    count = max(int(nbytes * scale) // dtype.itemsize, 1) if scale != -1 else nbytes // dtype.itemsize + 1
    x = np.ones(count, dtype)
    op = dist.ReduceOp.SUM if op is None else op
    if kind == "all_reduce":
        dist.all_reduce(x, op, group=g)
    elif kind == "broadcast":
        dist.broadcast(x, src=root, group=g)
    elif kind == "reduce":
        dist.reduce(x, dst=root, op=op, group=g)
    elif kind == "all_gather":
        dist.all_gather_into_tensor(np.zeros(n * count, dtype), x, group=g)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(x, np.ones(n * count, dtype), op, group=g)
    elif kind == "all_to_all":
        dist.all_to_all_single(np.zeros(n * count, dtype), np.ones(n * count, dtype), group=g)
    elif kind == "gather":
        dist.gather(x, [np.zeros(count, dtype) for _ in range(n)] if r == root else None, dst=root, group=g)
    elif kind == "scatter":
        dist.scatter(x, [np.ones(count, dtype) for _ in range(n)] if r == root else None, src=root, group=g)
    elif kind == "barrier":
        dist.barrier(group=g)
    elif r == 0:  # send_recv: group rank 0 sends, rank 1 receives
        dist.send(x, 1, group=g)
    elif r == 1:
        dist.recv(x, 0, group=g)


def _program(dist, g, kind: str, what: str, nbytes: int) -> None:  # type: ignore[no-untyped-def]
    """What this rank runs in scenario (kind, what): the common program, or its own variant of it. The odd rank
    is the last one; the root is group rank 0 (send_recv: its sender; "other": its receiver)."""
    n, r = g.size, dist.get_rank(g)
    odd = r == (1 if kind == "send_recv" else n - 1)
    other = "broadcast" if kind == "all_reduce" else "all_reduce"
    if what in ("size up", "size down", "size +1"):
        scale = {"size up": 2.0, "size down": 0.5, "size +1": -1}[what] if odd else 1.0
        _one(dist, g, kind, nbytes, scale=scale)
    elif what in ("extra on root", "extra on other"):
        if r == 0 if what == "extra on root" else odd:
            _one(dist, g, kind, nbytes)
        _one(dist, g, other, 8)
    elif what == "order":
        first, second = ((kind, other) if not odd else (other, kind)) if kind != "send_recv" else (None, None)
        if kind == "send_recv":  # two messages of different sizes, received in the other order
            sizes = (nbytes, 2 * nbytes) if r == 0 else (2 * nbytes, nbytes)
            for size in sizes:
                _one(dist, g, kind, size)
        else:
            _one(dist, g, first, nbytes if first == kind else 8)
            _one(dist, g, second, nbytes if second == kind else 8)
    elif what == "root":
        _one(dist, g, kind, nbytes, root=1 % n if odd else 0)
    elif what == "dtype same bytes":  # float32[2k] against float64[k]
        _one(dist, g, kind, nbytes, dtype=np.float64 if odd else np.float32)
    elif what == "dtype other bytes":  # float32[k] against float64[k]
        _one(dist, g, kind, nbytes, dtype=np.float64 if odd else np.float32, scale=2.0 if odd else 1.0)
    else:  # op
        _one(dist, g, kind, nbytes, op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM)


def matrix_job(scenarios: list[tuple[str, str, int]]) -> list[tuple]:
    """Every scenario on a group of its own, then its closing check; this rank's (error type, message, seconds)."""
    import commlib as dist

    out = []
    for kind, what, nbytes in scenarios:
        g = dist.new_group(list(range(dist.get_world_size())), timeout=TIMEOUT)
        start = time.monotonic()
        outcome: tuple = ("", "", 0.0)
        try:
            _program(dist, g, kind, what, nbytes)
            g.close(TIMEOUT)  # what the program's end runs
        except Exception as e:
            outcome = (type(e).__name__, str(e), time.monotonic() - start)
        out.append(outcome)
        dist.barrier()  # every rank is done with the scenario: its group goes (no second check)
        dist.destroy_process_group(g)
    return out


def scenarios() -> list[tuple[str, str, int]]:
    return [(k, w, s) for k in KINDS for w in DISAGREEMENTS if applies(k, w) for s in SIZES]


#: The matrix runs in this many parts (each its own job): a parallel run (pytest -n) spreads them.
PARTS = 3


def _verdicts(n: int, backend: str = "mpi", part: int | None = None) -> list[tuple[tuple[str, str, int], list[tuple]]]:
    todo = scenarios() if part is None else scenarios()[part::PARTS]
    results = run(matrix_job, n, todo, timeout=1500, env=BACKENDS[backend])
    return [(sc, [results[r][i] for r in range(n)]) for i, sc in enumerate(todo)]


def _named(kind: str, message: str) -> bool:
    call = CALLS.get(kind, kind)
    return call in message or (kind == "send_recv" and "send" in message) or "closing check" in message


@pytest.mark.timeout(1500)  # the job's own deadline (4 ranks of the emulator on 2 loaded cores: minutes)
@pytest.mark.parametrize("part", range(PARTS))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("n", [2, 4])
def test_every_mismatched_program_ends_in_an_error_naming_the_call(n: int, backend: str, part: int) -> None:
    silent, unnamed, late = [], [], []
    verdicts = _verdicts(n, backend, part)
    for (kind, what, nbytes), ranks in verdicts:
        errors = [(t, m, s) for t, m, s in ranks if t]
        if not errors:
            silent.append((kind, what, nbytes))
        elif not any(_named(kind, m) for _, m, _ in errors):
            unnamed.append((kind, what, nbytes, errors[0][1][:300]))
        if max(s for _, _, s in ranks) > TIMEOUT + 5:
            late.append((kind, what, nbytes, [round(s, 1) for _, _, s in ranks]))
    assert silent == [], f"scenarios that ended without an error (exit 0): {silent}"
    assert unnamed == [], unnamed
    assert late == [], late
    # a rank that meets a peer's abort (nccl) names the peer that gave up and why, not only the engine's error
    aborted = [sc for sc, ranks in verdicts for t, m, _ in ranks if "aborted its communicator" in m]
    assert aborted == [], aborted
    # a message of another dtype of the same byte count is a mismatch, named on the receiving rank
    for (kind, what, nbytes), ranks in verdicts:
        if (kind, what) == ("send_recv", "dtype same bytes"):
            assert ranks[1][0] == "CollectiveMismatchError", (nbytes, ranks[1])


_PROGRAMS = {
    "recv into a larger buffer": """
        if r == 0: dist.send(np.ones(2, np.float32), 1)
        else: dist.recv(np.zeros(4, np.float32), 0)
        """,
    "recv of float64[n] from a send of float32[2n]": """
        if r == 0: dist.send(np.ones(2, np.float32), 1)
        else: dist.recv(np.zeros(1, np.float64), 0)
        """,
    "float32[2n] against float64[n], 64 KiB": """
        x = np.ones(16384, np.float32) if r == 0 else np.ones(8192, np.float64)
        dist.all_reduce(x)
        """,
    "SUM against MAX, 64 KiB": """
        dist.all_reduce(np.ones(16384, np.float32), dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX)
        """,
    "gather where rank 0 names root 1": """
        dst = 1 if r == 0 else 0
        dist.gather(np.ones(2, np.float32), [np.zeros(2, np.float32) for _ in range(n)] if r == dst else None, dst=dst)
        """,
    "reduce where rank 0 names root 1": """
        dist.reduce(np.ones(2, np.float32), dst=1 if r == 0 else 0)
        """,
    "one extra 8-byte broadcast": """
        if r == 0: dist.broadcast(np.ones(2, np.float32), 0)
        """,
    "one extra 8-byte scatter": """
        if r == 0: dist.scatter(np.ones(2, np.float32), [np.ones(2, np.float32)] * n, src=0)
        """,
    "one extra 8-byte send": """
        if r == 0: dist.send(np.ones(2, np.float32), 1)
        """,
    "one extra 8-byte gather": """
        if r == 1: dist.gather(np.ones(2, np.float32), dst=0)
        """,
    "one extra 8-byte reduce": """
        if r == 1: dist.reduce(np.ones(2, np.float32), dst=0)
        """,
    "scatter against gather": """
        if r == 0: dist.scatter(np.ones(2, np.float32), [np.ones(2, np.float32)] * n, src=0)
        else: dist.gather(np.ones(2, np.float32), dst=0)
        """,
    "ranks 0-1 of 4 broadcast 80 bytes before 128": """
        if r < 2: dist.broadcast(np.ones(20, np.float32), 0)
        dist.broadcast(np.ones(32, np.float32), 0)
        """,
}


@pytest.mark.parametrize("name", sorted(_PROGRAMS))
def test_the_programs_that_ended_silently_now_fail(name: str, tmp_path: Path) -> None:
    n = 4 if "of 4" in name else 2
    script = tmp_path / "program.py"
    body = textwrap.indent(textwrap.dedent(_PROGRAMS[name]).strip(), "    ")
    script.write_text(
        "import numpy as np\nimport commlib as dist\n\ndef main():\n    dist.init_process_group()\n"
        f"    r, n = dist.get_rank(), dist.get_world_size()\n{body}\n    print('finished', r, flush=True)\n\n"
        "main()\n"
    )
    env = {**os.environ, "COMMLIB_TIMEOUT": str(TIMEOUT)}
    cmd = [sys.executable, "-m", "commlib.launch", "--nproc_per_node", str(n), str(script)]
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    text = done.stdout + done.stderr
    assert done.returncode != 0, text
    assert "CollectiveMismatchError" in text or "CommTimeoutError" in text, text
    assert took < TIMEOUT + 30, took  # process start-up included


def _table(n: int, backend: str) -> str:
    rows = ["| call | disagreement | bytes | outcome (rank: error) | slowest (s) |", "| --- | --- | --- | --- | --- |"]
    for (kind, what, nbytes), ranks in _verdicts(n, backend):
        cells = [f"{r}: {t or 'ok'}" for r, (t, _, _) in enumerate(ranks)]
        rows.append(f"| {kind} | {what} | {nbytes} | {', '.join(cells)} | {max(s for _, _, s in ranks):.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(_table(int(sys.argv[1]) if len(sys.argv) > 1 else 2, sys.argv[2] if len(sys.argv) > 2 else "mpi"))
