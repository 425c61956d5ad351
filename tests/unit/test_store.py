"""The rendezvous store: key-value semantics, blocking waits with deadlines and clear timeout
messages, frame caps, and binding only to the address it was given."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from ddlcore.errors import RendezvousError
from ddlcore.job.store import MAX_KEY_BYTES, MAX_VALUE_BYTES, PrefixStore, StoreClient, StoreServer
from ddlcore.security.claims import STORE, Claim
from tests.harness import free_port


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0)
    yield srv
    srv.close()


def client(srv: StoreServer, **kw) -> StoreClient:
    return StoreClient("127.0.0.1", srv.port, kw.pop("timeout", 5.0), **kw)


def test_set_get_add_check_delete(server):
    with client(server) as c:
        c.set("a", b"\x00\x01binary")
        assert c.get("a") == b"\x00\x01binary"
        c.set("a", bytearray(b"replaced"))
        assert c.get("a") == b"replaced"
        c.set("empty", b"")
        assert c.get("empty") == b""
        assert c.add("n", 3) == 3 and c.add("n", -1) == 2 and c.get("n") == b"2"
        assert c.check("a") and not c.check("nope")
        assert c.delete("a") and not c.check("a") and not c.delete("a")
        c.set("ünïcode/ключ", b"ok")
        assert c.get("ünïcode/ключ") == b"ok"


def test_lookup_and_post_never_sit_behind_another_threads_wait(server):
    with client(server) as c:
        c.post("here", b"value", 0.5)
        assert c.lookup("here", 0.5) == b"value"
        t0 = time.monotonic()
        assert c.lookup("absent", 0.5) is None
        assert PrefixStore(c, "p/").lookup("absent", 0.5) is None
        assert time.monotonic() - t0 < 1.0

        def wait_in_vain() -> None:
            with pytest.raises(RendezvousError):
                c.get("never", timeout=1.5)

        waiter = threading.Thread(target=wait_in_vain, daemon=True)
        waiter.start()  # holds the connection for its whole wait
        time.sleep(0.2)
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match="stayed busy"):
            c.lookup("here", 0.3)
        assert time.monotonic() - t0 < 2.0
        waiter.join(10)


def test_add_on_a_non_counter_is_an_error(server):
    with client(server) as c:
        c.set("text", b"abc")
        with pytest.raises(ValueError, match="counter"):
            c.add("text", 1)
        assert c.get("text") == b"abc"  # the connection survives


def test_blocking_get_is_satisfied_by_a_later_set(server):
    with client(server) as waiter, client(server) as setter:
        timer = threading.Timer(0.2, setter.set, args=("late", b"here"))
        timer.start()
        t0 = time.monotonic()
        assert waiter.get("late", timeout=5.0) == b"here"
        assert 0.1 < time.monotonic() - t0 < 3.0
        timer.join()


def test_get_timeout_names_the_key_and_the_wait(server):
    with client(server, rank=3, size=4) as c:
        t0 = time.monotonic()
        with pytest.raises(RendezvousError) as info:
            c.get("g0/peer/2", timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 3.0
        message = str(info.value)
        assert "'g0/peer/2'" in message and "0.3 s" in message and "rank 3" in message, message


def test_wait_count_and_its_timeout(server):
    with client(server) as c, client(server) as other:
        threading.Timer(0.1, other.add, args=("arrived", 2)).start()
        assert c.wait_count("arrived", 2, timeout=5.0) == 2
        with pytest.raises(RendezvousError, match=r"reached 2 of 5 after 0\.2 s"):
            c.wait_count("arrived", 5, timeout=0.2)


def test_barrier_releases_everyone_and_can_be_reused(server):
    size = 3
    clients = [client(server, rank=r, size=size) for r in range(size)]
    errors: list[BaseException] = []

    def run(c: StoreClient) -> None:
        try:
            for _ in range(3):  # the same name, three times: each is a new barrier
                c.barrier("step", timeout=5.0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for c in clients:
        c.close()
    assert not errors, errors


def test_barrier_timeout_says_how_many_ranks_arrived(server):
    size = 4
    clients = [client(server, rank=r, size=size) for r in range(size)]
    messages: list[str] = []

    def run(c: StoreClient) -> None:
        try:
            c.barrier("init", timeout=0.5)
        except RendezvousError as exc:
            messages.append(str(exc))

    threads = [threading.Thread(target=run, args=(c,)) for c in clients if c.rank != 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for c in clients:
        c.close()
    assert len(messages) == 3
    for message in messages:
        assert "3 of 4 ranks" in message and "missing ranks: [2]" in message, message
        assert f"127.0.0.1:{server.port}" in message and "0.5 s" in message, message


def test_prefix_store_is_a_namespace(server):
    with client(server, rank=0, size=1) as c:
        a, b = PrefixStore(c, "a/"), PrefixStore(c, "b/")
        a.set("k", b"1")
        b.set("k", b"2")
        assert (a.get("k"), b.get("k"), c.get("a/k")) == (b"1", b"2", b"1")
        assert a.add("n", 1) == 1 and b.add("n", 5) == 5
        PrefixStore(a, "x/").set("k", b"3")
        assert c.get("a/x/k") == b"3" and a.check("x/k") and not b.check("x/k")
        assert a.host == "127.0.0.1" and a.port == server.port
        a.barrier("solo")


def test_oversize_key_and_value_are_refused_by_the_client(server):
    with client(server) as c:
        with pytest.raises(ValueError, match="1025 bytes"):
            c.set("k" * (MAX_KEY_BYTES + 1), b"")
        with pytest.raises(ValueError, match="at most"):
            c.set("big", memoryview(bytes(MAX_VALUE_BYTES + 1)))
        with pytest.raises(TypeError):
            c.set("text", "not bytes")  # type: ignore[arg-type]
        c.set("k" * MAX_KEY_BYTES, b"ok")  # the cap itself is allowed
        assert c.get("k" * MAX_KEY_BYTES) == b"ok"


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("<HBBHIqq", 0xDD5C, 1, 0, MAX_KEY_BYTES + 1, 0, 0, 0),  # key too long
        struct.pack("<HBBHIqq", 0xDD5C, 1, 0, 1, MAX_VALUE_BYTES + 1, 0, 0),  # value too long
        struct.pack("<HBBHIqq", 0xDD5C, 99, 0, 1, 0, 0, 0),  # unknown op
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not our protocol
    ],
)
@pytest.mark.parametrize("authenticated", [False, True])
def test_malformed_frames_close_the_connection(server, frame, authenticated):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        if authenticated:  # past the handshake, the request parser judges it
            server.job_key.connect(raw, Claim(STORE), time.monotonic() + 5)
        raw.sendall(frame)
        try:
            answer = raw.recv(64)
        except ConnectionResetError:  # hung up with our bytes unread
            answer = b""
        assert answer == b""  # the server hung up without answering
    with client(server) as c:  # and keeps serving everyone else
        c.set("still", b"up")
        assert c.get("still") == b"up"


def test_server_binds_only_the_given_address(server):
    assert server.sockname() == ("127.0.0.1", server.port)
    with pytest.raises(ConnectionRefusedError):  # another loopback address of this host
        socket.create_connection(("127.0.0.2", server.port), timeout=2).close()


def test_client_retries_until_the_server_starts():
    port = free_port()
    started: list[StoreServer] = []
    timer = threading.Timer(0.3, lambda: started.append(StoreServer("127.0.0.1", port)))
    timer.start()
    try:
        with StoreClient("127.0.0.1", port, 5.0) as c:
            c.set("k", b"v")
            assert c.get("k") == b"v"
    finally:
        timer.join()
        for srv in started:
            srv.close()


def test_unreachable_store_fails_within_the_timeout():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"127\.0\.0\.1:{port} within 0\.3 s"):
        StoreClient("127.0.0.1", port, 0.3, rank=1, size=2)
    assert time.monotonic() - t0 < 2.0


def test_lost_server_is_a_rendezvous_error():
    srv = StoreServer("127.0.0.1", 0)
    c = client(srv)
    c.set("k", b"v")
    srv.close()
    with pytest.raises(RendezvousError, match="lost the connection"):
        c.get("k", timeout=1.0)
    c.close()


def test_close_joins_the_server_threads():
    before = {t.ident for t in threading.enumerate()}
    srv = StoreServer("127.0.0.1", 0)
    clients = [client(srv) for _ in range(3)]
    for c in clients:
        c.set("x", b"1")
    srv.close()
    for c in clients:
        c.close()
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not left, left


def test_close_lingers_until_clients_leave():
    srv = StoreServer("127.0.0.1", 0)
    c = client(srv)
    # connect() returns once the kernel queues the connection; the server counts it when its
    # accept thread picks it up
    deadline = time.monotonic() + 5.0
    while srv.clients() == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    threading.Timer(0.2, c.close).start()
    t0 = time.monotonic()
    srv.close(linger=5.0)
    assert 0.1 < time.monotonic() - t0 < 3.0
    assert srv.clients() == 0


def test_unreachable_store_error_is_a_distinct_rendezvous_error():
    from ddlcore.job.store import StoreUnreachableError

    with pytest.raises(StoreUnreachableError):
        StoreClient("127.0.0.1", free_port(), 0.2)
    assert issubclass(StoreUnreachableError, RendezvousError)


def test_a_barrier_with_disagreeing_sizes_or_a_rank_twice_is_an_error(server):
    with (
        client(server, rank=0, size=2) as a,
        client(server, rank=1, size=3) as b,
        client(server, rank=0, size=2) as twin,
    ):
        errors: list[BaseException] = []

        def first() -> None:
            try:
                a.barrier("x", timeout=1.0)
            except RendezvousError as exc:
                errors.append(exc)

        arrived = threading.Thread(target=first)
        arrived.start()
        time.sleep(0.2)
        with pytest.raises(ValueError, match="says 3 ranks, an earlier one said 2"):
            b.barrier("x")
        with pytest.raises(ValueError, match="rank 0 arrived twice"):
            twin.barrier("x")
        arrived.join(10)
        assert "1 of 2 ranks" in str(errors[0]) and "missing ranks: [1]" in str(errors[0])
        with pytest.raises(ValueError, match="rank=2 of size=2"):
            a.barrier("y", rank=2)


def test_readers_free_a_value_after_its_last_read(server):
    with client(server) as c:
        PrefixStore(c, "p/").set("once", b"v", readers=2)
        assert c.get("p/once") == b"v" and c.check("p/once")
        assert c.get("p/once") == b"v" and not c.check("p/once")
        with pytest.raises(ValueError, match="readers"):
            c.set("k", b"v", readers=-1)
        assert server.stats()["keys"] == 0


def test_values_stay_while_any_client_is_connected_and_go_with_the_last(server):
    stays = client(server)
    with client(server) as leaves:
        leaves.set("address", b"x" * 1000)  # read after its owner left: UCX's lazy wire-up
        leaves.add("shared", 1)
    assert stays.get("address") == b"x" * 1000 and stays.add("shared", 1) == 2
    stays.close()
    deadline = time.monotonic() + 5
    while server.stats()["keys"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats()["keys"] == 0 and server.stats()["bytes"] == 0


def test_the_store_full_is_an_error_and_nothing_is_kept():
    with StoreServer("127.0.0.1", 0, max_bytes=1000) as srv, client(srv) as c:
        c.set("a", b"x" * 600)
        with pytest.raises(ValueError, match="cap of 1000"):
            c.set("b", b"x" * 600)
        c.set("a", b"y" * 900)  # replacing counts only the difference
        assert srv.stats()["bytes"] == 900 and not c.check("b")
