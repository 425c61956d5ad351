"""TCP transport: tag-matched, non-blocking point-to-point messages over sockets, any network.

Shape (after Gloo): `TcpTransport` -> `TcpContext` (this rank's listener and pairs) -> `TcpPair`
(``DDL_NCHANNELS`` sockets to one peer) -> `TcpRequest`. This file is over the ~500-line guide
because the wire protocol, the per-socket threads and the failure rules only make sense together.

Connecting is lazy: the lower rank of a pair connects to the higher rank's listener (address from
the store key ``tcp/addr/{rank}``), one socket per channel. With ``DDL_SOCKET_IFNAME`` listing A
interfaces (rails, one subnet each), local rank i listens on (and publishes) the (i mod A)-th's
address; a connection goes where the kernel routes the peer's address, so ranks of one rail
(mdring's rings across hosts) talk through their adapter, and no reply comes back on another
(no source is bound: that would break under strict reverse-path filtering). Before anything else on
a socket is acted on, the connector proves the job's key (``store.job_key``,
`ddlcore.auth.JobKey`) with its claim bound into the proof: protocol version, source rank,
destination rank, world size, channel and channel count. So a connection can only be the rank it claims, to the rank it meant.
Only then does the higher rank answer (ACK: accepted, or why not) and file the socket under its
pair; a second connection for a channel already connected is refused. Handshakes are served
concurrently (`HandshakeListener`): each has _HANDSHAKE_TIMEOUT_S for the whole of it, and caps
on pending ones (in all, and per source address) drop the oldest, so strangers holding
connections open delay nobody; a connector dropped that way tries again. ``pair(p)`` never
waits for the peer's program: on the higher side it returns at once, sends queue until the peer
connects, and a request that waits too long says the peer never connected (and how many
connections this rank refused, and why the last one was).

Each socket has a sender thread (queue of frames; ``sendmsg`` of header + payload view, no copy;
when the socket is idle the caller's thread sends without waiting) and a receiver thread, which
reads a header and then ``recv_into`` straight into the posted receive's buffer; a message no
receive has asked for yet is read into a new buffer and copied out when one is posted. A message
goes on socket ``tag % nchannels``, so messages with one tag stay ordered.

A thread waiting on a receive reads its socket itself (``_Channel.drive``: polling it for
``_SPIN_S``, then sleeping in ``poll``) while the receiver thread stands back, parked until no
waiter has read for ``_LINGER_S``. One reader at a time: the waiter asks the receiver thread out
through an eventfd and takes over between frames. So a small message wakes nobody: handing each
one from the receiver thread to the waiter cost two thread wake-ups of tens of µs on a VM. The
frame being read is kept on the channel (`_Inbound`): a waiter reads without blocking and leaves
at its deadline even half-way through a frame, and the next reader carries on from there.

Frame header (little endian, 28 bytes): magic u32 | kind u16 | reserved u16 | check u32 |
tag u64 | nbytes u64, then ``nbytes`` of payload. DATA carries a message; ABORT carries an error
code (``ABORT_*``) in ``check`` and a UTF-8 reason of at most MAX_ABORT_REASON_BYTES; CLOSE says
the sender closed: the receiver stops sending on that socket (shutdown) so both ends see EOF.

Failures: a size or check-word mismatch fails that one receive (`CollectiveMismatchError`), after
draining the payload so the stream stays usable. CLOSE, EOF or a reset fail the pending and later
requests of that socket with `PeerFailureError`; messages that had fully arrived before stay
receivable. An ABORT (sent or received) and `close` fail everything on the pair at once; an
ABORT received aborts the whole context in turn (`common.PairTableContext._note_abort`).
"""

from __future__ import annotations

import math
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

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
    MAX_CHECK,
    Matcher,
    Message,
    ThreadRequest,
    abort_error,
    as_view,
    check_tag,
    copy_error,
    job_key_of,
    recv_view,
    seconds,
    timeout_error,
)
from ddlcore.transports.pairs import LazyPair, PairTableContext
from ddlcore.transports.sockets import (
    HandshakeListener,
    format_address,
    parse_address,
    rail_address,
    recv_exact,
    route_address,
)

from ddlcore import config
from ddlcore.auth import AuthenticationError
from ddlcore.errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
    RendezvousError,
)
from ddlcore.store import StoreUnreachableError

PROTOCOL_VERSION = 2  # 2: the hello is a claim proven with the job's key
_MAGIC = 0xDD1C7C90
_HEADER = struct.Struct("<IHHIQQ")
# The claim a connector proves: label, version, nchannels, src, dst, size, channel.
_CLAIM = struct.Struct("<4sHHIIIH")
_CLAIM_LABEL = b"tcp\0"
_ACK = struct.Struct("<IHHHH")  # magic, version, status, nchannels, 0
_DATA, _ABORT, _CLOSE = 1, 2, 3
_ACK_OK, _ACK_WRONG_PEER, _ACK_NCHANNELS, _ACK_DUPLICATE, _ACK_CLOSED = 0, 1, 2, 3, 4
# A connection that has not finished its handshake by then is dropped; a real one takes
# milliseconds (two round trips and four HMACs).
_HANDSHAKE_TIMEOUT_S = 10.0
# Pending handshakes at most, in all and from one source address. Fixed, not scaled with the
# job: each pending one holds a thread and an fd for up to _HANDSHAKE_TIMEOUT_S, so a stranger
# from one address (or from 127.0.0.x, many) must never get more than these. A real handshake
# takes milliseconds, and a real connector dropped at a cap retries (_RETRY_PAUSE_S), so a burst
# of many lower ranks connecting at once is slowed, never refused.
_MAX_PENDING = 128
_MAX_PENDING_PER_SOURCE = 32
_RETRY_PAUSE_S = (0.005, 0.1)  # a connector dropped by a busy listener retries: first, longest
_CLOSE_TIMEOUT_S = 2.0  # how long close() lets peers answer CLOSE before cutting sockets
_DRAIN_CHUNK = 1 << 20
# A waiting receive polls its socket this long before sleeping in poll(): a reply usually comes
# within microseconds, a sleep costs a wake-up of tens of µs on a VM (shm spins the same 50 µs).
_SPIN_S = 50e-6
# The receiver thread stays parked this long after the last waiter stopped reading, so back-to-back
# collectives never hand the socket back and forth; it bounds how late a message nobody waits for
# is read (it waits in the socket meanwhile).
_LINGER_S = 0.002
_MAX_POLL_MS = 2**31 - 1  # poll() takes a C int of milliseconds; longer waits loop
_CLOSE_FRAME = _HEADER.pack(_MAGIC, _CLOSE, 0, 0, 0, 0)
_NO_PAYLOAD = memoryview(b"")


class _ProtocolError(Exception):
    """The peer sent something that is not a ddlcore tcp frame: the connection is dropped."""


class TcpRequest(ThreadRequest):
    """A send or receive; a receive's waiter reads the socket itself (`_Channel.drive`) while
    it can, and otherwise waits on the lock like any `ThreadRequest`."""

    __slots__ = ("_driven",)

    def __init__(self, pair: TcpPair, view: memoryview, tag: int, check: int,
                 is_send: bool) -> None:
        super().__init__(pair, view, tag, check, is_send)
        self._driven: _Channel | None = None  # the channel whose socket our waiter is reading

    def _fail(self, error: DDLError) -> None:
        super()._fail(error)
        driven = self._driven
        if driven is not None:  # failed by another thread: wake our waiter from its poll()
            driven.ring()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done and not self.is_send:
            ch = self._pair._channel_for(self.tag)
            # No deadline past what a lock can wait (threading.TIMEOUT_MAX, ~292 years; inf).
            deadline = (None if timeout is None or timeout >= threading.TIMEOUT_MAX
                        else time.monotonic() + timeout)
            while not self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._pair._timeout_error(self, timeout)
                if not ch.drive(self, deadline):
                    # Another thread reads this socket (or it is not connected yet): that thread,
                    # or the receiver thread once it is back, finishes us; look again meanwhile.
                    wait_s = _LINGER_S if left is None else min(_LINGER_S, left)
                    if self._lock.acquire(True, wait_s):
                        self._lock.release()
        super().wait(timeout)


@dataclass(slots=True)
class _Frame:
    """An item of a channel's send queue: a frame's header, its payload (DATA), the request it
    completes (None for control frames) and how many of its bytes are written already."""

    header: bytes
    view: memoryview | None = None
    req: TcpRequest | None = None
    sent: int = 0


class _Channel:
    """One socket of a pair: its send queue and threads, and the matching state of the tags that
    travel on it (``tag % nchannels == index``)."""

    def __init__(self, pair: TcpPair, index: int) -> None:
        self.pair, self.index = pair, index
        self.sock: socket.socket | None = None
        # The tags that travel on this socket: their receives, messages and failure
        self.matcher: Matcher[TcpRequest] = Matcher(pair.rank, pair.peer, "TCP")
        self.scond = threading.Condition(threading.Lock())  # guards queue, busy, stopping
        self.queue: deque[_Frame] = deque()
        self.busy = False  # a thread is writing to the socket
        self.stopping = False
        self.sender: threading.Thread | None = None  # started once the socket is attached
        self.receiver: threading.Thread | None = None
        # Who reads the socket: the receiver thread (``reading``) or one waiter (``driving``),
        # never both; guarded by rcond. The thread stays parked until ``resume_at``.
        self.rcond = threading.Condition(threading.Lock())
        self.reading = False
        self.driving: TcpRequest | None = None  # the request whose waiter reads the socket
        self.resume_at = 0.0
        self.wake_fd = -1  # eventfd: asks the reader in poll() to look at its flags again
        self.waiter_poll = select.poll()  # the driving waiter's (one at a time): set before sock
        self.inbound = _Inbound(self)

    @property
    def failure(self) -> str | None:
        """Why the socket is gone (a PeerFailureError prefix), or None."""
        return self.matcher.lost

    # --- sending --------------------------------------------------------------------------------
    def send(self, item: _Frame, front: bool = False) -> None:
        with self.scond:
            if self.sock is None or self.busy or self.queue:
                if front and self.queue and self.queue[0].sent:  # never inside a frame begun
                    self.queue.insert(1, item)
                elif front:
                    self.queue.appendleft(item)
                else:
                    self.queue.append(item)
                self.scond.notify()
                return
            self.busy = True
        self._send_now(item)

    def _send_now(self, item: _Frame) -> None:
        """Write what the socket takes without blocking; the sender thread does the rest."""
        header, view, req = item.header, item.view, item.req
        sock = self.sock
        assert sock is not None
        try:
            if view is not None and view.nbytes:
                sent = sock.sendmsg((header, view), (), socket.MSG_DONTWAIT)
            else:
                sent = sock.send(header, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            with self.scond:
                self.busy = False
                self.scond.notify()
            self.broken(exc, req)
            return
        if sent == len(header) + (view.nbytes if view is not None else 0):
            with self.scond:
                self.busy = False
                if self.queue or self.stopping:
                    self.scond.notify()
            if req is not None:
                req._complete()
            return
        item.sent = sent
        with self.scond:
            self.queue.appendleft(item)
            self.busy = False
            self.scond.notify()

    def send_loop(self) -> None:
        sock, cond, queue, pair = self.sock, self.scond, self.queue, self.pair
        assert sock is not None
        while True:
            with cond:
                while self.busy or not queue:
                    if self.stopping and not queue and not self.busy:
                        return
                    cond.wait()
                item = queue.popleft()
                self.busy = True
            header, req, sent = item.header, item.req, item.sent
            view = _NO_PAYLOAD if item.view is None else item.view
            if req is not None and not sent and (pair._failure is not None
                                                 or self.failure is not None):
                with cond:
                    self.busy = False
                req._fail(pair._error_for(self, req))
                continue
            try:
                hlen = len(header)
                nbytes = view.nbytes
                while sent < hlen:
                    if nbytes:
                        sent += sock.sendmsg((header[sent:], view))
                    else:
                        sock.sendall(header[sent:])
                        sent = hlen
                if sent < hlen + nbytes:
                    sock.sendall(view[sent - hlen:])
                if header is _CLOSE_FRAME:  # nothing more will be written on this socket
                    sock.shutdown(socket.SHUT_WR)
            except Exception as exc:  # OSError: the socket broke; anything else: a bug, same cure
                with cond:
                    self.busy = False
                self.broken(exc, req)
                continue
            with cond:
                self.busy = False
            if req is not None:
                if pair._failure is not None:  # a frame begun before an abort was finished
                    req._fail(pair._error_for(self, req))
                else:
                    req._complete()

    # --- receiving ------------------------------------------------------------------------------
    def recv_loop(self) -> None:
        """The receiver thread: read frames whenever no waiter does (see the module docstring)."""
        sock, cond = self.sock, self.rcond
        assert sock is not None
        poller = self.socket_and_wake_poll(sock)
        fd = sock.fileno()
        alive = True
        while alive:
            with cond:
                while self.driving is not None or (now := time.monotonic()) < self.resume_at:
                    cond.wait(_LINGER_S if self.driving is not None else self.resume_at - now)
                self.reading = True
            try:
                for efd, _ in poller.poll():
                    if efd == fd:
                        alive = self.inbound.advance(sock, True)
                    else:
                        self.drain()
            finally:
                with cond:
                    self.reading = False
                    if self.driving is not None:
                        cond.notify_all()
        with cond:
            if self.pair._closed:  # close() may have given up on joining us: the eventfd is ours
                self.release_wake_locked()

    def drive(self, req: TcpRequest, deadline: float | None) -> bool:
        """Read this socket from ``req``'s waiting thread until ``req`` is done, the socket
        fails or ``deadline`` passes. False: another thread reads it, or it is not connected
        (the caller waits on ``req``'s lock); True: look at ``req`` and the deadline again."""
        cond = self.rcond
        req._driven = self
        try:
            with cond:
                sock = self.sock
                if (self.driving is not None or sock is None or self.failure is not None
                        or self.pair._failure is not None):
                    return False
                self.driving = req  # one store: the finally below sees it set or not at all
                if self.reading:  # ask the receiver thread out; it leaves between reads
                    self._ring_locked()
                while self.reading and not req._done:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return True
                    cond.wait(left)
            self._read_until(sock, req, deadline)
        finally:
            req._driven = None
            with cond:
                if self.driving is req:
                    self.driving = None
                    self.resume_at = time.monotonic() + _LINGER_S
                    if self.pair._closed:  # the pair's close() left the eventfd to us
                        self.release_wake_locked()
        return True

    def _read_until(self, sock: socket.socket, req: TcpRequest, deadline: float | None) -> None:
        poller, inbound = self.waiter_poll, self.inbound  # one driver at a time uses them
        fd = sock.fileno()
        spin_end = time.monotonic() + _SPIN_S
        while not req._done:
            events = poller.poll(0)
            if not events:
                now = time.monotonic()
                if now < spin_end:
                    continue
                if deadline is None:
                    events = poller.poll()
                elif now >= deadline:
                    return
                else:
                    events = poller.poll(min(math.ceil((deadline - now) * 1000), _MAX_POLL_MS))
            for efd, _ in events:
                if efd == fd:
                    if not inbound.advance(sock, False):
                        return
                    spin_end = time.monotonic() + _SPIN_S
                else:
                    self.drain()

    def socket_and_wake_poll(self, sock: socket.socket) -> select.poll:
        """A poll object on ``sock`` and the eventfd (each reader has its own)."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(self.wake_fd, select.POLLIN)
        return poller

    def open_wake(self) -> None:
        """Make the eventfd, before the socket is attached (once)."""
        if self.wake_fd >= 0:
            return
        try:
            self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError as exc:
            pair = self.pair
            raise DDLError(f"rank {pair.rank} could not make an eventfd for TCP channel "
                           f"{self.index} to rank {pair.peer}: {exc}; raise the open-file limit "
                           "(ulimit -n)") from None

    def ring(self) -> None:
        """Wake whichever reader sleeps in poll() or on rcond (a request of it failed)."""
        with self.rcond:
            self._ring_locked()
            self.rcond.notify_all()

    def _ring_locked(self) -> None:
        if self.wake_fd >= 0:  # -1: released with the pair; nobody polls any more
            os.eventfd_write(self.wake_fd, 1)

    def release_wake_locked(self) -> None:
        """Close the eventfd once nothing can poll it (rcond held, so that a late ring() never
        writes to a reused descriptor number)."""
        receiver = self.receiver
        alive = receiver is not None and receiver.is_alive() and receiver is not \
            threading.current_thread()
        if self.wake_fd >= 0 and self.driving is None and not alive:
            os.close(self.wake_fd)
            self.wake_fd = -1

    def drain(self) -> None:
        try:
            os.eventfd_read(self.wake_fd)
        except OSError:  # BlockingIOError: the other reader drained it first
            pass

    # --- failure and shutdown -------------------------------------------------------------------
    def fail(self, base: str) -> None:
        """This socket is gone (peer closed, reset, died): fail its pending requests."""
        def sends() -> list[TcpRequest]:
            with self.scond:
                pending = [item.req for item in self.queue if item.req is not None]
                self.queue.clear()
            return pending

        pair = self.pair
        if self.matcher.lose(base, sends):
            self.inbound.abandon(lambda req: pair._error_for(self, req))

    def take_sends(self) -> list[TcpRequest]:
        """Take the pair's sends out of the queue to fail them (an abort or close): control
        frames stay, and a frame partly written is finished."""
        with self.scond:
            kept = [item for item in self.queue if item.req is None or item.sent]
            pending = [item.req for item in self.queue if item.req is not None]
            self.queue.clear()
            self.queue.extend(kept)
        return pending

    def broken(self, exc: BaseException, req: TcpRequest | None) -> None:
        """The socket failed under ``req`` (if any): fail it and everything pending here."""
        self.fail(f"connection to rank {self.pair.peer} lost: {exc};")
        if req is not None:
            req._fail(self.pair._error_for(self, req))

    def stop(self) -> None:
        """Queue CLOSE (if the socket still works) and let the sender thread finish."""
        with self.scond:
            if self.sock is not None and self.failure is None:
                self.queue.append(_Frame(_CLOSE_FRAME))
            self.stopping = True
            self.scond.notify()


class _Inbound:
    """The frame being read off one channel's socket: how much of its header is in, where its
    payload goes and what to do once it is all in. It lives on the channel, so a waiter that
    leaves at its deadline half-way through a frame and the receiver thread carry on where the
    other stopped. Only the one reader of the moment (``_Channel.drive`` / ``recv_loop``) uses
    it; a request it took out of ``posted`` is finished by that reader alone."""

    def __init__(self, ch: _Channel) -> None:
        self.ch = ch
        self.head = bytearray(_HEADER.size)
        self.hview = memoryview(self.head)
        self.hgot = 0  # header bytes in; the payload's turn once it is _HEADER.size
        self.kind = self.check = self.tag = self.nbytes = 0
        self.sink: memoryview | None = None  # where the payload goes; None: thrown away
        self.got = 0  # payload bytes in
        self.req: TcpRequest | None = None  # the posted receive the payload is for
        self.mismatch: CollectiveMismatchError | None = None  # req's: drain, then fail it
        self.data: bytearray | None = None  # an unexpected message's or an abort's bytes
        self.scratch: memoryview | None = None  # for thrown-away payloads

    def advance(self, sock: socket.socket, blocking: bool) -> bool:
        """Read on the current frame (``blocking``: the rest of it, waiting; else what the
        socket holds now) and finish it if it is all in. False: the socket is gone, and this
        channel's requests have failed."""
        try:
            self._read(sock, blocking)
        except (BlockingIOError, InterruptedError):  # nothing more for now
            return True
        except OSError as exc:
            self._lost(exc)
            return False
        except Exception as exc:  # a bad frame (e.g. absurd size): drop this connection
            self._lost(ConnectionError(f"protocol error: {exc!r}"))
            _shutdown(sock)
            return False
        except BaseException:  # e.g. Ctrl-C between a read and its bookkeeping: where the
            self._lost(ConnectionError("a read was interrupted"))  # stream stands is unknown
            _shutdown(sock)
            raise
        return True

    def _lost(self, exc: BaseException) -> None:
        """The stream is unusable: fail the request the frame was for with everything else
        pending, and forget the frame (later reads see the socket's EOF or error)."""
        req = self.req
        self._next_frame()
        self.ch.broken(exc, req)

    def _next_frame(self) -> None:
        self.hgot = self.nbytes = self.got = 0
        self.sink, self.req, self.data = None, None, None

    def _read(self, sock: socket.socket, blocking: bool) -> None:
        flags = socket.MSG_WAITALL if blocking else socket.MSG_DONTWAIT
        hsize = _HEADER.size
        while self.hgot < hsize:
            got = sock.recv_into(self.hview[self.hgot:], hsize - self.hgot, flags)
            if got == 0:
                raise ConnectionResetError("the peer closed the connection (EOF)" if not self.hgot
                                           else "EOF inside a frame header")
            self.hgot += got
            if self.hgot == hsize:
                self._begin()
        while self.got < self.nbytes:
            want = self.nbytes - self.got
            sink = self.sink  # once: abandon() may clear it from another thread
            if sink is not None:
                got = sock.recv_into(sink[self.got:], want, flags)
            else:
                want = min(want, _DRAIN_CHUNK)
                if self.scratch is None or len(self.scratch) < want:
                    self.scratch = memoryview(bytearray(want))
                got = sock.recv_into(self.scratch, want, flags)
            if got == 0:
                raise ConnectionResetError("EOF inside a message")
            self.got += got
        self._finish()

    def _begin(self) -> None:
        """The header is in: decide where the payload goes."""
        magic, kind, _, check, tag, nbytes = _HEADER.unpack_from(self.head)
        if magic != _MAGIC:
            raise _ProtocolError(f"bad frame magic {magic:#x}: not a ddlcore tcp peer")
        self.kind, self.check, self.tag, self.nbytes, self.got = kind, check, tag, nbytes, 0
        self.sink, self.req, self.mismatch, self.data = None, None, None, None
        ch = self.ch
        if kind == _DATA:
            self.req = req = ch.matcher.take(tag)
            if req is not None:
                self.mismatch = ch.matcher.mismatch(req, check, nbytes)
                if self.mismatch is None and nbytes:
                    assert isinstance(req.view, memoryview)  # host memory only (as_view)
                    self.sink = req.view
            elif ch.pair._failure is None and ch.failure is None:  # else nobody asks: drop it
                self.data = bytearray(nbytes)
                self.sink = memoryview(self.data)
        elif kind == _ABORT:
            if nbytes > MAX_ABORT_REASON_BYTES:
                raise _ProtocolError(f"abort reason of {nbytes} bytes (cap "
                                     f"{MAX_ABORT_REASON_BYTES})")
            self.data = bytearray(nbytes)
            self.sink = memoryview(self.data)
        elif kind != _CLOSE:
            raise _ProtocolError(f"unknown frame kind {kind}")

    def _finish(self) -> None:
        """The whole frame is in: hand it on, then be ready for the next header (in that order:
        an interruption in between leaves the request with `_lost`, which fails it)."""
        kind, check, tag, nbytes = self.kind, self.check, self.tag, self.nbytes
        req, data = self.req, self.data
        ch = self.ch
        pair = ch.pair
        if kind == _DATA:
            if req is not None:
                if self.mismatch is not None:
                    req._fail(self.mismatch)
                else:
                    req._complete()
            elif data is not None:
                ch.matcher.arrived(tag, Message(check, nbytes, data))
        elif kind == _ABORT:
            assert data is not None
            error = abort_error(check, pair.peer, data.decode("utf-8", "replace"))
            pair._ctx._note_abort(error)
            pair._fail_pair(error)
        else:  # CLOSE
            ch.fail(f"rank {pair.peer} closed its connection while")
            try:  # we will not be read any more: stop writing, so both ends see EOF
                ch.sock.shutdown(socket.SHUT_WR)  # type: ignore[union-attr]
            except OSError:
                pass
        self._next_frame()

    def abandon(self, error_for: Callable[[TcpRequest], DDLError]) -> None:
        """Fail the request whose payload is coming in (abort, close, socket gone), from any
        thread; the rest of its payload is read into scratch, not into the caller's buffer."""
        req = self.req
        if req is not None:
            self.sink = None
            req._fail(error_for(req))


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class TcpPair(LazyPair, Pair):
    """The ``nchannels`` sockets to one peer and their threads."""

    _ctx: TcpContext

    def __init__(self, ctx: TcpContext, peer: int) -> None:
        self.rank, self.peer = ctx.rank, peer
        self._ctx = ctx
        self._nch = ctx.nchannels
        self._channels = [_Channel(self, i) for i in range(self._nch)]
        self._lock = threading.Lock()  # attaching sockets, pair-wide failure, closing
        self._init_connect()
        self._failure: DDLError | None = None  # abort (either side) or local close: final
        self._abort_frame: bytes | None = None
        self._closed = False
        self._connected = peer < ctx.rank  # the higher rank is connected to; it needs nothing

    # --- requests -------------------------------------------------------------------------------
    def isend(self, view: memoryview, tag: int, check: int = 0) -> Request:
        view = as_view(view)
        check_tag(tag, check)
        req = TcpRequest(self, view, tag, check, True)
        ch = self._channel_for(tag)
        if self._failure is not None or ch.failure is not None:
            req._fail(self._error_for(ch, req))
        else:
            ch.send(_Frame(_HEADER.pack(_MAGIC, _DATA, 0, check, tag, req.nbytes), view, req))
        return req

    def irecv(self, view: memoryview, tag: int, check: int = 0) -> Request:
        view = recv_view(view, tag, check)
        req = TcpRequest(self, view, tag, check, False)
        self._channel_for(tag).matcher.post(req)
        return req

    def _channel_for(self, tag: int) -> _Channel:
        return self._channels[tag % self._nch]

    def _error_for(self, ch: _Channel, req: TcpRequest) -> DDLError:
        if self._failure is not None:
            return copy_error(self._failure)
        return ch.matcher.error_for(req)

    def _timeout_error(self, req: TcpRequest, timeout: float) -> DDLTimeoutError:
        note = ""
        if self._channel_for(req.tag).sock is None:
            note = f" (rank {self.peer} has not connected to rank {self.rank} yet"
            refusals = self._ctx.refusals()
            note += f"; rank {self.rank}'s listener: {refusals})" if refusals else ")"
        return timeout_error(self.rank, self.peer, req, timeout, note)

    # --- connection -----------------------------------------------------------------------------
    def _open(self, deadline: float) -> None:
        """Lower rank: open every channel to the peer's listener (`LazyPair._connect`)."""
        ctx, peer = self._ctx, self.peer
        try:
            raw = ctx.store.get(f"tcp/addr/{peer}", max(0.0, deadline - time.monotonic()))
        except StoreUnreachableError as exc:  # rank 0, which serves the store, is gone
            raise PeerFailureError(f"rank {self.rank} could not look up the TCP address of "
                                   f"rank {peer}: {exc}", 0) from None
        host, port = parse_address(raw.decode())
        where = f"rank {peer} at {format_address(host, port)}"
        for ch in self._channels:
            if ch.sock is not None:
                continue
            ch.open_wake()
            sock, ack = self._open_channel(ch.index, (host, port), where, deadline)
            magic, version, status, their_nch, _ = _ACK.unpack(ack)
            if magic != _MAGIC or version != PROTOCOL_VERSION or status != _ACK_OK:
                sock.close()
                if status == _ACK_NCHANNELS:
                    raise RendezvousError(
                        f"rank {self.rank} has DDL_NCHANNELS={self._nch} but rank {peer} has "
                        f"DDL_NCHANNELS={their_nch}; set the same value on every rank")
                raise PeerFailureError(f"{where} refused the TCP connection (status {status}, "
                                       f"protocol {version}, ours {PROTOCOL_VERSION})", peer)
            with self._lock:
                if self._closed:
                    sock.close()
                    raise CommunicatorClosedError(f"rank {self.rank}: the TCP pair to rank "
                                                  f"{peer} was closed while connecting")
                self._attach(ch, sock)

    def _open_channel(self, index: int, addr: tuple[str, int], where: str,
                      deadline: float) -> tuple[socket.socket, bytearray]:
        """Connect channel ``index``, prove our claim and read the peer's answer (ACK). A
        connection the peer's listener dropped before answering (too many pending handshakes
        there, strangers' perhaps) is tried again until ``deadline``."""
        ctx, peer = self._ctx, self.peer
        claim = _CLAIM.pack(_CLAIM_LABEL, PROTOCOL_VERSION, self._nch, self.rank, peer, ctx.size,
                            index)
        what = f"rank {self.rank} could not connect to {where} (TCP channel {index})"
        pause = _RETRY_PAUSE_S[0]
        dropped = 0  # times the listener dropped us mid-handshake
        while True:
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            except OSError as exc:  # EMFILE: out of file descriptors
                raise DDLError(f"{what}: no socket to be had ({exc}); raise the limit on open "
                               "files (ulimit -n)") from None
            connected = False
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.connect(addr)
                connected = True
                ctx.key.connect(sock, claim, deadline)
                ack = bytearray(_ACK.size)
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                if not recv_exact(sock, memoryview(ack)):
                    raise ConnectionResetError("closed before answering the hello")
                return sock, ack
            except AuthenticationError as exc:
                sock.close()
                raise AuthenticationError(f"{what}: {exc}") from None
            except TimeoutError:
                sock.close()
                raise DDLTimeoutError(f"rank {self.rank} could not connect to {where} within "
                                      f"{seconds(ctx.timeout)} s (TCP channel {index})") from None
            except OSError as exc:
                sock.close()
                if not connected:
                    raise PeerFailureError(f"{what}: {exc}; rank {peer} has closed its "
                                           "transport or exited", peer) from None
                dropped += 1
                if time.monotonic() + pause >= deadline:
                    raise DDLTimeoutError(
                        f"{what} within {seconds(ctx.timeout)} s: its listener dropped our "
                        f"handshake {dropped} time(s), the last with {exc}; too many "
                        f"connections are pending there (strangers'?), or rank {peer} is "
                        "closing") from None
            time.sleep(pause)  # dropped mid-handshake: the listener was busy, or is going away
            pause = min(2 * pause, _RETRY_PAUSE_S[1])

    def _attach(self, ch: _Channel, sock: socket.socket) -> None:
        """Start using ``sock`` for channel ``ch`` (called with ``self._lock`` held)."""
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert ch.wake_fd >= 0  # open_wake() came first: drive polls both once sock is set
        ch.waiter_poll = ch.socket_and_wake_poll(sock)
        with ch.scond:
            ch.sock = sock
            if self._abort_frame is not None:  # we aborted before the peer connected: tell it
                ch.queue.appendleft(_Frame(self._abort_frame))
        name = f"{self.rank}-{self.peer}.{ch.index}"
        ch.sender = threading.Thread(target=ch.send_loop, name=f"ddl-tcp-send-{name}",
                                     daemon=True)
        ch.receiver = threading.Thread(target=ch.recv_loop, name=f"ddl-tcp-recv-{name}",
                                       daemon=True)
        ch.sender.start()
        ch.receiver.start()

    def _accept(self, index: int, sock: socket.socket) -> int:
        """Higher rank: the peer connected channel ``index``; answer and start using it."""
        failure = None
        with self._lock:
            ch = self._channels[index]
            status = (_ACK_CLOSED if self._closed else
                      _ACK_DUPLICATE if ch.sock is not None else _ACK_OK)
            if status == _ACK_OK:
                try:
                    ch.open_wake()
                except DDLError as exc:
                    status, failure = _ACK_CLOSED, exc
            sock.sendall(_ACK.pack(_MAGIC, PROTOCOL_VERSION, status, self._nch, 0))
            if status == _ACK_OK:
                self._attach(ch, sock)
        if failure is not None:
            self._fail_pair(failure)
        return status

    # --- failure and shutdown -------------------------------------------------------------------
    def _fail_pair(self, error: DDLError) -> None:
        """Fail every pending and later request (first error wins)."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
        for ch in self._channels:
            ch.matcher.fail(error, ch.take_sends)
            ch.inbound.abandon(lambda req: copy_error(error))

    def abort(self, code: int, reason: str) -> None:
        raw = reason.encode("utf-8", "replace")[:MAX_ABORT_REASON_BYTES]
        frame = _HEADER.pack(_MAGIC, _ABORT, 0, code & MAX_CHECK, 0, len(raw)) + raw
        with self._lock:
            if self._abort_frame is not None or self._closed:
                return
            self._abort_frame = frame
        for ch in self._channels:
            if ch.sock is not None and ch.failure is None:
                ch.send(_Frame(frame), front=True)
        self._fail_pair(abort_error(code, self.rank, reason, peer=self.peer))

    def _begin_close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail_pair(CommunicatorClosedError(
            f"rank {self.rank} closed its TCP connection to rank {self.peer} while the request "
            "was pending"))
        for ch in self._channels:
            ch.stop()

    def _finish_close(self, deadline: float) -> None:
        for ch in self._channels:  # senders: CLOSE goes out, then shutdown(SHUT_WR)
            if ch.sender is not None:
                ch.sender.join(max(0.0, deadline - time.monotonic()))
        for ch in self._channels:  # receivers: the peer answers CLOSE with EOF
            if ch.receiver is not None:
                ch.receiver.join(max(0.0, deadline - time.monotonic()))
        for ch in self._channels:
            if ch.sock is None:  # never connected (a failed connect may have made its eventfd)
                with ch.rcond:
                    ch.release_wake_locked()
                continue
            _shutdown(ch.sock)  # wakes whatever is still blocked
            for thread in (ch.sender, ch.receiver):
                if thread is not None:
                    thread.join(1.0)
            ch.sock.close()
            with ch.rcond:  # else the waiter still reading, or the receiver thread, releases it
                ch.release_wake_locked()

    def close(self) -> None:
        self._begin_close()
        self._finish_close(time.monotonic() + _CLOSE_TIMEOUT_S)


class TcpContext(PairTableContext):
    """This rank's listener, accept thread and pairs."""

    _label = "TCP"

    def __init__(self, rank: int, size: int, store: Store, timeout: float,
                 local_rank: int = 0) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} must be in [0, size={size})")
        self.rank, self.size, self.timeout, self.store = rank, size, float(timeout), store
        self.nchannels: int = config.get("DDL_NCHANNELS")
        if self.nchannels > 0xFFFF:
            raise ValueError(f"DDL_NCHANNELS={self.nchannels} is more than 65535")
        ifname = config.get("DDL_SOCKET_IFNAME")
        # Several interfaces: local rank i's rail is the (i mod A)-th; it listens on and
        # publishes that address, so peers reach it through that adapter.
        address = rail_address(ifname, rank, local_rank)
        if address is not None:
            self.address = address
        else:
            master = getattr(store, "host", None)
            self.address = (route_address(master) if master else
                            socket.gethostbyname(socket.gethostname()))
        self.key = job_key_of(store, "TCP")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._init_pairs()
        self._closed = False
        self._handshakes: HandshakeListener | None = None
        try:
            listener.bind((self.address, 0))
            listener.listen(max(128, size * self.nchannels))
            self.port: int = listener.getsockname()[1]
            self._handshakes = HandshakeListener(
                listener, self._handshake, f"ddl-tcp-{rank}",
                min(self.timeout, _HANDSHAKE_TIMEOUT_S), _MAX_PENDING, _MAX_PENDING_PER_SOURCE)
            store.set(f"tcp/addr/{rank}", format_address(self.address, self.port).encode())
        except BaseException:
            if self._handshakes is not None:
                self._handshakes.close(_CLOSE_TIMEOUT_S)
            else:
                listener.close()
            raise

    def refusals(self) -> str:
        """How many connections this rank's listener refused and why the last (or "")."""
        return self._handshakes.refusals() if self._handshakes is not None else ""

    def _handshake(self, conn: socket.socket, address: tuple, deadline: float) -> bool:
        """A connection's handshake (on its own thread): its proof of the job's key and claim,
        then our answer. True: the socket now belongs to a pair."""
        claim = self.key.accept(conn, deadline)
        if len(claim) != _CLAIM.size:
            raise AuthenticationError(f"a proven claim of {len(claim)} bytes, not a TCP channel's")
        label, version, nch, src, dst, size, index = _CLAIM.unpack(claim)
        if label != _CLAIM_LABEL:
            raise AuthenticationError(f"a proven claim for {label!r}, not a TCP channel")
        assert self._handshakes is not None
        if not self._handshakes.adopt(conn):  # dropped meanwhile (a cap, or close)
            return False
        status = _ACK_OK
        if self._closed:
            status = _ACK_CLOSED
        elif version != PROTOCOL_VERSION or dst != self.rank or size != self.size \
                or not 0 <= src < self.rank:
            status = _ACK_WRONG_PEER
        elif nch != self.nchannels or index >= nch:
            status = _ACK_NCHANNELS
        if status != _ACK_OK:
            conn.sendall(_ACK.pack(_MAGIC, PROTOCOL_VERSION, status, self.nchannels, 0))
            if status == _ACK_NCHANNELS and not self._closed:
                self._pair_for(src)._fail_pair(RendezvousError(
                    f"rank {src} has DDL_NCHANNELS={nch} but rank {self.rank} has "
                    f"DDL_NCHANNELS={self.nchannels}; set the same value on every rank"))
            return False
        return self._pair_for(src)._accept(index, conn) == _ACK_OK

    def _new_pair(self, peer: int) -> TcpPair:
        return TcpPair(self, peer)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._handshakes is not None:
            self._handshakes.close(_CLOSE_TIMEOUT_S)
        with self._lock:
            pairs = list(self._pairs.values())
        for p in pairs:  # all CLOSE frames first, then wait for all peers together
            p._begin_close()
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        for p in pairs:
            p._finish_close(deadline)


class TcpTransport(Transport):
    """Sockets over any IPv4 network; always available (on Linux, as the rest of ddlcore)."""

    name = "tcp"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return True

    def create_context(self, rank: int, size: int, store: Store, timeout: float) -> Context:
        return TcpContext(rank, size, store, timeout)

    def create_context_local(self, rank: int, size: int, store: Store, timeout: float,
                             local_rank: int) -> Context:
        return TcpContext(rank, size, store, timeout, local_rank)
