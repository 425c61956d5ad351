"""The job-key handshake (``ddlcore.security.auth``, claims in ``ddlcore.security.claims``): the right key
passes both ways and the claim arrives whole; a wrong key or a tampered claim is refused on both
ends; a claim for another service, another start of the job or another address is refused before
anything is proven; malformed hellos are refused before anything else is read; deadlines hold
against a peer that dribbles bytes; and where the secret comes from."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from unittest.mock import patch

import pytest

from ddlcore.errors import DDLError
from ddlcore.security.auth import (
    MAX_CLAIM_BYTES,
    NONCE_BYTES,
    Acceptor,
    AuthenticationError,
    HandshakeRefused,
    JobKey,
    job_secret,
    new_secret,
)
from ddlcore.security.claims import STORE, TCP, Claim, peer_uid

_HELLO = struct.Struct("<IHH")
_MAGIC = 0xDD1A7E57


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    return a, b


def _handshake(
    connector: JobKey,
    acceptor: JobKey,
    claim: Claim | None = None,
    timeout: float = 5.0,
    service: str = TCP,
    **accept_kw: object,
) -> tuple[object, object]:
    """Run both ends on a socket pair; returns (connect's outcome, accept's outcome)."""
    claim = claim or Claim(TCP, src=3, dst=4, size=8)
    a, b = _pair()
    outcome: dict[str, object] = {}

    def accept() -> None:
        try:
            outcome["accept"] = acceptor.accept(b, time.monotonic() + timeout, service, **accept_kw)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcome["accept"] = exc

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        outcome["connect"] = connector.connect(a, claim, time.monotonic() + timeout)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        outcome["connect"] = exc
    a.close()  # as a caller does after a failed handshake
    thread.join(timeout + 5)
    b.close()
    return outcome["connect"], outcome["accept"]


def test_the_right_key_passes_and_the_claim_arrives():
    secret = new_secret().encode()
    claim = Claim(TCP, src=3, dst=4, size=8, origin="DDL_SECRET", extra=b"\x01\x02")
    answer, got = _handshake(
        JobKey(secret, "5000"), JobKey(secret, "5000"), claim, answer=b"job id here"
    )
    assert answer == b"job id here"
    assert isinstance(got, Claim)
    assert (got.service, got.src, got.dst, got.size, got.extra) == (TCP, 3, 4, 8, b"\x01\x02")
    assert got.pid == os.getpid() and got.origin == "DDL_SECRET"


def test_claims_round_trip_and_malformed_ones_decode_to_none():
    claim = Claim(
        STORE, src=1, dst=-1, size=2, job_id=b"j" * 16, target=("::1", 29500), origin="o" * 300
    )
    back = Claim.decode(claim.encode())
    assert back is not None and back.target == ("::1", 29500) and back.job_id == b"j" * 16
    assert back.origin == "o" * 120  # cut to its cap
    v4 = Claim.decode(Claim(TCP, target=("127.0.0.1", 7)).encode())
    assert v4 is not None and v4.target == ("127.0.0.1", 7)
    raw = claim.encode()
    assert Claim.decode(raw[:-1]) is None and Claim.decode(raw + b"x") is None
    assert Claim.decode(b"garbage") is None
    assert Claim.decode(b"nostore\0" + raw[8:]) is None  # an unknown service
    assert len(raw) <= MAX_CLAIM_BYTES


@pytest.mark.parametrize(
    "acceptor_secret, acceptor_job",
    [
        (b"another secret", "5000"),  # a stranger, or a rank given another secret
        (None, "5001"),  # the same secret, another job (port)
    ],
)
def test_a_wrong_key_is_refused_on_both_ends(acceptor_secret, acceptor_job):
    secret = new_secret().encode()
    connected, accepted = _handshake(
        JobKey(secret, "5000", "DDL_SECRET"), JobKey(acceptor_secret or secret, acceptor_job)
    )
    # The connector finds that the acceptor cannot prove the key, and says so; the acceptor
    # sees no proof, and learns why.
    assert isinstance(connected, AuthenticationError), connected
    assert "DDL_SECRET" in str(connected)
    assert isinstance(accepted, AuthenticationError), accepted
    assert "could not check our proof" in str(accepted)


def test_the_acceptor_notes_a_mismatch_and_the_connector_learns_its_proof_was_refused():
    """An acceptor that proves a key it does not hold cannot exist; check the refusal path of
    the verdict with an acceptor that holds the key but whose connector lies about its proof."""
    key = JobKey(new_secret().encode(), "5000")
    acceptor = key.acceptor(TCP)
    claim = Claim(TCP, src=0, dst=1, size=2).encode()
    acceptor.feed(_HELLO.pack(_MAGIC, 2, len(claim)))
    challenge = acceptor.feed(os.urandom(NONCE_BYTES) + claim)
    assert struct.unpack_from("<IHH", challenge) == (_MAGIC, 0, 0)
    verdict = acceptor.feed(struct.pack("<IHH", _MAGIC, 0, 0) + os.urandom(32))  # not the MAC
    assert struct.unpack("<IHH", verdict) == (_MAGIC, 1, 0)  # refused: wrong proof
    assert acceptor.mismatch and acceptor.error == "wrong proof of the job's secret"
    assert acceptor.unproven is not None and acceptor.unproven.src == 0 and acceptor.claim is None


@pytest.mark.parametrize(
    "claim, service, why",
    [
        (Claim(STORE, src=1, size=2), TCP, "serves tcp, not store"),  # another service
        (Claim(TCP, src=0, dst=1, size=2, target=("127.0.0.1", 1)), TCP, "dialled 127.0.0.1:1"),
        (Claim(TCP, src=0, dst=1, size=2, job_id=b"o" * 16), TCP, "another start of this job"),
    ],
)
def test_a_claim_not_for_this_listener_gets_no_proof(claim, service, why):
    """Refused before anything is proven: the connector hears why (unproven), and a relay
    never holds a proof it could show elsewhere."""
    key = JobKey(b"s", "1")
    key.job_id = b"j" * 16
    acceptor = key.acceptor(service)
    raw = claim.encode()
    acceptor.feed(_HELLO.pack(_MAGIC, 2, len(raw)))
    reply = acceptor.feed(os.urandom(NONCE_BYTES) + raw)
    magic, status, nbody = struct.unpack_from("<IHH", reply)
    assert (magic, status) == (_MAGIC, 1) and why in acceptor.error
    assert reply[8:72] == bytes(64)  # no nonce, no MAC: nothing proven
    assert why.encode() in reply[72 : 72 + nbody]
    if claim.target != ("", 0):
        return  # connect() aims the claim at where its socket is connected: shown below
    # Over a socket, the connector raises HandshakeRefused with the listener's reason.
    connected, accepted = _handshake(key, key, claim, service=service)
    assert isinstance(connected, HandshakeRefused) and not connected.proven, connected
    assert why in connected.reason
    assert isinstance(accepted, AuthenticationError)


def test_a_service_refuses_after_both_proofs_with_its_reason():
    key = JobKey(b"s", "1")
    connected, accepted = _handshake(key, key, confirm=lambda claim: "rank 3 is taken")
    assert isinstance(connected, HandshakeRefused) and connected.proven, connected
    assert connected.reason == "rank 3 is taken"
    assert isinstance(accepted, AuthenticationError)


def test_the_address_dialled_is_bound_into_the_claim():
    """Over TCP the claim carries the address the connector reached; a listener accepts it only
    where it arrived (a relay at another address would be refused)."""
    key = JobKey(new_secret().encode(), "1")
    listener = socket.create_server(("127.0.0.1", 0))
    seen: dict[str, object] = {}

    def accept() -> None:
        conn, _ = listener.accept()
        with conn:
            seen["claim"] = key.accept(conn, time.monotonic() + 10, TCP)

    thread = threading.Thread(target=accept)
    thread.start()
    with socket.create_connection(listener.getsockname(), timeout=10) as sock:
        key.connect(sock, Claim(TCP, src=0, dst=1, size=2), time.monotonic() + 10)
    thread.join(10)
    address = listener.getsockname()[:2]
    listener.close()
    claim = seen["claim"]
    assert isinstance(claim, Claim) and claim.target == address


def test_peer_uid_names_the_owner_of_a_local_connection():
    listener = socket.create_server(("127.0.0.1", 0))
    with socket.create_connection(listener.getsockname(), timeout=10) as sock:
        conn, _ = listener.accept()
        with conn:
            assert peer_uid(conn) == os.getuid()
            assert peer_uid(sock) == os.getuid()
    listener.close()
    a, b = _pair()
    assert peer_uid(a) is None  # not TCP
    a.close()
    b.close()


def test_peer_uid_believes_no_closed_socket():
    """A closed socket's row (FIN_WAIT2, TIME_WAIT) says uid 0 and no inode whoever held it:
    a stranger that closes at once must not pass for root's own process."""
    listener = socket.create_server(("127.0.0.1", 0))
    sock = socket.create_connection(listener.getsockname(), timeout=10)
    conn, _ = listener.accept()
    sock.close()  # the connector is gone; its row lingers without an owner
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and conn.recv(1):
        pass
    with conn:
        assert peer_uid(conn) is None
    listener.close()


def test_a_tampered_claim_is_refused():
    """A man in the middle rewrites the claim in the hello (rank 3 -> rank 0): the MACs cover
    the claim, so neither end accepts."""
    secret = new_secret().encode()
    key = JobKey(secret, "5000")
    conn_end, mitm_in = _pair()
    mitm_out, acc_end = _pair()
    outcome: dict[str, object] = {}
    nclaim = len(Claim(TCP, src=3, dst=4, size=8).encode())

    def relay() -> None:
        hello = bytearray(mitm_in.recv(8 + NONCE_BYTES + nclaim, socket.MSG_WAITALL))
        src_at = 8 + NONCE_BYTES + 8 + 16  # service, job id, then src
        hello[src_at : src_at + 4] = struct.pack("<i", 0)
        mitm_out.sendall(bytes(hello))
        mitm_in.sendall(mitm_out.recv(72, socket.MSG_WAITALL))  # challenge back
        proof = mitm_in.recv(40, socket.MSG_WAITALL)  # "your proof is wrong", or nothing
        if proof:
            mitm_out.sendall(proof)
        mitm_out.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        try:
            outcome["accept"] = key.accept(acc_end, time.monotonic() + 3, TCP)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcome["accept"] = exc

    threads = [threading.Thread(target=relay), threading.Thread(target=accept)]
    for t in threads:
        t.start()
    with pytest.raises(AuthenticationError):
        key.connect(conn_end, Claim(TCP, src=3, dst=4, size=8), time.monotonic() + 3)
    conn_end.close()
    for t in threads:
        t.join(10)
    assert not isinstance(outcome["accept"], Claim), outcome  # never "rank 0"
    for s in (mitm_in, mitm_out, acc_end):  # after the threads: none reads a closed socket
        s.close()


@pytest.mark.parametrize(
    "hello",
    [
        b"GET / HTTP/1.1\r\n",  # not our protocol
        _HELLO.pack(_MAGIC, 2, MAX_CLAIM_BYTES + 1),  # claim too long
        _HELLO.pack(0x12345678, 2, 4),  # wrong magic
    ],
)
def test_malformed_hellos_are_refused_from_their_first_8_bytes(hello):
    key = JobKey(b"s", "1")
    acceptor = key.acceptor(TCP)
    assert acceptor.wants == 8
    assert acceptor.feed(hello[:8]) == b""
    assert acceptor.error == "malformed hello" and acceptor.claim is None and acceptor.wants == 0
    a, b = _pair()
    a.sendall(hello)
    with pytest.raises(AuthenticationError, match="malformed hello"):
        key.accept(b, time.monotonic() + 2, TCP)
    a.close()
    b.close()


@pytest.mark.parametrize("version", [1, 99])
def test_another_handshake_version_is_told_so(version):
    """An older (or newer) ddlcore's hello is refused with a reason its connector can print."""
    acceptor = JobKey(b"s", "1").acceptor(TCP)
    reply = acceptor.feed(_HELLO.pack(_MAGIC, version, 10))
    assert f"handshake version {version}" in acceptor.error
    assert b"same ddlcore version" in reply[72:]


def test_acceptor_asks_for_bounded_amounts_and_checks_what_it_is_fed():
    acceptor = Acceptor(JobKey(b"s", "1"), TCP)
    assert acceptor.feed(_HELLO.pack(_MAGIC, 2, MAX_CLAIM_BYTES)) == b""
    assert acceptor.wants == NONCE_BYTES + MAX_CLAIM_BYTES
    with pytest.raises(ValueError, match="wanted"):
        acceptor.feed(b"short")


def test_the_deadline_holds_against_a_byte_at_a_time_sender():
    key = JobKey(b"s", "1")
    a, b = _pair()
    stop = threading.Event()
    hello = _HELLO.pack(_MAGIC, 2, 0) + os.urandom(NONCE_BYTES)

    def dribble() -> None:
        for byte in hello:
            if stop.wait(0.1):
                return
            try:
                a.send(bytes([byte]))
            except OSError:
                return

    thread = threading.Thread(target=dribble)
    thread.start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        key.accept(b, t0 + 0.5, TCP)  # 40 bytes at 10 per second would take 4 s
    elapsed = time.monotonic() - t0
    stop.set()
    thread.join(5)
    a.close()
    b.close()
    assert elapsed < 3.0, elapsed  # the deadline, not the sender, decided


def test_the_key_is_never_printed():
    key = JobKey(b"top secret", "5000", "DDL_SECRET")
    assert "top secret" not in repr(key) and "DDL_SECRET" in repr(key)


# --- where the secret comes from ---------------------------------------------------------------


def _clean_env(tmp_path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    env.update(extra)
    return env


def _secret_file(tmp_path, content: bytes, mode: int = 0o600):
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_secret_precedence_env_then_file_then_per_user(tmp_path):
    path = _secret_file(tmp_path, b"from-file\n")
    with patch.dict(
        os.environ,
        _clean_env(tmp_path, DDL_SECRET="from-env", DDL_SECRET_FILE=str(path)),
        clear=True,
    ):
        assert job_secret() == (b"from-env", "DDL_SECRET")
    with patch.dict(os.environ, _clean_env(tmp_path, DDL_SECRET_FILE=str(path)), clear=True):
        assert job_secret() == (b"from-file", f"DDL_SECRET_FILE={path}")
    with patch.dict(os.environ, _clean_env(tmp_path), clear=True):
        secret, origin = job_secret()
        assert job_secret() == (secret, origin)  # created once, then reused
        user_file = tmp_path / "config" / "ddlcore" / "secret"
        assert origin == str(user_file) and len(secret) == 64
        assert stat.S_IMODE(user_file.stat().st_mode) == 0o600
    # An explicit mapping is read instead of os.environ.
    assert job_secret({"DDL_SECRET": "given"}) == (b"given", "DDL_SECRET")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_secret_file_others_can_read_is_refused(tmp_path, mode):
    path = _secret_file(tmp_path, b"s3cret", mode)
    with pytest.raises(DDLError, match=rf"chmod 600 {path}"):
        job_secret(_clean_env(tmp_path, DDL_SECRET_FILE=str(path)))


def test_a_secret_file_that_is_not_a_regular_file_is_refused(tmp_path):
    with pytest.raises(DDLError, match="not a regular file"):
        job_secret(_clean_env(tmp_path, DDL_SECRET_FILE=str(tmp_path)))


def test_an_empty_or_missing_secret_file_is_an_error(tmp_path):
    with pytest.raises(DDLError, match="is empty"):
        job_secret(_clean_env(tmp_path, DDL_SECRET_FILE=str(_secret_file(tmp_path, b"\n"))))
    with pytest.raises(DDLError, match="cannot be read"):
        job_secret(_clean_env(tmp_path, DDL_SECRET_FILE=str(tmp_path / "nope")))


def test_new_secrets_are_fresh():
    assert len({new_secret() for _ in range(100)}) == 100
    assert len(new_secret()) == 64
