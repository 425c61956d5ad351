# cython: language_level=3, boundscheck=False, wraparound=False
"""Fused pack and unpack: many byte ranges into (or out of) one flat buffer in one nogil loop.

The address and size tables are copied once into C arrays (from any sequence, or without a Python
loop from NumPy integer arrays), then one loop of memcpy runs with the GIL released. This is the
CPU side of gradient fusion: 1,000 small tensors cost one call, not 1,000.
"""

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

cnp.import_array()


cdef _table(values, Py_ssize_t n, str name):
    arr = np.ascontiguousarray(np.asarray(values, dtype=np.uint64).reshape(-1))
    if arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} entries, expected {n}")
    return arr


cdef uint64_t _gather_scatter(uintptr_t flat, table, nbytes, str table_name, bint to_flat) except? 0:
    """Copy between ``flat`` (contiguous) and the ranges of ``table``: into flat when ``to_flat``
    (pack), out of it otherwise (unpack). One nogil loop; returns the total bytes."""
    cdef Py_ssize_t n = len(nbytes)
    sizes = _table(nbytes, n, "nbytes")
    addrs = _table(table, n, table_name)
    cdef const uint64_t[::1] s = sizes
    cdef const uint64_t[::1] a = addrs
    cdef Py_ssize_t i
    cdef uint64_t off = 0
    with nogil:
        for i in range(n):
            if s[i]:
                if to_flat:
                    memcpy(<void *>(flat + off), <const void *><uintptr_t>a[i], <size_t>s[i])
                else:
                    memcpy(<void *><uintptr_t>a[i], <const void *>(flat + off), <size_t>s[i])
            off += s[i]
    return off


def pack(uintptr_t dst, srcs, nbytes):
    """Concatenate the byte ranges (srcs[i], nbytes[i]) into dst; returns the total bytes."""
    return _gather_scatter(dst, srcs, nbytes, "srcs", True)


def unpack(uintptr_t src, dsts, nbytes):
    """Split src into the byte ranges (dsts[i], nbytes[i]); returns the total bytes."""
    return _gather_scatter(src, dsts, nbytes, "dsts", False)


def arrays_between(uintptr_t flat, uint64_t capacity, arrays, bint to_flat):
    """Pack NumPy ``arrays`` into ``flat`` (``to_flat``) or unpack ``flat`` into them, in order:
    the table of addresses and sizes is read in C (tens of nanoseconds per array, where
    ``a.ctypes.data`` costs over a microsecond), then one nogil loop copies. Checks every array
    first (C-contiguous; writable when unpacking) and that ``flat`` holds ``capacity`` >= the
    total. Returns the total bytes."""
    cdef list items = list(arrays)
    cdef Py_ssize_t i, n = len(items)
    cdef cnp.ndarray a
    cdef uint64_t total = 0
    cdef uintptr_t *addr = <uintptr_t *>malloc(max(n, 1) * sizeof(uintptr_t))
    cdef uint64_t *size = <uint64_t *>malloc(max(n, 1) * sizeof(uint64_t))
    if addr == NULL or size == NULL:
        free(addr)
        free(size)
        raise MemoryError("pack/unpack table")
    try:
        for i in range(n):
            if not isinstance(items[i], np.ndarray):
                raise TypeError(f"arrays[{i}] is a {type(items[i]).__name__}, not a NumPy array")
            a = items[i]
            if not cnp.PyArray_IS_C_CONTIGUOUS(a) or (not to_flat and not cnp.PyArray_ISWRITEABLE(a)):
                raise ValueError(f"arrays[{i}] is not a {'' if to_flat else 'writable '}"
                                 "C-contiguous array")
            addr[i] = <uintptr_t>cnp.PyArray_DATA(a)
            size[i] = <uint64_t>cnp.PyArray_NBYTES(a)
            total += size[i]
        if total > capacity:
            raise ValueError(f"the flat buffer holds {capacity} bytes, the arrays {total}")
        total = 0
        with nogil:
            for i in range(n):
                if size[i]:
                    if to_flat:
                        memcpy(<void *>(flat + total), <const void *>addr[i], <size_t>size[i])
                    else:
                        memcpy(<void *>addr[i], <const void *>(flat + total), <size_t>size[i])
                total += size[i]
    finally:
        free(addr)
        free(size)
    return total
