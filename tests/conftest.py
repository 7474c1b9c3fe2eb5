"""Shared test settings: every multi-rank job gets a short collective timeout, and a temporary folder of the
session's own (the flight recorder dumps of the failure scenarios go there, not in /tmp for good).

Warm ranks: in the modules marked ``pytestmark = pytest.mark.warm_ranks``, ``commlib.testing.run`` reuses warm
jobs, one per (world size, environment), shared by every such module of the session
(:func:`commlib.testing.warm_ranks`: a module, torch and MPI are loaded once per job, not once per call); a test
marked ``fresh_ranks`` starts new processes for its calls, as every other module does. ``--fresh-ranks`` turns
warm ranks off (every call a new job).
"""

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from commlib.testing import fresh_ranks, warm_ranks

# Collectives in tests time out after 20 s unless a test sets its own (the harness's deadline is longer).
os.environ.setdefault("COMMLIB_TIMEOUT", "20")

_WARM: list = []  # the session's warm jobs (commlib.testing._pool.Pools), once they ended

# Under pytest-xdist each worker is a session of its own: its folder goes beside the controller's, not inside it
# (Ray's socket paths must stay under 107 bytes).
_BASE = os.environ.setdefault("TESTS_TMP_BASE", tempfile.gettempdir())
_SESSION_TMP = tempfile.mkdtemp(prefix="commlib-tests-", dir=_BASE)
os.environ["TMPDIR"] = tempfile.tempdir = _SESSION_TMP  # every rank and launcher the tests start inherits it

# globalview measures the machine once per (host, world, mesh) and keeps it in a file: one file for the whole run,
# shared by the xdist workers (a run measures afresh; its jobs, warm or not, and benchmark smoke runs share it).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or os.path.basename(_SESSION_TMP)
os.environ["GLOBALVIEW_CACHE"] = os.path.join(_BASE, f"commlib-tests-globalview-{_RUN}.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fresh-ranks",
        action="store_true",
        help="start new processes for every commlib.testing.run call, also in modules marked warm_ranks",
    )


@pytest.fixture(scope="session", autouse=True)
def _warm_ranks(request: pytest.FixtureRequest):
    """The session's warm jobs, shared by the modules marked warm_ranks."""
    if request.config.getoption("--fresh-ranks"):
        yield None
        return
    with warm_ranks() as pools:
        yield pools
    _WARM.append(pools)


@pytest.fixture(scope="module", autouse=True)
def _fresh_ranks_for_the_module(request: pytest.FixtureRequest, _warm_ranks):
    if request.node.get_closest_marker("warm_ranks") is not None:
        yield
        return
    with fresh_ranks():
        yield


@pytest.fixture(autouse=True)
def _fresh_ranks_for_the_test(request: pytest.FixtureRequest):
    if request.node.get_closest_marker("fresh_ranks") is None:
        yield
        return
    with fresh_ranks():
        yield


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess]:
    """``once_per_run(key, cmd, **kw)``: ``subprocess.run(cmd, capture_output=True, text=True, **kw)`` run once for
    the whole test run, its result shared by every test and every xdist worker that asks for ``key`` (a reference
    run several modules compare against: started once, not once per module and worker). The result lives in the
    run's own temporary folder, so a later run starts it again."""
    workers = os.environ.get("PYTEST_XDIST_WORKER") is not None
    shared = tmp_path_factory.getbasetemp().parent if workers else tmp_path_factory.getbasetemp()
    mine: dict[str, subprocess.CompletedProcess] = {}

    def run(key: str, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        if key in mine:
            return mine[key]
        path = Path(shared) / f"once-{key}.json"
        with open(f"{path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker running it: wait for its result
            if path.is_file():
                proc = subprocess.CompletedProcess(**json.loads(path.read_text()))
            else:
                proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
                record = {
                    "args": proc.args,
                    "returncode": proc.returncode,
                    "stdout": proc.stdout,
                    "stderr": proc.stderr,
                }
                path.write_text(json.dumps(record))
        mine[key] = proc
        return proc

    return run


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line on the warm jobs (with -v: what ended each job that could not be reused)."""
    for pools in _WARM:
        terminalreporter.write_line(
            f"warm ranks: {pools.calls} calls ran on {pools.started} jobs; {len(pools.retired)} could not be reused "
            f"after a function that passed, {pools.evicted} were stopped to make room"
        )
        if config.getoption("verbose") > 0:
            for fn, why in pools.retired:
                terminalreporter.write_line(f"  {fn}: {why}")


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0:  # a failed session keeps its folder (tmp_path, dumps) to look into
        shutil.rmtree(_SESSION_TMP, ignore_errors=True)
