/* Shared-memory primitives for the shm transport: acquire/release counters, a futex doorbell
 * that works across processes, wrap-around copies into and out of a byte ring, and a
 * cross-memory read (process_vm_readv). Everything here is called with the GIL released. */
#ifndef DDL_SHM_H
#define DDL_SHM_H

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static inline uint64_t ddl_load_acquire_u64(const void *p) {
    return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE);
}

static inline void ddl_store_release_u64(void *p, uint64_t v) {
    __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE);
}

static inline uint32_t ddl_load_acquire_u32(const void *p) {
    return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE);
}

static inline void ddl_store_release_u32(void *p, uint32_t v) {
    __atomic_store_n((uint32_t *)p, v, __ATOMIC_RELEASE);
}

static inline uint32_t ddl_fetch_add_u32(void *p, uint32_t v) {
    return __atomic_fetch_add((uint32_t *)p, v, __ATOMIC_SEQ_CST);
}

/* A doorbell is two u32 words: a sequence number bumped by every ring, and the number of
 * threads asleep on it. Both sides use sequentially consistent operations, so either the ringer
 * sees the sleeper (and wakes it) or the sleeper sees the new sequence (and does not sleep):
 * no wake-up is lost. The futex is not private: the word lives in a shared mapping. */
static inline void ddl_bell_ring(void *bell) {
    uint32_t *seq = (uint32_t *)bell, *sleepers = seq + 1;
    __atomic_add_fetch(seq, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static inline uint32_t ddl_bell_seq(const void *bell) {
    return __atomic_load_n((const uint32_t *)bell, __ATOMIC_SEQ_CST);
}

/* Sleep until the bell's sequence differs from `seen` or `timeout_ns` passes. */
static inline void ddl_bell_wait(void *bell, uint32_t seen, int64_t timeout_ns) {
    uint32_t *seq = (uint32_t *)bell, *sleepers = seq + 1;
    struct timespec ts;
    ts.tv_sec = (time_t)(timeout_ns / 1000000000);
    ts.tv_nsec = (long)(timeout_ns % 1000000000);
    __atomic_add_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(seq, __ATOMIC_SEQ_CST) == seen)
        syscall(SYS_futex, seq, FUTEX_WAIT, seen, &ts, NULL, 0);
    __atomic_sub_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
}

/* Copy n bytes into a ring of `cap` bytes (a power of two) at stream position pos. */
static inline void ddl_ring_put(uint8_t *ring, uint64_t cap, uint64_t pos, const uint8_t *src,
                                uint64_t n) {
    uint64_t off = pos & (cap - 1), first = cap - off;
    if (first > n) first = n;
    memcpy(ring + off, src, first);
    if (n > first) memcpy(ring, src + first, n - first);
}

/* Copy n bytes out of the ring at stream position pos. */
static inline void ddl_ring_get(const uint8_t *ring, uint64_t cap, uint64_t pos, uint8_t *dst,
                                uint64_t n) {
    uint64_t off = pos & (cap - 1), first = cap - off;
    if (first > n) first = n;
    memcpy(dst, ring + off, first);
    if (n > first) memcpy(dst + first, ring, n - first);
}

/* Read n bytes at `remote` in process `pid` into `local` (one copy, kernel to kernel).
 * Returns 0, or -errno (EPERM when ptrace rules forbid it, ESRCH when the process is gone). */
static inline int64_t ddl_cma_read(int pid, uint64_t remote, uint8_t *local, uint64_t n) {
    while (n > 0) {
        struct iovec l = {local, n}, r = {(void *)(uintptr_t)remote, n};
        ssize_t got = process_vm_readv((pid_t)pid, &l, 1, &r, 1, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) return -EFAULT;
        local += got;
        remote += (uint64_t)got;
        n -= (uint64_t)got;
    }
    return 0;
}

/* Write n bytes from `local` to `remote` in process `pid` (process_vm_writev). 0 or -errno. */
static inline int64_t ddl_cma_write(int pid, uint64_t remote, const uint8_t *local, uint64_t n) {
    while (n > 0) {
        struct iovec l = {(void *)local, n}, r = {(void *)(uintptr_t)remote, n};
        ssize_t put = process_vm_writev((pid_t)pid, &l, 1, &r, 1, 0);
        if (put < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (put == 0) return -EFAULT;
        local += put;
        remote += (uint64_t)put;
        n -= (uint64_t)put;
    }
    return 0;
}

#endif
