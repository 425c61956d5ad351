"""Socket helpers shared by the TCP transport and rendezvous: which local address to use, and
"host:port" strings.

The address a rank listens on is the IPv4 address of ``DDL_SOCKET_IFNAME`` when that is set
(looked up with the ``SIOCGIFADDR`` ioctl), otherwise the local address the kernel would use to
reach the master, so peers on other hosts can reach it over the same network.
"""

from __future__ import annotations

import socket
import struct

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>
_IFNAMSIZ = 16


def _interface_names() -> str:
    try:
        return ", ".join(name for _, name in socket.if_nameindex()) or "none"
    except OSError:
        return "unknown"


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface ``ifname`` (e.g. ``eth0``).

    Raises
    ------
    ValueError
        No such interface, or it has no IPv4 address; the message names ``DDL_SOCKET_IFNAME``
        and lists the interfaces that exist.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        raise ValueError(f"DDL_SOCKET_IFNAME={ifname!r}: interface lookup needs Linux "
                         "(fcntl/ioctl); unset it to use the interface that reaches the "
                         "master address") from None
    raw = ifname.encode()
    if not raw or len(raw) >= _IFNAMSIZ or b"\0" in raw:
        raise ValueError(f"DDL_SOCKET_IFNAME={ifname!r} is not a valid interface name; "
                         f"interfaces here: {_interface_names()}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", raw))
        except OSError as exc:
            why = "has no IPv4 address" if ifname in _interface_names().split(", ") else \
                "is not a network interface here"
            raise ValueError(f"DDL_SOCKET_IFNAME={ifname!r} {why} ({exc.strerror}); "
                             f"interfaces here: {_interface_names()}") from None
    return socket.inet_ntoa(res[20:24])


def local_address_towards(host: str) -> str:
    """The local IP address the kernel routes ``host`` through (no packet is sent: a UDP
    "connect" only selects the route). For a loopback ``host`` this is a loopback address."""
    infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    last: OSError | None = None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return s.getsockname()[0]
        except OSError as exc:
            last = exc
    raise OSError(f"no route from this host to {host!r}: {last}")


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> tuple[str, int]:
    """Inverse of `format_address`; raises ValueError on anything else."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)
