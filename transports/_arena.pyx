# cython: language_level=3, boundscheck=False, wraparound=False
"""Native half of the shm transport's host collectives (``shm.boards``): a rank's view of every
local rank's board and the collective bodies of ``ddl_arena.h`` (large messages:
``ddl_arena_direct.h``), each one call with the GIL released.

Addresses are plain integers; the Python side validated the buffers and computes deadlines on
``time.monotonic()`` (CLOCK_MONOTONIC, the clock the C side reads).
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc


from ddl_arena_api cimport (
    DDL_A_ABORT,
    DDL_A_ABORT_CODE,
    DDL_A_ABORT_LEN,
    DDL_A_HEADER,
    DDL_ARENA_MAX,
    DDL_E_COUNT,
    DDL_E_DTYPE,
    DDL_E_KIND,
    DDL_E_OP,
    DDL_E_ROOT,
    ddl_arena,
    ddl_arena_abort,
    ddl_arena_direct,
    ddl_arena_settle,
    ddl_arena_small,
    ddl_arena_sync,
    ddl_call,
    ddl_entry,
    ddl_get_u64,
    ddl_load_acquire_u32,
)

MAX_RANKS = DDL_ARENA_MAX
HEADER_BYTES = DDL_A_HEADER


cdef int64_t _deadline_ns(double deadline):
    # A timeout of years (or inf) must not overflow into the past.
    return <int64_t>(min(deadline, 4e9) * 1e9)


cdef class Arena:
    """This rank's handle on the boards of ``size`` local ranks (``boards[q]``: the address where
    rank q's board is mapped here; ``pidfds[q]``: -1 for this rank)."""

    cdef ddl_arena a

    def __cinit__(self, int rank, int size, boards, pids, pidfds, uint64_t slot_bytes,
                  uint64_t chunk):
        if not 1 < size <= DDL_ARENA_MAX or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of size {size}: host collectives take 2 to "
                             f"{DDL_ARENA_MAX} ranks")
        self.a.rank, self.a.size = rank, size
        for q in range(size):
            self.a.boards[q] = <uint8_t *><uintptr_t>boards[q]
            self.a.pids[q] = pids[q]
            self.a.pidfds[q] = pidfds[q]
        self.a.slot_bytes, self.a.chunk, self.a.epoch = slot_bytes, chunk, 0
        self.a.exposed, self.a.saved = 0, 0
        self.a.temp[0] = <uint8_t *>malloc(3 * chunk)
        if self.a.temp[0] == NULL:
            raise MemoryError("host collectives: no memory for the direct-read staging")
        self.a.temp[1] = self.a.temp[0] + chunk
        self.a.temp[2] = self.a.temp[1] + chunk
        self.a.bad_rank, self.a.err = -1, 0

    def __dealloc__(self):
        free(self.a.temp[0])

    def run(self, int mode, int kind, uintptr_t inp, uintptr_t out, int64_t count,
            int itemsize, int dtype, int op, int64_t divisor, int root, uint64_t check,
            double deadline):
        """Run one collective (mode 0: through the slots, 1: direct, 2: only a sync point
        comparing the call, before it runs elsewhere); returns a status (0: done; see
        ``shm.boards`` for the others)."""
        cdef ddl_call c
        cdef int st
        c.kind, c.dtype, c.op, c.root = kind, dtype, op, root
        c.count, c.itemsize, c.divisor, c.check = count, itemsize, divisor, check
        c.inp, c.out = <uint8_t *>inp, <uint8_t *>out
        c.deadline_ns = _deadline_ns(deadline)
        self.a.bad_rank, self.a.err = -1, 0
        with nogil:
            if mode == 1:
                st = ddl_arena_direct(&self.a, &c)
            elif mode == 2:
                st = ddl_arena_sync(&self.a, &c, NULL, NULL)
            else:
                st = ddl_arena_small(&self.a, &c)
        return st

    def settle(self, double deadline):
        """After a failed direct call: True once no peer can still touch our buffers, False if
        ``deadline`` passed first."""
        cdef int64_t ns = _deadline_ns(deadline)
        cdef int ok
        with nogil:
            ok = ddl_arena_settle(&self.a, ns)
        return bool(ok)

    @property
    def address(self):
        """Where this handle's ``ddl_arena`` lives: the compiled front end
        (``ddlcore.execution._frontend``) runs the same bodies on it, holding this object."""
        return <uintptr_t>&self.a

    @property
    def bad_rank(self):
        return self.a.bad_rank

    @property
    def err(self):
        return self.a.err

    @property
    def epoch(self):
        return self.a.epoch

    def entry(self, int q):
        """What rank q published at our current epoch: (kind, dtype, op, root, count)."""
        cdef const uint8_t *e = ddl_entry(&self.a, q, self.a.epoch)
        return ((<const uint32_t *>(e + DDL_E_KIND))[0], (<const uint32_t *>(e + DDL_E_DTYPE))[0],
                (<const uint32_t *>(e + DDL_E_OP))[0], (<const uint32_t *>(e + DDL_E_ROOT))[0],
                ddl_get_u64(e + DDL_E_COUNT))

    def abort_note(self, int q):
        """Rank q's abort (code, reason bytes); code 0 if it has not aborted."""
        cdef uint8_t *b = self.a.boards[q]
        cdef uint32_t code = ddl_load_acquire_u32(b + DDL_A_ABORT_CODE)
        if not code:
            return 0, b""
        cdef uint32_t n = ddl_load_acquire_u32(b + DDL_A_ABORT_LEN)
        return code, bytes(b[DDL_A_ABORT:DDL_A_ABORT + min(n, 1024)])

    def abort(self, uint32_t code, bytes reason):
        """Leave our abort note (the first one stays) and wake the peers."""
        cdef const uint8_t *p = reason
        ddl_arena_abort(&self.a, code, p, <uint32_t>len(reason))
