"""The rendezvous store's client: what every rank (rank 0 included) uses to exchange addresses
and meet at barriers with the others before any transport is connected, at the server rank 0
runs (`StoreServer`, in ``store_server``).

Every connection first proves the job's key (``ddlcore.security.auth``), claiming which rank it is; a
store that cannot prove the key, or refuses ours, is an error naming where this rank's secret
came from. Requests are fixed binary headers and raw bytes (``store_wire``), one at a time per
connection, nothing pickled. Every wait has a deadline; a rendezvous that does not complete raises
`RendezvousError` saying what was waited for, for how long, and which ranks did not arrive.
`PrefixStore` gives each communicator or transport its own key namespace.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import defaultdict
from typing import Any, Protocol

from ddlcore.errors import RendezvousError, StoreUnreachableError
from ddlcore.job import store_wire as wire
from ddlcore.job.store_server import StoreServer
from ddlcore.job.store_wire import MAX_KEY_BYTES, MAX_VALUE_BYTES
from ddlcore.security.auth import AuthenticationError, HandshakeRefused, JobKey, default_key
from ddlcore.security.claims import JOB_ID_BYTES, STORE
from ddlcore.transports.sockets import owned, recv_exact

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "PrefixStore",
    "JobFailedError",
    "StoreAuthenticationError",
    "StoreClient",
    "StoreServer",
    "StoreUnreachableError",
    "default_key",
]

# Extra seconds a client waits for the server's answer beyond the wait it asked the server for
# (the server answers "missing" at the deadline itself; this only covers a lost network).
_REPLY_SLACK_S = 10.0
# Backoff between connection attempts while rank 0's server is not listening yet.
_CONNECT_BACKOFF_S = (0.01, 0.25)
# Longest one handshake attempt may take before the client tries again (the server drops a
# handshake after 10 s; a real one takes a round trip).
_HANDSHAKE_S = 15.0
# How many missing ranks a barrier timeout lists by number before summarising.
_MAX_LISTED = 32


class JobFailedError(RendezvousError):
    """The store failed the job at its start, for every rank at once (two processes claim one
    rank; a rank of this host holds another secret): the message says why."""


class StoreAuthenticationError(RendezvousError, AuthenticationError):
    """The store and this rank do not hold the same job secret: the store refused this rank's
    proof, or could not prove the key itself (another job's store, or not a store at all)."""


def _recv_exact(sock: socket.socket, nbytes: int) -> bytearray | None:
    """Exactly ``nbytes`` from ``sock``; None on a clean EOF before the first byte."""
    buf = bytearray(nbytes)
    return buf if recv_exact(sock, memoryview(buf)) else None


class StoreClient:
    """One rank's connection to the rendezvous store; safe to share between threads.

    Parameters
    ----------
    host, port : str, int
        Where rank 0 serves the store. Connection is retried until ``timeout`` (rank 0 may start
        later than this rank).
    timeout : float
        Default deadline, in seconds, of connecting and of every wait.
    rank, size : int, optional
        This rank and the world size, used in error messages and as `barrier` defaults.
    job_key : JobKey, optional
        The job's key, proven to the server (default: `default_key` of ``port``); transports
        authenticate their connections with it too (``store.job_key``).
    member : int, optional
        Which rank of the job this process is, as the store keeps it (one process per rank;
        default ``rank``): a split's client passes its world rank.
    connect_s : float, optional
        How long to keep trying to connect (default ``timeout``): shorter where the store is
        known to be up already, so that a refusal means it is gone.

    Raises
    ------
    StoreAuthenticationError
        The store refused this rank's proof of the job key, or could not prove it itself (the
        ranks hold different secrets; the message says where this rank's came from).
    StoreUnreachableError
        The store could not be reached (and its handshake completed) within ``timeout``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        rank: int | None = None,
        size: int | None = None,
        job_key: JobKey | None = None,
        member: int | None = None,
        connect_s: float | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout={timeout} must be positive")
        self.host, self.port, self.timeout = host, int(port), float(timeout)
        self.job_key = job_key if job_key is not None else default_key(self.port)
        self.rank, self.size = rank, size
        self.member = rank if member is None else member
        self._lock = threading.Lock()
        self._barrier_seq: dict[str, int] = defaultdict(int)
        connect_s = self.timeout if connect_s is None else min(connect_s, self.timeout)
        self._sock: socket.socket | None = self._connect(time.monotonic() + connect_s)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _who(self) -> str:
        return "" if self.rank is None else f"rank {self.rank}: "

    def _connect(self, deadline: float) -> socket.socket:
        delay, max_delay = _CONNECT_BACKOFF_S
        attempts = 0
        refused = ""  # the last refusal heard (unproven), for the final message
        while True:
            attempts += 1
            try:
                infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise RendezvousError(
                    f"{self._who()}the rendezvous store address {self.host!r} does not resolve "
                    f"({exc}); check DDL_MASTER_ADDR"
                ) from None
            last: Exception | None = None
            for family, _, _, _, sockaddr in infos:
                sock = owned(socket.socket(family, socket.SOCK_STREAM))
                try:
                    sock.settimeout(max(0.05, min(5.0, deadline - time.monotonic())))
                    sock.connect(sockaddr)
                    if sock.getsockname() == sock.getpeername():
                        # Nobody listens there yet and the kernel picked the server's port as
                        # this socket's own (TCP self-connect): drop it, or rank 0 could not
                        # bind the port, and try again.
                        raise ConnectionRefusedError("connected to itself: nobody listens yet")
                except OSError as exc:
                    sock.close()
                    last = exc
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    answer = self.job_key.connect(
                        sock,
                        self.job_key.claim(
                            STORE,
                            src=-1 if self.member is None else self.member,
                            size=-1 if self.size is None else self.size,
                        ),
                        min(deadline, time.monotonic() + _HANDSHAKE_S),
                    )
                except HandshakeRefused as exc:
                    sock.close()
                    if exc.proven:  # the job's own store said no: final
                        raise JobFailedError(
                            f"{self._who()}the rendezvous store at {self.address} refused this "
                            f"rank: {exc.reason}"
                        ) from None
                    # Unproven: whatever listens there may be a stranger's; the store itself
                    # may be on the next address, or not up yet.
                    refused = exc.reason
                    last = exc
                    continue
                except AuthenticationError as exc:
                    sock.close()
                    raise StoreAuthenticationError(
                        f"{self._who()}cannot join the rendezvous store at {self.address}: {exc}"
                    ) from None
                except (OSError, ConnectionError, TimeoutError) as exc:
                    # Dropped during the handshake (the server sheds handshakes when strangers
                    # crowd it) or not answered in time: try again until the deadline.
                    sock.close()
                    last = exc
                    continue
                self._learn_job_id(answer, sock)
                sock.settimeout(None)
                return sock
            left = deadline - time.monotonic()
            if left <= 0:
                if refused:
                    raise StoreUnreachableError(
                        f"{self._who()}could not join the rendezvous store at {self.address} "
                        f"within {self.timeout:.1f} s: what answers there refused this rank "
                        f"({refused})"
                    )
                raise StoreUnreachableError(
                    f"{self._who()}could not reach the rendezvous store at {self.address} within "
                    f"{self.timeout:.1f} s ({attempts} attempts, last error: {last}); is rank 0 "
                    "running, and do DDL_MASTER_ADDR/DDL_MASTER_PORT name it?"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, max_delay)

    def _learn_job_id(self, answer: bytes, sock: socket.socket) -> None:
        """The store's answer is its job id (proven with its key): the first tells this rank
        which start of the job it is in; a later one must be the same (a store that restarted
        on the same port with the same secret is another start)."""
        if len(answer) != JOB_ID_BYTES:
            sock.close()
            raise StoreAuthenticationError(
                f"{self._who()}the rendezvous store at {self.address} answered with "
                f"{len(answer)} bytes, not a job id: another ddlcore version?"
            )
        if self.job_key.job_id is None:
            self.job_key.job_id = answer
        elif answer != self.job_key.job_id:
            sock.close()
            raise JobFailedError(
                f"{self._who()}the rendezvous store at {self.address} is another start of the "
                "job than the one this rank joined (the store was restarted); start every rank "
                "again"
            )

    def _request(
        self,
        op: int,
        key: str,
        value: Any = b"",
        arg: int = 0,
        wait_s: float = 0.0,
        within_s: float | None = None,
    ) -> tuple[int, bytes, int]:
        """One request and its reply. ``within_s``: how long to wait for the connection while
        another thread's request holds it (a wait of its own, maybe), and then for the reply
        (the connection is dropped if it does not come); None: as long as they take."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        raw_key = key.encode("utf-8")
        if len(raw_key) > MAX_KEY_BYTES:
            raise ValueError(
                f"key is {len(raw_key)} bytes in UTF-8; the store takes keys of at "
                f"most {MAX_KEY_BYTES} bytes"
            )
        if isinstance(value, str) or not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"value must be bytes-like, got {type(value).__name__}")
        nvalue = memoryview(value).nbytes
        if nvalue > MAX_VALUE_BYTES:
            raise ValueError(
                f"value is {nvalue} bytes; the store takes values of at most "
                f"{MAX_VALUE_BYTES} bytes"
            )
        wait_s = min(max(wait_s, 0.0), wire.MAX_WAIT_S)
        header = wire.REQUEST.pack(
            wire.MAGIC, op, 0, len(raw_key), nvalue, arg, wire.wait_ms(wait_s)
        )
        if not self._lock.acquire(timeout=-1 if within_s is None else within_s):
            raise RendezvousError(
                f"{self._who()}the store client for {self.address} stayed busy with another "
                f"thread's request for {within_s:.1f} s"
            )
        try:
            sock = self._sock
            if sock is None:
                raise StoreUnreachableError(
                    f"{self._who()}the store client for {self.address} is closed (or lost its "
                    "connection earlier)"
                )
            try:
                sock.settimeout(wait_s + _REPLY_SLACK_S if within_s is None else within_s)
                sock.sendall(header + raw_key)
                if nvalue:
                    sock.sendall(value)
                reply = _recv_exact(sock, wire.REPLY.size)
                if reply is None:
                    raise ConnectionError("the server closed the connection")
                magic, status, flags, rlen, rarg = wire.REPLY.unpack(reply)
                if magic != wire.MAGIC or flags or rlen > MAX_VALUE_BYTES:
                    raise ConnectionError("malformed reply")
                out = bytes(_recv_exact(sock, rlen) or b"") if rlen else b""
            except (OSError, ConnectionError) as exc:
                self._sock = None
                sock.close()
                raise StoreUnreachableError(
                    f"{self._who()}lost the connection to the rendezvous store at "
                    f"{self.address} ({exc}); rank 0, which serves it, may have exited"
                ) from None
        finally:
            self._lock.release()
        if status == wire.ERROR:
            raise ValueError(out.decode("utf-8", "replace"))
        if status == wire.FAILED:
            raise JobFailedError(
                f"{self._who()}the job failed at its start, as the rendezvous store at "
                f"{self.address} says: {out.decode('utf-8', 'replace')}"
            )
        return status, out, rarg

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else max(0.0, float(timeout))

    def set(self, key: str, value: bytes, readers: int = 0) -> None:
        """Store ``value`` under ``key`` (replacing any earlier value) and wake its waiters.

        The value lives while this client (or another that set the key) is connected; with
        ``readers=n`` it is freed after its n-th read, as soon as everyone who needs it has it.

        Raises
        ------
        ValueError
            The store is full (see `StoreServer`'s ``max_bytes``).
        """
        if readers < 0:
            raise ValueError(f"readers={readers} must not be negative")
        self._request(wire.SET, key, value, arg=int(readers))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds (default: the client's) for
        some rank to set it.

        Raises
        ------
        RendezvousError
            The key was not set in time; the message names the key and the wait.
        """
        wait_s = self._deadline(timeout)
        status, value, _ = self._request(wire.GET, key, wait_s=wait_s)
        if status != wire.OK:
            raise RendezvousError(
                f"{self._who()}waited {wait_s:.1f} s for key {key!r} at the rendezvous store "
                f"{self.address}; the rank that sets it has not started, is stuck, or failed"
            )
        return value

    def check(self, key: str) -> bool:
        """Whether ``key`` is set (no waiting)."""
        return self._request(wire.CHECK, key)[0] == wire.OK

    def lookup(self, key: str, within_s: float) -> bytes | None:
        """The value of ``key`` if it is set, without waiting for it: for a rank that is
        failing, which must not sit behind another thread's wait or a stalled store.

        Parameters
        ----------
        key : str
            The key.
        within_s : float
            Most seconds to wait for the connection (another thread's request may hold it),
            and as much again for the reply.

        Returns
        -------
        bytes or None
            The value; None if ``key`` is not set.

        Raises
        ------
        RendezvousError
            No answer within ``within_s`` (`StoreUnreachableError` where the store is gone).
        """
        status, value, _ = self._request(wire.GET, key, within_s=within_s)
        return value if status == wire.OK else None

    def post(self, key: str, value: bytes, within_s: float) -> None:
        """`set` ``key``, waiting at most ``within_s`` seconds for the connection and as
        much again for the reply (`RendezvousError` then), as `lookup` reads."""
        self._request(wire.SET, key, value, within_s=within_s)

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was set."""
        return self._request(wire.DELETE, key)[0] == wire.OK

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (missing: 0) and return the new value."""
        return self._request(wire.ADD, key, arg=int(amount))[2]

    def wait_count(self, key: str, target: int, timeout: float | None = None) -> int:
        """Wait until the counter ``key`` reaches ``target``; returns its value then.

        Raises
        ------
        RendezvousError
            Not reached in time; says how far the counter got.
        """
        wait_s = self._deadline(timeout)
        status, _, value = self._request(wire.WAIT_GE, key, arg=int(target), wait_s=wait_s)
        if status != wire.OK:
            raise RendezvousError(
                f"{self._who()}counter {key!r} at the rendezvous store {self.address} reached "
                f"{value} of {target} after {wait_s:.1f} s"
            )
        return value

    def barrier(
        self,
        name: str,
        rank: int | None = None,
        size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        """Return once all ``size`` ranks have called ``barrier(name)`` as often as this one.

        Raises
        ------
        RendezvousError
            Not every rank arrived in time; says how many of how many did, and which are missing.
        """
        rank = self.rank if rank is None else rank
        size = self.size if size is None else size
        if rank is None or size is None:
            raise ValueError("barrier needs rank and size (pass them, or give them to StoreClient)")
        wait_s = self._deadline(timeout)
        if not 0 <= rank < size <= wire.MAX_BARRIER_SIZE:
            raise ValueError(f"barrier {name!r}: rank={rank} of size={size}")
        self._barrier_seq[name] += 1
        base = f"barrier/{name}/{self._barrier_seq[name]}"
        # One request: the server counts the ranks in and answers all at once (and forgets the
        # barrier when it has); a timeout is answered with the ranks that did arrive.
        status, arrived, _ = self._request(
            wire.BARRIER, base, arg=wire.barrier_arg(rank, size), wait_s=wait_s
        )
        if status == wire.OK:
            return
        present = set(wire.arrived_ranks(arrived, size))
        missing = [r for r in range(size) if r not in present]
        listed = str(missing[:_MAX_LISTED])
        if len(missing) > _MAX_LISTED:
            listed = listed[:-1] + f", ... ({len(missing) - _MAX_LISTED} more)]"
        raise RendezvousError(
            f"rendezvous at {self.address}: {size - len(missing)} of {size} ranks joined "
            f"barrier {name!r} after {wait_s:.1f} s (seen from rank {rank}); missing ranks: {listed}"
        )

    def abort(self) -> None:
        """Fail a call another thread has in progress, now, and every later one: the connection
        is shut down without waiting for that call (`close` waits for it)."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Drop the connection (idempotent)."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _KeyValueStore(Protocol):
    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float | None = None) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...


class PrefixStore:
    """A view of ``store`` in which every key is prefixed with ``prefix`` (a namespace per
    communicator or transport). Closing is the underlying client's business."""

    def __init__(self, store: _KeyValueStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        # The master's address: transports find their outgoing interface from it.
        self.host: str = getattr(store, "host", "")
        self.port: int = getattr(store, "port", 0)
        # The job's key: transports authenticate their connections with it.
        self.job_key: JobKey | None = getattr(store, "job_key", None)

    @property
    def rank(self) -> int | None:
        return getattr(self.store, "rank", None)

    @property
    def size(self) -> int | None:
        return getattr(self.store, "size", None)

    @property
    def member(self) -> int | None:
        return getattr(self.store, "member", None)

    @property
    def timeout(self) -> float:
        return self.store.timeout  # type: ignore[attr-defined]

    def set(self, key: str, value: bytes, readers: int = 0) -> None:
        if readers:
            self.store.set(self.prefix + key, value, readers)  # type: ignore[call-arg]
        else:
            self.store.set(self.prefix + key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self.prefix + key, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self.prefix + key, amount)

    def check(self, key: str) -> bool:
        return self.store.check(self.prefix + key)  # type: ignore[attr-defined]

    def lookup(self, key: str, within_s: float) -> bytes | None:
        return self.store.lookup(self.prefix + key, within_s)  # type: ignore[attr-defined]

    def post(self, key: str, value: bytes, within_s: float) -> None:
        self.store.post(self.prefix + key, value, within_s)  # type: ignore[attr-defined]

    def delete(self, key: str) -> bool:
        return self.store.delete(self.prefix + key)  # type: ignore[attr-defined]

    def wait_count(self, key: str, target: int, timeout: float | None = None) -> int:
        return self.store.wait_count(self.prefix + key, target, timeout)  # type: ignore[attr-defined]

    def barrier(
        self,
        name: str,
        rank: int | None = None,
        size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self.store.barrier(self.prefix + name, rank, size, timeout)  # type: ignore[attr-defined]
