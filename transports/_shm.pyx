# cython: language_level=3, boundscheck=False, wraparound=False
"""Native half of the shm transport: mapping segments, atomics with acquire/release ordering,
the futex doorbell, ring copies and cross-memory reads (see ``ddl_shm.h``).

Addresses are plain integers (a mapping's base plus an offset); copies into and out of user
buffers take the buffer itself, so no address has to be dug out of a memoryview in Python.
Every copy and every sleep releases the GIL.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy
from posix.mman cimport MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap, munmap


cdef extern from "ddl_shm.h" nogil:
    uint64_t ddl_load_acquire_u64(const void *p)
    void ddl_store_release_u64(void *p, uint64_t v)
    uint32_t ddl_load_acquire_u32(const void *p)
    void ddl_store_release_u32(void *p, uint32_t v)
    uint32_t ddl_fetch_add_u32(void *p, uint32_t v)
    void ddl_bell_ring(void *bell)
    uint32_t ddl_bell_seq(const void *bell)
    void ddl_bell_wait(void *bell, uint32_t seen, int64_t timeout_ns)
    void ddl_ring_put(uint8_t *ring, uint64_t cap, uint64_t pos, const uint8_t *src, uint64_t n)
    void ddl_ring_get(const uint8_t *ring, uint64_t cap, uint64_t pos, uint8_t *dst, uint64_t n)
    int64_t ddl_cma_read(int pid, uint64_t remote, uint8_t *local, uint64_t n)
    int64_t ddl_cma_write(int pid, uint64_t remote, const uint8_t *local, uint64_t n)

cdef extern from "<errno.h>":
    int errno


def map_shared(int fd, uint64_t nbytes):
    """Map ``nbytes`` of ``fd`` read-write and shared; returns the base address."""
    cdef void *p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
    if p == MAP_FAILED:
        raise OSError(errno, "mmap of a shared-memory segment failed")
    return <uintptr_t>p


def unmap(uintptr_t addr, uint64_t nbytes):
    munmap(<void *>addr, nbytes)


def load_u64(uintptr_t addr):
    return ddl_load_acquire_u64(<void *>addr)


def store_u64(uintptr_t addr, uint64_t value):
    ddl_store_release_u64(<void *>addr, value)


def load_u32(uintptr_t addr):
    return ddl_load_acquire_u32(<void *>addr)


def store_u32(uintptr_t addr, uint32_t value):
    ddl_store_release_u32(<void *>addr, value)


def put_bytes(uintptr_t addr, const uint8_t[::1] data):
    """Copy ``data`` to ``addr`` (small control records: headers, abort reasons)."""
    cdef Py_ssize_t n = data.shape[0]
    if n:
        memcpy(<void *>addr, &data[0], n)


def get_bytes(uintptr_t addr, Py_ssize_t n):
    return bytes((<uint8_t *>addr)[:n]) if n else b""


def fetch_add_u32(uintptr_t addr, uint32_t value):
    return ddl_fetch_add_u32(<void *>addr, value)


def bell_ring(uintptr_t bell):
    ddl_bell_ring(<void *>bell)


def bell_seq(uintptr_t bell):
    return ddl_bell_seq(<void *>bell)


def bell_wait(uintptr_t bell, uint32_t seen, double timeout_s):
    cdef int64_t ns = <int64_t>(timeout_s * 1e9) if timeout_s > 0 else 0
    with nogil:
        ddl_bell_wait(<void *>bell, seen, ns)


def ring_put(uintptr_t ring, uint64_t cap, uint64_t pos, const uint8_t[::1] src, uint64_t offset,
             uint64_t n):
    """Copy ``src[offset:offset + n]`` into the ring at stream position ``pos``."""
    if offset + n > <uint64_t>src.shape[0]:
        raise ValueError("ring_put beyond the source buffer")
    if n:
        with nogil:
            ddl_ring_put(<uint8_t *>ring, cap, pos, &src[0] + offset, n)


def ring_get(uintptr_t ring, uint64_t cap, uint64_t pos, uint8_t[::1] dst, uint64_t offset,
             uint64_t n):
    """Copy ``n`` bytes at stream position ``pos`` into ``dst[offset:offset + n]``."""
    if offset + n > <uint64_t>dst.shape[0]:
        raise ValueError("ring_get beyond the destination buffer")
    if n:
        with nogil:
            ddl_ring_get(<const uint8_t *>ring, cap, pos, &dst[0] + offset, n)


def address_of(const uint8_t[::1] buf):
    """The address of a contiguous buffer's first byte (0 when empty)."""
    return <uintptr_t>&buf[0] if buf.shape[0] else 0


def cma_read(int pid, uint64_t remote, uint8_t[::1] dst, uint64_t offset, uint64_t n):
    """Read ``n`` bytes at ``remote`` in process ``pid`` into ``dst[offset:]``; 0 or -errno."""
    cdef int64_t rc = 0
    if offset + n > <uint64_t>dst.shape[0]:
        raise ValueError("cma_read beyond the destination buffer")
    if n:
        with nogil:
            rc = ddl_cma_read(pid, remote, &dst[0] + offset, n)
    return rc


def cma_write(int pid, uint64_t remote, const uint8_t[::1] src, uint64_t offset, uint64_t n):
    """Write ``src[offset:offset + n]`` to ``remote`` in process ``pid``; 0 or -errno."""
    cdef int64_t rc = 0
    if offset + n > <uint64_t>src.shape[0]:
        raise ValueError("cma_write beyond the source buffer")
    if n:
        with nogil:
            rc = ddl_cma_write(pid, remote, &src[0] + offset, n)
    return rc
