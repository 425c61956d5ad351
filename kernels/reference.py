"""NumPy oracles: what every kernel and collective is tested against.

The reductions apply the op left to right in the arrays' own dtype exactly as NumPy does
(float16 via NumPy's float16 arithmetic, bfloat16 via ml_dtypes, integers wrapping). ``avg`` is
the sum divided by the number of arrays: floats rounded once (float16/bfloat16 through float32,
as the kernels do); integers the exact mean rounded down (floor), never wrapping. The
bool arrays reduce as NumPy's bool arithmetic does: sum logical or, prod logical and (which
are max and min: ``ddlcore.ops.logical``); their avg is undefined. The
``*_widened`` / ``accumulate_float32`` oracles keep half-precision sums in float32 and round once
at the end; ``cast_ref`` and the ``*_cast_ref`` pack oracles convert and scale as the fused GPU
pack kernels do.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from ddlcore.ops import Op, as_op

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_BINARY = {Op.SUM: np.add, Op.PROD: np.multiply, Op.MIN: np.minimum, Op.MAX: np.maximum}


def _combine(arrays: Sequence[np.ndarray], op: Op) -> np.ndarray:
    if not arrays:
        raise ValueError("need at least one array")
    fn = _BINARY[op]
    acc = np.array(arrays[0], copy=True)
    with np.errstate(over="ignore", invalid="ignore"):
        for a in arrays[1:]:
            acc = fn(acc, a).astype(acc.dtype, copy=False)
    return acc


def divide_ref(total: np.ndarray, divisor: int) -> np.ndarray:
    """``total / divisor`` with the kernels' rounding: floats once, integers down (floor)."""
    dt = total.dtype
    if dt.kind in "iu":
        return np.floor_divide(total.astype(np.int64), divisor).astype(dt)
    if dt.itemsize == 2:  # float16 and bfloat16: divide in float32, round once
        return (total.astype(np.float32) / np.float32(divisor)).astype(dt)
    return (total / dt.type(divisor)).astype(dt)


def reduce_ref(arrays: Sequence[np.ndarray], op: str | Op = "sum") -> np.ndarray:
    """Element-wise reduction of ``arrays`` (left to right); "avg" = sum then `divide_ref`."""
    rop = as_op(op)
    if rop == Op.AVG and arrays and np.asarray(arrays[0]).dtype.kind == "b":
        raise TypeError("op='avg' has no bool result")
    if rop == Op.AVG:
        return avg_ref(arrays)
    return _combine(arrays, rop)


def avg_ref(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The element-wise mean: floats as the kernels round it (sum in the dtype, then
    `divide_ref`); integers exactly, rounded down (floor), in Python's unbounded integers."""
    if arrays and np.asarray(arrays[0]).dtype.kind in "iu":
        dt = np.asarray(arrays[0]).dtype
        total = np.zeros(np.asarray(arrays[0]).shape, object)
        for a in arrays:
            total = total + np.asarray(a).astype(object)
        return np.asarray(total // len(arrays)).astype(dt)
    return divide_ref(_combine(arrays, Op.SUM), len(arrays))


def pack_ref(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The bytes of ``arrays`` back to back, as one uint8 array."""
    if not arrays:
        return np.empty(0, np.uint8)
    return np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])


def unpack_ref(flat: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Arrays shaped and typed like ``like``, cut in order from the bytes of ``flat``."""
    out, off = [], 0
    raw = flat.reshape(-1).view(np.uint8)
    for a in like:
        out.append(raw[off : off + a.nbytes].view(a.dtype).reshape(a.shape).copy())
        off += a.nbytes
    return out


def accumulate_float32_ref(arrays: Sequence[np.ndarray], op: str | Op = "sum") -> np.ndarray:
    """Element-wise reduction of half-precision ``arrays`` (left to right) in float32: each
    widened exactly, every step rounded to float32 only ("avg" is "sum" here)."""
    rop = as_op(op)
    return _combine(
        [np.asarray(a).astype(np.float32) for a in arrays], Op.SUM if rop == Op.AVG else rop
    )


def reduce_widened_ref(arrays: Sequence[np.ndarray], op: str | Op = "sum") -> np.ndarray:
    """`accumulate_float32_ref`, then rounded once to the arrays' dtype; "avg" divides the float32
    sum by ``len(arrays)`` before that one rounding."""
    acc = accumulate_float32_ref(arrays, op)
    if as_op(op) == Op.AVG:
        acc = acc / np.float32(len(arrays))
    return acc.astype(arrays[0].dtype)


def cast_ref(array: np.ndarray, dtype: np.dtype, scale: float | None = None) -> np.ndarray:
    """``array`` converted to ``dtype`` and multiplied by ``scale``, rounded once, as the fused
    pack kernels do: arithmetic in float32, or float64 when either type is float64 (float64 ->
    bfloat16 then goes through float32, as ml_dtypes' own cast does). No scale and no change of
    type is a plain copy."""
    dt = np.dtype(dtype)
    if array.dtype == dt and scale is None:
        return np.array(array, copy=True)
    wide = np.dtype(np.float64) in (array.dtype, dt)
    work: type[np.floating] = np.float64 if wide else np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        value = array.astype(work)
        if scale is not None:
            value = value * work(scale)
        if dt == _BFLOAT16:
            value = value.astype(np.float32)
        return value.astype(dt)


def pack_cast_ref(
    arrays: Sequence[np.ndarray], dtype: np.dtype, scale: float | None = None
) -> np.ndarray:
    """The elements of ``arrays`` back to back as one ``dtype`` array, each `cast_ref`'d."""
    parts = [cast_ref(np.asarray(a).reshape(-1), dtype, scale) for a in arrays]
    return np.concatenate(parts) if parts else np.empty(0, dtype)


def unpack_cast_ref(
    flat: np.ndarray, like: Sequence[np.ndarray], scale: float | None = None
) -> list[np.ndarray]:
    """Arrays shaped and typed like ``like``, cut in order from the elements of ``flat`` and
    `cast_ref`'d to their dtype."""
    out, off = [], 0
    flat = flat.reshape(-1)
    for a in like:
        out.append(cast_ref(flat[off : off + a.size], a.dtype, scale).reshape(a.shape))
        off += a.size
    return out
