"""Socket helpers shared by the rendezvous store and the TCP transport: which local address to
listen on, connecting with retries, exact reads, and "host:port" strings.

The address a rank listens on is the IPv4 address of ``DDL_SOCKET_IFNAME`` when that is set
(looked up with the ``SIOCGIFADDR`` ioctl), otherwise the local address the kernel would use to
reach the master, so peers on other hosts reach it over the same network.
"""

from __future__ import annotations

import errno
import socket
import struct
import time

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: get an interface's IPv4 address
_IFNAMSIZ = 16
# Errors worth retrying while the listener may not be up yet (or a SYN got lost).
_RETRY_ERRNOS = (errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH,
                 errno.ETIMEDOUT, errno.ECONNABORTED)


def interface_names() -> list[str]:
    """Names of this host's network interfaces (empty if they cannot be listed)."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface ``ifname`` (e.g. ``eth0``).

    Raises
    ------
    ValueError
        No such interface, or it has no IPv4 address; the message names ``DDL_SOCKET_IFNAME``
        and lists the interfaces that exist.
    """
    names = ", ".join(interface_names()) or "none found"
    try:
        import fcntl
    except ImportError:  # not POSIX
        raise ValueError(f"DDL_SOCKET_IFNAME={ifname!r}: interface lookup needs Linux "
                         "(fcntl/ioctl); unset it to use the interface that reaches the "
                         "master address") from None
    raw = ifname.encode()
    if not raw or len(raw) >= _IFNAMSIZ or b"\0" in raw:
        raise ValueError(f"DDL_SOCKET_IFNAME={ifname!r} is not a valid interface name; "
                         f"interfaces here: {names}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", raw))
        except OSError as exc:
            why = ("has no IPv4 address" if ifname in interface_names()
                   else "is not a network interface of this host")
            raise ValueError(f"DDL_SOCKET_IFNAME={ifname!r} {why} ({exc.strerror}); "
                             f"interfaces here: {names}") from None
    return socket.inet_ntoa(res[20:24])


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
        return sock


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
