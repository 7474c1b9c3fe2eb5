"""``ReduceOp``: the reduction operators, with torch.distributed's names."""

from __future__ import annotations

import enum

__all__ = ["ReduceOp", "as_reduce_op"]


class ReduceOp(enum.Enum):
    """Reduction operator of the reducing collectives (torch.distributed's members)."""

    SUM = "sum"
    PRODUCT = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons, so identity hashing is exact; Enum's own __hash__ is a
    # Python-level call that would cost a dict lookup on every collective ~40 ns.
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    __str__ = __repr__


_BY_NAME = {op.name: op for op in ReduceOp} | {"PROD": ReduceOp.PRODUCT}


def as_reduce_op(op: object, where: str) -> ReduceOp:
    """Return ``op`` as a :class:`ReduceOp`; also accepts torch's ``ReduceOp`` members and names."""
    if type(op) is ReduceOp:
        return op
    name = getattr(op, "name", op)  # torch.distributed.ReduceOp.SUM has .name == "SUM"
    if isinstance(name, str) and name.upper() in _BY_NAME:
        return _BY_NAME[name.upper()]
    choices = ", ".join(o.name for o in ReduceOp)
    raise ValueError(f"{where}: op must be a ReduceOp ({choices}), got {op!r}")
