"""`TcpPair`: the ``nchannels`` sockets to one peer: requests (a message goes on channel
``tag % nchannels``), the lower rank's connect and handshake, the higher rank's accept, and
the pair's abort and close.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING

from ddlcore.transports.base import MAX_ABORT_REASON_BYTES, Pair, Request
from ddlcore.transports.common import (
    MAX_CHECK,
    abort_error,
    as_view,
    check_tag,
    copy_error,
    recv_view,
    seconds,
    timeout_error,
)
from ddlcore.transports.pairs import LazyPair
from ddlcore.transports.sockets import format_address, owned, parse_address, recv_exact
from ddlcore.transports.tcp.channel import Channel, TcpRequest
from ddlcore.transports.tcp.protocol import (
    _ABORT,
    _ACK,
    _ACK_CLOSED,
    _ACK_DUPLICATE,
    _ACK_NCHANNELS,
    _ACK_OK,
    _CLAIM_EXTRA,
    _CLOSE_TIMEOUT_S,
    _DATA,
    _HEADER,
    _MAGIC,
    _RETRY_PAUSE_S,
    PROTOCOL_VERSION,
    Frame,
    shutdown_quietly,
)

from ddlcore.errors import (
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
    RendezvousError,
    StoreUnreachableError,
)
from ddlcore.security.auth import AuthenticationError
from ddlcore.security.claims import TCP

if TYPE_CHECKING:
    from ddlcore.transports.tcp.context import TcpContext


class TcpPair(LazyPair, Pair):
    """The ``nchannels`` sockets to one peer and their threads."""

    _ctx: TcpContext

    def __init__(self, ctx: TcpContext, peer: int) -> None:
        self.rank, self.peer = ctx.rank, peer
        self._ctx = ctx
        self._nch = ctx.nchannels
        self._channels = [Channel(self, i) for i in range(self._nch)]
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
            ch.send(Frame(_HEADER.pack(_MAGIC, _DATA, 0, check, tag, req.nbytes), view, req))
        return req

    def irecv(self, view: memoryview, tag: int, check: int = 0) -> Request:
        view = recv_view(view, tag, check)
        req = TcpRequest(self, view, tag, check, False)
        self._channel_for(tag).matcher.post(req)
        return req

    def _channel_for(self, tag: int) -> Channel:
        return self._channels[tag % self._nch]

    def _error_for(self, ch: Channel, req: TcpRequest) -> DDLError:
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
            raise PeerFailureError(
                f"rank {self.rank} could not look up the TCP address of rank {peer}: {exc}", 0
            ) from None
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
                        f"DDL_NCHANNELS={their_nch}; set the same value on every rank"
                    )
                raise PeerFailureError(
                    f"{where} refused the TCP connection (status {status}, "
                    f"protocol {version}, ours {PROTOCOL_VERSION})",
                    peer,
                )
            with self._lock:
                if self._closed:
                    sock.close()
                    raise CommunicatorClosedError(
                        f"rank {self.rank}: the TCP pair to rank {peer} was closed while connecting"
                    )
                self._attach(ch, sock)

    def _open_channel(
        self, index: int, addr: tuple[str, int], where: str, deadline: float
    ) -> tuple[socket.socket, bytearray]:
        """Connect channel ``index``, prove our claim and read the peer's answer (ACK). A
        connection the peer's listener dropped before answering (too many pending handshakes
        there, strangers' perhaps) is tried again until ``deadline``."""
        ctx, peer = self._ctx, self.peer
        claim = ctx.key.claim(
            TCP,
            src=self.rank,
            dst=peer,
            size=ctx.size,
            extra=_CLAIM_EXTRA.pack(PROTOCOL_VERSION, self._nch, index),
        )
        what = f"rank {self.rank} could not connect to {where} (TCP channel {index})"
        pause = _RETRY_PAUSE_S[0]
        dropped = 0  # times the listener dropped us mid-handshake
        while True:
            try:
                sock = owned(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            except OSError as exc:  # EMFILE: out of file descriptors
                raise DDLError(
                    f"{what}: no socket to be had ({exc}); raise the limit on open "
                    "files (ulimit -n)"
                ) from None
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
                raise DDLTimeoutError(
                    f"rank {self.rank} could not connect to {where} within "
                    f"{seconds(ctx.timeout)} s (TCP channel {index})"
                ) from None
            except OSError as exc:
                sock.close()
                if not connected:
                    raise PeerFailureError(
                        f"{what}: {exc}; rank {peer} has closed its transport or exited", peer
                    ) from None
                dropped += 1
                if time.monotonic() + pause >= deadline:
                    raise DDLTimeoutError(
                        f"{what} within {seconds(ctx.timeout)} s: its listener dropped our "
                        f"handshake {dropped} time(s), the last with {exc}; too many "
                        f"connections are pending there (strangers'?), or rank {peer} is "
                        "closing"
                    ) from None
            time.sleep(pause)  # dropped mid-handshake: the listener was busy, or is going away
            pause = min(2 * pause, _RETRY_PAUSE_S[1])

    def _attach(self, ch: Channel, sock: socket.socket) -> None:
        """Start using ``sock`` for channel ``ch`` (called with ``self._lock`` held)."""
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert ch.wake_fd >= 0  # open_wake() came first: drive polls both once sock is set
        ch.waiter_poll = ch.socket_and_wake_poll(sock)
        with ch.scond:
            ch.sock = sock
            if self._abort_frame is not None:  # we aborted before the peer connected: tell it
                ch.queue.appendleft(Frame(self._abort_frame))
        name = f"{self.rank}-{self.peer}.{ch.index}"
        ch.sender = threading.Thread(target=ch.send_loop, name=f"ddl-tcp-send-{name}", daemon=True)
        ch.receiver = threading.Thread(
            target=ch.recv_loop, name=f"ddl-tcp-recv-{name}", daemon=True
        )
        ch.sender.start()
        ch.receiver.start()

    def _accept(self, index: int, sock: socket.socket) -> int:
        """Higher rank: the peer connected channel ``index``; answer and start using it."""
        failure = None
        with self._lock:
            ch = self._channels[index]
            status = (
                _ACK_CLOSED if self._closed else _ACK_DUPLICATE if ch.sock is not None else _ACK_OK
            )
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
            ch.ring_lease()

    def abort(self, code: int, reason: str) -> None:
        raw = reason.encode("utf-8", "replace")[:MAX_ABORT_REASON_BYTES]
        frame = _HEADER.pack(_MAGIC, _ABORT, 0, code & MAX_CHECK, 0, len(raw)) + raw
        with self._lock:
            if self._abort_frame is not None or self._closed:
                return
            self._abort_frame = frame
        for ch in self._channels:
            if ch.sock is not None and ch.failure is None:
                ch.send(Frame(frame), front=True)
        self._fail_pair(abort_error(code, self.rank, reason, peer=self.peer))

    def _begin_close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail_pair(
            CommunicatorClosedError(
                f"rank {self.rank} closed its TCP connection to rank {self.peer} while the request "
                "was pending"
            )
        )
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
            shutdown_quietly(ch.sock)  # wakes whatever is still blocked
            for thread in (ch.sender, ch.receiver):
                if thread is not None:
                    thread.join(1.0)
            ch.sock.close()
            with ch.rcond:  # else the waiter still reading, or the receiver thread, releases it
                ch.release_wake_locked()

    def close(self) -> None:
        self._begin_close()
        self._finish_close(time.monotonic() + _CLOSE_TIMEOUT_S)
