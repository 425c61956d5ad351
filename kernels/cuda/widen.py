"""Mixed-precision accumulation on the GPU: reduce float16/bfloat16 data into a float32
accumulator and round to the half type once at the end, instead of rounding after every step.

    widen_copy(acc, x0)              acc = float32(x0)
    reduce_widen(acc, acc, x1, op)   acc = acc OP float32(x1)     (as often as there are inputs)
    narrow_copy(out, acc, divisor)   out = half(acc / divisor)    (one rounding; divisor 1: none)

A sum of P half-precision inputs then carries one rounding error, not P - 1. Widening is exact;
narrowing rounds to nearest-even (``elements``). Kernels are cached per (op, dtype) like
``reduce``'s; bfloat16 arrays are uint16/int16 device arrays named by ``dtype="bfloat16"``.
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

_WIDEN_COPY_SOURCE = """
def widen_copy_kernel(dst, src, n):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < n:
        dst[i] = {widen}
        i += stride
"""

_REDUCE_WIDEN_SOURCE = """
def reduce_widen_kernel(dst, acc, src, n):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < n:
        x = acc[i]
        y = {widen}
        {combine}
        dst[i] = r
        i += stride
"""

_NARROW_COPY_SOURCE = """
def narrow_copy_kernel(dst, src, divisor, n):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    d = np.float32(divisor)
    divide = divisor != 1
    while i < n:
        r = src[i]
        if divide:
            r = r / d
        {narrow}
        dst[i] = out
        i += stride
"""


def _half(dtype: str) -> np.dtype:
    dt = as_kernel_dtype(dtype, "dtype")
    if dt not in HALF_DTYPES:
        raise TypeError(f"dtype={dt.name}: the widening kernels take float16 and bfloat16")
    return dt


@functools.cache
def widen_copy_kernel(dtype: str) -> Any:
    """``dst_f32[i] = float32(src[i])`` for a half ``dtype`` (exact)."""
    dt = _half(dtype)
    source = fill(_WIDEN_COPY_SOURCE, widen=elements.widen(dt, "src[i]", "np.float32"))
    return build_kernel(source, "widen_copy_kernel", f"widen_copy_kernel {dt.name}")


@functools.cache
def reduce_widen_kernel(op: Op, dtype: str) -> Any:
    """``dst_f32[i] = acc_f32[i] OP float32(src[i])`` for a half ``dtype``; dst may be acc."""
    dt = _half(dtype)
    source = fill(
        _REDUCE_WIDEN_SOURCE,
        widen=elements.widen(dt, "src[i]", "np.float32"),
        combine=elements.combine(op, elements.F32),
    )
    return build_kernel(source, "reduce_widen_kernel", f"reduce_widen_kernel {op!r} {dt.name}")


@functools.cache
def narrow_copy_kernel(dtype: str) -> Any:
    """``dst[i] = half(src_f32[i] / divisor)``, rounded once (no division when divisor is 1)."""
    dt = _half(dtype)
    source = fill(_NARROW_COPY_SOURCE, narrow=elements.narrow(dt, "r", "out"))
    return build_kernel(source, "narrow_copy_kernel", f"narrow_copy_kernel {dt.name}")


def _float32(arr: Any, name: str) -> None:
    if np.dtype(arr.dtype) != np.float32:
        raise TypeError(f"{name} must be a float32 device array, not {arr.dtype}")


def _half_of(arr: Any, dtype: Any, name: str) -> np.dtype:
    dt = element_dtype(arr.dtype, dtype, name)
    if dt not in HALF_DTYPES:
        raise TypeError(
            f"{name} holds {dt.name}; the widening kernels take float16 and bfloat16 "
            "(bfloat16 as uint16/int16 with dtype='bfloat16')"
        )
    return dt


def _same_size(**arrays: Any) -> int:
    sizes = {name: int(a.size) for name, a in arrays.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError("sizes differ: " + ", ".join(f"{k} has {v}" for k, v in sizes.items()))
    return next(iter(sizes.values()))


def widen_copy(dst: Any, src: Any, stream: Any = 0, dtype: Any = None) -> None:
    """``dst = float32(src)``: start a float32 accumulator from half-precision data.

    Parameters
    ----------
    dst
        float32 device array.
    src
        float16 device array, or uint16/int16 holding bfloat16 (with ``dtype="bfloat16"``).
    stream
        The CUDA stream to launch on.
    dtype
        What ``src`` holds when its own dtype does not say ("bfloat16").

    Raises
    ------
    TypeError
        ``dst`` not float32, or ``src`` not a half type (naming the argument).
    ValueError
        Different sizes.
    """
    _float32(dst, "dst")
    dt = _half_of(src, dtype, "src")
    n = _same_size(dst=dst, src=src)
    if n:
        blocks, threads = launch_config(n)
        widen_copy_kernel(dt.name)[blocks, threads, stream](
            dst.reshape(n), as_storage(src, dt).reshape(n), n
        )


def reduce_widen(
    dst: Any, acc: Any, src: Any, op: Op | str = Op.SUM, stream: Any = 0, dtype: Any = None
) -> None:
    """``dst = acc OP float32(src)``: fold half-precision ``src`` into a float32 accumulator
    (``dst`` may be ``acc``). ``op``: "sum", "prod", "min", "max" ("avg" is "sum"; divide in
    `narrow_copy`). Other arguments and errors as in `widen_copy`."""
    rop = as_op(op)
    _float32(dst, "dst")
    _float32(acc, "acc")
    dt = _half_of(src, dtype, "src")
    n = _same_size(dst=dst, acc=acc, src=src)
    kernel = reduce_widen_kernel(Op.SUM if rop == Op.AVG else rop, dt.name)
    if n:
        blocks, threads = launch_config(n)
        kernel[blocks, threads, stream](
            dst.reshape(n), acc.reshape(n), as_storage(src, dt).reshape(n), n
        )


def narrow_copy(dst: Any, src: Any, divisor: int = 1, stream: Any = 0, dtype: Any = None) -> None:
    """``dst = half(src / divisor)``: finish a float32 accumulation, rounding once to ``dst``'s
    half type (float16, or bfloat16 in a uint16/int16 array with ``dtype="bfloat16"``).
    ``divisor`` (>= 1) is avg's count; the division is in float32. Errors as in `widen_copy`,
    plus ValueError for a divisor < 1."""
    if divisor < 1:
        raise ValueError(f"divisor must be positive, got {divisor}")
    _float32(src, "src")
    dt = _half_of(dst, dtype, "dst")
    n = _same_size(dst=dst, src=src)
    if n:
        blocks, threads = launch_config(n)
        narrow_copy_kernel(dt.name)[blocks, threads, stream](
            as_storage(dst, dt).reshape(n), src.reshape(n), divisor, n
        )
