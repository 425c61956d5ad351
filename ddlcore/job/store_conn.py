"""One connection to the rendezvous store's server (`_Conn`) and its life there, on the
server's thread: the job-key handshake, each request read as its bytes arrive (header, then key
and value) and handed to the `StoreTable`, one reply at a time written as the socket drains, and
leaving (`_drop`: what the connection held is released). The event loop, the caps on
connections and the timers are ``store_server``'s; the wire format is ``store_wire``'s.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from dataclasses import dataclass, field

from ddlcore.job import store_wire as wire
from ddlcore.job.store_table import StoreTable, Wait
from ddlcore.security.auth import Acceptor
from ddlcore.security.claims import Claim

log = logging.getLogger("ddlcore")

# Largest single recv: bytes are read as they arrive, at most this much at a time.
_RECV_CHUNK = 1 << 20

_HANDSHAKE, _HEADER, _BODY = range(3)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    source: str
    acceptor: Acceptor | None
    deadline: float
    phase: int = _HANDSHAKE
    need: int = 0
    inbuf: bytearray = field(default_factory=bytearray)
    header: tuple = ()
    out: memoryview | None = None
    wait: Wait | None = None
    rank: int | None = None
    closed: bool = False


class StoreConnections:
    """The connection-serving half of `StoreServer` (which sets every attribute below up)."""

    port: int
    _selector: selectors.BaseSelector
    _conns: dict[socket.socket, _Conn]
    _pending: dict[_Conn, None]  # in their handshake, oldest first
    _pending_by_source: dict[str, dict[_Conn, None]]
    _table: StoreTable
    _cond: threading.Condition
    _nclients: int  # authenticated connections (under _cond: other threads read it)

    def _mismatch(self, conn: _Conn) -> None:
        """A connection's handshake showed that the secrets differ (the server's business)."""

    def _joined(self, conn: _Conn, claim: Claim) -> None:
        """A connection proved its claim (the server keeps who holds each rank)."""

    def _left(self, conn: _Conn) -> None:
        """An authenticated connection closed."""

    # --- reading and writing --------------------------------------------------------------

    def _read(self, conn: _Conn) -> None:
        if conn.wait is not None:
            # A client sends nothing while its request is pending: this is its leaving.
            try:
                byte = conn.sock.recv(1)
            except (BlockingIOError, InterruptedError):
                return
            if byte:
                self._drop(conn, "sent bytes while its request was pending")
            else:
                self._drop(conn, None)
            return
        try:
            chunk = conn.sock.recv(min(conn.need - len(conn.inbuf), _RECV_CHUNK))
        except (BlockingIOError, InterruptedError):
            return
        if not chunk:
            self._drop(
                conn,
                None
                if conn.phase == _HEADER and not conn.inbuf
                else "closed in the middle of a message",
            )
            return
        conn.inbuf += chunk
        if len(conn.inbuf) < conn.need:
            return
        data, conn.inbuf = conn.inbuf, bytearray()
        if conn.phase == _HANDSHAKE:
            self._handshake(conn, bytes(data))
        elif conn.phase == _HEADER:
            self._header(conn, bytes(data))
        else:
            klen = conn.header[3]
            self._request(conn, bytes(data[:klen]), bytes(memoryview(data)[klen:]))

    def _request(self, conn: _Conn, raw_key: bytes, value: bytes) -> None:
        _, op, _, _, _, arg, wait_ms = conn.header
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            self._drop(conn, "a key that is not UTF-8")
            return
        self._table.request(conn, op, key, value, arg, min(max(wait_ms, 0) / 1e3, wire.MAX_WAIT_S))

    def _handshake(self, conn: _Conn, data: bytes) -> None:
        acceptor = conn.acceptor
        assert acceptor is not None
        reply = acceptor.feed(data)
        if acceptor.error is not None:
            if reply:
                try:
                    conn.sock.send(reply)
                except OSError:
                    pass
            if acceptor.mismatch:
                self._mismatch(conn)
            self._drop(conn, acceptor.error)
            return
        if acceptor.claim is None:
            conn.need = acceptor.wants
            self._send(conn, reply)
            return
        conn.rank = acceptor.claim.src if acceptor.claim.src >= 0 else None
        self._joined(conn, acceptor.claim)
        conn.acceptor = None
        self._pending.pop(conn, None)
        self._unlist_source(conn)
        conn.phase, conn.need = _HEADER, wire.REQUEST.size
        with self._cond:
            self._nclients += 1
        self._send(conn, reply)

    def _header(self, conn: _Conn, data: bytes) -> None:
        header = wire.REQUEST.unpack(data)
        magic, op, flags, klen, vlen = header[:5]
        if (
            magic != wire.MAGIC
            or flags
            or op not in wire.OPS
            or klen > wire.MAX_KEY_BYTES
            or vlen > wire.MAX_VALUE_BYTES
        ):
            self._drop(conn, "malformed or oversize request header")
            return
        conn.header = header
        if klen + vlen:
            conn.phase, conn.need = _BODY, klen + vlen
        else:
            self._request(conn, b"", b"")

    def _send(self, conn: _Conn, data: bytes) -> None:
        """Send ``data`` (one reply); the rest, if the socket is full, as it drains. A
        connection with a reply going out is not read: one reply at most is buffered."""
        if conn.closed or not data:
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(conn, None)
            return
        if sent < len(data):
            conn.out = memoryview(data)[sent:]
            self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)

    def _write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        conn.out = conn.out[sent:]
        if not len(conn.out):
            conn.out = None
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _reply(self, conn: _Conn, status: int, value: bytes = b"", arg: int = 0) -> None:
        conn.phase, conn.need, conn.wait = _HEADER, wire.REQUEST.size, None
        self._send(conn, wire.REPLY.pack(wire.MAGIC, status, 0, len(value), arg) + value)

    # --- leaving ----------------------------------------------------------------------------

    def _unlist_source(self, conn: _Conn) -> None:
        by_source = self._pending_by_source.get(conn.source)
        if by_source is not None:
            by_source.pop(conn, None)
            if not by_source:
                del self._pending_by_source[conn.source]

    def _drop(self, conn: _Conn, why: str | None) -> None:
        """Close ``conn`` and release what it held: its wait; when it was the last client, every
        value."""
        if conn.closed:
            return
        conn.closed = True
        if why is not None:
            log.debug(
                "store %d: dropped a connection from %s (rank %s): %s",
                self.port,
                conn.source,
                "?" if conn.rank is None else conn.rank,
                why,
            )
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
        self._conns.pop(conn.sock, None)
        if conn.acceptor is not None:
            self._pending.pop(conn, None)
            self._unlist_source(conn)
        else:
            self._left(conn)
            with self._cond:
                self._nclients -= 1
                self._cond.notify_all()
                last = not self._nclients
            if last:  # the job has left: what it stored goes with it
                self._table.clear()
        if conn.wait is not None:
            self._table.leave(conn.wait)
            conn.wait = None
        conn.inbuf = bytearray()
        conn.out = None
