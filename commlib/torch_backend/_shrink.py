"""torch's ``dist.shrink_group`` on the "commlib" backend.

torch 2.13's ``shrink_group`` asks the group's device backend (``ProcessGroup._get_backend``) whether it
``supports_shrinking``, calls its ``shrink(ranks, flags, pg_options)``, and wraps what that returns in a new
c10d ``ProcessGroup``. Both ends assume a C++ backend: a Python group (which torch accepts as a backend since
2.13) has no device backend to ask, and a new c10d group takes only a C++ one. So commlib bridges those two of
torch's helpers, for its own groups only: the backend asked is the :class:`CommlibProcessGroup` itself, and the
group its ``shrink`` returns is the new group. Every other step stays torch's: the checks of the arguments,
destroying the other groups when the default one shrinks, the new default group's registration.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["install"]


def install() -> bool:
    """Bridge torch's shrink helpers for commlib's groups (idempotent); False where torch has no shrink_group."""
    import torch.distributed.distributed_c10d as c10d

    validate = getattr(c10d, "_validate_shrink_backend_requirements", None)
    create = getattr(c10d, "_create_shrunk_process_group", None)
    if validate is None or create is None:
        return False
    if getattr(validate, "_commlib", False):
        return True

    @functools.wraps(validate)
    def validate_shrink(group_info: dict) -> Any:
        from commlib.torch_backend._process_group import CommlibProcessGroup

        pg = group_info["process_group"]
        return pg if isinstance(pg, CommlibProcessGroup) else validate(group_info)

    @functools.wraps(create)
    def create_shrunk(new_backend: Any, remaining_ranks: list[int], metadata: dict, is_default_group: bool) -> Any:
        from commlib.torch_backend._process_group import CommlibProcessGroup

        if not isinstance(new_backend, CommlibProcessGroup):
            return create(new_backend, remaining_ranks, metadata, is_default_group)
        new_backend.setGroupName(metadata["new_group_name"])
        return new_backend

    validate_shrink._commlib = True  # type: ignore[attr-defined]
    c10d._validate_shrink_backend_requirements = validate_shrink
    c10d._create_shrunk_process_group = create_shrunk
    return True
