"""The ``torch.distributed`` backend "commlib": ``init_process_group(backend="commlib")``.

torch's own collectives, ``DistributedDataParallel``, FSDP2 (``fully_shard``) and
DTensor then run on commlib's groups (mpi for CPU tensors, nccl for CUDA tensors),
with commlib's timeouts and error messages. The backend is registered

- by ``import commlib`` when torch is already imported (commlib never imports torch itself), and
- by ``import torch`` alone, through the ``torch.backends`` entry point :func:`autoload`.

Registering imports neither mpi4py nor the backend's own modules and initialises
nothing: commlib joins the job when torch creates the first group. It also lets
``dist.shrink_group`` reach commlib's groups (``_shrink``). See docs/torch.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND", "autoload", "register"]

#: The name to pass to ``torch.distributed.init_process_group(backend=...)``.
BACKEND = "commlib"


def register() -> bool:
    """Register the "commlib" backend with torch.distributed (idempotent); False when torch has no distributed."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
        from commlib.torch_backend._shrink import install

        install()  # dist.shrink_group on commlib's groups
    return True


def autoload() -> None:
    """torch's ``torch.backends`` entry point, called at the end of ``import torch``: register, nothing more."""
    register()


def _create(opts: Any, pg_options: Any) -> Any:
    """torch's creator hook (called on the member ranks of each new group)."""
    from commlib.torch_backend._create import create

    return create(opts, pg_options)
