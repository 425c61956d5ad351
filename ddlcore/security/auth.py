"""Authenticated connections: before anything else on a socket is acted on, both ends prove that
they hold the job's secret, over a claim (``ddlcore.security.claims``) that names the service, the start
of the job, both ends' ranks and the exact address the connector dialled. The rendezvous store and
the TCP transport run this on every connection.

Where the secret comes from is ``secret``'s (`job_secret`, re-exported here).

Handshake, version 2 (nonces fresh on both sides, HMAC-SHA256, constant-time comparison;
``key`` = HMAC(secret, job), so one secret serves many jobs without crossing them)::

    connector                                                acceptor
      HELLO  magic u32 | version u16 | claim length u16 | nonce_c[32] | claim  ->
             (the acceptor checks the claim first: its service, its job id, that it is meant
              for this rank, dialled at the address it arrived on; else REFUSED, unproven)
                  <-  CHALLENGE  magic u32 | status u16 | n u16 | nonce_a[32] | mac_a[32] | body[n]
      status 0: body is the acceptor's answer (the store's job id), and
          mac_a = HMAC(key, "accept" | version | claim | answer | nonce_c | nonce_a);
      else: zeros, and body says why (refused, or another handshake version).
      PROOF  magic u32 | status u16 | 0 u16 | mac_c[32]  ->
          status 0: mac_c = HMAC(key, "connect" | version | claim | answer | nonce_c | nonce_a);
          status 1: the acceptor's proof was wrong (the secrets differ), told so it can say so
                  <-  VERDICT  magic u32 | status u16 | n u16 | body[n]  (0 ok; else refused, why)

A listener proves nothing for a claim that is not for it, so a relay at another address, or a
proof asked of one service to be shown to another, gets nothing usable. A claim is at most
`MAX_CLAIM_BYTES`, read only after its length is checked; nothing here allocates what a peer
announces beyond that. `JobKey.accept` serves one socket, blocking until a deadline; `Acceptor` is
the same acceptor side without I/O, for a server that runs many handshakes from one event loop
(the rendezvous store). Payloads after the handshake are not encrypted or authenticated: an
attacker on the network path is out of scope (see SECURITY.md).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from collections.abc import Callable

from ddlcore.errors import DDLError
from ddlcore.security.claims import (
    MAX_CLAIM_BYTES,
    NO_JOB_ID,
    Claim,
    endpoint,
    same_endpoint,
)
from ddlcore.security.secret import job_secret, new_secret

__all__ = [
    "MAX_CLAIM_BYTES",
    "PROTOCOL_VERSION",
    "Acceptor",
    "AuthenticationError",
    "HandshakeRefused",
    "JobKey",
    "default_key",
    "job_secret",
    "new_secret",
    "printable",
]

PROTOCOL_VERSION = 2  # 2: claims name service, job id, both ranks and the address dialled
NONCE_BYTES = 32
MAC_BYTES = 32

_MAGIC = 0xDD1A7E57
_HELLO = struct.Struct("<IHH")  # magic, version, claim length
_CHALLENGE = struct.Struct("<IHH")  # magic, status, body length (+ nonce_a, mac_a, body)
_PROOF = struct.Struct("<IHH")  # magic, status, 0 (+ mac_c)
_VERDICT = struct.Struct("<IHH")  # magic, status, body length (+ body)
_OK, _REFUSED = 0, 1  # a challenge's status
_PROOF_WRONG = 1  # a proof's status: the acceptor's proof did not check out
_WRONG_PROOF, _VERDICT_REFUSED = 1, 2  # a verdict's status besides _OK
_MAX_BODY = 512  # longest answer or reason
# How long a connector that found the acceptor's proof wrong holds its socket for the acceptor
# to see who it is (the store looks the socket's owner up in a few ms).
_HOLD_AFTER_WRONG_S = 0.5
_KEY_LABEL = b"ddlcore job key v1\0"
_ADVICE = (
    "Give every rank the same DDL_SECRET or DDL_SECRET_FILE (ddlrun and mpiexec provide "
    "one themselves; under torchrun, srun or by hand, set one)"
)


class AuthenticationError(DDLError):
    """A connection did not prove knowledge of the job's secret (or we could not prove ours to
    it): the ends hold different secrets, or the other end is not part of this job."""


class HandshakeRefused(AuthenticationError):
    """The listener refused our claim before proving anything (another service, another start
    of the job, another rank, another address), or refused it after both proofs (the store: a
    rank another process holds already); ``reason`` is the listener's own word, unproven when
    ``proven`` is false."""

    def __init__(self, message: str, reason: str = "", proven: bool = False) -> None:
        super().__init__(message)
        self.reason, self.proven = reason, proven


# Checks a service runs on a claim: None to go on, or why it is refused.
ClaimCheck = Callable[[Claim], "str | None"]


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

    Attributes
    ----------
    job_id : bytes or None
        Which start of the job this is: drawn by the store that serves it, learned by a client in
        its first handshake with the store, and carried in every later claim (None until then).
    """

    def __init__(self, secret: bytes, job: str, origin: str = "") -> None:
        self._key = hmac.new(secret, _KEY_LABEL + job.encode(), hashlib.sha256).digest()
        self.job = job
        self.origin = origin
        self.job_id: bytes | None = None

    def __repr__(self) -> str:
        return f"JobKey(job={self.job!r}, origin={self.origin!r})"  # never the key

    def _mac(
        self, label: bytes, claim: bytes, answer: bytes, nonce_c: bytes, nonce_a: bytes
    ) -> bytes:
        data = b"".join(
            (
                label,
                b"\0",
                struct.pack("<HHH", PROTOCOL_VERSION, len(claim), len(answer)),
                claim,
                answer,
                nonce_c,
                nonce_a,
            )
        )
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def derive(self, label: bytes, data: bytes) -> bytes:
        """32 bytes that only holders of the key can compute, ``HMAC(key, label | 0 | data)``
        (``label`` other than the handshake's own): for transports that authenticate messages
        rather than connections (ucx)."""
        if label in (b"accept", b"connect") or b"\0" in label:
            raise ValueError(f"label {label!r} is the handshake's own, or holds a NUL")
        return hmac.new(self._key, label + b"\0" + data, hashlib.sha256).digest()

    def claim(self, service: str, **fields: object) -> Claim:
        """A claim for ``service`` in this job (its job id and the secret's origin filled in)."""
        return Claim(
            service,
            job_id=self.job_id or NO_JOB_ID,
            origin=self.origin,
            **fields,  # type: ignore[arg-type]
        )

    def connect(self, sock: socket.socket, claim: Claim, deadline: float) -> bytes:
        """Prove ``claim`` (aimed at the address ``sock`` is connected to) to the acceptor at the
        other end of ``sock``, and check its proof; returns the acceptor's answer.

        Raises
        ------
        HandshakeRefused
            The acceptor refused the claim (``proven``: after both proofs, so it is the job's).
        AuthenticationError
            The other end does not know the key, or refused ours.
        ConnectionError, TimeoutError, OSError
            The connection broke or ``deadline`` (``time.monotonic()``) passed.
        """
        try:
            target = endpoint(sock.getpeername())
        except OSError:
            target = ("", 0)
        raw_claim = claim.aimed_at(target).encode()
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        _settimeout(sock, deadline)
        sock.sendall(_HELLO.pack(_MAGIC, PROTOCOL_VERSION, len(raw_claim)) + nonce_c + raw_claim)
        head = _recv(sock, _CHALLENGE.size, deadline)
        magic, status, nbody = _CHALLENGE.unpack(head)
        if magic != _MAGIC or nbody > _MAX_BODY:
            raise AuthenticationError(
                "the other end does not speak ddlcore's handshake (or an older version of it)"
            )
        nonce_a = _recv(sock, NONCE_BYTES, deadline)
        mac_a = _recv(sock, MAC_BYTES, deadline)
        body = _recv(sock, nbody, deadline) if nbody else b""
        if status != _OK:
            reason = printable(body)
            raise HandshakeRefused(
                f"the listener refused our claim (its word, unverified): {reason}", reason
            )
        if not hmac.compare_digest(mac_a, self._mac(b"accept", raw_claim, body, nonce_c, nonce_a)):
            _tell_wrong(sock, deadline)
            raise AuthenticationError(
                "the other end could not prove it holds this job's secret: it belongs to another "
                f"job, or holds another secret (ours is from {self.origin or 'unknown'}). "
                + _ADVICE
            )
        sock.sendall(
            _PROOF.pack(_MAGIC, _OK, 0) + self._mac(b"connect", raw_claim, body, nonce_c, nonce_a)
        )
        magic, status, nbody = _VERDICT.unpack(_recv(sock, _VERDICT.size, deadline))
        if magic != _MAGIC or nbody > _MAX_BODY:
            raise AuthenticationError("a malformed verdict on our proof")
        reason = printable(_recv(sock, nbody, deadline)) if nbody else ""
        if status == _WRONG_PROOF:
            raise AuthenticationError(
                "the other end refused our proof of the job's secret: the ranks hold different "
                f"secrets (ours is from {self.origin or 'unknown'}). " + _ADVICE
            )
        if status != _OK:
            raise HandshakeRefused(reason, reason, proven=True)
        return body

    def acceptor(
        self,
        service: str,
        arrived: object = None,
        check: ClaimCheck | None = None,
        confirm: ClaimCheck | None = None,
        answer: bytes = b"",
    ) -> Acceptor:
        """The acceptor's side of one handshake as a state machine over bytes (`Acceptor`), for
        servers that serve many connections from one event loop."""
        return Acceptor(self, service, arrived, check, confirm, answer)

    def accept(
        self,
        sock: socket.socket,
        deadline: float,
        service: str,
        check: ClaimCheck | None = None,
        confirm: ClaimCheck | None = None,
        answer: bytes = b"",
    ) -> Claim:
        """Check the claim and proof of a connector on ``sock``; returns its claim once proven.

        Raises
        ------
        AuthenticationError
            Malformed hello, a claim refused (`Acceptor`), or a wrong proof (the connector was
            told why).
        ConnectionError, TimeoutError, OSError
            The connection broke or ``deadline`` passed.
        """
        try:
            arrived = sock.getsockname()
        except OSError:
            arrived = None
        acceptor = Acceptor(self, service, arrived, check, confirm, answer)
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

    Before it proves anything it checks the claim: well formed, for ``service``, dialled at
    ``arrived`` (the address the connection came in on), from this job (``key.job_id``, where
    known and claimed), and whatever ``check`` adds; a claim that fails gets a refusal and no
    proof. ``confirm`` runs once the connector has proven the key (a refusal then is the job's
    own word: the store refuses a rank another process holds). `mismatch` is set when the
    connector's proof was wrong or it said ours was: the secrets differ (or it is a stranger).

    It never asks for more than `MAX_CLAIM_BYTES` + `NONCE_BYTES` bytes at a time, so a caller
    that reads what it wants allocates nothing a peer merely announces, and it judges the hello's
    first 8 bytes before asking for the rest, so garbage is refused as soon as it arrives.
    """

    __slots__ = (
        "_key",
        "_service",
        "_arrived",
        "_check",
        "_confirm",
        "_answer",
        "_step",
        "wants",
        "claim",
        "error",
        "mismatch",
        "unproven",
        "_nonce_c",
        "_nonce_a",
        "_raw_claim",
    )

    def __init__(
        self,
        key: JobKey,
        service: str,
        arrived: object = None,
        check: ClaimCheck | None = None,
        confirm: ClaimCheck | None = None,
        answer: bytes = b"",
    ) -> None:
        self._key, self._service = key, service
        self._arrived = endpoint(arrived)
        self._check, self._confirm, self._answer = check, confirm, answer
        self._step = 0  # 0: hello header, 1: nonce and claim, 2: proof, 3: done or failed
        self.wants = _HELLO.size
        self.claim: Claim | None = None
        self.unproven: Claim | None = None  # the claim as received, before its proof
        self.error: str | None = None
        self.mismatch = False
        self._nonce_c = self._nonce_a = self._raw_claim = b""

    def feed(self, data: bytes) -> bytes:
        """Take the `wants` bytes asked for; returns the bytes to send back (maybe none)."""
        if len(data) != self.wants or self._step == 3:
            raise ValueError(f"fed {len(data)} bytes, wanted {self.wants} (step {self._step})")
        if self._step == 0:
            magic, version, nclaim = _HELLO.unpack(data)
            if magic != _MAGIC:
                return self._fail("malformed hello", b"")
            if version != PROTOCOL_VERSION:
                other = (
                    f"handshake version {version}, this ddlcore speaks {PROTOCOL_VERSION}: run "
                    "the same ddlcore version on every rank"
                )
                return self._fail(other, _refusal(other))
            if nclaim > MAX_CLAIM_BYTES:
                return self._fail("malformed hello", b"")
            self._step, self.wants = 1, NONCE_BYTES + nclaim
            return b""
        if self._step == 1:
            self._nonce_c, self._raw_claim = bytes(data[:NONCE_BYTES]), bytes(data[NONCE_BYTES:])
            claim = Claim.decode(self._raw_claim)
            why = self._refuse(claim)
            if why is not None:
                return self._fail(why, _refusal(why))
            self.unproven = claim
            self._nonce_a = secrets.token_bytes(NONCE_BYTES)
            self._step, self.wants = 2, _PROOF.size + MAC_BYTES
            mac = self._key._mac(
                b"accept", self._raw_claim, self._answer, self._nonce_c, self._nonce_a
            )
            return (
                _CHALLENGE.pack(_MAGIC, _OK, len(self._answer)) + self._nonce_a + mac + self._answer
            )
        magic, status, zero = _PROOF.unpack_from(data)
        if magic != _MAGIC or status not in (_OK, _PROOF_WRONG) or zero:
            return self._fail("malformed proof", b"")
        if status == _PROOF_WRONG:
            self.mismatch = True
            return self._fail("it could not check our proof of the job's secret", b"")
        expected = self._key._mac(
            b"connect", self._raw_claim, self._answer, self._nonce_c, self._nonce_a
        )
        if not hmac.compare_digest(bytes(data[_PROOF.size :]), expected):
            self.mismatch = True
            return self._fail(
                "wrong proof of the job's secret", _VERDICT.pack(_MAGIC, _WRONG_PROOF, 0)
            )
        assert self.unproven is not None
        why = self._confirm(self.unproven) if self._confirm is not None else None
        if why is not None:
            return self._fail(why, b"", told=why)
        self._step, self.wants = 3, 0
        self.claim = self.unproven
        return _VERDICT.pack(_MAGIC, _OK, 0)

    def _refuse(self, claim: Claim | None) -> str | None:
        """Why ``claim`` gets no proof from this acceptor, or None."""
        if claim is None:
            return "a malformed claim"
        if claim.service != self._service:
            return f"this listener serves {self._service}, not {claim.service}"
        if not same_endpoint(claim.target, self._arrived):
            return (
                f"dialled {_where(claim.target)} but reached {_where(self._arrived)}: something "
                "between the two (a relay, a NAT or a proxy) changed the address"
            )
        job_id = self._key.job_id
        if job_id is not None and claim.job_id not in (NO_JOB_ID, job_id):
            return (
                f"the connector belongs to another start of this job (job id "
                f"{claim.job_id.hex()[:12]}, this one is {job_id.hex()[:12]}): a process left "
                "from an earlier start?"
            )
        return self._check(claim) if self._check is not None else None

    def _fail(self, why: str, reply: bytes, told: str = "") -> bytes:
        self._step, self.wants, self.error = 3, 0, why
        if told:  # a verdict with its reason: the header says how long the reason is
            body = told.encode("ascii", "replace")[:_MAX_BODY]
            return _VERDICT.pack(_MAGIC, _VERDICT_REFUSED, len(body)) + body
        return reply


def printable(raw: bytes, limit: int = _MAX_BODY) -> str:
    """A peer's text, as safe to print: ASCII letters, digits, punctuation and spaces only (no
    control characters, no escape sequences), at most ``limit`` characters."""
    text = raw[:limit].decode("ascii", "replace")
    return "".join(c if " " <= c <= "~" else "?" for c in text)


def _tell_wrong(sock: socket.socket, deadline: float) -> None:
    """Tell the acceptor its proof was wrong (so that it can say so too), and hold the socket
    until it closes (half a second at most): it may look up who we are meanwhile, which only
    an open socket tells."""
    try:
        sock.sendall(_PROOF.pack(_MAGIC, _PROOF_WRONG, 0) + bytes(MAC_BYTES))
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(max(0.001, min(_HOLD_AFTER_WRONG_S, deadline - time.monotonic())))
        while sock.recv(64):
            pass
    except OSError:
        pass


def _refusal(why: str) -> bytes:
    body = why.encode("ascii", "replace")[:_MAX_BODY]
    return _CHALLENGE.pack(_MAGIC, _REFUSED, len(body)) + bytes(NONCE_BYTES + MAC_BYTES) + body


def _where(address: tuple[str, int]) -> str:
    host, port = address
    if not host:
        return "a local socket"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
