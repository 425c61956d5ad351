"""Authenticated connections: before anything else on a socket is acted on, both ends prove that
they hold the job's secret, and the connecting end's claim (who it is, where it connects) is
bound into that proof. The rendezvous store and the TCP transport run this on every connection.

Where the secret comes from (`job_secret`), first match wins: ``DDL_SECRET``; the file named by
``DDL_SECRET_FILE``; otherwise a per-user secret kept in ``~/.config/ddlcore/secret`` (created
0600 on first use), which every job of one user on one host (or on hosts sharing a home
directory) shares. ddlrun exports a fresh ``DDL_SECRET`` for each job; under an MPI launcher,
rank 0 draws one and broadcasts it over MPI with the store's address (``rendezvous``).

Handshake (after the TCP connection; nonces fresh on both sides, HMAC-SHA256, constant-time
comparison; ``key`` = HMAC(secret, job), so one secret serves many jobs without crossing them)::

    connector                                                acceptor
      HELLO  magic u32 | version u16 | claim length u16 | nonce_c[32] | claim  ->
                                        <-  CHALLENGE  magic u32 | 0 u32 | nonce_a[32] | mac_a[32]
      (checks mac_a = HMAC(key, "accept" | claim | nonce_c | nonce_a): the acceptor knows the key)
      PROOF  mac_c[32] = HMAC(key, "connect" | claim | nonce_c | nonce_a)  ->
                                        <-  VERDICT  magic u32 | status u32 (0 ok, 1 refused)

A claim is at most `MAX_CLAIM_BYTES`, read only after its length is checked; nothing here
allocates what a peer announces beyond that. `JobKey.accept` serves one socket, blocking until a
deadline; `Acceptor` is the same acceptor side without I/O, for a server that runs many
handshakes from one event loop (the rendezvous store). Payloads after the handshake are not encrypted or
authenticated: an attacker on the network path is out of scope (see SECURITY.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path

from ddlcore import config
from ddlcore.errors import DDLError

PROTOCOL_VERSION = 1
MAX_CLAIM_BYTES = 256
NONCE_BYTES = 32
MAC_BYTES = 32

_MAGIC = 0xDD1A7E57
_HELLO = struct.Struct("<IHH")
_CHALLENGE = struct.Struct("<II")
_VERDICT = struct.Struct("<II")
_OK, _REFUSED = 0, 1
_KEY_LABEL = b"ddlcore job key v1\0"
_SECRET_BYTES = 32
_ADVICE = (
    "Give every rank the same DDL_SECRET or DDL_SECRET_FILE (ddlrun and mpiexec provide "
    "one themselves; under torchrun, srun or by hand, set one)"
)


class AuthenticationError(DDLError):
    """A connection did not prove knowledge of the job's secret (or we could not prove ours to
    it): the ends hold different secrets, or the other end is not part of this job."""


def _user_secret_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "ddlcore" / "secret"


def _user_secret() -> tuple[bytes, str]:
    """The per-user secret file's contents, creating it (0600, atomically) on first use."""
    path = _user_secret_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            tmp = path.with_name(f".secret.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, secrets.token_hex(_SECRET_BYTES).encode() + b"\n")
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # fails if another rank created it first: theirs wins
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        return _read_secret_file(path, "the per-user secret"), str(path)
    except OSError as exc:
        raise DDLError(
            f"no job secret is set and the per-user secret {path} cannot be used ({exc}); set "
            "DDL_SECRET, or DDL_SECRET_FILE to a file only you can read (ddlrun and mpiexec "
            "provide one themselves)"
        ) from None


def _read_secret_file(path: Path, what: str) -> bytes:
    mode = path.stat().st_mode
    if mode & 0o077:
        raise DDLError(
            f"{what} {path} can be read by other users (mode {mode & 0o777:o}); "
            f"run: chmod 600 {path}"
        )
    raw = path.read_bytes().strip()
    if not raw:
        raise DDLError(f"{what} {path} is empty")
    return raw


def job_secret(environ: Mapping[str, str] | None = None) -> tuple[bytes, str]:
    """The job's secret and where it came from (for messages: never the secret itself).

    Raises
    ------
    DDLError
        ``DDL_SECRET_FILE`` is unreadable, empty or readable by others; or no secret is set and
        the per-user secret cannot be created.
    """
    secret = config.get("DDL_SECRET", environ)
    if secret:
        return secret.encode(), "DDL_SECRET"
    path = config.get("DDL_SECRET_FILE", environ)
    if path:
        try:
            return _read_secret_file(Path(path), "DDL_SECRET_FILE"), f"DDL_SECRET_FILE={path}"
        except OSError as exc:
            raise DDLError(
                f"DDL_SECRET_FILE={path} cannot be read ({exc.strerror or exc})"
            ) from None
    return _user_secret()


def new_secret() -> str:
    """A fresh random secret, as launchers export it in ``DDL_SECRET``."""
    return secrets.token_hex(_SECRET_BYTES)


class JobKey:
    """The key of one job (its secret bound to the job's name) and the handshake that proves it.

    Parameters
    ----------
    secret : bytes
        The shared secret (see `job_secret`).
    job : str
        What distinguishes this job from others sharing the secret (the store's port).
    origin : str
        Where the secret came from, for error messages.
    """

    def __init__(self, secret: bytes, job: str, origin: str = "") -> None:
        self._key = hmac.new(secret, _KEY_LABEL + job.encode(), hashlib.sha256).digest()
        self.job = job
        self.origin = origin

    def __repr__(self) -> str:
        return f"JobKey(job={self.job!r}, origin={self.origin!r})"  # never the key

    def _mac(self, label: bytes, claim: bytes, nonce_c: bytes, nonce_a: bytes) -> bytes:
        return hmac.new(
            self._key, label + b"\0" + claim + nonce_c + nonce_a, hashlib.sha256
        ).digest()

    def derive(self, label: bytes, data: bytes) -> bytes:
        """32 bytes that only holders of the key can compute, ``HMAC(key, label | 0 | data)``
        (``label`` other than the handshake's own): for transports that authenticate messages
        rather than connections (ucx)."""
        if label in (b"accept", b"connect"):
            raise ValueError(f"label {label!r} is the handshake's own")
        return hmac.new(self._key, label + b"\0" + data, hashlib.sha256).digest()

    def connect(self, sock: socket.socket, claim: bytes, deadline: float) -> None:
        """Prove ``claim`` to the acceptor at the other end of ``sock``, and check its proof.

        Raises
        ------
        AuthenticationError
            The other end does not know the key, or refused ours.
        ConnectionError, TimeoutError, OSError
            The connection broke or ``deadline`` (``time.monotonic()``) passed.
        """
        if len(claim) > MAX_CLAIM_BYTES:
            raise ValueError(f"claim of {len(claim)} bytes (at most {MAX_CLAIM_BYTES})")
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        _settimeout(sock, deadline)
        sock.sendall(_HELLO.pack(_MAGIC, PROTOCOL_VERSION, len(claim)) + nonce_c + claim)
        challenge = _recv(sock, _CHALLENGE.size + NONCE_BYTES + MAC_BYTES, deadline)
        magic, _ = _CHALLENGE.unpack_from(challenge)
        if magic != _MAGIC:
            raise AuthenticationError("the other end does not speak ddlcore's handshake")
        nonce_a = challenge[_CHALLENGE.size : _CHALLENGE.size + NONCE_BYTES]
        mac_a = challenge[_CHALLENGE.size + NONCE_BYTES :]
        if not hmac.compare_digest(mac_a, self._mac(b"accept", claim, nonce_c, nonce_a)):
            raise AuthenticationError(
                "the other end could not prove it holds this job's secret: it belongs to another "
                f"job, or holds another secret (ours is from {self.origin or 'unknown'}). "
                + _ADVICE
            )
        sock.sendall(self._mac(b"connect", claim, nonce_c, nonce_a))
        magic, status = _VERDICT.unpack(_recv(sock, _VERDICT.size, deadline))
        if magic != _MAGIC or status != _OK:
            raise AuthenticationError(
                "the other end refused our proof of the job's secret: the ranks hold different "
                f"secrets (ours is from {self.origin or 'unknown'}). " + _ADVICE
            )

    def acceptor(self) -> Acceptor:
        """The acceptor's side of one handshake as a state machine over bytes (`Acceptor`), for
        servers that serve many connections from one event loop."""
        return Acceptor(self)

    def accept(self, sock: socket.socket, deadline: float) -> bytes:
        """Check the proof of a connector on ``sock``; returns its claim once proven.

        Raises
        ------
        AuthenticationError
            Malformed hello, or a wrong proof (the connector was told "refused").
        ConnectionError, TimeoutError, OSError
            The connection broke or ``deadline`` passed.
        """
        acceptor = Acceptor(self)
        while acceptor.claim is None:
            reply = acceptor.feed(_recv(sock, acceptor.wants, deadline))
            if acceptor.error is not None:
                if reply:
                    try:
                        sock.sendall(reply)
                    except OSError:
                        pass
                raise AuthenticationError(acceptor.error)
            if reply:
                _settimeout(sock, deadline)
                sock.sendall(reply)
        return acceptor.claim


class Acceptor:
    """The acceptor's side of the handshake, without I/O: `feed` it exactly `wants` bytes
    received from the connector, send back what it returns, until `claim` is set (proven) or
    `error` is (send the returned bytes, if any, then drop the connection).

    It never asks for more than `MAX_CLAIM_BYTES` + `NONCE_BYTES` bytes at a time, so a caller
    that reads what it wants allocates nothing a peer merely announces, and it judges the hello's
    first 8 bytes before asking for the rest, so garbage is refused as soon as it arrives.
    """

    __slots__ = (
        "_key",
        "_step",
        "wants",
        "claim",
        "error",
        "_nonce_c",
        "_nonce_a",
        "_pending_claim",
    )

    def __init__(self, key: JobKey) -> None:
        self._key = key
        self._step = 0  # 0: hello header, 1: nonce and claim, 2: proof, 3: done or failed
        self.wants = _HELLO.size
        self.claim: bytes | None = None
        self.error: str | None = None
        self._nonce_c = self._nonce_a = self._pending_claim = b""

    def feed(self, data: bytes) -> bytes:
        """Take the `wants` bytes asked for; returns the bytes to send back (maybe none)."""
        if len(data) != self.wants or self._step == 3:
            raise ValueError(f"fed {len(data)} bytes, wanted {self.wants} (step {self._step})")
        if self._step == 0:
            magic, version, nclaim = _HELLO.unpack(data)
            if magic != _MAGIC or version != PROTOCOL_VERSION or nclaim > MAX_CLAIM_BYTES:
                return self._fail("malformed hello", b"")
            self._step, self.wants = 1, NONCE_BYTES + nclaim
            return b""
        if self._step == 1:
            self._nonce_c, self._pending_claim = (
                bytes(data[:NONCE_BYTES]),
                bytes(data[NONCE_BYTES:]),
            )
            self._nonce_a = secrets.token_bytes(NONCE_BYTES)
            self._step, self.wants = 2, MAC_BYTES
            return (
                _CHALLENGE.pack(_MAGIC, 0)
                + self._nonce_a
                + self._key._mac(b"accept", self._pending_claim, self._nonce_c, self._nonce_a)
            )
        expected = self._key._mac(b"connect", self._pending_claim, self._nonce_c, self._nonce_a)
        if not hmac.compare_digest(bytes(data), expected):
            return self._fail("wrong proof of the job's secret", _VERDICT.pack(_MAGIC, _REFUSED))
        self._step, self.wants = 3, 0
        self.claim = self._pending_claim
        return _VERDICT.pack(_MAGIC, _OK)

    def _fail(self, why: str, reply: bytes) -> bytes:
        self._step, self.wants, self.error = 3, 0, why
        return reply


def default_key(port: int) -> JobKey:
    """The key of a store on ``port`` when none is given: this process's job secret
    (`job_secret`) bound to the port."""
    secret, origin = job_secret()
    return JobKey(secret, str(port), origin)


def _settimeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake's deadline passed")
    sock.settimeout(left)


def _recv(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """Exactly ``nbytes`` (small: handshake messages) before ``deadline``."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        _settimeout(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("closed during the handshake")
        got += n
    return bytes(buf)
