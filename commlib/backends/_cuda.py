"""The GPU side of the nccl backend: is a GPU usable, which modules drive it, device arrays.

Kept apart from ``nccl.py`` because none of it can run without a GPU: the backend
logic itself runs in CI against the emulator, these few functions only on GPU
machines (tests marked ``gpu``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from commlib._settings import current
from commlib.errors import BackendUnavailableError

__all__ = ["device_count", "emulated", "load", "nccl_unavailable_reason", "unavailable"]


def nccl_unavailable_reason() -> str | None:
    """Why the real NCCL backend cannot run here, or None when a GPU and cupy's NCCL are usable."""
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")):
        return "no NVIDIA GPU is visible on this machine (no /dev/nvidia* device)"
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as e:
        return f"cupy with NCCL is not installed ({e}); pip install 'commlib[cuda12]'"
    if not getattr(nccl, "available", True):
        return "cupy was built without NCCL"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CUDA reports no device"
    except Exception as e:  # any CUDA failure means "not usable"; say which
        return f"CUDA is not usable: {e}"
    return None


def emulated() -> bool:
    """True when ``COMMLIB_NCCL_EMULATOR=1`` selects the CPU emulator for the nccl backend (read when asked)."""
    return bool(current("COMMLIB_NCCL_EMULATOR"))


def unavailable() -> str | None:
    """Why the nccl backend cannot run here, with what to do instead; None: it can (a GPU, or the emulator)."""
    if emulated():
        return None
    why = nccl_unavailable_reason()
    if why is None:
        return None
    return (
        f"backend 'nccl' cannot run: {why}. Use backend='mpi' for host arrays, or set COMMLIB_NCCL_EMULATOR=1 "
        "to run the nccl backend on the CPU emulator"
    )


def load(emulated: bool) -> tuple[Any, Any, Any, bool]:
    """(nccl module, cuda runtime namespace, array module, host memory?) for the emulator or the GPU."""
    if emulated:
        from commlib.backends import nccl_emulator

        return nccl_emulator, nccl_emulator.cuda, np, True
    why = nccl_unavailable_reason()
    if why is not None:
        raise BackendUnavailableError(
            f"init_process_group: backend 'nccl' cannot run: {why}. Use backend='mpi' for host arrays, "
            "or set COMMLIB_NCCL_EMULATOR=1 to run the nccl backend on the CPU emulator"
        )
    import cupy
    from cupy.cuda import nccl

    return nccl, cupy.cuda, cupy, False


def device_count() -> int:
    """The number of CUDA devices this process sees (0 without a usable GPU)."""
    if nccl_unavailable_reason() is not None:
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()
