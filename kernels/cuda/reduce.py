"""Numba CUDA kernels: element-wise reduce, fused reduce-copy and avg's division on the GPU.

Kernels are built by factories and cached per (op, dtype), compiled on first use; ``numba.cuda``
is imported only when a kernel is first asked for. float16 and bfloat16 are widened to float32,
combined and rounded once (round-to-nearest-even), exactly as NumPy, ml_dtypes and the CPU
kernels do, so GPU and CPU results are bit-identical (``elements`` holds the rules). bfloat16
arrays are uint16 or int16 device arrays holding the bit patterns, named by ``dtype="bfloat16"``.
Integers wrap. Float min/max propagate NaN like np.minimum/np.maximum.

Every kernel is a grid-stride loop: ``launch_config(n)`` caps the grid, so one launch covers any
n. Kernels run on the caller's stream when one is given.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from ddlcore.kernels.cuda import elements
from ddlcore.kernels.cuda.primitives import build_kernel
from ddlcore.kernels.cuda.runtime import (
    HALF_DTYPES,
    as_kernel_dtype,
    as_storage,
    element_dtype,
    fill,
    launch_config,
)

from ddlcore.ops import Op, as_op

OPS = (Op.SUM, Op.PROD, Op.MIN, Op.MAX)

_REDUCE_COPY_SOURCE = """
def reduce_copy_kernel(dst, a, b, n):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < n:
        x = {widen_a}
        y = {widen_b}
        {combine}
        {narrow}
        dst[i] = out
        i += stride
"""

_AVG_SCALE_FLOAT_SOURCE = """
def avg_scale_kernel(dst, divisor, n):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    d = {work}(divisor)
    while i < n:
        r = {widen} / d
        {narrow}
        dst[i] = out
        i += stride
"""

_AVG_SCALE_INT_SOURCE = """
def avg_scale_kernel(dst, divisor, n):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < n:
        dst[i] = np.int64(dst[i]) // divisor  # Python's //: floor, integer avg's rounding
        i += stride
"""


@functools.cache
def reduce_copy_kernel(op: Op, dtype: str) -> Any:
    """``dst[i] = a[i] OP b[i]`` for ``dtype`` (a name in KERNEL_DTYPES; bfloat16's arrays are
    uint16); dst may be a or b. float16 and bfloat16 are combined in float32."""
    dt = as_kernel_dtype(dtype, "dtype")
    work = "np.float32" if dt in HALF_DTYPES else ""
    source = fill(
        _REDUCE_COPY_SOURCE,
        widen_a=elements.widen(dt, "a[i]", work),
        widen_b=elements.widen(dt, "b[i]", work),
        combine=elements.combine(op, dt),
        narrow=elements.narrow(dt, "r", "out"),
    )
    return build_kernel(source, "reduce_copy_kernel", f"reduce_copy_kernel {op!r} {dt.name}")


@functools.cache
def avg_scale_kernel(dtype: str) -> Any:
    """``dst[i] = dst[i] / divisor``: floats rounded once (float16 and bfloat16 via float32),
    integers rounded down (floor)."""
    dt = as_kernel_dtype(dtype, "dtype")
    if dt.kind in "iu":
        return build_kernel(_AVG_SCALE_INT_SOURCE, "avg_scale_kernel", f"avg_scale_kernel {dt}")
    work = "np.float64" if dt == elements.F64 else "np.float32"
    source = fill(
        _AVG_SCALE_FLOAT_SOURCE,
        work=work,
        widen=elements.widen(dt, "dst[i]", work),
        narrow=elements.narrow(dt, "r", "out"),
    )
    return build_kernel(source, "avg_scale_kernel", f"avg_scale_kernel {dt.name}")


def reduce_copy(
    dst: Any, a: Any, b: Any, op: Op | str = Op.SUM, stream: Any = 0, dtype: Any = None
) -> None:
    """``dst = a OP b`` element-wise on device arrays of one dtype and size (dst may be a or b).

    Parameters
    ----------
    dst, a, b
        Numba device arrays (anything ``numba.cuda.as_cuda_array`` made), C-contiguous.
    op
        "sum", "prod", "min" or "max" ("avg" is "sum"; divide with `avg_scale`).
    stream
        The CUDA stream to launch on (0: the default stream).
    dtype
        What the arrays hold when their own dtype does not say: ``"bfloat16"`` (or
        ``ml_dtypes.bfloat16``) for uint16/int16 arrays of bfloat16 bit patterns.

    Raises
    ------
    TypeError
        An element type the kernels do not take (naming the array or ``dtype``).
    ValueError
        Arrays of different dtypes or sizes, or an op that is not a reduction.
    """
    rop = as_op(op)
    dt = element_dtype(dst.dtype, dtype, "dst")
    if np.dtype(a.dtype) != np.dtype(dst.dtype) or np.dtype(b.dtype) != np.dtype(dst.dtype):
        raise ValueError(f"dst, a and b must have one dtype; got {dst.dtype}, {a.dtype}, {b.dtype}")
    if not dst.size == a.size == b.size:
        raise ValueError(f"dst, a and b must have one size; got {dst.size}, {a.size}, {b.size}")
    kernel = reduce_copy_kernel(Op.SUM if rop == Op.AVG else rop, dt.name)
    n = int(dst.size)
    if n == 0:
        return
    blocks, threads = launch_config(n)
    kernel[blocks, threads, stream](*(as_storage(x, dt).reshape(n) for x in (dst, a, b)), n)


def reduce_into(
    dst: Any, src: Any, op: Op | str = Op.SUM, stream: Any = 0, dtype: Any = None
) -> None:
    """``dst = dst OP src`` (see `reduce_copy`)."""
    reduce_copy(dst, dst, src, op, stream, dtype)


def avg_scale(dst: Any, divisor: int, stream: Any = 0, dtype: Any = None) -> None:
    """``dst = dst / divisor`` in place: floats rounded once (half types through float32),
    integers rounded down (floor, as integer avg; the collectives sum integers wide first). ``dtype`` as in `reduce_copy`; ValueError for a divisor < 1."""
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    dt = element_dtype(dst.dtype, dtype, "dst")
    kernel = avg_scale_kernel(dt.name)
    n = int(dst.size)
    if n == 0:
        return
    blocks, threads = launch_config(n)
    kernel[blocks, threads, stream](as_storage(dst, dt).reshape(n), divisor, n)
