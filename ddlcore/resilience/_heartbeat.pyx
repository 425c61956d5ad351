# cython: language_level=3
"""Native half of the failure detector: the heartbeat thread of ``ddl_heartbeat.h``, started on
a bound UDP socket, watched peers added and removed by address, and a wait for the peers it
found silent (or for this process's own exclusion) that releases the GIL."""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t


cdef extern from "<arpa/inet.h>" nogil:
    int inet_pton(int af, const char *src, void *dst)
    const char *inet_ntop(int af, const void *src, char *dst, unsigned size)
    uint16_t htons(uint16_t)
    uint16_t ntohs(uint16_t)
    int AF_INET


cdef extern from "ddl_heartbeat.h" nogil:
    ctypedef struct ddl_hb:
        int running
    int ddl_hb_start(ddl_hb *hb, int fd, const uint8_t *token, int64_t interval_ns,
                     int64_t timeout_ns)
    void ddl_hb_watch(ddl_hb *hb, uint32_t ip, uint16_t port, int delta)
    int ddl_hb_wait(ddl_hb *hb, int64_t timeout_ns, uint32_t *ips, uint16_t *ports, int max)
    void ddl_hb_stop(ddl_hb *hb, int goodbye)


DEF _BATCH = 64

STOPPED = -2
FENCED = -1


cdef uint32_t _ip(str host) except? 0:
    cdef uint32_t ip = 0
    if inet_pton(AF_INET, host.encode(), &ip) != 1:
        raise ValueError(f"not an IPv4 address: {host!r}")
    return ip


cdef str _text(uint32_t ip):
    cdef char buf[16]
    inet_ntop(AF_INET, &ip, buf, 16)
    return buf.decode()


cdef class Heartbeat:
    """The heartbeat thread on the bound UDP socket ``fd`` (kept open by the caller until
    `stop`), pinging every watched peer each ``interval_s`` and calling one silent after
    ``timeout_s`` without a word from it; packets carry ``token`` (8 bytes)."""

    cdef ddl_hb hb

    def __cinit__(self, int fd, bytes token, double interval_s, double timeout_s):
        if len(token) != 8:
            raise ValueError("a heartbeat token is 8 bytes")
        cdef const uint8_t *raw = token
        rc = ddl_hb_start(&self.hb, fd, raw, <int64_t>(interval_s * 1e9),
                          <int64_t>(timeout_s * 1e9))
        if rc != 0:
            raise OSError(rc, "the heartbeat thread could not start")

    def watch(self, str host, int port, int delta=1):
        """Watch the plane at ``host:port`` (``delta`` -1: one watcher less)."""
        cdef uint32_t ip = _ip(host)
        with nogil:
            ddl_hb_watch(&self.hb, ip, htons(<uint16_t>port), delta)

    def wait(self, double timeout_s):
        """Up to ``timeout_s`` for news: ``(FENCED, [address])`` when a peer said this process
        was excluded, ``(STOPPED, [])`` after `stop`, else ``(n, addresses)`` of the peers found
        silent since the last call (n may be 0)."""
        cdef uint32_t ips[_BATCH]
        cdef uint16_t ports[_BATCH]
        cdef int n
        cdef int64_t ns = <int64_t>(timeout_s * 1e9)
        with nogil:
            n = ddl_hb_wait(&self.hb, ns, ips, ports, _BATCH)
        if n == STOPPED:
            return STOPPED, []
        count = 1 if n == FENCED else n
        return n, [(_text(ips[k]), ntohs(ports[k])) for k in range(count)]

    def stop(self, bint goodbye=True):
        """Tell the peers (``goodbye``), stop the thread and free its state; idempotent."""
        with nogil:
            ddl_hb_stop(&self.hb, goodbye)

    def forget(self):
        """In a forked child: the thread is the parent's; never join or free it here."""
        self.hb.running = 0

    def __dealloc__(self):
        ddl_hb_stop(&self.hb, 0)
