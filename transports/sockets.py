"""Socket helpers shared by the rendezvous store and the TCP transport: which local address to
listen on, connecting with retries, exact reads, "host:port" strings, and `HandshakeListener`
(accepting connections and serving their handshakes concurrently, bounded).

Every socket ddlcore keeps open is `owned`: a process forked from this one (a data loader's
worker) closes its copies at once, so that it never holds a connection open past this
process's death, which would hide that death from the peers (they see it as the connection's
end).

The address a rank listens on is the IPv4 address of ``DDL_SOCKET_IFNAME`` when that is set
(looked up with the ``SIOCGIFADDR`` ioctl), otherwise the local address the kernel would use to
reach the master, so peers on other hosts reach it over the same network. A comma list there
names one interface per network adapter (rail): local rank i takes the (i mod A)-th
(`rail_interface`).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: get an interface's IPv4 address
_IFNAMSIZ = 16
# Errors worth retrying while the listener may not be up yet (or a SYN got lost).
_RETRY_ERRNOS = (
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ETIMEDOUT,
    errno.ECONNABORTED,
)
# accept() errors that pass: out of descriptors or memory for a moment, or a connection that
# was reset before we took it. The listener pauses (_ACCEPT_PAUSE_S) and goes on.
_ACCEPT_TRANSIENT = (
    errno.EMFILE,
    errno.ENFILE,
    errno.ENOBUFS,
    errno.ENOMEM,
    errno.ECONNABORTED,
    errno.EPROTO,
    errno.EPERM,
    errno.EINTR,
)
_ACCEPT_PAUSE_S = 0.01
_log = logging.getLogger("ddlcore")


_owned: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def owned(sock: socket.socket) -> socket.socket:
    """``sock``, closed in any child this process forks (see the module docstring)."""
    _owned.add(sock)
    return sock


def _close_owned_in_child() -> None:
    # close, never shutdown: shutdown would end the parent's connection too.
    for sock in list(_owned):
        try:
            sock.close()
        except OSError:
            pass


os.register_at_fork(after_in_child=_close_owned_in_child)


def interface_names() -> list[str]:
    """Names of this host's network interfaces (empty if they cannot be listed)."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def interface_address(ifname: str, label: str | None = None, fix: str = "") -> str:
    """The IPv4 address of network interface ``ifname`` (e.g. ``eth0``).

    ``label`` says where the name came from in errors (default ``DDL_SOCKET_IFNAME=<ifname>``)
    and ``fix`` what to do (default: unset it, or list the interfaces that exist).

    Raises
    ------
    ValueError
        No such interface, or it has no IPv4 address; the message names ``DDL_SOCKET_IFNAME``
        and lists the interfaces that exist.
    """
    label = label or f"DDL_SOCKET_IFNAME={ifname!r}"
    names = ", ".join(interface_names()) or "none found"
    try:
        import fcntl
    except ImportError:  # not POSIX
        raise ValueError(
            f"{label}: interface lookup needs Linux (fcntl/ioctl); unset "
            "DDL_SOCKET_IFNAME to use the interface that reaches the master "
            "address"
        ) from None
    raw = ifname.encode()
    if not raw or len(raw) >= _IFNAMSIZ or b"\0" in raw:
        raise ValueError(f"{label} is not a valid interface name; interfaces here: {names}{fix}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", raw))
        except OSError as exc:
            why = (
                "has no IPv4 address"
                if ifname in interface_names()
                else "is not a network interface of this host"
            )
            raise ValueError(
                f"{label} {why} ({exc.strerror}); interfaces here: {names}{fix}"
            ) from None
    return socket.inet_ntoa(res[20:24])


def rail_interfaces(ifname: str) -> tuple[str, ...]:
    """The interfaces ``DDL_SOCKET_IFNAME`` lists, one per rail ("eth0,eth1" -> both; "" -> none).

    Raises
    ------
    ValueError
        An empty name in the list or one named twice.
    """
    if not ifname.strip():
        return ()
    names = tuple(n.strip() for n in ifname.split(","))
    if "" in names:
        raise ValueError(
            f"DDL_SOCKET_IFNAME={ifname!r} has an empty interface name; list one "
            "interface per network adapter, e.g. eth0,eth1"
        )
    if len(set(names)) != len(names):
        raise ValueError(
            f"DDL_SOCKET_IFNAME={ifname!r} names an interface twice; list each network adapter once"
        )
    return names


def rail_address(ifname: str, rank: int, local_rank: int) -> str | None:
    """The IPv4 address rank ``rank`` (local rank ``local_rank``) listens on and sends from:
    that of its rail's interface (None when ``ifname`` is empty).

    Raises
    ------
    ValueError
        The rail's interface is missing or has no IPv4 address; the message names it, the rank
        and what to do.
    """
    rails = rail_interfaces(ifname)
    if not rails:
        return None
    rail = local_rank % len(rails)
    if len(rails) == 1:
        return interface_address(rails[0], f"rank {rank}: DDL_SOCKET_IFNAME={rails[0]!r}")
    return interface_address(
        rails[rail],
        f"rank {rank} (local rank {local_rank}): interface {rails[rail]!r}, rail "
        f"{rail} of DDL_SOCKET_IFNAME={ifname!r},",
        "; every host needs each listed interface with an IPv4 address (one subnet per rail): "
        "list only the adapters all hosts have",
    )


def route_address(host: str) -> str:
    """The local IPv4 address the kernel routes ``host`` through (no packet is sent: a UDP
    "connect" only selects the route). For a loopback ``host`` it is a loopback address.

    Raises
    ------
    OSError
        ``host`` does not resolve to IPv4, or there is no route to it.
    """
    last: OSError | None = None
    for _, _, _, _, sockaddr in socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return s.getsockname()[0]
        except OSError as exc:
            last = exc
    raise OSError(f"no IPv4 route from this host to {host!r}: {last}")


local_address_towards = route_address


def connect_with_retry(addr: tuple[str, int], deadline: float, what: str) -> socket.socket:
    """A blocking TCP connection to ``addr`` (TCP_NODELAY set), retrying refused or unreachable
    attempts with a growing pause until ``deadline`` (``time.monotonic``); the listener may not
    be up yet.

    Raises
    ------
    TimeoutError
        Not connected by the deadline; the message names ``what`` and the last error.
    OSError
        A failure that retrying cannot fix.
    """
    delay = 0.01
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"could not connect to {what} at {format_address(*addr)}: {last}")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(min(left, 5.0))
        try:
            sock.connect(addr)
        except OSError as exc:
            sock.close()
            if not isinstance(exc, TimeoutError) and exc.errno not in _RETRY_ERRNOS:
                raise
            last = exc
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.25)
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return owned(sock)


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on a clean EOF before the first byte.

    Raises
    ------
    ConnectionResetError
        EOF in the middle of ``view``.
    """
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            if got == 0:
                return False
            raise ConnectionResetError(f"connection closed after {got} of {n} bytes")
        got += k
    return True


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> tuple[str, int]:
    """Inverse of `format_address`.

    Raises
    ------
    ValueError
        ``text`` is not ``host:port``.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


class HandshakeListener:
    """Accept connections on a listening socket and serve each one's handshake on a thread of its
    own, so that an idle or slow connection never delays another's.

    Bounds: a handshake must be over within ``handshake_s`` (the whole of it, not per read: the
    ``serve`` callback gets the deadline); at most ``max_pending`` handshakes are pending at once,
    and at most ``max_per_source`` from one source address. A connection that would pass a cap
    drops the oldest pending handshake of its source (or of all): a stranger holding connections
    open cannot keep a new one out, and a real peer whose attempt was dropped that way tries
    again. ``serve(conn, address, deadline)`` returns True when it kept the connection (after
    calling `adopt`); when it returns False or raises, the connection is closed and counted in
    `refusals` (and logged at debug level: ``DDL_DEBUG=1`` shows each one).

    Parameters
    ----------
    sock : socket.socket
        A bound, listening socket; the listener owns it from here on.
    serve : callable
        The handshake, run on its own thread.
    name : str
        Prefix of the threads' names.
    """

    def __init__(
        self,
        sock: socket.socket,
        serve: Callable[[socket.socket, tuple, float], bool],
        name: str,
        handshake_s: float,
        max_pending: int,
        max_per_source: int,
    ) -> None:
        self._sock, self._serve, self._name = owned(sock), serve, name
        self.handshake_s = handshake_s
        self.max_pending, self.max_per_source = max_pending, max(1, max_per_source)
        self._lock = threading.Lock()
        self._pending: OrderedDict[socket.socket, str] = OrderedDict()  # oldest first
        self._per_source: dict[str, int] = {}
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.refused = 0  # connections dropped without being kept
        self.last_refusal = ""  # why the last one was, and where it came from
        self._accepter = threading.Thread(
            target=self._accept_loop, name=f"{name}-accept", daemon=True
        )
        self._accepter.start()

    def refusals(self) -> str:
        """ "" when no connection was refused, else how many and the last one's reason."""
        with self._lock:
            if not self.refused:
                return ""
            return f"{self.refused} connection(s) refused, the last {self.last_refusal}"

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def adopt(self, conn: socket.socket) -> bool:
        """Called by ``serve`` before keeping ``conn``: takes it out of the pending handshakes (no
        cap drops it any more). False: it was dropped already, and must not be kept."""
        with self._lock:
            source = self._pending.pop(conn, None)
            if source is None:
                return False
            self._forget_source(source)
            return not self._closed

    def _forget_source(self, source: str) -> None:
        left = self._per_source[source] - 1
        if left:
            self._per_source[source] = left
        else:
            del self._per_source[source]

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, address = self._sock.accept()
                owned(conn)
            except OSError as exc:
                if self._closed:
                    return  # close() shut the listener down
                if exc.errno in _ACCEPT_TRANSIENT or isinstance(exc, TimeoutError):
                    if exc.errno in (errno.EMFILE, errno.ENFILE):
                        self._drop_oldest()  # out of fds: an unfinished handshake gives one back
                    time.sleep(_ACCEPT_PAUSE_S)
                    continue
                return  # the listening socket itself is broken: nothing more will come
            source = address[0] if address else "?"
            deadline = time.monotonic() + self.handshake_s
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                victim = self._victim_for(source)
                self._pending[conn] = source
                self._per_source[source] = self._per_source.get(source, 0) + 1
                thread = threading.Thread(
                    target=self._run,
                    args=(conn, address, deadline),
                    name=f"{self._name}-handshake",
                    daemon=True,
                )
                self._threads.add(thread)
            if victim is not None:
                _shutdown(victim)  # its thread sees the socket fail, and closes it
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: drop this connection
                with self._lock:
                    self._threads.discard(thread)
                self._run_done(conn, address, "no thread could be started for it")

    def _drop_oldest(self) -> None:
        with self._lock:
            if not self._pending:
                return
            victim = next(iter(self._pending))
            self._forget_source(self._pending.pop(victim))
        _shutdown(victim)  # its thread sees the socket fail, and closes it

    def _victim_for(self, source: str) -> socket.socket | None:
        """At a cap: the oldest pending connection to drop for a new one (lock held)."""
        victim = None
        if self._per_source.get(source, 0) >= self.max_per_source:
            victim = next(c for c, s in self._pending.items() if s == source)
        elif len(self._pending) >= self.max_pending:
            victim = next(iter(self._pending))
        if victim is not None:
            self._forget_source(self._pending.pop(victim))
        return victim

    def _run(self, conn: socket.socket, address: tuple, deadline: float) -> None:
        why = ""
        try:
            if self._serve(conn, address, deadline):
                return
            why = "refused by the handshake"
        except BaseException as exc:  # a stranger, a bad proof, a stall, a cap: drop it
            why = f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
        self._run_done(conn, address, why)

    def _run_done(self, conn: socket.socket, address: tuple, why: str) -> None:
        with self._lock:
            source = self._pending.pop(conn, None)
            if source is not None:
                self._forget_source(source)
            self.refused += 1
            where = format_address(*address[:2]) if len(address) >= 2 else "?"
            self.last_refusal = f"from {where}: {why}"
        conn.close()
        _log.debug("%s: refused a connection from %s: %s", self._name, where, why)

    def close(self, timeout: float) -> None:
        """Stop accepting, drop every pending handshake and wait (up to ``timeout`` s) for their
        threads."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        _shutdown(self._sock)  # wakes accept() on Linux
        self._accepter.join(max(0.0, deadline - time.monotonic()))
        self._sock.close()
        for conn in pending:
            _shutdown(conn)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
