"""Reduction operators accepted by the collectives ("sum", "avg", "prod", "min", "max")."""

from __future__ import annotations

import enum


class Op(enum.IntEnum):
    """Reduction operator. The integer values are the codes the kernels take."""

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4


_BY_NAME = {op.name.lower(): op for op in Op}


def as_op(op: Op | str, argname: str = "op") -> Op:
    """Normalise ``op`` ("sum", "SUM", Op.SUM ...) to an `Op`; ValueError names the argument."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        found = _BY_NAME.get(op.lower())
        if found is not None:
            return found
        raise ValueError(
            f"{argname}={op!r} is not a reduction operator; use one of {sorted(_BY_NAME)}"
        )
    raise TypeError(f"{argname} must be a str or ddlcore.Op, not {type(op).__name__}")
