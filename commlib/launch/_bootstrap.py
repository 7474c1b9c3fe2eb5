"""Worker entry point used by ``commlib.launch``: line-buffered output, then the user's script or module.

hydra prefixes each chunk it reads with the rank, so the worker's stdout and
stderr must flush whole lines; ``python -u`` would split ``print`` into two writes.

    python -m commlib.launch._bootstrap script.py args...
    python -m commlib.launch._bootstrap -m package.module args...
"""

from __future__ import annotations

import io
import os
import runpy
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from commlib._settings import value as setting


def _line_buffered(stream: Any) -> Any:
    # A fresh buffered layer: under PYTHONUNBUFFERED the original has none to line-buffer.
    raw = open(stream.fileno(), "wb", buffering=1 << 16, closefd=False)  # noqa: SIM115 - lives as long as sys.stdout
    return _Lines(io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors))


class _Lines(io.TextIOBase):
    """Passes on only whole lines: a partial line waits for its newline (or an explicit flush).

    TextIOWrapper's own line buffering flushes after any write that *contains* a
    newline, so ``print("a\nb")`` would reach hydra as "a\nb" and then "\n", and that
    lone newline would get a rank prefix of its own.
    """

    def __init__(self, out: io.TextIOWrapper) -> None:
        super().__init__()
        self._out, self._tail = out, ""

    def write(self, text: str) -> int:
        """Buffer ``text``; pass on everything up to its last newline."""
        head, newline, tail = (self._tail + text).rpartition("\n")
        if newline:
            self._out.write(head + newline)
            self._out.flush()
            self._tail = tail
        else:
            self._tail = tail
        return len(text)

    def flush(self) -> None:
        """Pass on the partial line too (an explicit flush wants it seen)."""
        if self._tail:
            self._out.write(self._tail)
            self._tail = ""
        self._out.flush()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._out.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._out.encoding


def _record(name: str, text: str) -> None:
    """Leave a note for the launcher (which rank runs as which pid, how it ended)."""
    folder = setting("COMMLIB_LAUNCH_STATUS")
    if folder:
        spare = setting("COMMLIB_SPARE")  # a spare (--spares) has no rank of its own yet
        path = Path(folder) / (f"spare{spare}.{name}" if spare else f"rank{os.environ.get('RANK', 'x')}.{name}")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def _record_ended_before() -> None:
    """Before a failure's note: the other ranks of this node already on their way out (killed, or ended with
    no note of success), as the kernel shows them now. This failure came after theirs, likely because of
    them (a peer that vanished mid-call), so the launcher names theirs."""
    folder = setting("COMMLIB_LAUNCH_STATUS")
    if not folder:
        return
    from commlib.launch._mpiexec import pid_ending  # only on the way out

    ended = []
    for note in Path(folder).glob("rank*.pid"):
        rank = note.name[len("rank") : -len(".pid")]
        try:
            finished = note.with_suffix(".exit").read_text().startswith("0 ")
        except OSError:
            finished = False
        if rank.isdigit() and rank != os.environ.get("RANK") and not finished:
            try:
                if pid_ending(int(note.read_text())):
                    ended.append(rank)
            except (OSError, ValueError):
                continue
    if ended:
        _record("after", " ".join(sorted(ended, key=int)))


def main(argv: list[str]) -> None:
    """Run ``argv`` as ``__main__`` and tell the launcher how it ended."""
    _record("pid", str(os.getpid()))
    try:
        _run(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code:
            _record_ended_before()
        _record("exit", f"{code} sys.exit({e.code!r})")
        raise
    except BaseException as e:
        _record_ended_before()
        _record("exit", f"1 {type(e).__name__}: {e}")
        raise
    _record("exit", "0 finished")


def _run(argv: list[str]) -> None:
    """Run ``argv`` (``[script, *args]`` or ``["-m", module, *args]``) as ``__main__``."""
    sys.stdout, sys.stderr = _line_buffered(sys.stdout), _line_buffered(sys.stderr)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the user's first frame on: this module's and runpy's frames say nothing to the user."""
    ours = {__file__, "<frozen runpy>", runpy.__file__}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Exception as e:  # as Python ends on an uncaught exception (hook, exit status 1), without our frames
        e.__traceback__ = _user_frames(e.__traceback__) or e.__traceback__  # the hook prints the exception's own
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)
