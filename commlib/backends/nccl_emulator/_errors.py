"""NcclError and the ncclResult_t codes of the NCCL emulator (see ``nccl_emulator``)."""

from __future__ import annotations

from commlib._settings import current

__all__ = [
    "INTERNAL_ERROR",
    "INVALID_ARGUMENT",
    "INVALID_USAGE",
    "REMOTE_ERROR",
    "SUCCESS",
    "SYSTEM_ERROR",
    "NcclError",
    "check_status",
    "op_timeout",
]

# ncclResult_t values (nccl.h).
SUCCESS = 0
UNHANDLED_CUDA_ERROR = 1
SYSTEM_ERROR = 2
INTERNAL_ERROR = 3
INVALID_ARGUMENT = 4
INVALID_USAGE = 5
REMOTE_ERROR = 6
IN_PROGRESS = 7

# Name and ncclGetErrorString() text per code, as cupy formats them ("NAME: text").
_MESSAGES = {
    SUCCESS: ("NCCL_ERROR_SUCCESS", "no error"),
    UNHANDLED_CUDA_ERROR: (
        "NCCL_ERROR_UNHANDLED_CUDA_ERROR",
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    ),
    SYSTEM_ERROR: ("NCCL_ERROR_SYSTEM_ERROR", "unhandled system error (run with NCCL_DEBUG=INFO for details)"),
    INTERNAL_ERROR: (
        "NCCL_ERROR_INTERNAL_ERROR",
        "internal error - please report this issue to the NCCL developers",
    ),
    INVALID_ARGUMENT: ("NCCL_ERROR_INVALID_ARGUMENT", "invalid argument (run with NCCL_DEBUG=WARN for details)"),
    INVALID_USAGE: ("NCCL_ERROR_INVALID_USAGE", "invalid usage (run with NCCL_DEBUG=WARN for details)"),
    REMOTE_ERROR: ("NCCL_ERROR_REMOTE_ERROR", "remote process exited or there was a network error"),
    IN_PROGRESS: ("NCCL_ERROR_IN_PROGRESS", "NCCL operation in progress"),
}

_DEFAULT_TIMEOUT = 300.0


class NcclError(RuntimeError):
    """An NCCL failure with its ncclResult_t ``status``; ``detail`` says what the emulator saw."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = int(status)
        self.detail = detail
        name, text = _MESSAGES.get(self.status, (f"NCCL_ERROR_UNKNOWN_{self.status}", "unknown result code"))
        message = f"{name}: {text}"
        # The real message has no room for a cause; the emulator knows it, so append it.
        super().__init__(f"{message} [nccl emulator: {detail}]" if detail else message)

    def __reduce__(self) -> tuple:
        """Pickle as (status, detail), like cupy's NcclError pickles as (status,)."""
        return (type(self), (self.status, self.detail))


def check_status(status: int) -> None:
    """Raise NcclError unless ``status`` is ncclSuccess."""
    if status != SUCCESS:
        raise NcclError(status)


def op_timeout() -> float:
    """Seconds any blocking step may take (the setting COMMLIB_NCCL_EMULATOR_TIMEOUT, default 300), read per call."""
    try:
        value = current("COMMLIB_NCCL_EMULATOR_TIMEOUT")
    except ValueError as e:  # the setting's own words: the variable, the value, the rule
        raise NcclError(INVALID_ARGUMENT, str(e)) from None
    return _DEFAULT_TIMEOUT if value is None else float(value)
