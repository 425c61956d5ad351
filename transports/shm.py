"""Shared-memory transport: ranks on one host exchange tag-matched messages through lock-free
single-producer/single-consumer byte rings in ``/dev/shm``. This file is over the ~500-line guide
because the ring protocol, the two ways of making progress and the failure rules only make sense
together; the native half (atomics, futex, copies) is ``_shm.pyx`` / ``ddl_shm.h``.

Layout. Every rank owns one *inbox* segment, ``/dev/shm/ddl-<pid>-<random>-r<rank>``, made at
context creation and published in the store (``shm/inbox/<rank>``: name, pid). It holds a
header (magic, the owner's doorbell, an attach counter) and one ring slot per possible source
rank; slot ``s`` carries the messages from rank ``s`` to the owner::

    inbox of rank r:  [header | slot 0: ring 0->r | slot 1: ring 1->r | ... ]
    slot:             [head u64 | tail u64 | producer state, pid, inbox name, abort reason | data]

The producer (rank s) alone writes ``head`` and the data; the consumer (rank r) alone writes
``tail``. Counters are published with release stores and read with acquire loads, so a reader
never sees bytes the writer has not finished. Records are a 32-byte header (kind, check, tag,
nbytes) then the payload, padded to 32 bytes; a message larger than the ring streams through it
in pieces of at most ``_PIECE`` bytes, so the consumer copies piece k while the producer writes
piece k+1: no round trip per piece, just the counters.

Progress. Each context runs one progress thread that pushes queued sends into the peers' rings,
copies arrived data straight into posted receive buffers (or, for a message nobody asked for
yet, into a new buffer that a later receive copies from: sends never wait for the receiver's
program), and sleeps on a futex doorbell when there is nothing to do. Producers ring the
consumer's bell when they publish data, consumers ring the producer's bell when they free space.
``isend`` on an idle pair writes into the ring from the caller's thread, and a thread waiting on
a request moves its pair's bytes itself (spinning briefly, then sleeping on the doorbell) while
the progress thread stands back, so a small message costs no thread hand-off. All copies release
the GIL (``_shm.pyx``).

Lifetime and failures. A rank that first uses a pair maps the peer's inbox and marks its slot
there ATTACHED (with its pid and inbox name, so the peer attaches back without the store).
A peer's state lives in the slot it produces into, i.e. in our own inbox: CLOSED (its context
closed: data already in the ring is still delivered, then requests fail), ABORTED (code and
reason: requests fail at once with that error class). A peer that dies is seen through a pidfd
within ``_LIVENESS_S``. Segments are unlinked by their owner's ``close()`` (or at its exit); a
survivor unlinks the segments of a peer it saw die, before it raises (here and in the host
collectives); ``ddlrun`` removes those of its ranks once they have exited
(`remove_segments_of`); and every new context first removes this user's segments whose owner is
gone (`remove_orphans`: the pid in the name is dead or was reused, and the owner's lock on the
file is free), which covers ranks that died unseen under any launcher. Names carry the owner's
pid and random bits, so two jobs on one host never collide.

Single copy. A message of ``_CMA_MIN`` bytes or more travels as a CMA record (the address of the
data in the sender); the receiver reads it with ``process_vm_readv`` straight into the posted
buffer (or one of its own) and answers with an ACK record, which completes the send. Off where
Yama forbids reading a peer's memory, or when the peer's pid does not name it here.

Device memory is host-staged above this layer; CUDA IPC handles are where it would go here.
"""

from __future__ import annotations

import fcntl
import functools
import os
import secrets
import select
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from ddlcore.transports import _shm
from ddlcore.transports.base import (
    MAX_ABORT_REASON_BYTES,
    Context,
    Pair,
    PeerInfo,
    Request,
    Store,
    Transport,
)
from ddlcore.transports.common import (
    Matcher,
    Message,
    ThreadRequest,
    abort_error,
    as_view,
    check_tag,
    recv_view,
    timeout_error,
)
from ddlcore.transports.pairs import MatchedPair, PairTableContext

from ddlcore.errors import (
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
)
from ddlcore.store import StoreUnreachableError

SHM_DIR = "/dev/shm"
PREFIX = "ddl-"
_MAGIC = 0xDD1C_5E60_0000_0001
_VERSION = 1
# 2 MiB per ordered pair: large enough that a 1 MiB pipeline chunk streams without stalls,
# small enough to stay in the last-level cache of the cores copying through it.
_CAP = 1 << 21
# Publish the head at least every 256 KiB so the consumer starts copying before a large
# message is all in (measured: 128 KiB-1 MiB pieces give the same bandwidth here).
_PIECE = 1 << 18
_HDR = 32                       # record header and record alignment
_INBOX_HEADER = 4096
_SLOT_HEADER = 8192
_SLOT = _SLOT_HEADER + _CAP
# Inbox header offsets.
_OFF_MAGIC, _OFF_VERSION, _OFF_NSLOTS, _OFF_CAP, _OFF_PID = 0, 8, 12, 16, 24
_OFF_BELL, _OFF_ATTACH_GEN = 64, 128
# Slot header offsets (the producer writes everything but the tail).
_S_HEAD, _S_TAIL, _S_STATE, _S_PID, _S_ABORT_CODE, _S_ABORT_LEN = 0, 64, 128, 132, 136, 140
_S_NAME_LEN, _S_NAME, _S_ABORT = 144, 192, 512
_MAX_NAME = 255
# Producer states.
_NONE, _ATTACHED, _CLOSED, _ABORTED = 0, 1, 2, 3
# Record kinds.
_DATA = 1                       # header, then the payload through the ring
_CMA = 2                        # header, then where the payload is: the receiver reads it itself
_ACK = 3                        # the receiver has read CMA message ``msgno``: the send is done
_RECORD = struct.Struct("<IIQQQ")   # kind, check, tag, nbytes, msgno (CMA, ACK)
_CMA_BLOCK = struct.Struct("<QQQQ")  # address in the sender, 3 x reserved
# From 256 KiB up one kernel copy (process_vm_readv) beats two copies through the ring even with
# the ACK's round trip; below it the ring wins (measured with benchmarks/p2p.py).
_CMA_MIN = 1 << 18
_IDLE_WAIT_S = 0.05             # the progress thread wakes at least this often ...
_LIVENESS_S = 0.05              # ... to look at the peers' pidfds
# A waiting thread moves its pair's bytes itself for this long before it blocks on the request
# (one wake-up per message instead of two: the doorbell wakes the waiter directly).
_DRIVE_S = 0.05
_SPIN_S = 50e-6                 # spin this long before sleeping on the doorbell (4 KB p2p: 66 -> 14 µs)
_POLL_WHILE_DRIVEN_S = 0.0005  # how often the progress thread looks while waiters drive
_CLOSE_WAIT_S = 5.0             # close() waits this long for waiting threads to step out


def _pad(n: int) -> int:
    return (n + _HDR - 1) & ~(_HDR - 1)


def _inbox_bytes(nslots: int) -> int:
    return _INBOX_HEADER + nslots * _SLOT


def _reserve(fd: int, offset: int, length: int, what: str) -> None:
    """Allocate tmpfs pages now, so a full /dev/shm is an error here rather than a SIGBUS on
    first write."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        raise DDLError(f"cannot reserve {length >> 10} KiB of shared memory for {what} in "
                       f"{SHM_DIR}: {exc}; free space there (df -h {SHM_DIR}) or use "
                       "DDL_TRANSPORT=tcp") from None


# Segment paths -> the descriptor holding the owner's shared lock on it, until it is unlinked:
# the kernel drops the lock when the owner dies, however it dies (`remove_orphans`).
_OWNER_LOCKS: dict[str, int] = {}
# `remove_orphans` leaves younger segments alone: their owner may not hold its lock yet (it
# takes it right after creating the file, microseconds later).
_ORPHAN_MIN_AGE_S = 1.0
_SWEEP_EVERY_S = 10.0
_last_sweep = -_SWEEP_EVERY_S


def create_segment(name: str, nbytes: int, reserve: int, what: str) -> tuple[str, int]:
    """Create ``/dev/shm/<name>`` (owner-only) of ``nbytes``, its first ``reserve`` bytes
    allocated now, and map it; returns (path, address). Names start with `PREFIX` and the
    owner's pid, which is how `remove_segments_of` finds a dead rank's segments; the owner
    holds a lock on it until `_unlink_quietly`, which is how `remove_orphans` tells a dead
    owner's segment from a live one. First removes the orphans of earlier jobs (at most every
    `_SWEEP_EVERY_S`: a sweep costs about 0.1 ms per segment in /dev/shm)."""
    global _last_sweep
    if time.monotonic() - _last_sweep >= _SWEEP_EVERY_S:
        _last_sweep = time.monotonic()
        remove_orphans()
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, nbytes)
        _reserve(fd, 0, reserve, what)
        address = _shm.map_shared(fd, nbytes)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    _OWNER_LOCKS[path] = fd
    return path, address


def _segment_owner(name: str) -> int | None:
    parts = name.split("-")
    if len(parts) >= 3 and parts[0] + "-" == PREFIX and parts[1].isdigit():
        return int(parts[1])
    return None


def _unlink_if_free(name: str, may_go: Callable[[os.stat_result], bool]) -> bool:
    """Unlink segment ``name`` if it is this user's, ``may_go(its stat)`` says so, and nobody
    holds its owner's lock (a live owner does, in any pid namespace); True if it went."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not may_go(st):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a live owner holds it
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_segments_of(pids: set[int]) -> list[str]:
    """Unlink the segments owned by the given (dead) processes; returns the names removed.
    A survivor calls this for a peer it saw die, the launcher for ranks that died. Only this
    user's segments whose owner's lock is free go: a pid reused since (by a rank of another job,
    in this or another pid namespace) holds the lock on its own segments, which stay."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [name for name in names
            if _segment_owner(name) in pids and _unlink_if_free(name, lambda st: True)]


@functools.lru_cache(maxsize=1)
def _boot_time() -> float:
    """When this host booted (wall clock, whole seconds)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _owner_gone(pid: int, since: float, boot: float) -> bool:
    """Whether process ``pid`` cannot be the one that made a segment that existed at ``since``
    (wall clock): no such pid here, or one started after that (the pid was reused). The start
    time computed from whole-second ``btime`` errs early, so a live owner is never taken for
    gone; a process of another pid namespace is, and the segment's lock decides then."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22: start time
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        return False
    return boot + ticks / _TICKS_PER_S > since


def remove_orphans() -> list[str]:
    """Unlink this user's segments whose owner is gone: its pid names no process that could
    have made the segment (`_owner_gone`) and nobody holds the owner's lock (a live owner in
    another pid namespace does). Every context creation calls this, so the segments of a rank
    that died unseen (SIGKILL, under any launcher) go at the next job on the host."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
        boot = _boot_time() if names else 0.0
    except OSError:
        return removed
    now = time.time()
    for name in names:
        pid = _segment_owner(name)
        if pid is None or pid == os.getpid():
            continue
        if _unlink_if_free(name, lambda st: now - st.st_ctime >= _ORPHAN_MIN_AGE_S and
                           _owner_gone(pid, st.st_ctime, boot)):  # noqa: B023 (called at once)
            removed.append(name)
    return removed


class ShmRequest(ThreadRequest):
    """A request whose waiter drives progress on its pair (see `ShmPair._drive`)."""

    __slots__ = ("_driven",)

    def __init__(self, pair: ShmPair, view: memoryview, tag: int, check: int,
                 is_send: bool) -> None:
        super().__init__(pair, view, tag, check, is_send)
        self._driven = False

    def _complete(self) -> None:
        super()._complete()
        if self._driven:  # the waiter may be asleep on the doorbell: wake it
            _shm.bell_ring(self._pair._ctx._bell)

    def _fail(self, error: DDLError) -> None:
        super()._fail(error)
        if self._driven:
            _shm.bell_ring(self._pair._ctx._bell)

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            start = time.monotonic()
            self._pair._drive(self, _DRIVE_S if timeout is None else min(timeout, _DRIVE_S))
            if not self._done and timeout is not None:  # the rest of the wait, on the lock
                if not self._lock.acquire(True, max(0.0, timeout - (time.monotonic() - start))):
                    raise self._pair._timeout_error(self, timeout)
                self._lock.release()
        super().wait(timeout)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # a survivor took us for dead, or the launcher cleaned up
        pass
    fd = _OWNER_LOCKS.pop(path, None)
    if fd is not None:
        os.close(fd)


def _cma_allowed() -> bool:
    """Whether this kernel lets a process read a same-user peer's memory (process_vm_readv):
    Yama's ptrace_scope 1 and up forbids it between processes that are not parent and child."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:  # no Yama: ordinary same-user ptrace rules, which allow it
        return True


_CMA_OK = _cma_allowed()


class _Send:
    """An item of the producer's queue: its record (header, and for CMA where the data is), the
    payload streamed after it (DATA), and how much of it is already in the ring."""

    __slots__ = ("req", "view", "record", "total", "written", "kind")

    def __init__(self, req: ThreadRequest | None, record: bytes, kind: int,
                 view: memoryview | None = None) -> None:
        self.req, self.record, self.kind, self.view = req, record, kind, view
        self.total = len(record) + (_pad(len(view)) if view is not None else 0)
        self.written = 0


class _Incoming:
    """The record the consumer is in the middle of."""

    __slots__ = ("req", "target", "tag", "check", "nbytes", "total", "read", "data")

    def __init__(self, tag: int, check: int, nbytes: int) -> None:
        self.tag, self.check, self.nbytes = tag, check, nbytes
        self.total = _pad(nbytes)  # payload + padding still to consume
        self.read = 0
        self.req: ThreadRequest | None = None
        self.target: memoryview | None = None  # None: drain (mismatch, or nobody will ask)
        self.data: bytearray | None = None     # unexpected: a buffer of our own


class ShmPair(MatchedPair, Pair):
    """Both rings between this rank and ``peer``: ours in their inbox (we produce), theirs in
    our inbox (we consume)."""

    def __init__(self, ctx: ShmContext, peer: int) -> None:
        self.rank, self.peer, self._ctx = ctx.rank, peer, ctx
        self._in = ctx._base + _INBOX_HEADER + peer * _SLOT  # their ring to us
        self._in_data = self._in + _SLOT_HEADER
        self._tail = _shm.load_u64(self._in + _S_TAIL)
        self._out = 0  # our ring in their inbox, once attached
        self._out_data = 0
        self._head = 0
        self._peer_base = 0
        self._peer_bytes = 0
        self._peer_bell = 0
        self._peer_pid = 0
        self._pidfd = -1
        self._connected = False
        self._plock = threading.Lock()  # send queue and our ring's head
        self._clock = threading.Lock()  # posted, unexpected, incoming record, our ring's tail
        self._sendq: deque[_Send] = deque()
        # Receives and messages by tag; failure (abort, close) and lost (the peer closed, died)
        self._matcher: Matcher[ShmRequest] = Matcher(self.rank, peer, "shm")
        self._incoming: _Incoming | None = None
        self._closed = False
        self._announced = _ATTACHED  # what we last told the peer (or will, once attached)
        self._abort_note: tuple[int, bytes] = (0, b"")
        self._watched = False
        self._cma = _CMA_OK  # and the peer is in our pid namespace: see _attach
        self._msgno = 0  # CMA messages sent (``_plock``)
        self._await_ack: dict[int, ThreadRequest] = {}  # CMA sends the peer has not read yet
        self._acks: deque[int] = deque()  # CMA messages read, to acknowledge (``_clock``)
        self._driving = 0  # threads in _drive on this pair (guarded by the context's _drivers)

    # --- attaching --------------------------------------------------------------------------
    def _attach(self, name: str, pid: int) -> None:
        """Map the peer's inbox and announce ourselves in our slot there."""
        path = os.path.join(SHM_DIR, name)
        nbytes = _inbox_bytes(self._ctx.size)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PeerFailureError(
                f"rank {self.rank} cannot open rank {self.peer}'s shared memory {path}: it is "
                "gone, so that rank closed its transport or exited (or runs on another host: "
                "use DDL_TRANSPORT=auto or tcp across hosts)", self.peer) from None
        try:
            if os.fstat(fd).st_size != nbytes:
                raise PeerFailureError(
                    f"rank {self.peer}'s shared memory {path} has {os.fstat(fd).st_size} bytes, "
                    f"rank {self.rank} expected {nbytes}: the ranks disagree on the world size",
                    self.peer)
            _reserve(fd, _INBOX_HEADER + self.rank * _SLOT, _SLOT,
                     f"rank {self.rank}'s ring to rank {self.peer}")
            base = _shm.map_shared(fd, nbytes)
        finally:
            os.close(fd)
        if _shm.load_u64(base + _OFF_MAGIC) != _MAGIC or \
                _shm.load_u32(base + _OFF_VERSION) != _VERSION:
            _shm.unmap(base, nbytes)
            raise PeerFailureError(f"{path} is not a ddlcore shm inbox of protocol version "
                                   f"{_VERSION}", self.peer)
        out = base + _INBOX_HEADER + self.rank * _SLOT
        self._peer_base, self._peer_bytes, self._peer_pid = base, nbytes, pid
        self._peer_bell = base + _OFF_BELL
        self._head = _shm.load_u64(out + _S_HEAD)
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # already gone, or another pid namespace: the deadline still applies
            self._pidfd = -1
            self._cma = False  # its pid may not name it here: keep data in the ring
        me = self._ctx.name.encode()
        _shm.store_u32(out + _S_PID, os.getpid())
        _shm.store_u32(out + _S_NAME_LEN, len(me))
        _shm.put_bytes(out + _S_NAME, me)
        self._out, self._out_data = out, out + _SLOT_HEADER
        _shm.store_u32(out + _S_STATE, _ATTACHED)
        _shm.fetch_add_u32(base + _OFF_ATTACH_GEN, 1)
        self._connected = True
        _shm.bell_ring(self._peer_bell)
        if self._announced != _ATTACHED:  # we aborted or closed before attaching: say so now
            self._announce(self._announced, *self._abort_note)

    def _detach(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if self._peer_base:
            _shm.unmap(self._peer_base, self._peer_bytes)
            self._peer_base = self._out = self._out_data = self._peer_bell = 0

    # --- requests ---------------------------------------------------------------------------
    def isend(self, view: memoryview, tag: int, check: int = 0) -> Request:
        view = as_view(view)
        check_tag(tag, check)
        req = ShmRequest(self, view, tag, check, True)
        with self._plock:
            if self._failure is not None or self._lost is not None:
                req._fail(self._error_for(req))
                return req
            if self._cma and req.nbytes >= _CMA_MIN:
                msgno = self._msgno = self._msgno + 1
                self._await_ack[msgno] = req  # before the peer can possibly answer
                record = _RECORD.pack(_CMA, check, tag, req.nbytes, msgno) + _CMA_BLOCK.pack(
                    _shm.address_of(view), 0, 0, 0)
                self._sendq.append(_Send(req, record, _CMA))
            else:
                self._sendq.append(_Send(req, _RECORD.pack(_DATA, check, tag, req.nbytes, 0),
                                         _DATA, view))
            if len(self._sendq) == 1 and self._connected:
                self._push()  # idle pair: straight into the ring from this thread
            pending = bool(self._sendq)
        if pending:
            self._ctx._wake()
        return req

    def irecv(self, view: memoryview, tag: int, check: int = 0) -> Request:
        view = recv_view(view, tag, check)
        req = ShmRequest(self, view, tag, check, False)
        self._matcher.post(req)
        return req

    def _error_for(self, req: ThreadRequest) -> DDLError:
        return self._matcher.error_for(req)

    def _timeout_error(self, req: ThreadRequest, timeout: float) -> DDLTimeoutError:
        note = "" if self._connected else \
            f" (rank {self.peer} has not connected to rank {self.rank} yet)"
        if not self._connected and _shm.load_u32(self._in + _S_STATE) != _NONE:
            note = ""
        return timeout_error(self.rank, self.peer, req, timeout, note)

    # --- moving bytes (progress thread, or the caller's thread for an idle pair) --------------
    def _push(self) -> bool:
        """Write queued sends into our ring as far as it has room (``_plock`` held)."""
        out, data, queue = self._out, self._out_data, self._sendq
        head = start = self._head
        free = _CAP - (head - _shm.load_u64(out + _S_TAIL))
        published = head
        while queue and free > 0:
            item = queue[0]
            if item.written == 0:
                record = item.record
                if free < len(record):
                    break
                _shm.ring_put(data, _CAP, head, record, 0, len(record))
                head += len(record)
                free -= len(record)
                item.written = len(record)
            n = min(free, item.total - item.written, _PIECE)
            if n > 0:
                assert item.view is not None  # only a DATA item has payload to stream
                lo = item.written - _HDR
                copy = min(n, len(item.view) - lo)
                if copy > 0:
                    _shm.ring_put(data, _CAP, head, item.view, lo, copy)
                head += n
                free -= n
                item.written += n
            if item.written == item.total:
                queue.popleft()
                if item.kind == _DATA:
                    assert item.req is not None  # only ACKs are queued without a request
                    item.req._complete()  # CMA sends complete on the peer's ACK
            if head - published >= _PIECE:  # let the consumer start on what is there
                _shm.store_u64(out + _S_HEAD, head)
                _shm.bell_ring(self._peer_bell)
                published = head
        self._head = head
        if head != published:
            _shm.store_u64(out + _S_HEAD, head)
            _shm.bell_ring(self._peer_bell)
        return head != start

    def _pull(self) -> bool:
        """Consume what the peer has published into our inbox (``_clock`` held)."""
        ring, data = self._in, self._in_data
        head = _shm.load_u64(ring + _S_HEAD)
        tail = start = self._tail
        while True:
            cur = self._incoming
            if cur is None:
                if tail >= head:
                    break
                kind, check, tag, nbytes, msgno = _RECORD.unpack(
                    _shm.get_bytes(data + (tail & (_CAP - 1)), _HDR))
                if kind == _ACK:
                    tail += _HDR
                    done = self._await_ack.pop(msgno, None)
                    if done is not None:
                        done._complete()
                    continue
                if kind == _CMA:
                    if head - tail < _HDR + _CMA_BLOCK.size:
                        break  # published whole by the producer: cannot happen, but be safe
                    address = _CMA_BLOCK.unpack(
                        _shm.get_bytes(data + ((tail + _HDR) & (_CAP - 1)), _CMA_BLOCK.size))[0]
                    tail += _HDR + _CMA_BLOCK.size
                    self._cma_receive(tag, check, nbytes, address, msgno)
                    continue
                tail += _HDR
                if kind != _DATA or nbytes > 1 << 48:
                    raise DDLError(f"rank {self.rank}: corrupt record (kind {kind}, {nbytes} "
                                   f"bytes) in the ring from rank {self.peer}")
                cur = self._incoming = self._begin(tag, check, nbytes)
            n = min(head - tail, cur.total - cur.read)
            copy = min(n, cur.nbytes - cur.read)
            if copy > 0 and cur.target is not None:
                _shm.ring_get(data, _CAP, tail, cur.target, cur.read, copy)
            tail += n
            cur.read += n
            if cur.read == cur.total:
                self._incoming = None
                self._finish(cur)
            elif tail >= head:
                break
        if tail != start:
            self._tail = tail
            _shm.store_u64(ring + _S_TAIL, tail)
            if self._peer_bell:
                _shm.bell_ring(self._peer_bell)
            return True
        return False

    def _cma_receive(self, tag: int, check: int, nbytes: int, address: int, msgno: int) -> None:
        """Read a CMA message straight out of the sender's memory into the matched receive (or
        a buffer of our own), then queue the ACK that completes the sender's request."""
        cur = self._begin(tag, check, nbytes)
        if cur.target is not None and nbytes:
            rc = _shm.cma_read(_shm.load_u32(self._in + _S_PID), address, cur.target, 0, nbytes)
            if rc != 0:
                error = PeerFailureError(
                    f"rank {self.rank} could not read the {nbytes}-byte message with tag {tag:#x} "
                    f"out of rank {self.peer}'s memory (process_vm_readv: {os.strerror(-rc)}); "
                    "ranks sharing memory must run as the same user, and Yama's "
                    "kernel.yama.ptrace_scope must be 0 (or use DDL_TRANSPORT=tcp)", self.peer)
                if cur.req is not None:
                    cur.req._fail(error)
                    cur.req = None
                cur.data = None
        cur.read = cur.total
        self._finish(cur)
        self._acks.append(msgno)

    def _send_acks(self) -> None:
        """Queue the ACKs of CMA messages read (``_clock`` not held: this takes ``_plock``)."""
        with self._plock:
            if self._failure is not None or self._lost is not None:
                self._acks.clear()
                return
            while self._acks:
                item = _Send(None, _RECORD.pack(_ACK, 0, 0, 0, self._acks.popleft()), _ACK)
                if self._sendq and self._sendq[0].written:  # never cut into a record
                    self._sendq.insert(1, item)
                else:
                    self._sendq.appendleft(item)
            if self._connected:
                self._push()

    def _begin(self, tag: int, check: int, nbytes: int) -> _Incoming:
        cur = _Incoming(tag, check, nbytes)
        req = self._matcher.take(tag)
        if req is not None:
            error = self._matcher.mismatch(req, check, nbytes)
            if error is not None:
                req._fail(error)
            else:
                assert isinstance(req.view, memoryview)  # host memory only (as_view)
                cur.req, cur.target = req, req.view
        elif self._failure is None:
            cur.data = bytearray(nbytes)
            cur.target = memoryview(cur.data)
        return cur

    def _finish(self, cur: _Incoming) -> None:
        if cur.req is not None:
            cur.req._complete()
            return
        if cur.data is None:
            return  # drained
        self._matcher.arrived(cur.tag, Message(cur.check, cur.nbytes, cur.data))

    def _progress(self) -> bool:
        """One round for this pair: peer state, sends, receives. True if anything moved."""
        moved = False
        state = _shm.load_u32(self._in + _S_STATE)
        if state == _ABORTED and self._failure is None:
            self._peer_aborted()
            return True
        if state == _ATTACHED and not self._connected and not self._closed:
            with self._plock:
                if not self._connected and self._failure is None and self._lost is None:
                    self._attach_back()
        if self._sendq and self._connected:
            with self._plock:
                if self._sendq and self._failure is None and self._lost is None:
                    moved = self._push()
        with self._clock:
            if self._failure is None:
                moved = self._pull() or moved
        if self._acks:
            self._send_acks()
        if state == _CLOSED and self._lost is None:
            self._peer_gone(f"rank {self.peer} closed its connection while")
            moved = True
        return moved

    def _drive(self, req: ShmRequest, budget: float) -> None:
        """Move this pair's bytes from the waiting thread until ``req`` is done or ``budget``
        seconds pass, sleeping on our doorbell (rung by the peer when it publishes data or frees
        space, and by ``req`` when another thread finishes it)."""
        ctx = self._ctx
        bell = ctx._bell
        end = time.monotonic() + budget
        with ctx._drivers:
            if ctx._closed:  # the mappings may be gone: leave it to the request's lock
                return
            ctx._driving += 1
            self._driving += 1
        try:
            while not req._done:
                seen = _shm.bell_seq(bell)
                try:
                    self._progress()
                except DDLError as exc:
                    self._fail_pair(exc)
                left = end - time.monotonic()
                if req._done or left <= 0:
                    return
                # Spin briefly first: a reply usually comes within microseconds, and a futex
                # sleep costs a wake-up of tens of µs on a busy VM (the MPI transport does same).
                spin_end = time.monotonic() + _SPIN_S
                while _shm.bell_seq(bell) == seen and not req._done:
                    if time.monotonic() > spin_end:
                        # Only while asleep must another thread's completion ring the bell.
                        req._driven = True
                        if not req._done:
                            _shm.bell_wait(bell, seen, left)
                        req._driven = False
                        break
        finally:
            req._driven = False
            with ctx._drivers:
                ctx._driving -= 1
                self._driving -= 1
                ctx._drivers.notify_all()

    def _attach_back(self) -> None:
        """The peer attached to us first: attach to it with the name it left in its slot."""
        length = _shm.load_u32(self._in + _S_NAME_LEN)
        name = _shm.get_bytes(self._in + _S_NAME, min(length, _MAX_NAME)).decode()
        pid = _shm.load_u32(self._in + _S_PID)
        try:
            self._attach(name, pid)
        except DDLError as exc:  # we can still receive what it sent; sending to it fails
            self._matcher.lost = f"rank {self.rank} could not attach to rank {self.peer} ({exc}), and"

    # --- failure and shutdown ---------------------------------------------------------------
    def _peer_aborted(self) -> None:
        code = _shm.load_u32(self._in + _S_ABORT_CODE)
        length = min(_shm.load_u32(self._in + _S_ABORT_LEN), MAX_ABORT_REASON_BYTES)
        reason = _shm.get_bytes(self._in + _S_ABORT, length).decode("utf-8", "replace")
        error = abort_error(code, self.peer, reason)
        self._ctx._note_abort(error)
        self._fail_pair(error)

    def _peer_gone(self, why: str) -> None:
        """The peer closed or died: what had fully arrived stays receivable, the rest fails."""
        with self._clock:
            if self._failure is None:
                self._pull()
        with self._plock, self._clock:
            self._matcher.lose(why, lambda: self._take_requests(keep_incoming=False))

    def _fail_pair(self, error: DDLError) -> None:
        """Fail every pending and later request (first error wins)."""
        with self._plock, self._clock:
            self._matcher.fail(error, lambda: self._take_requests(keep_incoming=True))

    def _take_requests(self, keep_incoming: bool) -> list[ThreadRequest]:
        """Take out the sends and the receive being filled, to fail them (``_plock`` and
        ``_clock`` held). ``keep_incoming``: the record being read is drained to its end (an
        abort or close); else it is dropped (the peer is gone: nothing more comes)."""
        pending = [item.req for item in self._sendq if item.req is not None]
        pending += self._await_ack.values()
        self._sendq.clear()
        self._await_ack.clear()
        incoming = self._incoming
        if incoming is not None and incoming.req is not None:
            pending.append(incoming.req)
            if keep_incoming:
                incoming.req = incoming.target = None  # drain the rest
        if not keep_incoming:
            self._incoming = None
        return pending

    def _announce(self, state: int, code: int = 0, reason: bytes = b"") -> None:
        """Publish our state in our slot of the peer's inbox and wake it."""
        self._announced = state
        if not self._connected or not self._out:
            return  # _attach announces it once the pair is attached
        if state == _ABORTED:
            _shm.store_u32(self._out + _S_ABORT_CODE, code)
            _shm.store_u32(self._out + _S_ABORT_LEN, len(reason))
            _shm.put_bytes(self._out + _S_ABORT, reason)
        _shm.store_u32(self._out + _S_STATE, state)
        _shm.bell_ring(self._peer_bell)

    def abort(self, code: int, reason: str) -> None:
        raw = reason.encode("utf-8", "replace")[:MAX_ABORT_REASON_BYTES]
        if self._closed or self._failure is not None:
            return
        self._abort_note = (code, raw)
        self._announce(_ABORTED, code, raw)
        self._fail_pair(abort_error(code, self.rank, reason, peer=self.peer))

    def _begin_close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_pair(CommunicatorClosedError(
            f"rank {self.rank} closed its shm connection to rank {self.peer} while the request "
            "was pending"))
        if self._announced != _ABORTED:
            self._announce(_CLOSED)

    def close(self) -> None:
        self._begin_close()


class ShmContext(PairTableContext):
    """This rank's inbox, progress thread and pairs."""

    _label = "shm"

    def __init__(self, rank: int, size: int, store: Store, timeout: float) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} must be in [0, size={size})")
        self.rank, self.size, self.store, self.timeout = rank, size, store, float(timeout)
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}-r{rank}"
        self._bytes = _inbox_bytes(size)
        # Sparse: the slots' pages appear as peers attach.
        self.path, self._base = create_segment(self.name, self._bytes, _INBOX_HEADER,
                                               f"rank {rank}'s inbox")
        # A process that exits without close() still takes its segment's name with it.
        self._unlink_at_exit = weakref.finalize(self, _unlink_quietly, self.path)
        base = self._base
        _shm.store_u32(base + _OFF_VERSION, _VERSION)
        _shm.store_u32(base + _OFF_NSLOTS, size)
        _shm.store_u64(base + _OFF_CAP, _CAP)
        _shm.store_u32(base + _OFF_PID, os.getpid())
        _shm.store_u64(base + _OFF_MAGIC, _MAGIC)
        self._bell = base + _OFF_BELL
        self._attach_gen = 0
        self._init_pairs()
        self._pidfds = select.poll()
        self._drivers = threading.Condition()  # waiters moving bytes themselves (ShmPair._drive)
        self._driving = 0
        self._closed = False
        self._stopping = False
        try:
            store.set(f"shm/inbox/{rank}", f"{self.name} {os.getpid()}".encode())
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._progress_loop, daemon=True,
                                         name=f"ddl-shm-progress-{rank}")
        self._thread.start()

    # --- pairs ------------------------------------------------------------------------------
    def _new_pair(self, peer: int) -> ShmPair:
        return ShmPair(self, peer)

    def _connect_pair(self, found: ShmPair) -> None:
        """Attach to the peer's inbox (`PairTableContext.pair`), then wake the progress thread."""
        if not found._connected and found._failure is None and found._lost is None:
            name, pid = self._lookup(found.peer)
            with found._plock:
                if not found._connected and found._failure is None and found._lost is None:
                    try:
                        found._attach(name, pid)
                    except PeerFailureError as exc:
                        if _shm.load_u32(found._in + _S_STATE) == _NONE:
                            raise
                        # It wrote to us and left: what it sent is still ours to receive.
                        found._matcher.lost = f"{exc}; so"
        self._wake()

    def _lookup(self, peer: int) -> tuple[str, int]:
        try:
            raw = self.store.get(f"shm/inbox/{peer}", self.timeout)
        except StoreUnreachableError as exc:  # rank 0, which serves the store, is gone
            raise PeerFailureError(f"rank {self.rank} could not look up the shared memory of "
                                   f"rank {peer}: {exc}", 0) from None
        name, _, pid = raw.decode().partition(" ")
        if not name.startswith(PREFIX) or "/" in name or len(name) > _MAX_NAME:
            raise PeerFailureError(f"rank {peer} published a bad inbox name {name!r}", peer)
        return name, int(pid)

    # --- the progress thread ----------------------------------------------------------------
    def _wake(self) -> None:
        _shm.bell_ring(self._bell)

    def _discover(self) -> None:
        """Peers that attached to us before we used the pair get a pair now (their messages
        must be received, and we must be able to tell them when we close)."""
        for peer in range(self.size):
            if peer != self.rank and peer not in self._pairs and _shm.load_u32(
                    self._base + _INBOX_HEADER + peer * _SLOT + _S_STATE) != _NONE:
                self._pair_for(peer)

    def _progress_loop(self) -> None:
        bell = self._bell
        next_liveness = 0.0
        while not self._stopping:
            seen = _shm.bell_seq(bell)
            gen = _shm.load_u32(self._base + _OFF_ATTACH_GEN)
            if gen != self._attach_gen:
                self._attach_gen = gen
                self._discover()
            moved = False
            for p in self._pair_list():
                if p._driving:  # a waiting thread is moving this pair's bytes right now
                    continue
                try:
                    moved = p._progress() or moved
                except DDLError as exc:
                    p._fail_pair(exc)
                except Exception as exc:  # a bug must fail the pair, not silently stop progress
                    p._fail_pair(PeerFailureError(
                        f"rank {self.rank}: internal error in the shm progress thread towards "
                        f"rank {p.peer}: {exc!r}", p.peer))
                if p._pidfd >= 0 and not p._watched:  # only this thread touches the poll set
                    p._watched = True
                    self._pidfds.register(p._pidfd, select.POLLIN)
            now = time.monotonic()
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_S
                self._check_liveness()
            if moved:
                continue
            if self._driving:
                # Waiting threads are moving bytes and sleep on the doorbell themselves: poll
                # instead of sleeping there too, so each message wakes one thread, not two.
                time.sleep(_POLL_WHILE_DRIVEN_S)
            else:
                _shm.bell_wait(bell, seen, _IDLE_WAIT_S)

    def _check_liveness(self) -> None:
        dead = {fd for fd, _ in self._pidfds.poll(0)}
        if not dead:
            return
        for p in self._pair_list():
            if p._watched and p._pidfd in dead:
                p._watched = False
                self._pidfds.unregister(p._pidfd)
                # Survivors clean up (before anyone hears of it and exits): the dead rank's
                # segments would otherwise outlive the job.
                remove_segments_of({p._peer_pid})
                p._peer_gone(f"rank {p.peer} (pid {p._peer_pid}) exited while")

    # --- shutdown ---------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs = self._pair_list()
        for p in pairs:
            p._begin_close()
        self._stopping = True
        self._wake()
        self._thread.join()
        with self._drivers:  # nobody may touch the mappings once they are gone
            self._drivers.wait_for(lambda: self._driving == 0, timeout=_CLOSE_WAIT_S)
        for p in pairs:
            p._detach()
        self._release()

    def _release(self) -> None:
        _shm.unmap(self._base, self._bytes)
        self._unlink_at_exit()


class ShmTransport(Transport):
    """Shared memory between ranks of one host (same hostname and network namespace)."""

    name = "shm"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
            return False, f"{SHM_DIR} is missing or not writable (mount a tmpfs there)"
        if not hasattr(os, "pidfd_open"):
            return False, "needs Linux >= 5.3 and Python >= 3.9 (os.pidfd_open)"
        return True, ""

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return me.host_id == peer.host_id

    def create_context(self, rank: int, size: int, store: Store, timeout: float) -> Context:
        return ShmContext(rank, size, store, timeout)
