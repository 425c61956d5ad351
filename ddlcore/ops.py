"""Reduction operators accepted by the collectives ("sum", "avg", "prod", "min", "max"), and
what each is on bool buffers (`logical`)."""

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


# What each op is on bool buffers, whose bytes (0 or 1) reduce as uint8: torch.distributed
# gloo's results (sum: OR, prod: AND, measured on torch 2.13), as max and min, which keep every
# byte 0 or 1 (gloo's sum adds the bytes: 2 for True + True, and 0 again after 256 Trues).
_LOGICAL = {Op.SUM: Op.MAX, Op.MAX: Op.MAX, Op.PROD: Op.MIN, Op.MIN: Op.MIN}


def logical(op: Op, argname: str = "op") -> Op:
    """The op that reduces bool buffers as ``op`` does: sum and max are logical OR (`Op.MAX`),
    prod and min logical AND (`Op.MIN`).

    Raises
    ------
    TypeError
        ``op`` is avg, which bool has no result for (gloo refuses it too).
    """
    found = _LOGICAL.get(op)
    if found is None:
        raise TypeError(
            f"{argname}={op.name.lower()!r} has no bool result; reduce bool with 'max' or "
            "'sum' (logical or) or 'min' or 'prod' (logical and), or convert it first"
        )
    return found
