"""Per-rank entry point of ``commlib.testing.run``: ``python -m commlib.testing._worker SPEC_DIR``.

Deliberately imports only the standard library and the (stdlib-only) package: every
rank of every test pays for what is imported here before the function under test starts. It must not
initialise MPI either; the function under test does that (mpi4py finalises at exit).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import itertools
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

# The package (imported anyway by "-m commlib.testing._worker") owns the spec dir
# layout; it must not import this module, or runpy warns about a double import.
from commlib.launch._mpiexec import pid_alive
from commlib.testing import (
    _ARGS_FILE,
    _ERROR,
    _OK,
    _SPEC_FILE,
    WORKER_ENV,
    _pid_path,
    _result_path,
    _stack_path,
)

# Launchers' rank variables, hydra's first; all are set before exec, so the rank
# is known without initialising MPI.
_RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")

# faulthandler writes into this file from a signal handler; keep it open for good.
_stack_file: Any = None


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so that the parent sees either nothing or all of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _rank() -> int:
    for name in _RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            return int(value)
    raise RuntimeError(f"no rank in the environment (looked for {', '.join(_RANK_VARIABLES)})")


def _line_buffer_output() -> None:
    # With PYTHONUNBUFFERED every piece of a print() is its own write(), and hydra's
    # -prepend-rank prefixes every write it reads, giving "[1] a[1]  [1] b" lines.
    # Line buffering in the text layer turns each line into a single write().
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)


def _load_file(name: str, file: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {file!r} as module {name!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _same_file(module: ModuleType, file: str) -> bool:
    try:
        return os.path.samefile(getattr(module, "__file__", None) or "", file)
    except OSError:
        return False


def _import_module(name: str, file: str | None) -> ModuleType:
    """Import the module of the function under test under the parent's name for it."""
    if name == "__main__":
        # Running the parent's script as "__main__" would re-run its main block;
        # like multiprocessing, load it as "__mp_main__" and alias it so that
        # pickles referring to __main__ resolve.
        if file is None:
            raise ImportError("the function is defined in a __main__ without a source file")
        module = _load_file("__mp_main__", file)
        sys.modules["__main__"] = module
        return module
    if file is None:
        return importlib.import_module(name)
    found: ModuleType | None
    try:
        found = importlib.import_module(name)
    except Exception:  # retried from the file, which re-raises real errors
        found = None
    if found is not None and _same_file(found, file):
        return found
    # pytest may have named the module after its rootdir-relative path with no
    # importable package behind it (tests/ without __init__.py, importmode=importlib).
    return _load_file(name, file)


def _load_call(spec_dir: Path) -> tuple[Callable[..., Any], tuple, dict]:
    with open(spec_dir / _SPEC_FILE, "rb") as f:
        spec = pickle.load(f)
    for entry in reversed(spec["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ[WORKER_ENV] = "loading"  # run() refuses to start workers from here: no recursion without end
    try:
        module = _import_module(spec["module"], spec["file"])
    finally:
        os.environ[WORKER_ENV] = "1"
    fn: Any = module
    for part in spec["qualname"].split("."):
        fn = getattr(fn, part)
    # Only now, with the function's module imported, can its objects be unpickled.
    with open(spec_dir / _ARGS_FILE, "rb") as f:
        args, kwargs = pickle.load(f)
    return fn, args, kwargs


def _run(spec_dir: Path) -> tuple[str, Any]:
    try:
        fn, args, kwargs = _load_call(spec_dir)
    except BaseException:  # reported like a failure of fn
        return _ERROR, f"could not load the function to run:\n{traceback.format_exc()}"
    return _call(fn, args, kwargs)


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[str, Any]:
    try:
        return _OK, fn(*args, **kwargs)
    except BaseException as exc:  # SystemExit & co. are failures of fn too
        # Start the traceback at fn: this frame is the same noise for every test.
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        return _ERROR, "".join(traceback.format_exception(type(exc), exc, tb))


def _encode(status: str, payload: Any) -> tuple[str, bytes]:
    try:
        return status, pickle.dumps((status, payload), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # any pickling failure is reported, not raised
        message = f"the return value could not be pickled:\n{traceback.format_exc()}"
        return _ERROR, pickle.dumps((_ERROR, message))


def _begin(spec_dir: Path, rank: int) -> None:
    """Stack dumps of this call go to its directory; then say which pid runs it."""
    global _stack_file
    previous, _stack_file = _stack_file, open(_stack_path(spec_dir, rank), "w")  # noqa: SIM115 - kept open
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    # Crashes in C code (segfaults, aborts) leave a Python stack trace as well.
    faulthandler.enable(file=_stack_file, all_threads=True)
    if previous is not None:
        previous.close()
    # Only now: the parent sends SIGUSR1 to recorded pids, and unhandled it would kill.
    _write_atomic(_pid_path(spec_dir, rank), f"{os.getpid()} {os.getppid()}".encode())


def main(argv: list[str]) -> int:
    """Run the function described in ``argv[1]`` (the spec dir) on this rank; or, given
    ``--warm JOB_DIR PARENT_PID``, serve the calls of a warm job (:func:`serve`)."""
    if len(argv) == 4 and argv[1] == "--warm":
        return serve(Path(argv[2]), int(argv[3]))
    spec_dir = Path(argv[1])
    rank = _rank()
    _begin(spec_dir, rank)
    _line_buffer_output()
    status, data = _encode(*_run(spec_dir))
    _write_atomic(_result_path(spec_dir, rank, status), data)
    # Exit 0 even if fn failed: the parent judges by the result files, and a normal
    # exit lets MPI finalize instead of making hydra kill the other ranks.
    return 0


class _Bell:
    """This rank's FIFO in a warm job's directory: the parent writes a byte when there is something new."""

    def __init__(self, job_dir: Path, rank: int, parent: int) -> None:
        from commlib.testing._pool import NOTIFY, bell_path

        # Read and write: the FIFO always has a writer (us), so select() waits for real news.
        self.fd = os.open(bell_path(job_dir, rank), os.O_RDWR | os.O_NONBLOCK)
        self.notify = os.open(job_dir / NOTIFY, os.O_WRONLY | os.O_NONBLOCK)
        self.parent = parent

    def ring_parent(self) -> None:
        with contextlib.suppress(OSError):  # full (the parent is behind: it reads the files anyway) or gone
            os.write(self.notify, b"!")

    def wait(self, *paths: Path) -> Path | None:
        """Until one of ``paths`` exists (the first that does), or None once the parent is gone."""
        import select

        while True:
            for path in paths:
                if os.path.lexists(path):
                    return path
            ready, _, _ = select.select([self.fd], [], [], 1.0)
            if ready:
                try:
                    while os.read(self.fd, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif not pid_alive(self.parent):  # a zombie parent is gone too
                return None


def serve(job_dir: Path, parent: int) -> int:
    """A rank of a warm job: run call after call (``job_dir/call-<k>``, laid out as a fresh job's directory)
    until the parent says stop, a call fails, or this process cannot be put back as new (:mod:`._reset`)."""
    from commlib.testing._pool import RESET, STOP, answer_path, call_path
    from commlib.testing._reset import Baseline

    rank = _rank()
    bell = _Bell(job_dir, rank, parent)
    _line_buffer_output()
    os.environ[WORKER_ENV] = "1"  # what a fresh worker's function sees
    baseline = Baseline()
    stop = job_dir / STOP
    for k in itertools.count():
        call_dir = call_path(job_dir, k)
        if bell.wait(call_dir, stop) != call_dir:
            return 0
        _begin(call_dir, rank)
        marks = None
        try:
            fn, args, kwargs = _load_call(call_dir)
            marks = baseline.marks(fn.__module__)
        except BaseException:  # reported like a failure of fn
            outcome: tuple[str, Any] = (_ERROR, f"could not load the function to run:\n{traceback.format_exc()}")
        else:
            outcome = _call(fn, args, kwargs)
        status, data = _encode(*outcome)
        _write_atomic(_result_path(call_dir, rank, status), data)
        bell.ring_parent()
        if status != _OK or marks is None:
            return 0  # a failed rank ends, as in a fresh job; the parent ends the job
        if bell.wait(call_dir / RESET, stop) != call_dir / RESET:
            return 0
        why = baseline.reset(marks)
        _write_atomic(answer_path(call_dir, rank, not why), (why or "ready").encode())
        bell.ring_parent()
        if why:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
