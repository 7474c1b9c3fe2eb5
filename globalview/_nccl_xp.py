"""The array module of "cuda" placements: the nccl backend's device arrays.

cupy on GPUs; numpy when the nccl backend runs on commlib's CPU emulator
(``COMMLIB_NCCL_EMULATOR=1``, host memory, labelled as emulated by commlib).
Only this module imports cupy (the name says so: see tests/test_layering.py).
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np

import commlib


def emulated() -> bool:
    """True when commlib's nccl backend runs on its CPU emulator (the documented switch)."""
    return os.environ.get("COMMLIB_NCCL_EMULATOR", "") not in ("", "0")


def array_module(type_: str, call: str) -> ModuleType:
    """numpy or cupy for a placement of ``type_``, after checking the job's backend can carry it."""
    backend = commlib.get_backend()
    if type_ == "cuda":
        if backend != "nccl":
            raise ValueError(
                f"{call}: placement type 'cuda' needs the nccl backend (a GPU, or the CPU emulator with "
                f"COMMLIB_NCCL_EMULATOR=1); this job's backend is {backend!r}: use type 'cpu'"
            )
        if emulated():
            return np
        import cupy

        return cupy
    if backend == "nccl" and not emulated():
        raise ValueError(
            f"{call}: placement type 'cpu' needs host collectives, but this job's backend is nccl on GPUs: "
            f"use type 'cuda'"
        )
    return np


def to_host(a) -> np.ndarray:
    """A numpy copy (or the array itself) of a numpy or cupy array."""
    return a if isinstance(a, np.ndarray) else a.get()
