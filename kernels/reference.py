"""NumPy oracles: what every kernel and collective is tested against.

The reductions apply the op left to right in the arrays' own dtype exactly as NumPy does
(float16 via NumPy's float16 arithmetic, bfloat16 via ml_dtypes, integers wrapping). ``avg`` is
the sum divided by the number of arrays: floats rounded once (float16/bfloat16 through float32,
as the kernels do), integers truncated toward zero, computed exactly even for int64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ddlcore.ops import Op, as_op

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
    """``total / divisor`` with the kernels' rounding: floats once, integers toward zero."""
    dt = total.dtype
    if dt.kind in "iu":
        wide = total.astype(np.int64)
        quot = np.abs(wide) // divisor  # |x| fits: int64 minimum is never an avg of our inputs
        return (np.sign(wide) * quot).astype(dt)
    if dt.itemsize == 2:  # float16 and bfloat16: divide in float32, round once
        return (total.astype(np.float32) / np.float32(divisor)).astype(dt)
    return (total / dt.type(divisor)).astype(dt)


def reduce_ref(arrays: Sequence[np.ndarray], op: str | Op = "sum") -> np.ndarray:
    """Element-wise reduction of ``arrays`` (left to right); "avg" = sum then `divide_ref`."""
    rop = as_op(op)
    if rop == Op.AVG:
        return avg_ref(arrays)
    return _combine(arrays, rop)


def avg_ref(arrays: Sequence[np.ndarray]) -> np.ndarray:
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
        out.append(raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape).copy())
        off += a.nbytes
    return out
