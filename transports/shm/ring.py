"""The ring protocol of the shm transport: the inbox and slot layout, record kinds and sizes,
the producer's queue items (`Send`) and the record being consumed (`Incoming`), and
`ShmRequest`, whose waiter moves its pair's bytes itself; and `RingEnds`, which moves the
bytes through a pair's rings and matches what arrives.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from ddlcore.transports import _shm
from ddlcore.transports.common import Message, ThreadRequest
from ddlcore.transports.pairs import MatchedPair
from ddlcore.transports.shm.segments import cma_allowed

from ddlcore.errors import DDLError, PeerFailureError

if TYPE_CHECKING:
    from ddlcore.transports.shm.pair import ShmPair


_MAGIC = 0xDD1C_5E60_0000_0001
_VERSION = 1
# 2 MiB per ordered pair: large enough that a 1 MiB pipeline chunk streams without stalls,
# small enough to stay in the last-level cache of the cores copying through it.
_CAP = 1 << 21
# Publish the head at least every 256 KiB so the consumer starts copying before a large
# message is all in (measured: 128 KiB-1 MiB pieces give the same bandwidth here).
_PIECE = 1 << 18
_HDR = 32  # record header and record alignment
_INBOX_HEADER = 4096
_SLOT_HEADER = 8192
_SLOT = _SLOT_HEADER + _CAP
# Inbox header offsets.
_OFF_MAGIC, _OFF_VERSION, _OFF_NSLOTS, _OFF_CAP, _OFF_PID = 0, 8, 12, 16, 24
_OFF_BELL, _OFF_ATTACH_GEN = 64, 128
# Set in the attach counter, by one atomic add, when the inbox's owner closes: a peer's attach
# (the same word, also an atomic add) comes either before it, and the owner finds the peer and
# tells it of the close, or after it, and the peer sees the bit and treats the owner as gone.
_GEN_CLOSED = 1 << 31
# Slot header offsets (the producer writes everything but the tail).
_S_HEAD, _S_TAIL, _S_STATE, _S_PID, _S_ABORT_CODE, _S_ABORT_LEN = 0, 64, 128, 132, 136, 140
_S_NAME_LEN, _S_NAME, _S_ABORT = 144, 192, 512
_MAX_NAME = 255
# Producer states.
_NONE, _ATTACHED, _CLOSED, _ABORTED = 0, 1, 2, 3
# Record kinds.
_DATA = 1  # header, then the payload through the ring
_CMA = 2  # header, then where the payload is: the receiver reads it itself
_ACK = 3  # the receiver has read CMA message ``msgno``: the send is done
_RECORD = struct.Struct("<IIQQQ")  # kind, check, tag, nbytes, msgno (CMA, ACK)
_CMA_BLOCK = struct.Struct("<QQQQ")  # address in the sender, 3 x reserved
# From 256 KiB up one kernel copy (process_vm_readv) beats two copies through the ring even with
# the ACK's round trip; below it the ring wins (measured with benchmarks/p2p.py).
_CMA_MIN = 1 << 18
_IDLE_WAIT_S = 0.05  # the progress thread wakes at least this often ...
_LIVENESS_S = 0.05  # ... to look at the peers' pidfds
# A waiting thread moves its pair's bytes itself for this long before it blocks on the request
# (one wake-up per message instead of two: the doorbell wakes the waiter directly).
_DRIVE_S = 0.05
_SPIN_S = 50e-6  # spin this long before sleeping on the doorbell (4 KB p2p: 66 -> 14 µs)
_POLL_WHILE_DRIVEN_S = 0.0005  # how often the progress thread looks while waiters drive
_CLOSE_WAIT_S = 5.0  # close() waits this long for waiting threads to step out


def pad(n: int) -> int:
    return (n + _HDR - 1) & ~(_HDR - 1)


def inbox_bytes(nslots: int) -> int:
    return _INBOX_HEADER + nslots * _SLOT


class ShmRequest(ThreadRequest):
    """A request whose waiter drives progress on its pair (see `ShmPair._drive`)."""

    __slots__ = ("_driven",)

    def __init__(
        self, pair: ShmPair, view: memoryview, tag: int, check: int, is_send: bool
    ) -> None:
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


_CMA_OK = cma_allowed()


class Send:
    """An item of the producer's queue: its record (header, and for CMA where the data is), the
    payload streamed after it (DATA), and how much of it is already in the ring."""

    __slots__ = ("req", "view", "record", "total", "written", "kind")

    def __init__(
        self, req: ThreadRequest | None, record: bytes, kind: int, view: memoryview | None = None
    ) -> None:
        self.req, self.record, self.kind, self.view = req, record, kind, view
        self.total = len(record) + (pad(len(view)) if view is not None else 0)
        self.written = 0


class Incoming:
    """The record the consumer is in the middle of."""

    __slots__ = ("req", "target", "tag", "check", "nbytes", "total", "read", "data")

    def __init__(self, tag: int, check: int, nbytes: int) -> None:
        self.tag, self.check, self.nbytes = tag, check, nbytes
        self.total = pad(nbytes)  # payload + padding still to consume
        self.read = 0
        self.req: ThreadRequest | None = None
        self.target: memoryview | None = None  # None: drain (mismatch, or nobody will ask)
        self.data: bytearray | None = None  # unexpected: a buffer of our own


class RingEnds(MatchedPair):
    """This rank's ends of a pair's two rings, the bytes moving through them: `_push` writes
    queued sends into our ring in the peer's inbox, `_pull` consumes the peer's ring in ours and
    matches each record (`ShmPair` holds the state, and calls these from the progress thread or
    the caller's thread)."""

    rank: int
    peer: int
    _in: int  # the peer's ring to us (in our inbox) and its data
    _in_data: int
    _tail: int
    _out: int  # our ring in the peer's inbox, once attached, and its data
    _out_data: int
    _head: int
    _peer_bell: int
    _connected: bool
    _plock: threading.Lock
    _sendq: deque[Send]
    _incoming: Incoming | None
    _await_ack: dict[int, ShmRequest]
    _acks: deque[int]

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
                    _shm.get_bytes(data + (tail & (_CAP - 1)), _HDR)
                )
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
                        _shm.get_bytes(data + ((tail + _HDR) & (_CAP - 1)), _CMA_BLOCK.size)
                    )[0]
                    tail += _HDR + _CMA_BLOCK.size
                    self._cma_receive(tag, check, nbytes, address, msgno)
                    continue
                tail += _HDR
                if kind != _DATA or nbytes > 1 << 48:
                    raise DDLError(
                        f"rank {self.rank}: corrupt record (kind {kind}, {nbytes} "
                        f"bytes) in the ring from rank {self.peer}"
                    )
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
                    "kernel.yama.ptrace_scope must be 0 (or use DDL_TRANSPORT=tcp)",
                    self.peer,
                )
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
                item = Send(None, _RECORD.pack(_ACK, 0, 0, 0, self._acks.popleft()), _ACK)
                if self._sendq and self._sendq[0].written:  # never cut into a record
                    self._sendq.insert(1, item)
                else:
                    self._sendq.appendleft(item)
            if self._connected:
                self._push()

    def _begin(self, tag: int, check: int, nbytes: int) -> Incoming:
        cur = Incoming(tag, check, nbytes)
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

    def _finish(self, cur: Incoming) -> None:
        if cur.req is not None:
            cur.req._complete()
            return
        if cur.data is None:
            return  # drained
        self._matcher.arrived(cur.tag, Message(cur.check, cur.nbytes, cur.data))
