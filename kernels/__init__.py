"""Kernels: element-wise reductions, copies and pack/unpack, dispatched on (dtype code, op code).

The pointer-level API the engine uses (addresses are ints, counts in elements):

* ``reduce_into(dst, src, count, dtype, op)``        dst = dst OP src
* ``reduce_copy(dst, a, b, count, dtype, op)``       dst = a OP b (dst may be a or b)
* ``avg_finalize(dst, count, dtype, divisor)``       dst = dst / divisor
* ``copy_bytes(dst, src, nbytes)``
* ``pack(dst, srcs, nbytes)`` / ``unpack(src, dsts, nbytes)``   many ranges, one call

Array-level wrappers for NumPy (``reduce_arrays``, ``pack_arrays``, ``unpack_arrays``) serve tests
and users. ``reference`` holds the NumPy oracles every kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from ddlcore.kernels.cpu import (
    array_address,
    arrays_between,
    avg_finalize,
    copy_bytes,
    pack,
    reduce_copy,
    reduce_into,
    unpack,
)
from ddlcore.kernels.dtypes import DType, dtype_code

from ddlcore.ops import Op, as_op, logical


def _code(arr: np.ndarray, name: str) -> int:
    code = dtype_code(arr.dtype)
    if code is None:
        raise TypeError(f"{name} has unsupported dtype {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous")
    return int(code)


def reduce_arrays(
    dst: np.ndarray,
    src: np.ndarray,
    op: str | Op = "sum",
    out: np.ndarray | None = None,
    divisor: int | None = None,
) -> np.ndarray:
    """``out = dst OP src`` (``out`` defaults to ``dst``, i.e. in place); for "avg", the sum is
    divided by ``divisor`` (default 2): floats rounded once, integers the exact quotient rounded
    down (floor; computed without wrapping, e.g. int8 100 and 101 give 100). bool: sum and max
    are logical or, prod and min logical and; avg raises TypeError (`ddlcore.ops.logical`)."""
    rop = as_op(op)
    code = _code(dst, "dst")
    if dst.dtype.kind == "b":
        rop = logical(rop)
    if src.dtype != dst.dtype or src.size != dst.size:
        raise ValueError(f"src ({src.dtype}, {src.size}) must match dst ({dst.dtype}, {dst.size})")
    _code(src, "src")
    target = dst if out is None else out
    if target.dtype != dst.dtype or target.size != dst.size:
        raise ValueError("out must match dst in dtype and size")
    _code(target, "out")
    if rop == Op.AVG and dst.dtype.kind in "iu":
        target[...] = _floor_avg(dst, src, 2 if divisor is None else divisor)
        return target
    kop = Op.SUM if rop == Op.AVG else rop
    reduce_copy(target.ctypes.data, dst.ctypes.data, src.ctypes.data, dst.size, code, int(kop))
    if rop == Op.AVG:
        avg_finalize(target.ctypes.data, dst.size, code, 2 if divisor is None else divisor)
    return target


def _floor_avg(a: np.ndarray, b: np.ndarray, divisor: int) -> np.ndarray:
    """``floor((a + b) / divisor)`` element-wise without overflow: each operand split into
    quotient and remainder (``a = d*qa + ra``), so nothing wider than int64 is needed."""
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    a64, b64 = a.astype(np.int64).reshape(-1), b.astype(np.int64).reshape(-1)
    qa, ra = np.divmod(a64, divisor)
    qb, rb = np.divmod(b64, divisor)
    return (qa + qb + (ra + rb) // divisor).astype(a.dtype).reshape(a.shape)


def pack_arrays(arrays: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate the bytes of contiguous arrays into one uint8 buffer (one C loop)."""
    if out is None:
        out = np.empty(sum(a.nbytes for a in arrays), np.uint8)
    if not out.flags.c_contiguous:
        raise ValueError("out is not C-contiguous")
    arrays_between(array_address(out) if out.nbytes else 0, out.nbytes, arrays, True)
    return out


def unpack_arrays(flat: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    """Split ``flat`` (as written by `pack_arrays`) back into ``arrays``, in order."""
    if not flat.flags.c_contiguous:
        raise ValueError("flat is not C-contiguous")
    arrays_between(array_address(flat) if flat.nbytes else 0, flat.nbytes, arrays, False)


def describe() -> str:
    """One line for ``python -m ddlcore info``."""
    from ddlcore.kernels.cpu import _reduce

    return (
        f"Cython ({_reduce.__file__.rsplit('/', 1)[-1]}): reduce sum/prod/min/max/avg for "
        f"{', '.join(d.name.lower() for d in DType)} (bool as uint8); reduce-copy; pack/unpack"
    )


__all__ = [
    "DType",
    "array_address",
    "avg_finalize",
    "copy_bytes",
    "describe",
    "pack",
    "pack_arrays",
    "reduce_arrays",
    "reduce_copy",
    "reduce_into",
    "unpack",
    "unpack_arrays",
]
