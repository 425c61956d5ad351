# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled front end of a one-host communicator's collectives (issue: a 4 KB allreduce paid
~35 us of Python on each rank, the boards' native call 3 us). For the common call -- a
C-contiguous NumPy array of a supported dtype, nothing queued on the communicator -- `FrontEnd`
does in one native step what `calls.prepare`, the executor, the flight recorder and the boards
path do in Python: check the arguments, take the sequence number, record the call, run it
through the boards (``transports/ddl_arena.h``) with the GIL released. Anything else it declines
(`DECLINED`, before anything is taken or sent) and the Python path runs the call, so both paths
produce the same check words, sequence numbers and errors; a failed call is handed to Python
(``failed``, then ``broken``), which names it as the Python path would.

Where no boards run the collectives but one transport with a native runner links every peer
(tcp: ``Context.run_steps``), the front end takes allreduces the same way up to the run, which
``links`` (`frontend.OnLinks`) does: each call shape is planned once by the Python path's rules
(None: declined), then each call is handed to the links' runner, the engine finishing whatever
it leaves. Broadcast and barrier there take the Python path.

Also here: `check_word`, the word every message and sync point of a call carries (both paths).
"""

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.time cimport timespec

cnp.import_array()

cdef extern from "<time.h>" nogil:
    int clock_gettime(int clk, timespec *ts)
    enum: CLOCK_MONOTONIC
    enum: CLOCK_REALTIME

from ddl_arena_api cimport ddl_arena, ddl_arena_direct, ddl_arena_small, ddl_call

cdef extern from "numpy/arrayobject.h":
    object PyArray_NewLikeArray(cnp.ndarray prototype, int order, void *descr, int subok)

import numpy as np

# What the front end returns for a call it does not take (the Python path runs it).
DECLINED = object()

# ddl_arena.h's DDL_K_* (transports/shm/board_calls.BoardKind) and the modes of Arena.run.
DEF K_ALLREDUCE = 1
DEF K_BROADCAST = 4
DEF K_BARRIER = 5
DEF SLOTS = 0
DEF DIRECT = 1
DEF NONE_CODE = 255  # no dtype (barrier), no op: as in the check word of the Python path
# Op codes (ddlcore.ops.Op) and the first integer dtype code (kernels.dtypes.DType).
DEF OP_SUM = 0
DEF OP_AVG = 4
DEF FIRST_INT_CODE = 4
DEF N_CODES = 8

cdef uint32_t _crc_table[256]


cdef void _init_crc():
    cdef uint32_t c
    cdef int i, k
    for i in range(256):
        c = <uint32_t>i
        for k in range(8):
            c = (c >> 1) ^ (0xEDB88320 if c & 1 else 0)
        _crc_table[i] = c


_init_crc()


cdef inline void _put_i64(uint8_t *p, int64_t v) noexcept nogil:
    cdef uint64_t u = <uint64_t>v
    cdef int i
    for i in range(8):
        p[i] = <uint8_t>(u >> (8 * i))


cdef uint64_t _check_word(int kind, int code, int op, int64_t count, int64_t root,
                          int64_t chunk) noexcept nogil:
    # CRC-32 (zlib's) of struct.pack("<BBBqqq", kind, code, op, count, root, chunk), odd.
    cdef uint8_t raw[27]
    cdef uint32_t crc = ~(<uint32_t>0)
    cdef int i
    raw[0] = <uint8_t>kind
    raw[1] = <uint8_t>code
    raw[2] = <uint8_t>op
    _put_i64(raw + 3, count)
    _put_i64(raw + 11, root)
    _put_i64(raw + 19, chunk)
    for i in range(27):
        crc = _crc_table[<uint8_t>(crc ^ raw[i])] ^ (crc >> 8)
    crc = ~crc
    return crc | 1


def check_word(int kind, int code, int op, int64_t count, int64_t root, int64_t chunk):
    """The check word of a call: board kind, dtype code, op code (255: none), element count,
    root and the schedule's chunk bytes (0 on the boards), as one odd 32-bit number."""
    return _check_word(kind, code, op, count, root, chunk)


cdef inline int64_t _now_ns(int clk) noexcept nogil:
    cdef timespec ts
    clock_gettime(clk, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class FrontEnd:
    """One communicator's front end on its boards. ``host``: their `HostCollectives`, connected
    (its native handle, ranks, deadline, slot size and direct reads are the front end's too; its
    ``_closed`` and ``_busy`` are shared with close()); the
    communicator's ``executor`` (its lock, queue and sequence numbers, as ``run_inline`` takes
    them); the flight recorder's ``calls``/``ends`` lists (None: not recording); ``dtypes`` the
    NumPy dtypes by kernel code; ``ops`` the `Op` members by name and the `Op` type; ``names``: the
    collectives' and memory kind's objects the recorder keeps. After a failed native call,
    ``failed(status, kind, seq, x, out, op, root, mode)`` returns its error (the peers told,
    while the call still counts as in progress on the boards), then ``broken(error, slot)``
    breaks the communicator and raises it (the executor still held). Without boards (``host``
    None), ``links`` (`frontend.OnLinks`: its ``size``, ``plan`` and ``run``) takes allreduces
    instead. Set ``enabled`` False while the communicator must see every call (hooks
    registered, failed, closing).

    The executor's and the boards' counters are read and written with the GIL held and no
    Python code run in between (as their Python owners do under their locks): this relies on
    the GIL, as CPython with it."""

    cdef ddl_arena *a
    cdef object arena, host, executor, cv_acquire, cv_release, queue, run_acquire, run_release
    cdef list calls, ends
    cdef Py_ssize_t capacity
    cdef object failed, broken, by_name, op_type, allreduce_name, broadcast_name, barrier_name
    cdef object host_memory
    cdef tuple descrs
    cdef object links_plan, links_run
    cdef dict plans
    cdef int size
    cdef int64_t timeout_ns
    cdef bint direct
    cdef uint64_t slots_max, barrier_check
    cdef public bint enabled

    def __init__(self, host, executor, calls, ends, dtypes, ops, names, failed, broken,
                 links=None):
        self.host, self.executor = host, executor
        if host is not None:
            self.arena = host.arena
            self.a = <ddl_arena *><uintptr_t>self.arena.address
            self.size = host.size
            self.timeout_ns = <int64_t>(min(host.timeout, 1e8) * 1e9)  # years: never overflow
            self.direct = host.direct
            self.slots_max = host.slots_max
        else:  # on the links: ``links`` plans and runs each call (`OnLinks`)
            self.a = NULL
            self.size = links.size
            self.links_plan, self.links_run = links.plan, links.run
        self.plans = {}
        self.cv_acquire, self.cv_release = executor._cv.acquire, executor._cv.release
        self.queue = executor._queue
        self.run_acquire = executor._run_lock.acquire
        self.run_release = executor._run_lock.release
        self.calls, self.ends = calls, ends
        self.capacity = len(calls) if calls is not None else 0
        self.descrs = tuple(dtypes)
        assert len(self.descrs) == N_CODES
        self.by_name, self.op_type = ops
        self.allreduce_name, self.broadcast_name, self.barrier_name, self.host_memory = names
        self.failed, self.broken = failed, broken
        self.barrier_check = _check_word(K_BARRIER, NONE_CODE, NONE_CODE, 0, 0, 0)
        self.enabled = True

    cdef int _code(self, cnp.ndarray x):
        # The kernel code of x's dtype (-1: not one of ours, or not C-contiguous).
        cdef object descr = <object>cnp.PyArray_DESCR(x)
        cdef int i
        if not cnp.PyArray_IS_C_CONTIGUOUS(x):
            return -1
        for i in range(N_CODES):
            if <object>self.descrs[i] is descr:
                return i
        return -1

    cdef int _mode(self, Py_ssize_t nbytes):
        if <uint64_t>nbytes <= self.slots_max:  # as HostCollectives.mode
            return SLOTS
        return DIRECT if self.direct else -1

    def allreduce(self, x, op, out):
        """`Communicator.allreduce` (the result), or `DECLINED`."""
        cdef cnp.ndarray xa, oa
        cdef int code, mode = SLOTS, opc, kop
        cdef int64_t divisor = 0
        if not self.enabled or type(x) is not np.ndarray:
            return DECLINED
        xa = <cnp.ndarray>x
        code = self._code(xa)
        if code < 0:
            return DECLINED
        opm = self.by_name.get(op) if type(op) is str else op
        if type(opm) is not self.op_type:
            return DECLINED
        opc = kop = <int>opm
        if opc == OP_AVG:
            if code >= FIRST_INT_CODE:  # an integer avg: exact, in a wider type (int_avg)
                return DECLINED
            divisor, kop = self.size, OP_SUM
        if self.a != NULL:
            mode = self._mode(cnp.PyArray_NBYTES(xa))
            if mode < 0:
                return DECLINED
        if out is None:
            oa = PyArray_NewLikeArray(xa, cnp.NPY_CORDER, NULL, 0)
        elif (
            type(out) is np.ndarray
            and <object>cnp.PyArray_DESCR(<cnp.ndarray>out) is <object>cnp.PyArray_DESCR(xa)
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>out)
            and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out)
            and cnp.PyArray_SIZE(<cnp.ndarray>out) == cnp.PyArray_SIZE(xa)
        ):
            oa = <cnp.ndarray>out
        else:
            return DECLINED
        if self.a == NULL:
            return self._on_links(xa, oa, code, opc, opm)
        if self._run(K_ALLREDUCE, code, opc, kop, divisor, 0, xa, oa, mode, opm):
            return oa
        return DECLINED

    cdef object _on_links(self, cnp.ndarray xa, cnp.ndarray oa, int code, int opc, object opm):
        """An allreduce on the links: the plan of its shape (made once, by the Python path's
        rules; None: the front end does not take it), then the call, run by ``links_run``."""
        cdef Py_ssize_t seq, slot
        key = (cnp.PyArray_SIZE(xa), code, opc)
        plan = self.plans.get(key, DECLINED)
        if plan is DECLINED:
            plan = self.links_plan(xa, oa, opm)
            if len(self.plans) >= 256:  # shapes come and go: keep the recent
                self.plans.clear()
            self.plans[key] = plan
        if plan is None:
            return DECLINED
        seq = self._take()
        if seq < 0:
            return DECLINED
        try:
            slot = self._record(seq, K_ALLREDUCE, xa, opm, 0)
            self.links_run(plan, seq, slot, xa, oa, opm)  # raises the call's error
            if self.capacity:
                self.ends[slot] = _now_ns(CLOCK_REALTIME) * 1e-9
        finally:
            self.run_release()
        return oa

    def broadcast(self, x, root):
        """`Communicator.broadcast` (x), or `DECLINED`."""
        cdef cnp.ndarray xa
        cdef int code, mode
        if not self.enabled or self.a == NULL or type(x) is not np.ndarray or type(root) is not int:
            return DECLINED
        xa = <cnp.ndarray>x
        code = self._code(xa)
        if code < 0 or not cnp.PyArray_ISWRITEABLE(xa) or not 0 <= root < self.size:
            return DECLINED
        mode = self._mode(cnp.PyArray_NBYTES(xa))
        if mode < 0:
            return DECLINED
        if self._run(K_BROADCAST, code, NONE_CODE, OP_SUM, 0, root, xa, xa, mode, None):
            return x
        return DECLINED

    def barrier(self):
        """`Communicator.barrier`: True once done, False when declined."""
        if not self.enabled or self.a == NULL:
            return False
        return self._run(K_BARRIER, -1, NONE_CODE, OP_SUM, 0, 0, None, None, SLOTS, None)

    cdef Py_ssize_t _take(self) except -2:
        """The call's sequence number, taken as ``run_inline`` takes it, the executor's run
        lock held (and on the boards, the call counted busy); -1: the executor is not idle,
        nothing taken (never wait for it)."""
        cdef object executor = self.executor, host = self.host
        cdef Py_ssize_t seq
        if not self.cv_acquire(False):
            return -1
        try:
            if (
                self.queue
                or executor._closed
                or (host is not None and host._closed)
                or not self.run_acquire(False)
            ):
                return -1
            if not self.enabled:  # failed or closed since the caller looked: (the failing
                self.run_release()  # call had the run lock, so this sees it)
                return -1
            seq = executor._next_seq
            executor._next_seq = seq + 1
            if host is not None:
                host._busy += 1  # close() waits for calls in native code
        finally:
            self.cv_release()
        return seq

    cdef Py_ssize_t _record(self, Py_ssize_t seq, int kind, cnp.ndarray x, object opm,
                            int root):
        """The flight recorder's entry of the call, as ``recording()`` writes it; its slot."""
        cdef Py_ssize_t slot = 0
        if self.capacity:
            slot = seq % self.capacity
            now = _now_ns(CLOCK_REALTIME) * 1e-9
            if kind == K_BARRIER:
                entry = (seq, self.barrier_name, 0, None, None, 0, None, now)
            else:
                entry = (
                    seq,
                    self.allreduce_name if kind == K_ALLREDUCE else self.broadcast_name,
                    cnp.PyArray_SIZE(x),
                    <object>cnp.PyArray_DESCR(x),
                    opm,
                    root,
                    self.host_memory,
                    now,
                )
            self.calls[slot] = entry
            self.ends[slot] = 0.0
        return slot

    cdef bint _run(self, int kind, int code, int opc, int kop, int64_t divisor, int root,
                   cnp.ndarray x, cnp.ndarray out, int mode, object opm) except? False:
        """Take the executor as ``run_inline`` does, record, run; False: declined (nothing
        taken). Raises the call's error (``failed``, ``broken``)."""
        cdef ddl_call c
        cdef int st
        cdef Py_ssize_t seq, slot
        cdef object host = self.host
        cdef bint busy = True
        seq = self._take()
        if seq < 0:
            return False
        try:
            slot = self._record(seq, kind, x, opm, root)
            c.kind, c.op, c.root, c.divisor = kind, kop, root, divisor
            if x is None:
                c.dtype, c.count, c.itemsize, c.inp, c.out = 0, 0, 1, NULL, NULL
                c.check = self.barrier_check
            else:
                c.dtype, c.count = code, cnp.PyArray_SIZE(x)
                c.itemsize = <int>cnp.PyArray_ITEMSIZE(x)
                c.inp = <uint8_t *>cnp.PyArray_DATA(x)
                c.out = <uint8_t *>cnp.PyArray_DATA(out)
                c.check = _check_word(kind, code, opc, c.count, root, 0)
            self.a.bad_rank, self.a.err = -1, 0
            with nogil:
                c.deadline_ns = _now_ns(CLOCK_MONOTONIC) + self.timeout_ns
                if mode == DIRECT:
                    st = ddl_arena_direct(self.a, &c)
                else:
                    st = ddl_arena_small(self.a, &c)
            if st:
                error = self.failed(st, kind, seq, x, out, opm, root, mode)
                host._busy -= 1  # as HostCollectives.run: only the failure's note in the call
                busy = False
                self.broken(error, slot)  # raises
            if self.capacity:
                self.ends[slot] = _now_ns(CLOCK_REALTIME) * 1e-9
        finally:
            if busy:
                host._busy -= 1
            self.run_release()
        return True
