"""The frame being read off one TCP channel's socket (`Inbound`): header, then payload straight
into the posted receive (or a buffer of its own, or scratch), then the frame handed on: a
message to its receive or the matcher, an ABORT to the pair, a CLOSE to the channel.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from ddlcore.transports.base import MAX_ABORT_REASON_BYTES
from ddlcore.transports.common import Message, abort_error
from ddlcore.transports.tcp.protocol import (
    _ABORT,
    _CLOSE,
    _DATA,
    _DRAIN_CHUNK,
    _HEADER,
    _MAGIC,
    ProtocolError,
    shutdown_quietly,
)

from ddlcore.errors import CollectiveMismatchError, DDLError

if TYPE_CHECKING:
    from ddlcore.transports.tcp.channel import Channel, TcpRequest


class Inbound:
    """The frame being read off one channel's socket: how much of its header is in, where its
    payload goes and what to do once it is all in. It lives on the channel, so a waiter that
    leaves at its deadline half-way through a frame and the receiver thread carry on where the
    other stopped. Only the one reader of the moment (``Channel.drive`` / ``recv_loop``) uses
    it; a request it took out of ``posted`` is finished by that reader alone."""

    def __init__(self, ch: Channel) -> None:
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
            shutdown_quietly(sock)
            return False
        except BaseException:  # e.g. Ctrl-C between a read and its bookkeeping: where the
            self._lost(ConnectionError("a read was interrupted"))  # stream stands is unknown
            shutdown_quietly(sock)
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
            got = sock.recv_into(self.hview[self.hgot :], hsize - self.hgot, flags)
            if got == 0:
                raise ConnectionResetError(
                    "the peer closed the connection (EOF)"
                    if not self.hgot
                    else "EOF inside a frame header"
                )
            self.hgot += got
            if self.hgot == hsize:
                self._begin()
        while self.got < self.nbytes:
            want = self.nbytes - self.got
            sink = self.sink  # once: abandon() may clear it from another thread
            if sink is not None:
                got = sock.recv_into(sink[self.got :], want, flags)
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
            raise ProtocolError(f"bad frame magic {magic:#x}: not a ddlcore tcp peer")
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
                raise ProtocolError(
                    f"abort reason of {nbytes} bytes (cap {MAX_ABORT_REASON_BYTES})"
                )
            self.data = bytearray(nbytes)
            self.sink = memoryview(self.data)
        elif kind != _CLOSE:
            raise ProtocolError(f"unknown frame kind {kind}")

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
