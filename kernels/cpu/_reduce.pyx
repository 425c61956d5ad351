# cython: language_level=3, boundscheck=False, wraparound=False
"""Reduction and copy kernels over raw addresses, with the GIL released for the whole loop.

The engine calls these with the addresses of its buffers (``BufferDesc.ptr`` + offsets), so one
call costs a few hundred nanoseconds of Python overhead whatever the array type. Dtype and op are
the integer codes of ``ddlcore.kernels.dtypes.DType`` and ``ddlcore.ops.Op`` (SUM, PROD, MIN,
MAX; AVG is SUM followed by `avg_finalize`). The loops are in ``ddl_kernels.h``.
"""

cimport numpy as cnp
from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memcpy, memmove

cnp.import_array()


cdef extern from "ddl_kernels.h" nogil:
    int ddl_reduce(void *dst, const void *a, const void *b, int64_t n, int dtype, int op)
    int ddl_divide(void *dst, int64_t n, int dtype, int64_t divisor)
    int ddl_have_f16c()
    int ddl_force_portable_f16


def float16_path() -> str:
    """Which float16 sum/prod loop runs: "f16c" (vectorised) or "portable"."""
    return "f16c" if ddl_have_f16c() and not ddl_force_portable_f16 else "portable"


def force_portable_float16(bint on):
    """Use the portable float16 loops even where F16C exists (for tests comparing the two)."""
    global ddl_force_portable_f16
    ddl_force_portable_f16 = 1 if on else 0


cdef inline void _check(int dtype, int op) except *:
    if dtype < 0 or dtype > 7:
        raise ValueError(f"unknown dtype code {dtype}")
    if op < 0 or op > 3:
        raise ValueError(f"unknown op code {op} (AVG is SUM then avg_finalize)")


def reduce_into(uintptr_t dst, uintptr_t src, int64_t count, int dtype, int op):
    """dst[i] = dst[i] OP src[i] for i < count."""
    _check(dtype, op)
    with nogil:
        ddl_reduce(<void *>dst, <const void *>dst, <const void *>src, count, dtype, op)


def reduce_copy(uintptr_t dst, uintptr_t a, uintptr_t b, int64_t count, int dtype, int op):
    """dst[i] = a[i] OP b[i]; dst may be a or b (the same address, not a partial overlap)."""
    _check(dtype, op)
    with nogil:
        ddl_reduce(<void *>dst, <const void *>a, <const void *>b, count, dtype, op)


def avg_finalize(uintptr_t dst, int64_t count, int dtype, int64_t divisor):
    """dst[i] = dst[i] / divisor: floats rounded once (float16/bfloat16 via float32), integers
    rounded down (floor, toward minus infinity)."""
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    _check(dtype, 0)
    with nogil:
        ddl_divide(<void *>dst, count, dtype, divisor)


def copy_bytes(uintptr_t dst, uintptr_t src, int64_t nbytes):
    """memmove of nbytes (regions may overlap)."""
    if nbytes <= 0 or dst == src:
        return
    with nogil:
        memmove(<void *>dst, <const void *>src, <size_t>nbytes)


def array_address(cnp.ndarray a):
    """The address of a NumPy array's first element (``a.ctypes.data`` in ~1/30 of the time:
    buffer intake asks for it on every call)."""
    return <uintptr_t>cnp.PyArray_DATA(a)
