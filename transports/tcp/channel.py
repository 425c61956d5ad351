"""One socket of a TCP pair (`Channel`): its send queue and sender thread, its receiver thread,
the waiter that reads the socket itself (`Channel.drive`) and the failure of the socket; and
`TcpRequest`, whose waiter drives its channel.
"""

from __future__ import annotations

import math
import os
import select
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from ddlcore.transports.common import Matcher, ThreadRequest
from ddlcore.transports.tcp.inbound import Inbound
from ddlcore.transports.tcp.protocol import (
    _CLOSE_FRAME,
    _LINGER_S,
    _MAX_POLL_MS,
    _NO_PAYLOAD,
    _SPIN_S,
    Frame,
)

from ddlcore.errors import DDLError

if TYPE_CHECKING:
    from ddlcore.transports.tcp.pair import TcpPair


# How long a lease that reads waits for the receiver thread to leave poll() (it does within
# microseconds; an eventfd wake-up of a thread that is not running takes tens on a VM).
_LEASE_WAIT_S = 0.002


class _Lease:
    """What `Channel.driving` holds while the socket is leased (no request drives it then)."""


_LEASED: TcpRequest = _Lease()  # type: ignore[assignment]


class TcpRequest(ThreadRequest):
    """A send or receive; a receive's waiter reads the socket itself (`Channel.drive`) while
    it can, and otherwise waits on the lock like any `ThreadRequest`."""

    __slots__ = ("_driven",)

    def __init__(
        self, pair: TcpPair, view: memoryview, tag: int, check: int, is_send: bool
    ) -> None:
        super().__init__(pair, view, tag, check, is_send)
        self._driven: Channel | None = None  # the channel whose socket our waiter is reading

    def _fail(self, error: DDLError) -> None:
        super()._fail(error)
        driven = self._driven
        if driven is not None:  # failed by another thread: wake our waiter from its poll()
            driven.ring()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done and not self.is_send:
            ch = self._pair._channel_for(self.tag)
            # No deadline past what a lock can wait (threading.TIMEOUT_MAX, ~292 years; inf).
            deadline = (
                None
                if timeout is None or timeout >= threading.TIMEOUT_MAX
                else time.monotonic() + timeout
            )
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


class Channel:
    """One socket of a pair: its send queue and threads, and the matching state of the tags that
    travel on it (``tag % nchannels == index``)."""

    def __init__(self, pair: TcpPair, index: int) -> None:
        self.pair, self.index = pair, index
        self.sock: socket.socket | None = None
        # The tags that travel on this socket: their receives, messages and failure
        self.matcher: Matcher[TcpRequest] = Matcher(pair.rank, pair.peer, "TCP")
        self.scond = threading.Condition(threading.Lock())  # guards queue, busy, stopping
        self.queue: deque[Frame] = deque()
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
        self.inbound = Inbound(self)

    @property
    def failure(self) -> str | None:
        """Why the socket is gone (a PeerFailureError prefix), or None."""
        return self.matcher.lost

    # --- sending --------------------------------------------------------------------------------
    def send(self, item: Frame, front: bool = False) -> None:
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

    def _send_now(self, item: Frame) -> None:
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
            if (
                req is not None
                and not sent
                and (pair._failure is not None or self.failure is not None)
            ):
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
                    sock.sendall(view[sent - hlen :])
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

    def send_first(self, item: Frame) -> None:
        """Queue ``item`` before everything else: a frame begun by the lease holder, whose
        rest the sender thread writes once the lease ends."""
        with self.scond:
            self.queue.appendleft(item)

    # --- leasing (`ddlcore.transports.tcp.steps`) ----------------------------------------------
    def lease(self, reads: bool) -> int:
        """Take the socket's writing, and its reading too if ``reads``, for the calling thread
        alone, if nobody writes now and nothing is queued (or, for reading, held for a
        receive): its descriptor, else -1. Give it back with `unlease`. Meanwhile sends from
        other threads queue; a lease that reads asks the receiver thread out, which then stays
        parked (as while a waiter drives)."""
        with self.scond:
            sock = self.sock
            if (
                sock is None
                or self.busy
                or self.queue
                or self.stopping
                or self.failure is not None
                or self.pair._failure is not None
            ):
                return -1
            self.busy = True
        try:
            if reads and not self._lease_reads():
                self._end_send_lease()
                return -1
        except BaseException:  # e.g. Ctrl-C while the receiver thread leaves
            self.unlease()
            raise
        return sock.fileno()

    def _lease_reads(self) -> bool:
        with self.rcond:
            # Checked under rcond: a pair that fails after this rings the lease (`ring_lease`).
            if (
                self.driving is not None
                or self.failure is not None
                or self.pair._failure is not None
            ):
                return False
            self.driving = _LEASED
            if self.reading:  # ask the receiver thread out; it leaves between frames
                self._ring_locked()
                self.rcond.wait_for(lambda: not self.reading, _LEASE_WAIT_S)
            if self.reading or self.inbound.hgot or self.matcher.unexpected:
                self._end_read_lease_locked()  # busy, half-way in a frame, or a message kept
                return False
        return True

    def unlease(self) -> None:
        if self.driving is _LEASED:  # only the lease holder sets or clears it
            with self.rcond:
                self._end_read_lease_locked()
        self._end_send_lease()

    def _end_read_lease_locked(self) -> None:
        self.driving = None
        self.resume_at = time.monotonic() + _LINGER_S
        if self.reading:
            self.rcond.notify_all()
        if self.pair._closed:  # the pair's close() left the eventfd to us
            self.release_wake_locked()

    def _end_send_lease(self) -> None:
        with self.scond:
            self.busy = False
            if self.queue or self.stopping:
                self.scond.notify()

    def ring_lease(self) -> None:
        """The pair failed: a lease holder waiting in poll() stops and meets the failure."""
        with self.rcond:
            if self.driving is _LEASED:
                self._ring_locked()

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
                if (
                    self.driving is not None
                    or sock is None
                    or self.failure is not None
                    or self.pair._failure is not None
                ):
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
            raise DDLError(
                f"rank {pair.rank} could not make an eventfd for TCP channel "
                f"{self.index} to rank {pair.peer}: {exc}; raise the open-file limit "
                "(ulimit -n)"
            ) from None

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
        alive = (
            receiver is not None
            and receiver.is_alive()
            and receiver is not threading.current_thread()
        )
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
                self.queue.append(Frame(_CLOSE_FRAME))
            self.stopping = True
            self.scond.notify()
