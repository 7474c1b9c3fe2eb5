"""Worker entry point used by ``commlib.launch``: line-buffered output, then the user's script or module.

hydra prefixes each chunk it reads with the rank, so the worker's stdout and
stderr must flush whole lines; ``python -u`` would split ``print`` into two writes.

    python -m commlib._bootstrap script.py args...
    python -m commlib._bootstrap -m package.module args...
"""

from __future__ import annotations

import io
import os
import runpy
import sys
from pathlib import Path


def _line_buffered(stream: io.TextIOWrapper) -> io.TextIOWrapper:
    # A fresh buffered layer: under PYTHONUNBUFFERED the original has none to line-buffer.
    raw = open(stream.fileno(), "wb", buffering=1 << 16, closefd=False)  # noqa: SIM115 - lives as long as sys.stdout
    return io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, line_buffering=True)


def _record(name: str, text: str) -> None:
    """Leave a note for the launcher (which rank runs as which pid, how it ended)."""
    folder = os.environ.get("COMMLIB_LAUNCH_STATUS")
    if folder:
        path = Path(folder) / f"rank{os.environ.get('RANK', 'x')}.{name}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def main(argv: list[str]) -> None:
    """Run ``argv`` as ``__main__`` and tell the launcher how it ended."""
    _record("pid", str(os.getpid()))
    try:
        _run(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        _record("exit", f"{code} sys.exit({e.code!r})")
        raise
    except BaseException as e:
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


if __name__ == "__main__":
    main(sys.argv[1:])
