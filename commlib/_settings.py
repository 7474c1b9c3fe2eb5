"""commlib's settings: every ``COMMLIB_*`` and ``GLOBALVIEW_*`` environment variable, read here and nowhere else.

:data:`TABLE` is the one list (docs/reliability.md prints it): each setting's variable, default, meaning and
whether it *shapes messages*; the variables the launcher and the test helper pass to their workers
(``plumbing``: the launcher's status folder, the job's monitor store, ...) are in it too, so that every read of
such a variable is here (``tests/test_settings.py`` forbids reads elsewhere; code that sets one for a child
process names it where it sets it). A setting that shapes messages decides which bytes go to which rank (the
compiled executor present and on, the size up to which a message carries its stamp inline, the piece size
of a large reduction, ...): every group's ranks exchange these when the group is created and take one
pattern all of them speak (:func:`commlib.backends.mpi.MpiBackend.agree`), so a rank whose environment or
install differs never leaves the others waiting for messages it will not send.

Values are read when commlib is imported (a test that needs another value starts a process with it), but
those a program may set after importing commlib, read when they are used (:func:`current`: ``COMMLIB_TIMEOUT``
when a default group is made, the test helper's worker state). ``ddp`` and ``globalview`` read theirs through
the public :func:`commlib.setting`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TABLE", "Setting", "current", "markdown", "value"]


@dataclass(frozen=True, slots=True)
class Setting:
    """One environment variable: its name, default (as text), parser, meaning and whether it shapes messages."""

    name: str
    default: str
    parse: Callable[[str], Any]
    doc: str
    shapes_messages: bool = False
    plumbing: bool = False  # set by the launcher or the test helper for its workers, not by users

    def read(self, env: Mapping[str, str]) -> Any:
        """The value in ``env`` (the default where unset or empty); ``ValueError`` naming the variable if bad."""
        text = env.get(self.name, "").strip() or self.default
        try:
            return self.parse(text)
        except ValueError as e:
            raise ValueError(f"{self.name}={text!r}: {e}") from None


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return text == "1"


def _bytes(text: str) -> int:
    n = int(text)
    if n < 0:
        raise ValueError("must be a number of bytes >= 0")
    return n


def _count(text: str) -> int:
    return _bytes(text)


def _seconds(text: str) -> float | None:
    if text == "none":
        return None
    s = float(text)
    if not s > 0 or s == float("inf"):
        raise ValueError("must be a positive number of seconds")
    return s


def _debug(text: str) -> bool:
    return text.upper() == "DETAIL"


def _text(text: str) -> str:
    return text


def _on_failure(text: str) -> str:
    if text not in ("", "abort", "continue", "replace"):
        raise ValueError("must be abort, continue or replace")
    return text


def _served(text: str) -> str:
    """ "" (not served: "0") or the "host:port" the job's store is served at."""
    if text == "0":
        return ""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("must be 0 or host:port")
    return text


def _megabytes(text: str) -> float:
    n = float(text)
    if not n >= 0:
        raise ValueError("must be a number of megabytes >= 0")
    return n


TABLE: tuple[Setting, ...] = (
    Setting(
        "COMMLIB_NATIVE",
        "1",
        _flag,
        "1: run the mpi backend's steps in the compiled executor where it was built; 0: in Python (slower, the "
        "same messages). Ranks may differ: each says which it runs, and a mixed group warns once",
        shapes_messages=True,
    ),
    Setting(
        "COMMLIB_MPI_PERSISTENT_MAX",
        "4096",
        _bytes,
        "a message of up to this many bytes carries its stamp inline and moves through persistent requests over "
        "scratch buffers (one copy in, one out); a larger one moves on the caller's arrays after a stamp message "
        "of its own. A group takes its ranks' smallest value",
        shapes_messages=True,
    ),
    Setting(
        "COMMLIB_MPI_PIECE_BYTES",
        str(2 << 20),
        _bytes,
        "an all_reduce of 4 pieces or more runs piece after piece of this many bytes (the cache keeps "
        "each piece while it is reduced; 0: one piece). A group takes its ranks' smallest value",
        shapes_messages=True,
    ),
    Setting(
        "COMMLIB_MPI_COMPOSED",
        "0",
        _flag,
        "1: all_to_all, gather and scatter run as the grouped sends and receives of the Backend base class "
        "(as on backends without such calls; for testing them). A group composes if any rank asks",
        shapes_messages=True,
    ),
    Setting(
        "COMMLIB_MPI_BLOCK_FROM",
        str(64 << 10),
        _bytes,
        "a wait for this many bytes or more blocks in MPI (without the GIL, up to 0.25 s) while its data may be "
        "moving, where every rank of the node has a core of its own (0: never)",
    ),
    Setting(
        "COMMLIB_TIMEOUT",
        "none",
        _seconds,
        "seconds every blocking call of every group may wait (none: torch's defaults, 10 minutes for nccl and "
        "30 for mpi; init_process_group(timeout=) and new_group(timeout=) win)",
    ),
    Setting(
        "COMMLIB_DEBUG",
        "",
        _debug,
        "DETAIL: before each collective, all-gather every rank's description of its call and, where they "
        "differ, raise listing every rank's call (a second, slower check on top of the stamps)",
    ),
    Setting(
        "COMMLIB_FLIGHT_RECORDER_SIZE",
        "2000",
        _count,
        "collectives each process keeps in its flight recorder (0: no dumps)",
    ),
    Setting("COMMLIB_FLIGHT_DIR", "", _text, "where flight recorder dumps go (default: a folder per job in $TMPDIR)"),
    Setting("COMMLIB_FLIGHT_SIGNAL", "1", _flag, "0: leave SIGUSR1 alone (1: it dumps the flight recorder)"),
    Setting(
        "COMMLIB_MONITOR",
        "1",
        _flag,
        "0: no job monitor store (timeouts then cannot say which ranks arrived or what they were calling)",
    ),
    Setting(
        "COMMLIB_LIFELINES",
        "1",
        _flag,
        "0: no lifelines (a TCP connection between every two ranks that tells every survivor of a death at once, "
        "and carries their agreement for shrink_group/grow_group); deaths are then seen only as timeouts",
    ),
    Setting(
        "COMMLIB_ABORT_ON_EXCEPTION",
        "1",
        _flag,
        "0: an uncaught exception on one rank does not end the job: that rank exits (its program's end tells the "
        "others, whose calls with it then fail naming it) and the others are not stopped",
    ),
    Setting(
        "COMMLIB_EXIT_GC", "0", _flag, "1: keep the interpreter's last garbage collection at exit (slow with torch)"
    ),
    Setting(
        "COMMLIB_NCCL_EMULATOR",
        "0",
        _flag,
        "1: the nccl backend runs over commlib's CPU emulator of cupy.cuda.nccl (for testing without a GPU)",
    ),
    Setting("COMMLIB_STORE_TOKEN", "", _text, "a shared secret every rendezvous store client must present"),
    Setting(
        "COMMLIB_NCCL_EMULATOR_ADDR",
        "",
        _text,
        "the address the NCCL emulator's bootstrap root advertises (default: MASTER_ADDR if it is this host's, "
        "else this host's name)",
    ),
    Setting(
        "COMMLIB_NCCL_EMULATOR_TIMEOUT",
        "300",
        _seconds,
        "seconds any blocking step of the NCCL emulator may take (then its communicator fails, as NCCL's would "
        "report an error)",
    ),
    Setting(
        "COMMLIB_DDP_TRACE",
        "",
        _text,
        "a file name for ddp's Chrome-trace timeline of backward and bucket all-reduces (each rank writes its own: "
        "trace.json -> trace.rank0.json, ...)",
    ),
    Setting(
        "GLOBALVIEW_POOL_MB",
        "1024",
        _megabytes,
        "megabytes of freed buffers globalview keeps per process for its next results (0: none)",
    ),
    Setting(
        "GLOBALVIEW_CACHE",
        "",
        _text,
        "file where globalview.auto_parallel keeps the machine's measured times (empty: "
        "~/.cache/globalview/machine.json)",
    ),
    Setting("COMMLIB_JOB_ID", "", _text, "the job's id (commlib.launch: in flight recorder folders)", plumbing=True),
    Setting(
        "COMMLIB_LAUNCH_STATUS",
        "",
        _text,
        "commlib.launch's folder where each worker notes that it dumps its flight recorder on SIGUSR1",
        plumbing=True,
    ),
    Setting(
        "COMMLIB_MONITOR_STORE",
        "",
        _text,
        "host:port of the job's monitor store (commlib.launch serves one; else world rank 0 does)",
        plumbing=True,
    ),
    Setting("COMMLIB_MONITOR_TOKEN", "", _text, "the monitor store's token", plumbing=True),
    Setting(
        "COMMLIB_STORE_SERVED",
        "0",
        _served,
        "host:port: the job's rendezvous store is served there already (by commlib.launch, so that it outlives "
        "any rank): rank 0 connects to it instead of serving it, and MASTER_PORT is left to torch's "
        "init_process_group",
        plumbing=True,
    ),
    Setting(
        "COMMLIB_ON_FAILURE",
        "",
        _on_failure,
        "what commlib.launch does when a worker fails (its --on-failure: abort, continue or replace), for the "
        "workers to read (a loop that takes newcomers in waits for the replacements only under replace)",
        plumbing=True,
    ),
    Setting(
        "COMMLIB_JOIN",
        "0",
        _flag,
        "1: init_process_group joins the running job whose store MASTER_ADDR/MASTER_PORT (or init_method) names, "
        "as a newcomer its ranks take in with commlib.grow_group() (commlib.launch --on-failure replace sets it for "
        "a replacement; set it by hand to add a process)",
    ),
    Setting(
        "COMMLIB_SPARE",
        "",
        _text,
        "set (to its number) by commlib.launch --spares for a spare (with COMMLIB_JOIN=1, no RANK yet): when the "
        "job ends before taking it in, init_process_group ends the program with exit code 0 instead of raising",
        plumbing=True,
    ),
    Setting(
        "COMMLIB_REPLACES",
        "",
        _text,
        "the rank a replacement worker replaces (informational: it joins as a newcomer, ranked after the others)",
        plumbing=True,
    ),
    Setting(
        "COMMLIB_TESTING_WORKER",
        "",
        _text,
        "commlib.testing's worker state: 'loading' while it imports the module under test, then '1'",
        plumbing=True,
    ),
)

_BY_NAME = {s.name: s for s in TABLE}
_VALUES = {s.name: s.read(os.environ) for s in TABLE}


def value(name: str) -> Any:
    """The value of setting ``name`` as read at import (``KeyError`` for a name not in :data:`TABLE`)."""
    return _VALUES[name]


def current(name: str) -> Any:
    """The value of setting ``name`` in the environment now (for the few a program may set after importing
    commlib, before the call that reads them: ``COMMLIB_TIMEOUT``, read when a default group is made)."""
    return _BY_NAME[name].read(os.environ)


def markdown() -> str:
    """:data:`TABLE` as a Markdown table (docs/reliability.md holds a copy; a test keeps them equal)."""
    rows = ["| variable | default | shapes messages | meaning |", "| --- | --- | --- | --- |"]
    for s in TABLE:
        shapes = "yes" if s.shapes_messages else "no"
        doc = f"(set by commlib for its workers) {s.doc}" if s.plumbing else s.doc
        rows.append(f"| `{s.name}` | `{s.default or '(unset)'}` | {shapes} | {doc} |")
    return "\n".join(rows)
