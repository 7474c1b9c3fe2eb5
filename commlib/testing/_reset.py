"""A warm rank between two functions: put the process back as a fresh rank would find it, or say why not.

Imported by the ranks of warm jobs only (``_worker.serve``); standard library only, like the worker.

What is put back every time: commlib's and torch.distributed's default groups (destroyed, and commlib told
that a later first call may join the job again, as in a new process), the standard streams, ``sys.path``,
``sys.argv``, ``sys.excepthook`` and ``threading.excepthook``, the Python signal handlers, the warning filters,
the CPU affinity, process-wide settings (recursion limit, switch interval, the garbage collector on or off,
numpy's error handling, torch's default dtype, grad mode, thread count and deterministic mode), and the random
generators of ``random``, numpy and torch (seeded anew, as in a new process).

What cannot be put back ends the job after this function (the next call starts a new one): a teardown that
raised; a changed ``os.environ`` (but for the variables torch sets for itself, :data:`OWN_VARIABLES`) or
working directory (both are put back, but what was read from them may be cached: commlib keeps its place in
the job); a non-daemon thread still running; a module of commlib, ddp or
globalview (or the function's own) removed from ``sys.modules``; one of their globals rebound (but from None or
False: the library's own set-up on first use; or to a submodule, by its import) or a class's method replaced;
an import blocked through ``sys.modules``; a setting that could not be set back.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["Baseline"]

#: the packages whose functions and classes a test could replace (and the function's module, added per call)
WATCHED = ("commlib", "ddp", "globalview")
#: variables libraries set for themselves on first use, the same in every process of a job (torch's compiler
#: caches under TMPDIR): no function's doing
OWN_VARIABLES = ("TORCHINDUCTOR_",)
_CALLABLE = (types.FunctionType, types.BuiltinFunctionType, property, classmethod, staticmethod)


def _signals() -> list[signal.Signals]:
    found: list[signal.Signals] = []
    for s in signal.Signals:
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.getsignal(s)
        except (ValueError, OSError):
            continue
        found.append(s)
    return found


def _watched(name: str, extra: str) -> bool:
    return name == extra or any(name == p or name.startswith(p + ".") for p in WATCHED)


def _definitions(extra: str) -> dict[tuple[str, str], tuple[int, bool]]:
    """(module, name) and (module, class.attribute) -> (id, whether None) of what the watched modules bind:
    their globals, and their classes' functions (a global rebound, a method replaced: a patch, or state that a
    fresh process would not have)."""
    marks: dict[tuple[str, str], tuple[int, bool]] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not _watched(name, extra):
            continue
        for attr, value in list(vars(module).items()):
            if attr.startswith("__"):  # __warningregistry__ & co.
                continue
            marks[(name, attr)] = (id(value), value is None or value is False)
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                for key, member in list(vars(value).items()):
                    if isinstance(member, _CALLABLE) and not key.startswith("__"):
                        marks[(name, f"{attr}.{key}")] = (id(member), False)
    return marks


def _knobs() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """The process-wide settings a function may change, each with how to read it and how to set it back."""
    knobs: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
        "sys.getrecursionlimit()": (sys.getrecursionlimit, sys.setrecursionlimit),
        "sys.getswitchinterval()": (sys.getswitchinterval, sys.setswitchinterval),  # the nccl emulator lowers it
        "gc.isenabled()": (gc.isenabled, lambda on: gc.enable() if on else gc.disable()),
    }
    np = sys.modules.get("numpy")
    if np is not None and hasattr(np, "geterr"):
        knobs["numpy.geterr()"] = (np.geterr, lambda errors: np.seterr(**errors))
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "use_deterministic_algorithms"):
        knobs["torch.get_default_dtype()"] = (torch.get_default_dtype, torch.set_default_dtype)
        knobs["torch.is_grad_enabled()"] = (torch.is_grad_enabled, torch.set_grad_enabled)
        knobs["torch.get_num_threads()"] = (torch.get_num_threads, torch.set_num_threads)
        knobs["torch.are_deterministic_algorithms_enabled()"] = (
            torch.are_deterministic_algorithms_enabled,
            torch.use_deterministic_algorithms,
        )
    return knobs


def _torch_defaults() -> dict[str, Any]:
    """torch's settings in a new process (for a function that imported torch: nothing to compare with)."""
    torch = sys.modules["torch"]
    found = {
        "torch.get_default_dtype()": torch.float32,
        "torch.is_grad_enabled()": True,
        "torch.are_deterministic_algorithms_enabled()": False,
    }
    threads = os.environ.get("OMP_NUM_THREADS", "")  # commlib.testing sets it for every rank
    if threads.isdigit():
        found["torch.get_num_threads()"] = int(threads)
    return found


class Marks:
    """The state before one function: compared with the state after it, once its teardown ran."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.definitions = _definitions(module)
        self.modules = {name for name, m in sys.modules.items() if m is not None}
        self.blocked = {name for name, m in sys.modules.items() if m is None}
        self.settings = {name: get() for name, (get, _) in _knobs().items()}


class Baseline:
    """What a warm rank looked like before its first function: what each later function finds again."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.argv = list(sys.argv)
        self.streams = (sys.stdin, sys.stdout, sys.stderr)
        self.hooks = (sys.excepthook, threading.excepthook)
        self.signals = {s: signal.getsignal(s) for s in _signals()}
        self.filters = list(warnings.filters)
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    def marks(self, module: str) -> Marks:
        return Marks(module)

    def reset(self, marks: Marks) -> str:
        """Put the process back; "" if it can run another function, else why not."""
        problems = _teardown()
        now = os.environ
        changed = sorted(
            {k for k in now if now.get(k) != self.environ.get(k) and not k.startswith(OWN_VARIABLES)}
            | {k for k in self.environ if k not in now}
        )
        if os.getcwd() != self.cwd:
            changed.append("(the working directory)")
        if changed:  # put back below, but what the process read from it may be kept (commlib caches its place)
            problems.append(f"environment changed: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}")
        self._restore()
        problems += _compare(marks)
        return "; ".join(problems)

    def _restore(self) -> None:
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        if self.cpus is not None and os.sched_getaffinity(0) != self.cpus:
            os.sched_setaffinity(0, self.cpus)
        sys.path[:] = self.path
        sys.argv[:] = self.argv
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a stream the function left behind, already closed
                stream.flush()
        sys.stdin, sys.stdout, sys.stderr = self.streams
        sys.excepthook, threading.excepthook = self.hooks
        for s, handler in self.signals.items():
            if signal.getsignal(s) is not handler and handler is not None:
                signal.signal(s, handler)
        warnings.filters[:] = self.filters  # type: ignore[index]
        warnings._filters_mutated()  # type: ignore[attr-defined]  # drop the cached "already warned" answers
        # A new process's generators start from seeds of their own (torch's too): a function that seeded one must
        # not leave the next with that sequence (every rank drawing the same numbers, by accident).
        random.seed()
        np = sys.modules.get("numpy")
        if np is not None and hasattr(np, "random"):
            np.random.seed()
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "seed"):
            torch.seed()


def _teardown() -> list[str]:
    """Destroy the default groups the function left (as the program's end would check them), and let a later
    first call join the job again."""
    problems = []
    tdist = sys.modules.get("torch.distributed")
    if tdist is not None and hasattr(tdist, "is_available"):
        try:
            if tdist.is_available() and tdist.is_initialized():
                tdist.destroy_process_group()
        except Exception as e:
            problems.append(f"torch.distributed.destroy_process_group() raised {e!r}")
    commlib = sys.modules.get("commlib")
    if commlib is not None:
        try:
            if commlib.is_initialized():
                commlib.destroy_process_group()
        except Exception as e:
            problems.append(f"commlib.destroy_process_group() raised {type(e).__name__}: {e}")
        # After destroy_process_group() commlib refuses to join the job implicitly again (torch's rule for one
        # program); the next function is another program. What commlib read of its place in the job goes too.
        state = getattr(sys.modules.get("commlib._world"), "_state", None)
        if state is None or not hasattr(state, "destroyed"):
            problems.append(
                "commlib._world._state.destroyed is gone: teach commlib.testing._reset how a destroyed default "
                "group is forgotten (until then every warm job serves one function)"
            )
        else:
            state.destroyed = False
            if hasattr(state, "info"):
                state.info = None  # its place in the job, read again from the environment on first use
    return problems


def _submodule(package: str, attr: str) -> bool:
    """Whether ``package.attr`` is now the submodule of that name (importing it binds it there: no patch)."""
    value = getattr(sys.modules.get(package), attr, None)
    return isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{attr}"


def _compare(marks: Marks) -> list[str]:
    problems = []
    now = _definitions(marks.module)
    # Rebound since the function started: a patch, or state a fresh process would not have. A global set from None
    # or False (a hook installed with the default group, a choice made on first use) is the library's own lazy
    # set-up, and a package's name bound to its submodule by an import is no patch either.
    replaced = sorted(
        f"{m}.{a}"
        for (m, a), (i, unset) in marks.definitions.items()
        if not unset and now.get((m, a), (i,))[0] != i and not _submodule(m, a)
    )
    if replaced:
        problems.append(f"rebound: {', '.join(replaced[:5])}{' ...' if len(replaced) > 5 else ''}")
    gone = sorted(name for name in marks.modules if sys.modules.get(name) is None and _watched(name, marks.module))
    if gone:
        problems.append(f"modules removed from sys.modules: {', '.join(gone[:5])}")
    blocked = sorted(name for name, m in sys.modules.items() if m is None and name not in marks.blocked)
    if blocked:
        problems.append(f"imports blocked through sys.modules: {', '.join(blocked[:5])}")
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if threads:
        problems.append(f"non-daemon threads still running: {', '.join(threads)}")
    knobs = _knobs()
    if "torch.get_default_dtype()" in knobs and "torch.get_default_dtype()" not in marks.settings:
        marks.settings.update(_torch_defaults())  # imported by this function
    for name, before in marks.settings.items():
        get, put = knobs[name]
        try:
            if get() != before:
                put(before)
        except Exception as e:
            problems.append(f"{name} could not be set back to {before!r}: {e!r}")
    return problems
