"""The rendezvous store's listening sockets: bound on every address its name resolves to, so
that no other process can listen on one of them in its place (``localhost`` is ``::1`` and
``127.0.0.1`` on most systems: a client refused on one tries the next), and bound before the
address is published, so that no other process can take the port between the choice and the
bind.

`listen_all` binds a name's addresses on one port (port 0: one free port for all of them);
`reserve` does so ahead of the server, for a rank 0 that must publish its store's address
before it serves (through MPI or torch's store), and `take` hands the sockets to the server. A
launcher (ddlrun) binds them itself and hands them to rank 0 over an abstract Unix socket
(`Handoff`, named by ``DDL_STORE_SOCKETS``; a wrapper between ddlrun and the rank may close
inherited descriptors), which `take` asks for.
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import struct
import threading

from ddlcore import config
from ddlcore.errors import RendezvousError

# Tries at a port free on every address of the name, where the first address's free port is
# taken on another.
_PORT_TRIES = 16

# How long rank 0 waits for the launcher's answer, and how many sockets it takes.
_HANDOFF_S = 5.0
_MAX_HANDED = 8
_CREDS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid

_reserved: dict[tuple[str, int], list[socket.socket]] = {}
_lock = threading.Lock()
_handed = [False]  # the launcher's sockets were taken (once per process)


def _addresses(host: str, port: int) -> list[tuple[int, tuple]]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise RendezvousError(
            f"cannot serve the rendezvous store at {host}:{port}: {host!r} does not resolve ({exc})"
        ) from None
    seen: list[tuple[int, tuple]] = []
    for family, _, _, _, sockaddr in infos:
        if (family, sockaddr[:2]) not in [(f, a[:2]) for f, a in seen]:
            seen.append((family, sockaddr))
    return seen


def _bind(family: int, sockaddr: tuple, port: int, backlog: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((sockaddr[0], port, *sockaddr[2:]))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_all(host: str, port: int, backlog: int = 4096) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to that this host can bind, all on
    ``port`` (0: a port free on all of them).

    Raises
    ------
    RendezvousError
        No address can be bound, or one is in use (another process listens there: a job on
        that port, or a process waiting to answer in the store's place).
    """
    addresses = _addresses(host, port)
    for _ in range(_PORT_TRIES if port == 0 else 1):
        socks: list[socket.socket] = []
        chosen = port
        try:
            for family, sockaddr in addresses:
                try:
                    sock = _bind(family, sockaddr, chosen, backlog)
                except OSError as exc:
                    if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                        continue  # not an address of this host (IPv6 off, say)
                    if exc.errno == errno.EADDRINUSE and port == 0 and socks:
                        raise _TryAnotherPort from None
                    raise RendezvousError(
                        f"cannot serve the rendezvous store at {_where(sockaddr[0], chosen)}: "
                        f"{exc.strerror or exc}; is another job, or another process, using that "
                        "port?"
                    ) from None
                socks.append(sock)
                chosen = sock.getsockname()[1]
        except _TryAnotherPort:
            for sock in socks:
                sock.close()
            continue
        except BaseException:
            for sock in socks:
                sock.close()
            raise
        if not socks:
            raise RendezvousError(
                f"cannot serve the rendezvous store at {host}:{port}: none of its addresses "
                f"({', '.join(a[1][0] for a in addresses)}) is one of this host's"
            )
        return socks
    raise RendezvousError(
        f"cannot serve the rendezvous store at {host}: no port was free on all of its addresses "
        f"in {_PORT_TRIES} tries"
    )


class _TryAnotherPort(Exception):
    pass


def reserve(host: str) -> int:
    """Bind the store's sockets on ``host`` now, on a free port, and keep them for the server
    that `take` will give them to; returns the port."""
    socks = listen_all(host, 0)
    port = socks[0].getsockname()[1]
    with _lock:
        _reserved[(host, port)] = socks
    return port


def take(host: str, port: int) -> list[socket.socket] | None:
    """The sockets reserved (`reserve`) or handed over by the launcher (``DDL_STORE_SOCKETS``)
    for a store on ``host:port``; None if there are none (the server binds its own)."""
    with _lock:
        socks = _reserved.pop((host, port), None)
    if socks is not None:
        return socks
    return _received(port)


def _received(port: int) -> list[socket.socket] | None:
    """The store's sockets from the launcher (`Handoff`, named by ``DDL_STORE_SOCKETS``), where
    they listen on ``port``; taken once per process."""
    name = config.get("DDL_STORE_SOCKETS")
    with _lock:
        if not name or _handed[0]:
            return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(_HANDOFF_S)
            conn.connect(_abstract(name))
            _, fds, _, _ = socket.recv_fds(conn, 16, _MAX_HANDED)
    except OSError:
        return None  # ddlrun is gone, or this is no job of its: bind our own
    socks: list[socket.socket] = []
    for fd in fds:
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        try:
            ours = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and (
                sock.getsockname()[1] == port
            )
        except OSError:
            ours = False
        if ours:
            socks.append(sock)
        else:
            sock.close()
    if not socks:
        return None
    with _lock:
        _handed[0] = True
    return socks


class Handoff:
    """A launcher's side of ``DDL_STORE_SOCKETS``: it binds the store's sockets before any rank
    starts and hands them, over an abstract Unix socket, to whichever process of the user asks
    (rank 0's, wherever a wrapper put it: nothing has to be inherited), keeping its own copies,
    which hold the port and accept nothing, until `close`.

    Parameters
    ----------
    socks : list of socket
        The store's listening sockets (`listen_all`).
    """

    def __init__(self, socks: list[socket.socket]) -> None:
        self.socks = socks
        self.name = f"@ddlcore-store-{os.getpid()}-{secrets.token_hex(8)}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._server.bind(_abstract(self.name))
            self._server.listen(16)
        except BaseException:
            self._server.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="ddlrun-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        fds = [sock.fileno() for sock in self.socks]
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
                    if _CREDS.unpack(creds)[1] == os.getuid():  # (pid, uid, gid): ours only
                        socket.send_fds(conn, [b"s"], fds)
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        self._thread.join(5)
        for sock in self.socks:
            sock.close()


def _abstract(name: str) -> str:
    """An abstract Unix socket's address ("@name": no file, gone with its owner)."""
    return "\0" + name.removeprefix("@")


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
