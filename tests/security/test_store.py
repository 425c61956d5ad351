"""Attacks on the rendezvous store, each by a stranger on loopback against a real store (a
server process, or rank 0 of a real job): the stranger is refused, the job's results stay
bit-exact, and the store stays bounded (memory, fds, threads) and prompt.

The fuzz run (many malformed frames, hundreds of idle and some slow connections while a job
runs) is in ``test_store_fuzz.py``.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ddlcore.errors import RendezvousError
from ddlcore.job import store_wire as wire
from ddlcore.job.store import StoreAuthenticationError, StoreClient, StoreServer
from ddlcore.job.store_server import MAX_PENDING_PER_SOURCE
from ddlcore.security.auth import JobKey, new_secret
from ddlcore.security.claims import STORE, Claim
from tests.harness import free_port, mpiexec_path, require, run_ranks

_HELLO = struct.Struct("<IHH")
_AUTH_MAGIC = 0xDD1A7E57

# A store server in a process of its own, so that its memory, fds and threads can be read
# from /proc while strangers work on it. It prints its port, then serves until stdin closes.
_SERVER = """
import resource, sys
if len(sys.argv) > 2:  # a cap on this process's fds
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]),) * 2)
from ddlcore.security.auth import JobKey
from ddlcore.job.store import StoreServer
srv = StoreServer("127.0.0.1", 0, job_key=JobKey(sys.argv[1].encode(), "job"))
print(srv.port, flush=True)
sys.stdin.read()
srv.close()
"""


class ServerProcess:
    def __init__(self, *limits: str) -> None:
        self.secret = new_secret()
        self.key = JobKey(self.secret.encode(), "job")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, self.secret, *limits],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.port = int(self.proc.stdout.readline())

    def status(self, field: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise KeyError(field)

    def rss_kb(self) -> int:
        return self.status("VmRSS")

    def threads(self) -> int:
        return self.status("Threads")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def client(self, **kw) -> StoreClient:
        return StoreClient("127.0.0.1", self.port, kw.pop("timeout", 10.0), job_key=self.key, **kw)

    def stop(self) -> str:
        """Stop the server; returns what it wrote to stderr."""
        try:  # communicate() closes its stdin: the server's cue to stop
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


@pytest.fixture
def server_process():
    server = ServerProcess()
    yield server
    if server.proc.poll() is None:
        server.stop()


def _settle(read, target, timeout: float = 10.0):
    """Poll ``read()`` until it returns ``target`` (or the timeout); returns the last value."""
    deadline = time.monotonic() + timeout
    value = read()
    while value != target and time.monotonic() < deadline:
        time.sleep(0.05)
        value = read()
    return value


def _request(op: int, key: bytes, value: bytes = b"", arg: int = 0, wait_ms: int = 0) -> bytes:
    return wire.REQUEST.pack(wire.MAGIC, op, 0, len(key), len(value), arg, wait_ms) + key + value


def _authenticated_socket(port: int, key: JobKey, rank: int | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    key.connect(sock, Claim(STORE, src=-1 if rank is None else rank), time.monotonic() + 10)
    return sock


def _hung_up(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the other end closed ``sock`` without sending anything."""
    sock.settimeout(timeout)
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True


# --- without the secret, nothing ---------------------------------------------------------------


def test_a_stranger_cannot_read_overwrite_or_delete_keys():
    secret = new_secret().encode()
    with StoreServer("127.0.0.1", 0, job_key=JobKey(secret, "job")) as server:
        owner = StoreClient(
            "127.0.0.1", server.port, 5.0, rank=0, size=2, job_key=JobKey(secret, "job")
        )
        owner.set("g0/peer/0", b"the real record")
        # Requests without a handshake: the first 8 bytes are not a hello, so hang up.
        for frame in (
            _request(wire.GET, b"g0/peer/0"),
            _request(wire.SET, b"g0/peer/0", b"x"),
            _request(wire.DELETE, b"g0/peer/0"),
            _request(wire.ADD, b"n", arg=5),
        ):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
                raw.sendall(frame)
                assert _hung_up(raw)
        # A handshake with another secret: refused, and the client says what to set.
        with pytest.raises(StoreAuthenticationError) as info:
            StoreClient(
                "127.0.0.1",
                server.port,
                5.0,
                job_key=JobKey(b"guessed", "job", "DDL_SECRET"),
            )
        message = str(info.value)
        assert "DDL_SECRET" in message and "DDL_SECRET_FILE" in message
        assert f"127.0.0.1:{server.port}" in message
        # Another job's key (the same secret, bound to another job) is refused as well.
        with pytest.raises(StoreAuthenticationError):
            StoreClient("127.0.0.1", server.port, 5.0, job_key=JobKey(secret, "other job"))
        # A correct-looking hello with a made-up proof: told "refused", then dropped.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
            claim = Claim(STORE, target=("127.0.0.1", server.port)).encode()
            raw.sendall(_HELLO.pack(_AUTH_MAGIC, 2, len(claim)) + os.urandom(32) + claim)
            assert len(raw.recv(72 + 16, socket.MSG_WAITALL)) == 72 + 16  # challenge + job id
            raw.sendall(
                struct.pack("<IHH", _AUTH_MAGIC, 0, 0)
                + os.urandom(32)
                + _request(wire.DELETE, b"g0/peer/0")
            )
            assert struct.unpack("<IHH", raw.recv(8, socket.MSG_WAITALL)) == (_AUTH_MAGIC, 1, 0)
            assert _hung_up(raw)
        assert owner.get("g0/peer/0") == b"the real record"
        assert not owner.check("n")
        assert server.stats()["pending"] == 0
        owner.close()


def test_a_store_that_cannot_prove_the_key_is_refused_by_the_client():
    """A stranger listening where the store should be (another job's store on that port, or an
    impostor) cannot prove the key: the rank says so instead of talking to it."""
    with StoreServer("127.0.0.1", 0, job_key=JobKey(b"impostor", "job")) as impostor:
        with pytest.raises(StoreAuthenticationError, match="could not prove"):
            StoreClient(
                "127.0.0.1",
                impostor.port,
                5.0,
                rank=2,
                size=4,
                job_key=JobKey(b"the job's secret", "job", "DDL_SECRET_FILE=/x"),
            )


def _allreduce_job(rank, size, flag):
    import ddlcore

    if rank == 1:  # join only once the stranger has tried to take rank 1's place
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
    results = []
    with ddlcore.init(timeout=60) as comm:
        for n in (1, 7, 1009, 65537):
            x = np.random.default_rng([rank, n]).standard_normal(n)
            results.append(comm.allreduce(x).tobytes())
    return results


def _fake_rank(port: int) -> str:
    """Another user's try at rank 1's place (runs as that user): a guessed secret, as soon as
    rank 0's store listens; then a request with no handshake at all."""
    said = []
    fake = None
    try:
        fake = StoreClient(
            "127.0.0.1", port, 30.0, rank=1, size=2, job_key=JobKey(b"guessed", str(port))
        )
    except StoreAuthenticationError:
        said.append("refused")
    if fake is not None:
        fake.set("g0/peer/1", b"evil")
        fake.close()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(_request(wire.SET, b"g0/peer/1", b"evil"))
        if _hung_up(raw):
            said.append("raw hung up")
    return " ".join(said)


def test_a_fake_rank_joining_first_is_refused_and_the_job_stays_exact(tmp_path, stranger):
    """Another user's process claiming rank 1 with a guessed secret is refused and changes
    nothing (a process of the job's own user doing so is taken for a misconfigured rank: the
    next test)."""
    secret, port, flag = new_secret(), free_port(), str(tmp_path / "stranger-tried")
    outcome: dict[str, object] = {}

    def stranger_acts() -> None:
        try:
            outcome["said"] = stranger.run(_fake_rank, port)
        finally:
            open(flag, "w").close()

    thread = threading.Thread(target=stranger_acts)
    thread.start()
    try:
        results = run_ranks(
            _allreduce_job,
            2,
            flag,
            timeout=120,
            env={"DDL_SECRET": secret, "DDL_MASTER_PORT": str(port)},
        )
    finally:
        thread.join(60)
    assert outcome["said"] == "refused raw hung up", outcome
    for i, n in enumerate((1, 7, 1009, 65537)):
        expected = (
            np.random.default_rng([0, n]).standard_normal(n)
            + np.random.default_rng([1, n]).standard_normal(n)
        ).tobytes()
        assert results[0][i] == expected and results[1][i] == expected, n


def _secret_job(rank, size, secrets_by_rank):
    import ddlcore

    os.environ["DDL_SECRET"] = secrets_by_rank[rank]
    t0 = time.monotonic()
    try:
        with ddlcore.init(timeout=600):
            return "joined", time.monotonic() - t0
    except ddlcore.DDLError as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0


def test_ranks_whose_secrets_differ_all_fail_at_once_saying_where_each_came_from():
    """Rank 1 holds another secret: rank 1 is refused, and rank 0 (the store) does not wait out
    its 600 s: the store knows the connector is a process of this user on this host, so it
    fails the job for every rank, naming both secrets' origins."""
    port = free_port()
    results = run_ranks(
        _secret_job,
        2,
        [new_secret(), new_secret()],
        timeout=240,
        env={"DDL_MASTER_PORT": str(port), "DDL_TRANSPORT": "tcp"},
    )
    (said0, took0), (said1, took1) = results
    assert "holds another job secret" in said0 and "rank 1" in said0, said0
    assert "DDL_SECRET" in said0, said0
    assert "AuthenticationError" in said1 and "DDL_SECRET" in said1, said1
    assert took0 < 120 and took1 < 120, results  # not the 600 s timeout


def _claim_rank_1(port: str, secret: str, flag: str, tried: str) -> None:
    """A rank 1 left from an earlier start (same secret, same port): it takes rank 1 as soon as
    the store listens and holds it."""
    from ddlcore.job.store import JobFailedError

    key = JobKey(secret.encode(), port)
    try:
        client = StoreClient("127.0.0.1", int(port), 120.0, rank=1, size=2, job_key=key)
    except Exception as exc:  # noqa: BLE001 - reported through the flag file
        Path(tried).write_text(f"never joined: {exc!r}")
        return
    Path(flag).touch()
    try:
        client.barrier("init", 1, 2, 120.0)
        Path(tried).write_text("the job went on with the stale rank")
    except JobFailedError as exc:
        Path(tried).write_text(f"failed: {exc}")
    finally:
        client.close()


def _real_job(rank, size, flag):
    import ddlcore

    if rank == 1:  # the real rank 1 comes once the stale one holds its place
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
    try:
        with ddlcore.init(timeout=600) as comm:
            comm.barrier()
            return "joined"
    except ddlcore.DDLError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_a_stale_rank_from_an_earlier_start_is_named_and_the_job_fails_at_once(tmp_path):
    """The per-user secret and a fixed port, no launcher: a rank 1 left retrying from an earlier
    start takes rank 1 before the real one. The real rank 1 is refused, saying that two
    processes claim rank 1, and every rank fails at once with that (none waits 600 s)."""
    secret, port = new_secret(), free_port()
    flag, tried = str(tmp_path / "stale-joined"), str(tmp_path / "stale-outcome")
    stale = threading.Thread(target=_claim_rank_1, args=(str(port), secret, flag, tried))
    stale.start()
    try:
        results = run_ranks(
            _real_job,
            2,
            flag,
            timeout=240,
            env={"DDL_SECRET": secret, "DDL_MASTER_PORT": str(port), "DDL_TRANSPORT": "tcp"},
        )
    finally:
        stale.join(180)
    for said in results:
        assert "two processes claim rank 1" in said, results
    assert Path(tried).read_text().startswith("failed: "), Path(tried).read_text()


# --- bounded -----------------------------------------------------------------------------------


def test_an_announced_64_mib_value_allocates_nothing(server_process):
    srv = server_process
    baseline = srv.rss_kb()
    socks = []
    for _ in range(10):
        # Authenticated (the worst case: a stranger does not get past the hello): a header
        # announcing 64 MiB, then a few bytes, then nothing.
        sock = _authenticated_socket(srv.port, srv.key)
        sock.sendall(
            wire.REQUEST.pack(wire.MAGIC, wire.SET, 0, 1, wire.MAX_VALUE_BYTES, 0, 0)
            + b"k"
            + os.urandom(1000)
        )
        socks.append(sock)
        stranger = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        # Without the handshake: the same header is not a hello, and is dropped unread.
        stranger.sendall(wire.REQUEST.pack(wire.MAGIC, wire.SET, 0, 1, wire.MAX_VALUE_BYTES, 0, 0))
        socks.append(stranger)
    time.sleep(0.5)
    grown_mb = (srv.rss_kb() - baseline) / 1024
    assert grown_mb < 10, f"the server grew by {grown_mb:.1f} MB"  # not 640
    for sock in socks:
        sock.close()
    with srv.client() as c:  # still serving
        c.set("after", b"ok")
        assert c.get("after") == b"ok"


def test_abandoned_waits_release_fds_and_threads(server_process):
    srv = server_process
    threads, fds = srv.threads(), srv.fds()  # no client yet
    clients = [srv.client(rank=r, size=50) for r in range(50)]
    waiting = []
    for c in clients:
        sock = c._sock  # the request goes out; its answer will never be read
        sock.sendall(_request(wire.GET, b"never/set", wait_ms=600_000))
        waiting.append(sock)
    time.sleep(0.3)
    assert srv.threads() == threads  # no thread per connection or per wait
    for c in clients:  # leave mid-wait, without a word
        c.close()
    assert _settle(srv.fds, fds) == fds
    assert srv.threads() == threads
    with srv.client() as c:
        c.set("never/set", b"late")  # nobody left to answer: nothing breaks
        assert c.get("never/set") == b"late"


def test_a_huge_timeout_is_clamped_without_a_traceback(server_process):
    srv = server_process
    with srv.client() as waiter, srv.client() as setter:
        # Raw requests with absurd waits (the largest and the most negative i64).
        for wait_ms in (2**63 - 1, -(2**63)):
            with _authenticated_socket(srv.port, srv.key) as sock:
                sock.sendall(_request(wire.GET, b"absurd", wait_ms=wait_ms))
                time.sleep(0.1)
        # Through the client: a timeout far past what any clock can hold.
        threading.Timer(0.3, setter.set, args=("huge", b"arrived")).start()
        assert waiter.get("huge", timeout=1e300) == b"arrived"
        setter.add("count", 1)
        assert waiter.wait_count("count", 1, timeout=float("inf")) == 1
        with pytest.raises(RendezvousError):
            waiter.get("never", timeout=-5)
    err = srv.stop()
    assert "Traceback" not in err and "Error" not in err, err


def test_connection_caps_hold_and_a_real_client_still_gets_in():
    secret = new_secret().encode()
    key = JobKey(secret, "job")
    with StoreServer("127.0.0.1", 0, job_key=key, max_connections=16) as server:
        idle = [
            socket.create_connection(("127.0.0.1", server.port), timeout=10)
            for _ in range(3 * MAX_PENDING_PER_SOURCE)
        ]
        _settle(lambda: server.stats()["connections"], 16)
        stats = server.stats()
        assert stats["pending"] <= 16 and stats["connections"] <= 16, stats
        # A real client gets in: it sheds the oldest idle handshake, or retries.
        clients = [StoreClient("127.0.0.1", server.port, 20.0, job_key=key) for _ in range(16)]
        for c in clients:
            c.set("k", b"v")
        stats = server.stats()
        assert stats["clients"] == 16 and stats["connections"] == 16, stats
        # The total cap: a 17th authenticated connection is not served.
        with pytest.raises(RendezvousError, match="could not reach"):
            StoreClient("127.0.0.1", server.port, 1.0, job_key=key)
        for sock in idle:
            sock.close()
        for c in clients:
            c.close()


def test_a_store_out_of_fds_sheds_strangers_and_keeps_serving():
    """Rank 0 with few fds left: strangers' connections fill them; the store sheds the oldest
    handshakes (or rests its listener) instead of failing, and a real rank still gets in."""
    srv = ServerProcess("24")  # about 10 in use before any stranger comes
    try:
        with srv.client() as first:
            first.set("k", b"v")
            crowd = []
            for _ in range(60):
                try:
                    crowd.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
                except OSError:
                    break
            time.sleep(0.5)
            with srv.client(timeout=20.0) as late:  # sheds a stranger's handshake to get in
                assert late.get("k") == b"v"
            for sock in crowd:
                sock.close()
            assert first.get("k") == b"v"
        err = srv.stop()
        assert "Traceback" not in err, err
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.communicate()


def test_values_are_freed_when_read_by_all_or_when_the_job_leaves():
    key = JobKey(b"s", "job")
    with StoreServer("127.0.0.1", 0, job_key=key) as server:

        def client(rank):
            return StoreClient("127.0.0.1", server.port, 5.0, rank=rank, size=3, job_key=key)

        ranks = [client(r) for r in range(3)]
        # A record every rank reads once: gone after the third read.
        ranks[0].set("peer/0", b"record", readers=3)
        for c in ranks:
            assert c.get("peer/0") == b"record"
        assert not ranks[0].check("peer/0")
        # A completed barrier leaves nothing behind.
        threads = [threading.Thread(target=c.barrier, args=("init",)) for c in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert server.stats()["barriers"] == 0 and server.stats()["keys"] == 0
        # A client that stored 64 MiB and left: its value stays while the job is connected (a
        # peer may still need what a departed rank published, as UCX's lazy wire-up does) ...
        big = client(2)
        big.set("big", bytes(wire.MAX_VALUE_BYTES))
        assert server.stats()["bytes"] >= wire.MAX_VALUE_BYTES
        big.close()
        assert ranks[0].get("big", timeout=5) == bytes(wire.MAX_VALUE_BYTES)
        # ... and goes when the job does: the last client to leave takes everything with it.
        for c in ranks:
            c.close()
        assert _settle(lambda: server.stats()["bytes"], 0) == 0
        assert server.stats()["keys"] == 0


def test_slow_and_idle_connections_do_not_delay_init(tmp_path):
    """Strangers keep the store's handshake slots full (idle ones, and ones sending a byte a
    second) for the whole job: the real ranks still get in and compute exactly."""
    port, stop = free_port(), threading.Event()
    opened = [0]
    hello = _HELLO.pack(_AUTH_MAGIC, 1, 0) + os.urandom(32)
    flag = tmp_path / "go"  # rank 1 joins once the crowd has filled the store's slots

    def crowd() -> None:
        socks: list[list] = []  # [socket, bytes of the hello sent]
        while not stop.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=1)
            except OSError:
                time.sleep(0.05)  # rank 0 not listening yet, or gone
                continue
            if sock.getsockname() == sock.getpeername():
                # Nobody listens yet and the kernel gave this socket the port itself as its own
                # (TCP's self-connect): holding it would keep rank 0 from serving there.
                sock.close()
                continue
            socks.append([sock, 0])
            opened[0] += 1
            if opened[0] == 3 * MAX_PENDING_PER_SOURCE:
                flag.touch()
            for entry in list(socks):  # slow: the next byte of a valid hello, now and then
                try:
                    if entry[1] < len(hello) - 1:
                        entry[0].send(hello[entry[1] : entry[1] + 1])
                        entry[1] += 1
                except OSError:
                    socks.remove(entry)
                    entry[0].close()
            if len(socks) >= 2 * MAX_PENDING_PER_SOURCE:
                socks.pop(0)[0].close()
            time.sleep(0.02)
        for sock, _ in socks:
            sock.close()

    crowds = [threading.Thread(target=crowd) for _ in range(2)]
    for t in crowds:
        t.start()
    try:
        results = run_ranks(
            _allreduce_job,
            2,
            str(flag),
            timeout=120,
            env={"DDL_SECRET": new_secret(), "DDL_MASTER_PORT": str(port)},
        )
    finally:
        stop.set()
        for t in crowds:
            t.join(10)
    assert opened[0] > 3 * MAX_PENDING_PER_SOURCE
    expected = (
        np.random.default_rng([0, 1009]).standard_normal(1009)
        + np.random.default_rng([1, 1009]).standard_normal(1009)
    ).tobytes()
    assert results[0][2] == expected == results[1][2]


# --- MPI: the secret comes from rank 0, over MPI -----------------------------------------------


def _mpi_job(rank, size):
    import ddlcore
    from ddlcore.job.rendezvous import SECRET_ORIGIN_MPI

    assert not os.environ.get("DDL_SECRET") and not os.environ.get("DDL_SECRET_FILE")
    with ddlcore.init(timeout=60) as comm:
        assert comm.source == "mpich" and comm._store.job_key.origin == SECRET_ORIGIN_MPI
        x = np.random.default_rng([rank, 7]).standard_normal(1009)
        return comm.allreduce(x).tobytes()


_MPI_ENV = {
    v: None
    for v in (
        "DDL_SIZE",
        "DDL_MASTER_ADDR",
        "DDL_MASTER_PORT",
        "DDL_LOCAL_SIZE",
        "DDL_SECRET",
        "DDL_SECRET_FILE",
    )
}


def test_mpiexec_job_without_a_secret_gets_one_from_rank_0():
    require(mpiexec_path() is not None, "mpiexec is not installed (pip install 'ddlcore[mpi]')")
    results = run_ranks(_mpi_job, 2, launcher="mpiexec", env=_MPI_ENV, timeout=120)
    expected = (
        np.random.default_rng([0, 7]).standard_normal(1009)
        + np.random.default_rng([1, 7]).standard_normal(1009)
    ).tobytes()
    assert results == [expected, expected]


def _mpi_init_error(rank, size):
    import ddlcore

    t0 = time.monotonic()
    try:
        ddlcore.init(timeout=30)
    except ddlcore.DDLError as exc:
        return str(exc), time.monotonic() - t0
    return "joined", time.monotonic() - t0


@pytest.mark.parametrize("case", ["rank 0 only", "rank 1 only", "rank 0's file unreadable"])
def test_mpiexec_ranks_that_disagree_on_the_secret_all_fail_at_once(case, tmp_path):
    """Under MPI, ranks whose own secrets disagree with rank 0's choice (or a rank 0 that cannot
    read its DDL_SECRET_FILE) fail together at init, saying why: nobody waits out the timeout,
    nobody silently drops its own secret."""
    require(mpiexec_path() is not None, "mpiexec is not installed (pip install 'ddlcore[mpi]')")
    rank_envs = {
        "rank 0 only": {0: {"DDL_SECRET": new_secret()}},
        "rank 1 only": {1: {"DDL_SECRET": new_secret()}},
        "rank 0's file unreadable": {0: {"DDL_SECRET_FILE": str(tmp_path / "none")}},
    }[case]
    results = run_ranks(
        _mpi_init_error, 2, launcher="mpiexec", env=_MPI_ENV, rank_envs=rank_envs, timeout=120
    )
    for rank, (message, elapsed) in enumerate(results):
        assert elapsed < 15, (rank, message, elapsed)
        if case == "rank 0's file unreadable":
            expected = "DDL_SECRET_FILE" if rank == 0 else "rank 0 cannot read the job's secret"
        else:
            expected = "the ranks disagree on the job's secret"
        assert expected in message, (rank, message)
