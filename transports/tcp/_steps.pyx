# cython: language_level=3, boundscheck=False, wraparound=False
"""A collective's small steps over TCP sockets in one native call (``run``): each send is one
``sendmsg`` of the frame header and payload, each receive reads the frame straight off the
socket into its buffer (or the staging buffer, then reduced), in program order, with the GIL
released. The frames are those of the Python path (``protocol._HEADER``), so a rank running its
steps here and one running them in Python meet on the wire.

The sockets must be leased (`Channel.lease`): nobody else reads or writes them meanwhile. The
run stops before a step it cannot do at once and cleanly -- a send the socket would not take, a
frame that is not the one expected (another tag, a check word or size that differs, an abort,
a close, EOF), a receive that has not begun within ``stop_ns``, the eventfd rung -- and returns
that step's index with nothing of it done: the Python engine goes on from there and names
whatever is wrong. A send the socket takes only part of ends the run too (the caller hands
the rest to the channel's sender thread). Only a frame broken half-way while reading (the
socket failing inside it, or no progress until the deadline) ends it with an error status: the
stream is then unusable.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memmove
from libc.errno cimport errno, EAGAIN, EINTR  # EWOULDBLOCK is EAGAIN on Linux
from libc.time cimport timespec

cdef extern from "<time.h>" nogil:
    int clock_gettime(int clk, timespec *ts)
    enum: CLOCK_MONOTONIC

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>" nogil:
    struct msghdr:
        void *msg_name
        unsigned int msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    ssize_t sendmsg(int fd, const msghdr *msg, int flags)
    enum: MSG_PEEK
    enum: MSG_DONTWAIT
    enum: MSG_NOSIGNAL

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum: POLLIN

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "ddl_kernels.h" nogil:
    int ddl_reduce(void *dst, const void *a, const void *b, int64_t n, int dtype, int op)
    int ddl_divide(void *dst, int64_t n, int dtype, int64_t divisor)

# Step kinds (ddlcore.algorithms.schedule.Kind) and the columns of a step table (`Schedule.table`).
DEF K_SEND = 0
DEF K_RECV = 1
DEF K_RECV_REDUCE = 2
DEF K_COPY = 3
DEF C_KIND = 0
DEF C_PEER = 1
DEF C_SLOT = 2
DEF C_COUNT = 3
DEF C_SRC = 4
DEF C_SRC_OFF = 5
DEF C_DST = 6
DEF C_DST_OFF = 7
DEF C_FLAGS = 8
DEF F_FINALIZE = 1
DEF F_STAGED_FIRST = 2
# A receive peeks this long, then yields the core between peeks until ``spin_ns``, then sleeps
# in poll(): the boards' wait (ddl_arena.h's DDL_A_PAUSE_NS), so that ranks sharing cores with
# other work hand it the core instead of spinning out their slice.
DEF PAUSE_NS = 2000
DEF HEADER = 28  # protocol._HEADER.size: magic u32, kind u16, 0 u16, check u32, tag u64, nbytes u64

COLUMNS = ("kind", "peer", "slot", "count", "src", "src_off", "dst", "dst_off", "flags")

# Statuses: all done or stopped cleanly at the returned step; a frame broken half-way (the
# socket failed inside it, or no progress until the deadline); a send the socket took part of.
OK = 0
BROKEN = 1
STALLED = 2
PARTIAL = 3


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline void _put(uint8_t *p, uint64_t v, int n) noexcept nogil:
    cdef int i
    for i in range(n):
        p[i] = <uint8_t>(v >> (8 * i))


cdef inline void _header(uint8_t *h, uint32_t magic, int kind, uint32_t check, uint64_t tag,
                         uint64_t nbytes) noexcept nogil:
    _put(h, magic, 4)
    _put(h + 4, <uint64_t>kind, 2)
    _put(h + 6, 0, 2)
    _put(h + 8, check, 4)
    _put(h + 12, tag, 8)
    _put(h + 20, nbytes, 8)


cdef inline int _wait(int fd, int wake, int64_t until_ns) noexcept nogil:
    """poll ``fd`` (and ``wake``, if >= 0) for input until ``until_ns``: 1 readable, 0 not by
    then, -1 the eventfd rang."""
    cdef pollfd fds[2]
    cdef int64_t left
    cdef int r
    fds[0].fd, fds[0].events = fd, POLLIN
    fds[1].fd, fds[1].events = wake, POLLIN
    while True:
        left = until_ns - _now_ns()
        if left <= 0:
            return 0
        fds[0].revents = fds[1].revents = 0
        r = poll(fds, 2 if wake >= 0 else 1, <int>min((left + 999999) // 1000000, 1000))
        if r > 0:
            if fds[1].revents and wake >= 0:
                return -1
            return 1


cdef int _send(int fd, const uint8_t *h, const uint8_t *data, int64_t n,
               int64_t *written) noexcept nogil:
    """0 sent; 1 the socket would not take it (nothing written); 2 it took ``written`` bytes
    of the frame, the rest is the caller's to send."""
    cdef iovec iov[2]
    cdef msghdr msg
    cdef ssize_t r
    iov[0].iov_base, iov[0].iov_len = <void *>h, HEADER
    iov[1].iov_base, iov[1].iov_len = <void *>data, <size_t>n
    msg.msg_name, msg.msg_namelen = NULL, 0
    msg.msg_iov, msg.msg_iovlen = iov, 2 if n else 1
    msg.msg_control, msg.msg_controllen, msg.msg_flags = NULL, 0, 0
    while True:
        r = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL)
        if r >= 0 or errno != EINTR:
            break
    if r < 0:  # would block, or an error the Python path meets again and names
        return 1
    if r < HEADER + n:
        written[0] = r
        return 2
    return 0


cdef inline bint _rung(int wake) noexcept nogil:
    cdef pollfd p
    if wake < 0:
        return False
    p.fd, p.events, p.revents = wake, POLLIN, 0
    return poll(&p, 1, 0) > 0


cdef int _recv_frame(int fd, int wake, const uint8_t *want, uint8_t *sink, int64_t n,
                     int64_t spin_ns, int64_t stop_ns, int64_t deadline, int *err,
                     int *stalled) noexcept nogil:
    """Read the frame whose header is ``want`` into ``sink``: 0 done; 1 not begun (another
    frame first, none by ``stop_ns``, EOF, the eventfd: nothing read); -1 broken half-way."""
    cdef uint8_t got[HEADER]
    cdef ssize_t r
    cdef int64_t start = _now_ns(), have = 0, waited
    cdef int w
    if _rung(wake):  # the pair failed or closes: the Python engine meets it
        return 1
    while True:  # the header, peeked: it stays in the socket unless it is the one expected
        r = recv(fd, got, HEADER, MSG_PEEK | MSG_DONTWAIT)
        if r == HEADER:
            break
        if r == 0:
            return 1
        if r < 0 and errno != EAGAIN and errno != EINTR:
            return 1
        waited = _now_ns() - start
        if waited < PAUSE_NS:
            continue
        if waited < spin_ns:  # the peer, or whoever shares our core, may need it
            sched_yield()
            continue
        w = _wait(fd, wake, start + stop_ns)
        if w <= 0:
            return 1
        if r > 0:  # part of a header is in: the rest follows within microseconds
            if _now_ns() - start >= stop_ns:
                return 1
    if memcmp(got, want, HEADER) != 0:
        return 1
    r = recv(fd, got, HEADER, MSG_DONTWAIT)  # taken off the socket: the frame is ours now
    if r != HEADER:
        err[0] = errno if r < 0 else 0
        return -1
    while have < n:
        r = recv(fd, sink + have, <size_t>(n - have), MSG_DONTWAIT)
        if r > 0:
            have += r
            continue
        if r == 0:
            err[0] = 0
            return -1
        if errno == EINTR:
            continue
        if errno != EAGAIN:
            err[0] = errno
            return -1
        if _wait(fd, -1, deadline) == 0:
            stalled[0] = 1
            return -1
    return 0


def run(const int64_t[:, ::1] table, const int32_t[::1] fds,
        const int32_t[::1] wakes, const uint64_t[::1] bufs, uint64_t staging, int itemsize,
        uint32_t magic, int data_kind, uint64_t tag_base, uint32_t check, int dtype, int op,
        int64_t divisor, int64_t spin_ns, int64_t stop_ns, int64_t deadline_ns):
    """Run ``table``'s steps (``fds``/``wakes``: each step's leased socket and
    its eventfd; ``bufs``: the schedule's buffers' addresses by `Buf`; ``staging``: room for
    the largest reduced receive; ``divisor``: avg's, 0 for none). Returns (status, step,
    errno): `OK` with the first step not done (len(table): all), `BROKEN`/`STALLED` with the
    step whose frame broke, or `PARTIAL` with the send step the socket took only part of and,
    instead of the errno, how many bytes of its frame (header included) it took."""
    cdef Py_ssize_t i, nsteps = table.shape[0]
    cdef int kind, fd, r = 0, err = 0, stalled = 0
    cdef int64_t n, count, flags, written = 0
    cdef uint8_t h[HEADER]
    cdef uint8_t *src
    cdef uint8_t *dst
    cdef uint8_t *own
    cdef uint8_t *other
    i = 0
    with nogil:
        for i in range(nsteps):
            kind = <int>table[i, C_KIND]
            count = table[i, C_COUNT]
            n = count * itemsize
            flags = table[i, C_FLAGS]
            src = <uint8_t *>bufs[table[i, C_SRC]] + table[i, C_SRC_OFF] * itemsize
            dst = <uint8_t *>bufs[table[i, C_DST]] + table[i, C_DST_OFF] * itemsize
            fd = fds[i]
            if kind == K_COPY:
                if src != dst and n:
                    memmove(dst, src, <size_t>n)
                continue
            _header(h, magic, data_kind, check, tag_base | <uint64_t>table[i, C_SLOT], n)
            if kind == K_SEND:
                r = _send(fd, h, src, n, &written)
                if r == 2:
                    break
            elif kind == K_RECV:
                r = _recv_frame(fd, wakes[i], h, dst, n, spin_ns, stop_ns, deadline_ns, &err,
                                &stalled)
            else:
                r = _recv_frame(fd, wakes[i], h, <uint8_t *>staging, n, spin_ns, stop_ns,
                                deadline_ns, &err, &stalled)
                if r == 0 and n:
                    own, other = src, <uint8_t *>staging
                    if flags & F_STAGED_FIRST:
                        own, other = other, own
                    ddl_reduce(dst, own, other, count, dtype, op)
                    if divisor and flags & F_FINALIZE:
                        ddl_divide(dst, count, dtype, divisor)
            if r != 0:
                break
        else:
            i = nsteps
    if r == 2:
        return PARTIAL, i, written
    if r < 0:
        return (STALLED if stalled else BROKEN), i, err
    return OK, i, 0
