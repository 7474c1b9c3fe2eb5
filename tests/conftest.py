"""Shared test settings: every multi-rank job gets a short collective timeout, and a temporary folder of the
session's own (the flight recorder dumps of the failure scenarios go there, not in /tmp for good)."""

import os
import shutil
import tempfile

# Collectives in tests time out after 20 s unless a test sets its own (the harness's deadline is longer).
os.environ.setdefault("COMMLIB_TIMEOUT", "20")

_SESSION_TMP = tempfile.mkdtemp(prefix="commlib-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = _SESSION_TMP  # every rank and launcher the tests start inherits it


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0:  # a failed session keeps its folder (tmp_path, dumps) to look into
        shutil.rmtree(_SESSION_TMP, ignore_errors=True)
