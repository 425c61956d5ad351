# Declarations of the boards' native engine (ddl_arena.h, ddl_arena_direct.h), for the Cython
# modules that call it: transports/_arena.pyx and ddlcore/execution/_frontend.pyx.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

cdef extern from "ddl_arena.h" nogil:
    enum: DDL_ARENA_MAX
    enum: DDL_A_HEADER
    enum: DDL_A_ABORT_CODE
    enum: DDL_A_ABORT_LEN
    enum: DDL_A_ABORT
    enum: DDL_E_COUNT
    enum: DDL_E_KIND
    enum: DDL_E_DTYPE
    enum: DDL_E_OP
    enum: DDL_E_ROOT
    ctypedef struct ddl_arena:
        int rank, size
        uint8_t *boards[64]
        int pids[64]
        int pidfds[64]
        uint64_t slot_bytes
        uint64_t epoch
        uint64_t chunk
        uint8_t *temp[3]
        uint64_t exposed
        int saved
        int bad_rank
        int64_t err
    ctypedef struct ddl_call:
        int kind, dtype, op, root
        int64_t count
        int itemsize
        int64_t divisor
        uint64_t check
        uint8_t *inp "in"
        uint8_t *out
        int64_t deadline_ns
    int ddl_arena_small(ddl_arena *a, const ddl_call *c)
    int ddl_arena_sync(ddl_arena *a, const ddl_call *c, const void *inp, const void *out)
    int ddl_arena_settle(ddl_arena *a, int64_t deadline_ns)
    void ddl_arena_abort(ddl_arena *a, uint32_t code, const uint8_t *reason, uint32_t len)
    uint8_t *ddl_entry(const ddl_arena *a, int q, uint64_t epoch)
    uint32_t ddl_load_acquire_u32(const void *p)
    uint64_t ddl_get_u64(const uint8_t *p)

cdef extern from "ddl_arena_direct.h" nogil:
    int ddl_arena_direct(ddl_arena *a, const ddl_call *c)
