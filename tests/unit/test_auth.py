"""The job-key handshake (``ddlcore.job.auth``): the right key passes both ways, a wrong key or a
tampered claim is refused on both ends, malformed hellos are refused before anything else is
read, deadlines hold against a peer that dribbles bytes, and where the secret comes from."""

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
from ddlcore.job.auth import (
    MAX_CLAIM_BYTES,
    NONCE_BYTES,
    Acceptor,
    AuthenticationError,
    JobKey,
    job_secret,
    new_secret,
)

_HELLO = struct.Struct("<IHH")
_MAGIC = 0xDD1A7E57


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    return a, b


def _handshake(
    connector: JobKey, acceptor: JobKey, claim: bytes = b"rank 3", timeout: float = 5.0
) -> tuple[object, object]:
    """Run both ends on a socket pair; returns (connect's outcome, accept's outcome)."""
    a, b = _pair()
    outcome: dict[str, object] = {}

    def accept() -> None:
        try:
            outcome["accept"] = acceptor.accept(b, time.monotonic() + timeout)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcome["accept"] = exc

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        connector.connect(a, claim, time.monotonic() + timeout)
        outcome["connect"] = None
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        outcome["connect"] = exc
    a.close()  # as a caller does after a failed handshake
    thread.join(timeout + 5)
    b.close()
    return outcome["connect"], outcome["accept"]


def test_the_right_key_passes_and_the_claim_arrives():
    secret = new_secret().encode()
    connected, claim = _handshake(JobKey(secret, "5000"), JobKey(secret, "5000"), b"rank 3")
    assert connected is None and claim == b"rank 3"
    connected, claim = _handshake(JobKey(secret, "5000"), JobKey(secret, "5000"), b"")
    assert connected is None and claim == b""


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
    # The connector finds that the acceptor cannot prove the key; the acceptor sees no proof.
    assert isinstance(connected, AuthenticationError), connected
    assert "DDL_SECRET" in str(connected)
    assert isinstance(accepted, (AuthenticationError, ConnectionError)), accepted


def test_the_connector_learns_its_proof_was_refused():
    """An acceptor that proves a key it does not hold cannot exist; check the refusal path of
    the verdict with an acceptor that holds the key but whose connector lies about its proof."""
    secret = new_secret().encode()
    key = JobKey(secret, "5000")
    a, b = _pair()
    result: dict[str, object] = {}

    def accept() -> None:
        try:
            result["claim"] = key.accept(b, time.monotonic() + 5)
        except AuthenticationError as exc:
            result["error"] = exc

    thread = threading.Thread(target=accept)
    thread.start()
    a.sendall(_HELLO.pack(_MAGIC, 1, 6) + os.urandom(NONCE_BYTES) + b"rank 0")
    challenge = a.recv(8 + 64, socket.MSG_WAITALL)
    assert len(challenge) == 72
    a.sendall(os.urandom(32))  # not the MAC
    verdict = a.recv(8, socket.MSG_WAITALL)
    thread.join(10)
    assert struct.unpack("<II", verdict) == (_MAGIC, 1)  # refused
    assert "wrong proof" in str(result["error"])
    a.close()
    b.close()


def test_a_tampered_claim_is_refused():
    """A man in the middle rewrites the claim in the hello (rank 3 -> rank 0): the MACs cover
    the claim, so neither end accepts."""
    secret = new_secret().encode()
    key = JobKey(secret, "5000")
    conn_end, mitm_in = _pair()
    mitm_out, acc_end = _pair()
    outcome: dict[str, object] = {}

    def relay() -> None:
        hello = mitm_in.recv(8 + NONCE_BYTES + 6, socket.MSG_WAITALL)
        mitm_out.sendall(hello[:-6] + b"rank 0")
        mitm_in.sendall(mitm_out.recv(72, socket.MSG_WAITALL))  # challenge back
        proof = mitm_in.recv(32, socket.MSG_WAITALL)  # none: the connector saw through it
        if proof:
            mitm_out.sendall(proof)
            mitm_in.sendall(mitm_out.recv(8, socket.MSG_WAITALL))
        mitm_out.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        try:
            outcome["accept"] = key.accept(acc_end, time.monotonic() + 3)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcome["accept"] = exc

    threads = [threading.Thread(target=relay), threading.Thread(target=accept)]
    for t in threads:
        t.start()
    with pytest.raises(AuthenticationError):
        key.connect(conn_end, b"rank 3", time.monotonic() + 3)
    conn_end.close()  # the relay's read of a proof ends (no proof): it shuts its side down
    for t in threads:
        t.join(10)
    assert not isinstance(outcome["accept"], bytes), outcome  # never "rank 0"
    for s in (mitm_in, mitm_out, acc_end):  # after the threads: none reads a closed socket
        s.close()


@pytest.mark.parametrize(
    "hello",
    [
        b"GET / HTTP/1.1\r\n",  # not our protocol
        _HELLO.pack(_MAGIC, 99, 0),  # unknown version
        _HELLO.pack(_MAGIC, 1, MAX_CLAIM_BYTES + 1),  # claim too long
        _HELLO.pack(0x12345678, 1, 4),  # wrong magic
    ],
)
def test_malformed_hellos_are_refused_from_their_first_8_bytes(hello):
    key = JobKey(b"s", "1")
    acceptor = key.acceptor()
    assert acceptor.wants == 8
    assert acceptor.feed(hello[:8]) == b""
    assert acceptor.error == "malformed hello" and acceptor.claim is None and acceptor.wants == 0
    a, b = _pair()
    a.sendall(hello)
    with pytest.raises(AuthenticationError, match="malformed hello"):
        key.accept(b, time.monotonic() + 2)
    a.close()
    b.close()


def test_acceptor_asks_for_bounded_amounts_and_checks_what_it_is_fed():
    acceptor = Acceptor(JobKey(b"s", "1"))
    assert acceptor.feed(_HELLO.pack(_MAGIC, 1, MAX_CLAIM_BYTES)) == b""
    assert acceptor.wants == NONCE_BYTES + MAX_CLAIM_BYTES
    with pytest.raises(ValueError, match="wanted"):
        acceptor.feed(b"short")


def test_the_deadline_holds_against_a_byte_at_a_time_sender():
    key = JobKey(b"s", "1")
    a, b = _pair()
    stop = threading.Event()
    hello = _HELLO.pack(_MAGIC, 1, 0) + os.urandom(NONCE_BYTES)

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
        key.accept(b, t0 + 0.5)  # 40 bytes at 10 per second would take 4 s
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


def test_an_empty_or_missing_secret_file_is_an_error(tmp_path):
    with pytest.raises(DDLError, match="is empty"):
        job_secret(_clean_env(tmp_path, DDL_SECRET_FILE=str(_secret_file(tmp_path, b"\n"))))
    with pytest.raises(DDLError, match="cannot be read"):
        job_secret(_clean_env(tmp_path, DDL_SECRET_FILE=str(tmp_path / "nope")))


def test_new_secrets_are_fresh():
    assert len({new_secret() for _ in range(100)}) == 100
    assert len(new_secret()) == 64
