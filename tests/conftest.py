"""Shared test settings: every multi-rank job gets a short collective timeout, and a temporary folder of the
session's own (the flight recorder dumps of the failure scenarios go there, not in /tmp for good).

Warm ranks: in a module marked ``pytestmark = pytest.mark.warm_ranks``, ``commlib.testing.run`` reuses one job
of warm ranks per (world size, environment) for the whole module (:func:`commlib.testing.warm_ranks`: each
module imported, and MPI initialised, once per rank rather than once per call); a test marked
``fresh_ranks`` starts new processes for each of its calls. ``--fresh-ranks`` turns warm ranks off for the
session (every call a new job, as before).
"""

import os
import shutil
import tempfile

import pytest

from commlib.testing import fresh_ranks, warm_ranks

# Collectives in tests time out after 20 s unless a test sets its own (the harness's deadline is longer).
os.environ.setdefault("COMMLIB_TIMEOUT", "20")

_WARM: dict[str, tuple] = {}  # module -> (calls, jobs started, the jobs that retired) of its warm ranks

_SESSION_TMP = tempfile.mkdtemp(prefix="commlib-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = _SESSION_TMP  # every rank and launcher the tests start inherits it


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fresh-ranks",
        action="store_true",
        help="start new processes for every commlib.testing.run call, also in modules marked warm_ranks",
    )


@pytest.fixture(scope="module", autouse=True)
def _warm_ranks_for_the_module(request: pytest.FixtureRequest):
    if request.node.get_closest_marker("warm_ranks") is None or request.config.getoption("--fresh-ranks"):
        yield
        return
    with warm_ranks() as pools:
        yield
    _WARM[request.node.nodeid] = (pools.calls, pools.started, pools.retired)


@pytest.fixture(autouse=True)
def _fresh_ranks_for_the_test(request: pytest.FixtureRequest):
    if request.node.get_closest_marker("fresh_ranks") is None:
        yield
        return
    with fresh_ranks():
        yield


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line on the warm jobs (with -v: what ended each job that could not be reused)."""
    if not _WARM:
        return
    calls = sum(c for c, _, _ in _WARM.values())
    started = sum(s for _, s, _ in _WARM.values())
    retired = [(module, fn, why) for module, (_, _, r) in _WARM.items() for fn, why in r]
    terminalreporter.write_line(
        f"warm ranks: {calls} calls in {len(_WARM)} modules ran on {started} jobs; "
        f"{len(retired)} jobs could not be reused after a function that passed"
    )
    if config.getoption("verbose") > 0:
        for module, fn, why in retired:
            terminalreporter.write_line(f"  {module} {fn}: {why}")


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0:  # a failed session keeps its folder (tmp_path, dumps) to look into
        shutil.rmtree(_SESSION_TMP, ignore_errors=True)
