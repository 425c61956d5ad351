"""Numba CUDA kernels: element-wise reduce, fused reduce-copy and avg's division on the GPU.

Kernels are built by factories and cached per (op, dtype), compiled on first use; ``numba.cuda``
is imported only when a kernel is first asked for. float16 is widened to float32, combined and
rounded once (round-to-nearest-even), exactly as NumPy does on the host, so GPU and CPU results
are bit-identical. Integers wrap. Float min/max propagate NaN like np.minimum/np.maximum.

Every kernel is a grid-stride loop: ``launch_config(n)`` caps the grid, so one launch covers any
n. Kernels run on the caller's stream when one is given.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ddlcore.ops import Op

THREADS = 256
MAX_BLOCKS = 8192  # x 256 threads: enough to fill an H100 several times over

# What the kernels accept (bfloat16 has no Numba type; it waits for its own bit-level kernels).
DTYPES = (np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64)
OPS = (Op.SUM, Op.PROD, Op.MIN, Op.MAX)


# ``numba.cuda``, bound on first use. It must be a module global: kernel bodies name it, and
# Numba's simulator swaps a global called ``cuda`` for its own thread-index module.
cuda: Any = None


def _cuda() -> Any:
    global cuda
    if cuda is None:
        from numba import cuda as numba_cuda

        cuda = numba_cuda
    return cuda


def launch_config(n: int) -> tuple[int, int]:
    return max(1, min(MAX_BLOCKS, -(-n // THREADS))), THREADS


# The op is written into the kernel's source rather than called as a device function: a call
# into another jitted function makes Numba ask the driver for the current device, which would
# stop `compile_all_ptx` working on machines without a GPU (CI).
_COMBINE = {
    (Op.SUM, False): "r = x + y",
    (Op.SUM, True): "r = x + y",
    (Op.PROD, False): "r = x * y",
    (Op.PROD, True): "r = x * y",
    (Op.MIN, False): "r = y if y < x else x",
    (Op.MAX, False): "r = y if y > x else x",
    # NaN-propagating, like np.minimum / np.maximum
    (Op.MIN, True): "r = x if x != x else (y if (y < x or y != y) else x)",
    (Op.MAX, True): "r = x if x != x else (y if (y > x or y != y) else x)",
}

_REDUCE_COPY_SOURCE = """
def reduce_copy_kernel(dst, a, b, n):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < n:
        x = {widen}(a[i])
        y = {widen}(b[i])
        {combine}
        dst[i] = {narrow}(r)
        i += stride
"""


@functools.cache
def reduce_copy_kernel(op: Op, dtype: str) -> Any:
    """``dst[i] = a[i] OP b[i]`` for dtype; dst may be a or b. float16 is combined in float32."""
    _cuda()
    dt = np.dtype(dtype)
    key = (Op(op), dt.kind == "f")
    if key not in _COMBINE:
        raise ValueError(f"op {op!r} is not an element-wise reduction (AVG is SUM then avg_scale)")
    half = dt == np.float16
    source = _REDUCE_COPY_SOURCE.format(widen="np.float32" if half else "",
                                        narrow="np.float16" if half else "",
                                        combine=_COMBINE[key])
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<reduce_copy_kernel {op!r} {dt}>", "exec"), globals(), namespace)
    return cuda.jit(namespace["reduce_copy_kernel"])


@functools.cache
def avg_scale_kernel(dtype: str) -> Any:
    """``dst[i] = dst[i] / divisor``: floats rounded once (float16 via float32), integers
    truncated toward zero."""
    _cuda()
    dt = np.dtype(dtype)
    if dt == np.float16:
        @cuda.jit
        def avg_scale_kernel(dst, divisor, n):
            i = cuda.grid(1)
            stride = cuda.gridsize(1)
            d = np.float32(divisor)
            while i < n:
                dst[i] = np.float16(np.float32(dst[i]) / d)
                i += stride
    elif dt.kind == "f":
        @cuda.jit
        def avg_scale_kernel(dst, divisor, n):
            i = cuda.grid(1)
            stride = cuda.gridsize(1)
            while i < n:
                dst[i] = dst[i] / divisor
                i += stride
    else:
        @cuda.jit
        def avg_scale_kernel(dst, divisor, n):
            i = cuda.grid(1)
            stride = cuda.gridsize(1)
            while i < n:
                x = np.int64(dst[i])
                q = x // divisor
                if q < 0 and q * divisor != x:  # floor -> truncation toward zero
                    q += 1
                dst[i] = q
                i += stride
    return avg_scale_kernel


def _check(arr: Any, name: str) -> np.dtype:
    dt = np.dtype(arr.dtype)
    if dt not in [np.dtype(d) for d in DTYPES]:
        raise TypeError(f"{name} has dtype {dt}; the CUDA kernels take "
                        f"{', '.join(np.dtype(d).name for d in DTYPES)}")
    return dt


def reduce_copy(dst: Any, a: Any, b: Any, op: Op | str = Op.SUM, stream: Any = 0) -> None:
    """``dst = a OP b`` on device arrays of one dtype and size (dst may be a or b)."""
    from ddlcore.ops import as_op

    rop = as_op(op)
    dt = _check(dst, "dst")
    if np.dtype(a.dtype) != dt or np.dtype(b.dtype) != dt or not (dst.size == a.size == b.size):
        raise ValueError("dst, a and b must have one dtype and size")
    n = int(dst.size)
    if n == 0:
        return
    kernel = reduce_copy_kernel(Op.SUM if rop == Op.AVG else rop, dt.str)
    blocks, threads = launch_config(n)
    kernel[blocks, threads, stream](dst.reshape(n), a.reshape(n), b.reshape(n), n)


def reduce_into(dst: Any, src: Any, op: Op | str = Op.SUM, stream: Any = 0) -> None:
    """``dst = dst OP src``."""
    reduce_copy(dst, dst, src, op, stream)


def avg_scale(dst: Any, divisor: int, stream: Any = 0) -> None:
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    dt = _check(dst, "dst")
    n = int(dst.size)
    if n == 0:
        return
    blocks, threads = launch_config(n)
    avg_scale_kernel(dt.str)[blocks, threads, stream](dst.reshape(n), divisor, n)


def _signatures() -> dict[str, tuple[Any, str]]:
    """Every kernel's Python function and a concrete signature, for PTX compilation."""
    out = {}
    names = {np.dtype(d): np.dtype(d).name for d in DTYPES}
    for dt, name in names.items():
        arr = f"{name}[::1]"
        for op in OPS:
            kernel = reduce_copy_kernel(op, dt.str)
            out[f"reduce_copy_{op.name.lower()}_{name}"] = (kernel.py_func,
                                                            f"void({arr}, {arr}, {arr}, int64)")
        out[f"avg_scale_{name}"] = (avg_scale_kernel(dt.str).py_func, f"void({arr}, int64, int64)")
    return out


def compile_all_ptx(cc: tuple[int, int] = (8, 0)) -> dict[str, str]:
    """PTX of every kernel for compute capability ``cc`` (no GPU needed, only NVVM)."""
    _cuda()
    return {name: cuda.compile_ptx(fn, sig, cc=cc)[0] for name, (fn, sig) in _signatures().items()}


def describe() -> str:
    return (f"Numba CUDA: reduce-copy sum/prod/min/max and avg scale for "
            f"{', '.join(np.dtype(d).name for d in DTYPES)} (bfloat16 pending)")
