"""A process that sits between a rank and a listener it meant to reach gets nothing: the proof of
each handshake names the service and the exact address the connector dialled, and a listener
checks that claim before it proves anything. And no other process can listen on one of the
store's addresses in its place: the store binds every address its name resolves to.

The relay here needs no secret (it only forwards bytes, and would change them afterwards); the
squatter is another local user where the test can make one."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from unittest import mock

import pytest

from ddlcore.errors import DDLError
from ddlcore.job import store as store_module
from ddlcore.job import store_listen
from ddlcore.job.store import PrefixStore, StoreClient, StoreServer, StoreUnreachableError
from ddlcore.security.auth import AuthenticationError, JobKey, new_secret


class Relay:
    """Listens on ``listen`` and forwards every connection, both ways, to ``target``."""

    def __init__(self, listen: tuple[str, int], target: tuple, family: int) -> None:
        self.target, self.family = target, family
        self.server = socket.create_server(listen)
        self.address = self.server.getsockname()[:2]
        self.relayed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.server, selectors.EVENT_READ, None)
        socks: list[socket.socket] = []
        while not self._stop.is_set():
            for key, _ in sel.select(0.05):
                if key.data is None:
                    inbound, _ = self.server.accept()
                    outbound = socket.socket(self.family, socket.SOCK_STREAM)
                    outbound.connect(self.target)
                    self.relayed += 1
                    socks += [inbound, outbound]
                    sel.register(inbound, selectors.EVENT_READ, outbound)
                    sel.register(outbound, selectors.EVENT_READ, inbound)
                    continue
                try:
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:
                    for s in (key.fileobj, key.data):
                        try:
                            sel.unregister(s)
                        except (KeyError, ValueError):
                            pass
                        s.close()
                    continue
                try:
                    key.data.sendall(data)
                except OSError:
                    pass
        for s in socks:
            s.close()
        sel.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.server.close()


def _dual(name: str):
    """getaddrinfo that resolves ``name`` to ::1 first, then 127.0.0.1 (as ``localhost`` does on
    most distributions; this machine's may not)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host != name:
            return real(host, port, *args, **kwargs)
        port = int(port or 0)
        return [
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ]

    return getaddrinfo


def _ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="needs the IPv6 loopback ::1")


def _squat(port: int) -> str:
    """Another user tries to listen on 127.0.0.1:port (runs as that user)."""
    try:
        socket.create_server(("127.0.0.1", port)).close()
        return "listening"
    except OSError as exc:
        return f"refused: {exc.strerror}"


@needs_ipv6
def test_the_store_binds_every_address_of_its_name_so_nobody_squats_one(stranger):
    getaddrinfo = _dual("dual.test")
    with (
        mock.patch.object(store_listen.socket, "getaddrinfo", getaddrinfo),
        StoreServer("dual.test", 0, job_key=JobKey(b"s", "job")) as server,
    ):
        hosts = sorted(host for host, _ in server.socknames())
        assert hosts == ["127.0.0.1", "::1"], hosts
        assert stranger.run(_squat, server.port).startswith("refused"), "squatted"


@needs_ipv6
def test_a_store_address_already_taken_is_a_clear_error_not_a_half_served_store():
    getaddrinfo = _dual("dual.test")
    squatter = socket.create_server(("127.0.0.1", 0))
    port = squatter.getsockname()[1]
    try:
        with (
            mock.patch.object(store_listen.socket, "getaddrinfo", getaddrinfo),
            pytest.raises(DDLError, match=rf"127\.0\.0\.1:{port}.*another process"),
        ):
            StoreServer("dual.test", port, job_key=JobKey(b"s", "job"))
    finally:
        squatter.close()


@needs_ipv6
def test_a_relay_at_another_address_of_the_store_gets_the_rank_refused():
    """The store listens on [::1]:P only (as before the fix, or on a host where that is all its
    name gives); a relay on 127.0.0.1:P forwards to it. A rank that dials 127.0.0.1:P is refused
    by the real store (it was dialled elsewhere), so the relay never sits in an authenticated
    connection, and the rank's error says what happened."""
    secret = new_secret().encode()
    with StoreServer("::1", 0, job_key=JobKey(secret, "job")) as server:
        relay = Relay(("127.0.0.1", server.port), ("::1", server.port, 0, 0), socket.AF_INET6)
        try:
            with pytest.raises(StoreUnreachableError, match="refused this rank") as info:
                StoreClient(
                    "127.0.0.1", server.port, 3.0, rank=1, size=2, job_key=JobKey(secret, "job")
                )
            assert f"dialled 127.0.0.1:{server.port} but reached [::1]:{server.port}" in str(
                info.value
            )
            assert relay.relayed >= 1
            assert server.clients() == 0  # nothing got in
        finally:
            relay.close()


def test_a_relay_in_front_of_a_tcp_listener_gets_the_connection_refused():
    """Rank 1's published address is replaced by a relay's (as a process that got a rank to dial
    it would arrange): rank 0's connection through it is refused by rank 1's listener before any
    proof, so no relay ever carries the pair's bytes."""
    from ddlcore.transports.tcp import TcpTransport

    server = StoreServer("127.0.0.1", 0)
    clients = [StoreClient("127.0.0.1", server.port, 10.0, rank=r, size=2) for r in range(2)]
    contexts = []
    relay = None
    try:
        stores = [PrefixStore(c, "s/") for c in clients]
        contexts = [TcpTransport().create_context(r, 2, stores[r], 10.0) for r in (0, 1)]
        host, port = stores[1].get("tcp/addr/1").decode().rsplit(":", 1)
        relay = Relay(("127.0.0.1", 0), (host, int(port)), socket.AF_INET)
        stores[1].set("tcp/addr/1", f"127.0.0.1:{relay.address[1]}".encode())
        with pytest.raises(AuthenticationError, match="dialled 127.0.0.1:.* but reached"):
            contexts[0].pair(1)
        assert relay.relayed >= 1
    finally:
        if relay is not None:
            relay.close()
        for ctx in contexts:
            ctx.close()
        for client in clients:
            client.close()
        server.close()


def test_a_tcp_listener_proves_nothing_for_a_store_claim():
    """A store client pointed at a rank's TCP listener (a fake store would relay to it for a
    proof) is refused there: the listener serves TCP channels, not the store."""
    from ddlcore.transports.tcp import TcpTransport

    server = StoreServer("127.0.0.1", 0)
    client = StoreClient("127.0.0.1", server.port, 10.0, rank=0, size=2)
    ctx = None
    try:
        store = PrefixStore(client, "s/")
        ctx = TcpTransport().create_context(1, 2, store, 10.0)
        host, port = store.get("tcp/addr/1").decode().rsplit(":", 1)
        key = JobKey(b"unused", "job")
        key._key = client.job_key._key  # the job's own key: only the claim differs
        t0 = time.monotonic()
        with pytest.raises(StoreUnreachableError, match="serves tcp, not store"):
            store_module.StoreClient(host, int(port), 2.0, rank=1, size=2, job_key=key)
        assert time.monotonic() - t0 < 60
    finally:
        if ctx is not None:
            ctx.close()
        client.close()
        server.close()
