"""Shared test settings: every multi-rank job gets a short collective timeout."""

import os

# Collectives in tests time out after 20 s unless a test sets its own (the harness's deadline is longer).
os.environ.setdefault("COMMLIB_TIMEOUT", "20")
