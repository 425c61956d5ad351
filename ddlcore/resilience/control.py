"""The control plane: small messages between the processes of a job that outlive a failure of
its communicators, and the failure detector the fault-tolerant protocols run on.

Each process that joins a job opens one `ControlPlane`: a listener whose address goes into its
init record (every rank learns every other's, with no store needed later), and authenticated
connections to the other processes' planes, dialled when first needed and kept. Frames carry a
channel (one per communicator) and are handed to that channel's handler; a frame for a channel
not open yet is held (a peer may get there first) up to `_HELD_FRAMES`.

The failure detector: a peer is lost when its listener refuses us (or a stranger answers),
when every connection to it has closed, reported after the last frame each one carried (a
dead process closes them all; a live one only when it closes its plane), or when the peers
the communicators `watch` go silent: a native heartbeat thread (``ddl_heartbeat.h``) pings
them over UDP, on the listener's port number, and one that sends nothing for the heartbeat
timeout (stopped, hung in the kernel, cut off) is lost as "silent". Lost is final: its frames
still queued here are dropped, so are those it sends later, and a new connection from it is
refused. A peer lost as silent that wakes up is fenced: its pings are answered FENCED and its
connections get a FENCE frame (before anything else from here), after which its plane's
watchers hear `on_fenced` and its agreements refuse to decide: it cannot come back into a job
that went on without it.

A forked child (a data loader's worker) closes its copies of the plane's sockets at once
(`owned`): it must not keep a connection open past its parent's death, which would hide it.

Frame (little-endian): magic u32 | channel[8] | instance u64 | kind u16 | length u16 | body.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

from ddlcore.resilience._heartbeat import FENCED, STOPPED, Heartbeat
from ddlcore.security.auth import AuthenticationError, JobKey
from ddlcore.security.claims import CONTROL, Claim, ip_bytes, ip_text
from ddlcore.transports.sockets import HandshakeListener, format_address, owned

_log = logging.getLogger("ddlcore")

_MAGIC = 0xDDC7A1E5
_FRAME = struct.Struct("<I8sQHH")
_NO_CHANNEL = bytes(8)  # a frame of the plane's own, for no channel: read and dropped
_PING = _FRAME.pack(_MAGIC, _NO_CHANNEL, 0, 0, 0)
_FENCE_KIND = 1
_FENCE = _FRAME.pack(_MAGIC, _NO_CHANNEL, 0, _FENCE_KIND, 0)  # "you were excluded"
MAX_BODY = 0xFFFF
CHANNEL_BYTES = 8
_ADDRESS = struct.Struct("<16sH")  # a plane's listening address, in a connector's claim
_HANDSHAKE_S = 15.0  # as the TCP transport's; a peer that cannot finish one in that is lost
_HELD_FRAMES = 4096  # frames held for channels not open yet, over all of them,
_HELD_BYTES = 4 << 20  # and their bodies' bytes (agreement frames are a few bytes each)
# Many ranks of one host dial one plane at once (a first agree): their handshakes all fit.
_MAX_PENDING, _MAX_PENDING_PER_SOURCE = 256, 128
_CLOSE_S = 2.0
_REDIAL_S = (0.01, 0.5)  # first and longest pause before dialling a peer again
_BEATS_PER_TIMEOUT = 10  # pings per heartbeat timeout: one lost packet or two is no silence
_DEFAULT_HEARTBEAT_S = 1.0  # the pace of a heartbeat that only answers
_BIND_TRIES = 32  # listener ports tried before one whose UDP twin is free too
SILENT, CLOSED, REFUSED = "silent", "closed", "refused"  # how a peer was lost

Address = tuple[str, int]


class Watcher(Protocol):
    """What a watcher of peers gets from the plane (`ControlPlane.watch`; called on the plane's
    threads: quick, never blocking on I/O)."""

    def on_silent(self, peer: Address) -> None: ...

    def on_fenced(self, peer: Address) -> None: ...


class Handler(Protocol):
    """What a channel's owner gets from the plane (called on the plane's threads: quick, and
    never blocking on I/O)."""

    def on_frame(self, peer: Address, instance: int, kind: int, body: bytes) -> None: ...

    def on_lost(self, peer: Address) -> None: ...


class _Peer:
    """Another process's plane, as seen from here: its connections and what waits to go."""

    __slots__ = ("address", "conns", "queue", "sending", "sender", "lost")

    def __init__(self, address: Address) -> None:
        self.address = address
        self.conns: list[socket.socket] = []
        self.queue: collections.deque[bytes] = collections.deque()
        self.sending = False  # frames taken from the queue, not yet in the kernel's hands
        self.sender: threading.Thread | None = None
        self.lost: str | None = None  # how it was lost (SILENT, CLOSED, REFUSED), once it is


class ControlPlane:
    """This process's control plane (see the module docstring).

    Parameters
    ----------
    host : str
        The address to listen on (and publish): the one the job's other hosts reach us at.
    key : JobKey
        The job's key (its ``job_id`` known): every connection proves it both ways.
    timeout : float
        Upper bound of one handshake (at most `_HANDSHAKE_S`).
    heartbeat_s : float
        Silence after which a watched peer is lost (``DDL_HEARTBEAT_TIMEOUT``); 0: none.
    """

    def __init__(
        self, host: str, key: JobKey, timeout: float = _HANDSHAKE_S, heartbeat_s: float = 0.0
    ) -> None:
        self.key = key
        self._handshake_s = min(float(timeout), _HANDSHAKE_S)
        self._lock = threading.Condition()
        self._peers: dict[Address, _Peer] = {}
        self._channels: dict[bytes, Handler] = {}
        self._held: collections.deque[tuple[bytes, Address, int, int, bytes]] = collections.deque()
        self._held_bytes = 0
        self._readers: set[threading.Thread] = set()
        self._closed = False
        self._users = 0
        self.fenced: Address | None = None  # the peer that said this process was excluded
        self._watchers: dict[int, tuple[list[Address], Watcher]] = {}
        self.heartbeat_s = heartbeat_s
        sock, self._udp = _bind_pair(host)
        self.address: Address = (host, sock.getsockname()[1])
        self._sock = sock
        # Always there to answer (a peer may watch with a timeout of its own); it pings only
        # the peers watched here, and nobody with the heartbeat off.
        token = key.derive(b"heartbeat", key.job_id or b"")[:8]
        beat_s = heartbeat_s or _DEFAULT_HEARTBEAT_S
        self._heartbeat = Heartbeat(self._udp.fileno(), token, beat_s / _BEATS_PER_TIMEOUT, beat_s)
        threading.Thread(target=self._silence_loop, name="ddl-heartbeat", daemon=True).start()
        self._listener = HandshakeListener(
            sock,
            self._accept,
            "ddl-control",
            self._handshake_s,
            _MAX_PENDING,
            _MAX_PENDING_PER_SOURCE,
        )
        _planes.add(self)

    def __repr__(self) -> str:
        return f"ControlPlane({format_address(*self.address)})"

    # --- channels ----------------------------------------------------------------------------
    def open_channel(self, channel: bytes, handler: Handler, peers: Iterable[Address]) -> None:
        """Route ``channel``'s frames to ``handler`` (the frames held for it first), and tell it
        of every peer among ``peers`` that is lost already."""
        if len(channel) != CHANNEL_BYTES:
            raise ValueError(f"a channel is {CHANNEL_BYTES} bytes, not {len(channel)}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the control plane is closed")
            if channel in self._channels:
                raise ValueError(f"channel {channel.hex()} is open already")
            self._channels[channel] = handler
            self._users += 1
            held = [f for f in self._held if f[0] == channel]
            self._held = collections.deque(f for f in self._held if f[0] != channel)
            self._held_bytes -= sum(len(f[4]) for f in held)
            lost = [a for a in peers if a in self._peers and self._peers[a].lost]
        for _, peer, instance, kind, body in held:
            handler.on_frame(peer, instance, kind, body)
        for peer in lost:
            handler.on_lost(peer)

    def close_channel(self, channel: bytes) -> bool:
        """Stop routing ``channel``; True when no channel is left (close the plane then)."""
        with self._lock:
            if self._channels.pop(channel, None) is not None:
                self._users -= 1
            return self._users == 0

    def watch(self, peers: Iterable[Address], watcher: Watcher) -> Callable[[], None]:
        """Heartbeat ``peers`` (while any watcher watches them): ``watcher`` hears of each that
        goes silent, and of this process being fenced. Returns the function that stops it."""
        peers = list(peers)
        beating = peers if self.heartbeat_s > 0 else []  # off: nobody is ever called silent
        with self._lock:  # the heartbeat's table changes under it, never after its stop
            if self._closed:
                raise RuntimeError("the control plane is closed")
            token = id(watcher)
            self._watchers[token] = (peers, watcher)
            silent = [a for a in peers if a in self._peers and self._peers[a].lost == SILENT]
            fenced = self.fenced
            for host, port in beating:
                self._heartbeat.watch(host, port, 1)
        for peer in silent:
            watcher.on_silent(peer)
        if fenced is not None:
            watcher.on_fenced(fenced)

        def stop() -> None:
            with self._lock:
                if self._watchers.pop(token, None) is None or self._closed:
                    return
                for host, port in beating:
                    self._heartbeat.watch(host, port, -1)

        return stop

    def _silence_loop(self) -> None:
        """The heartbeat's news, to the peers' states and the watchers (a thread of its own)."""
        while True:
            n, peers = self._heartbeat.wait(1.0)
            if n == STOPPED:
                return
            if n == FENCED:
                self._fence(peers[0])
                continue
            for peer in peers:
                with self._lock:
                    state = self._peer(peer)
                self._lose(state, SILENT)

    def _fence(self, by: Address) -> None:
        with self._lock:
            if self.fenced is not None or self._closed:
                return
            self.fenced = by
            watchers = [w for _, w in self._watchers.values()]
            self._lock.notify_all()
        _log.warning(
            "%r: the plane at %s says this process was excluded from its job (it was silent "
            "for longer than the heartbeat timeout)",
            self,
            format_address(*by),
        )
        for watcher in watchers:
            try:
                watcher.on_fenced(by)
            except Exception:
                _log.exception("%r: a watcher failed on being fenced", self)

    # --- sending -----------------------------------------------------------------------------
    def send(self, peer: Address, channel: bytes, instance: int, kind: int, body: bytes) -> None:
        """Send a frame to ``peer``, never blocking: on a connection with room, at once from
        this thread (no hop to another); else queued for the peer's sender thread, which dials
        on first use. A frame for a lost peer is dropped: its handlers heard, or will hear,
        that it is lost."""
        if len(body) > MAX_BODY:
            raise ValueError(f"a control frame of {len(body)} bytes (at most {MAX_BODY})")
        frame = _FRAME.pack(_MAGIC, channel, instance, kind, len(body)) + body
        with self._lock:
            if self._closed:
                return
            state = self._peer(peer)
            if state.lost:
                return
            conn = state.conns[0] if state.conns and not state.queue and not state.sending else None
            if conn is None:
                self._queue(state, frame)
                return
            state.sending = True  # this thread's, until it has handed the frame over
        sent = 0
        try:
            sent = conn.send(frame, socket.MSG_DONTWAIT)
            if 0 < sent < len(frame):  # rare: the rest must follow on this connection
                conn.sendall(frame[sent:])
                sent = len(frame)
        except BlockingIOError:
            pass
        except OSError:
            _shutdown(conn)  # its reader sees it end, and counts it out
            sent = 0 if sent < len(frame) else sent
        with self._lock:
            state.sending = False
            if sent < len(frame) and not state.lost:
                # Whole, on whichever connection comes next: every frame is idempotent at
                # the receiver (a repeat is no new information), never half on two.
                state.queue.appendleft(frame)
                self._queue(state, b"")
            self._lock.notify_all()

    def _queue(self, state: _Peer, frame: bytes) -> None:
        """Queue ``frame`` (lock held) and make sure the sender thread runs."""
        if frame:
            state.queue.append(frame)
        if state.sender is None:
            state.sender = threading.Thread(
                target=self._send_loop,
                args=(state,),
                name=f"ddl-control-to-{format_address(*state.address)}",
                daemon=True,
            )
            state.sender.start()
        else:
            self._lock.notify_all()

    def probe(self, peer: Address) -> None:
        """Make sure ``peer`` is watched: dial it if no connection is open (or being opened). A
        dead peer's listener refuses, and it is reported lost; a live one's connection closes
        when it dies."""
        with self._lock:
            state = self._peer(peer)
            if not (state.conns or state.lost or self._closed or state.queue or state.sending):
                self._queue(state, _PING)

    def _peer(self, address: Address) -> _Peer:
        state = self._peers.get(address)
        if state is None:
            state = self._peers[address] = _Peer(address)
        return state

    def _send_loop(self, state: _Peer) -> None:
        while True:
            with self._lock:
                # Waits while another thread sends inline too: bytes of two frames never mix.
                while (not state.queue or state.sending) and not state.lost and not self._closed:
                    self._lock.wait()
                if state.lost or self._closed:
                    return
                frames = b"".join(state.queue)
                state.queue.clear()
                state.sending = True
                conn = state.conns[0] if state.conns else None
            try:
                if conn is None:
                    conn = self._dial(state)
                    if conn is None:
                        return
                conn.sendall(frames)
            except OSError:
                _shutdown(conn)  # type: ignore[arg-type]  # its reader sees it end
                with self._lock:
                    while state.conns and state.conns[0] is conn and not self._closed:
                        self._lock.wait(0.05)
                    if not state.lost:  # the peer lives on another connection, or a redial
                        state.queue.appendleft(frames)
            finally:
                with self._lock:
                    state.sending = False
                    self._lock.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until every queued frame is in the kernel's hands (or its
        peer is lost): a process may exit then, and its peers still read them. True if so."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while any((p.queue or p.sending) and not p.lost for p in self._peers.values()):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._lock.wait(left)
        return True

    def _dial(self, state: _Peer) -> socket.socket | None:
        """A connection to ``state``'s plane, or None when it is lost: its listener refused
        (nobody listens there: the process is gone, or closed its plane) or a stranger
        answered (another key). Anything else (a handshake dropped by a listener at its cap,
        a stall, out of descriptors) is tried again after a pause, until the plane closes: a
        live peer is never called lost for being slow; the wait above has its deadline."""
        pause = _REDIAL_S[0]
        while True:
            try:
                sock = owned(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            except OSError as exc:  # out of descriptors: not the peer's doing
                _log.debug("%r: no socket to dial %s: %s", self, state.address, exc)
            else:
                try:
                    return self._handshake(state, sock)
                except (ConnectionRefusedError, AuthenticationError) as exc:
                    sock.close()
                    _log.debug("%r: %s is lost: %s", self, format_address(*state.address), exc)
                    self._lose(state, REFUSED)
                    return None
                except Exception as exc:  # dropped, reset mid-handshake, timed out: again
                    sock.close()
                    _log.debug("%r: dial %s again: %s", self, state.address, exc)
            with self._lock:
                if self._lock.wait_for(lambda: state.lost or self._closed, pause):
                    return None
            pause = min(pause * 2, _REDIAL_S[1])

    def _handshake(self, state: _Peer, sock: socket.socket) -> socket.socket | None:
        deadline = time.monotonic() + self._handshake_s
        sock.settimeout(self._handshake_s)
        sock.connect(state.address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        host, port = self.address
        claim = self.key.claim(CONTROL, extra=_ADDRESS.pack(ip_bytes(host), port))
        self.key.connect(sock, claim, deadline)
        sock.settimeout(None)
        return sock if self._adopt(state, sock) else None

    # --- receiving ---------------------------------------------------------------------------
    def _accept(self, conn: socket.socket, address: tuple, deadline: float) -> bool:
        claim = self.key.accept(conn, deadline, CONTROL, check=_check_claim)
        raw_ip, port = _ADDRESS.unpack(claim.extra)
        peer = (ip_text(raw_ip), port)
        if not self._listener.adopt(conn):
            return False
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are small
        with self._lock:
            state = self._peer(peer)
        return self._adopt(state, conn)

    def _adopt(self, state: _Peer, conn: socket.socket) -> bool:
        with self._lock:
            if state.lost or self._closed:
                if state.lost == SILENT:  # woke up: tell it why it is refused
                    _send_quietly(conn, _FENCE)
                conn.close()
                return False
            state.conns.append(conn)
            reader = threading.Thread(
                target=self._read_loop,
                args=(state, conn),
                name=f"ddl-control-from-{format_address(*state.address)}",
                daemon=True,
            )
            self._readers.add(reader)
            self._lock.notify_all()
        reader.start()
        return True

    def _read_loop(self, state: _Peer, conn: socket.socket) -> None:
        try:
            while True:
                head = _recv(conn, _FRAME.size)
                if head is None:
                    break
                magic, channel, instance, kind, length = _FRAME.unpack(head)
                if magic != _MAGIC:
                    _log.debug("%r: a bad frame from %s", self, format_address(*state.address))
                    break
                body = _recv(conn, length) if length else b""
                if body is None:
                    break
                if channel == _NO_CHANNEL:
                    if kind == _FENCE_KIND:
                        self._fence(state.address)
                elif not state.lost:  # a peer lost as silent may wake up: it is not heard
                    self._deliver(channel, state.address, instance, kind, body)
        finally:
            conn.close()
            with self._lock:
                state.conns.remove(conn)
                self._readers.discard(threading.current_thread())
                gone = not state.conns and not self._closed
                self._lock.notify_all()
            if gone:
                self._lose(state, CLOSED)

    def _deliver(
        self, channel: bytes, peer: Address, instance: int, kind: int, body: bytes
    ) -> None:
        with self._lock:
            handler = self._channels.get(channel)
            if handler is None:
                self._held.append((channel, peer, instance, kind, body))
                self._held_bytes += len(body)
                while len(self._held) > _HELD_FRAMES or self._held_bytes > _HELD_BYTES:
                    self._held_bytes -= len(self._held.popleft()[4])
                return
        try:
            handler.on_frame(peer, instance, kind, body)
        except Exception:  # a handler's bug must not end the connection (a false loss)
            _log.exception("%r: a channel's handler failed on a frame", self)

    def _lose(self, state: _Peer, how: str) -> None:
        with self._lock:
            if state.lost or self._closed:
                return
            state.lost = how
            state.queue.clear()
            handlers = list(self._channels.values())
            watchers = [w for peers, w in self._watchers.values() if state.address in peers]
            conns = list(state.conns) if how == SILENT else []
            self._lock.notify_all()
        for conn in conns:  # read first when it wakes up: nothing else from here will be
            _send_quietly(conn, _FENCE)
        for watcher in watchers:
            try:
                watcher.on_silent(state.address)
            except Exception:
                _log.exception("%r: a watcher failed on a silent peer", self)
        for handler in handlers:
            try:
                handler.on_lost(state.address)
            except Exception:  # every other channel still hears of it
                _log.exception("%r: a channel's handler failed on a loss", self)

    def lost(self, peer: Address) -> bool:
        return self.how_lost(peer) is not None

    def how_lost(self, peer: Address) -> str | None:
        """How ``peer`` was lost (`SILENT`, `CLOSED`, `REFUSED`), or None while it is not."""
        with self._lock:
            state = self._peers.get(peer)
            return None if state is None else state.lost

    # --- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the listener and every connection (after what is queued went out, within a
        bound): the other planes see this process lost."""
        self.flush(_CLOSE_S)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._heartbeat.stop(goodbye=True)  # the peers stop watching us before we go quiet
            conns = [c for p in self._peers.values() for c in p.conns]
            readers = list(self._readers)
            self._lock.notify_all()
        self._listener.close(_CLOSE_S)
        for conn in conns:
            _shutdown(conn)
        deadline = time.monotonic() + _CLOSE_S
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        self._udp.close()


_planes: weakref.WeakSet[ControlPlane] = weakref.WeakSet()


def _closed_in_child() -> None:
    """After a fork, in the child: every plane is closed (its sockets are `owned`: the child's
    copies are closed already). Their locks are not taken: another thread of the parent may
    have held them at the fork."""
    for plane in list(_planes):
        plane._closed = True
        plane._heartbeat.forget()


os.register_at_fork(after_in_child=_closed_in_child)


def _check_claim(claim: Claim) -> str | None:
    if len(claim.extra) != _ADDRESS.size:
        return f"a control claim's address is {len(claim.extra)} bytes, not {_ADDRESS.size}"
    return None


def _bind_pair(host: str) -> tuple[socket.socket, socket.socket]:
    """A listening TCP socket on an ephemeral port of ``host`` and a UDP socket bound to the
    same port number: one address names both the plane and its heartbeat."""
    for _ in range(_BIND_TRIES):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))
            sock.listen(128)
            twin = owned(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            try:
                twin.bind((host, sock.getsockname()[1]))
            except OSError as exc:
                twin.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                sock.close()
                continue
            return sock, twin
        except BaseException:
            sock.close()
            raise
    raise OSError(errno.EADDRINUSE, f"no port of {host} free for both TCP and UDP")


def _send_quietly(conn: socket.socket, frame: bytes) -> None:
    try:
        conn.send(frame, socket.MSG_DONTWAIT)
    except OSError:
        pass


def _recv(conn: socket.socket, nbytes: int) -> bytes | None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        try:
            n = conn.recv_into(view[got:])
        except OSError:
            return None
        if n == 0:
            return None
        got += n
    return bytes(buf)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
