"""The rendezvous store: a small TCP key-value server on rank 0 where ranks exchange addresses
and meet at barriers before any transport is connected.

`StoreServer` runs in daemon threads of rank 0 (one per client connection); `StoreClient` is what
every rank (rank 0 included) talks to it with; `PrefixStore` gives each communicator or transport
its own key namespace. The wire format is fixed binary headers followed by raw bytes, with caps
on key and value length; nothing is pickled, and a malformed or oversize frame closes that
connection. Every wait has a deadline; a rendezvous that does not complete raises
`RendezvousError` saying what was waited for, for how long, and which ranks did not arrive.

Request:  magic u16, op u8, flags u8 (0), key length u16, value length u32, arg i64, wait ms i64,
          then the key (UTF-8) and the value.
Reply:    magic u16, status u8, flags u8 (0), value length u32, arg i64, then the value.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import defaultdict
from typing import Any, Protocol

from ddlcore.auth import JobKey, job_secret
from ddlcore.errors import RendezvousError
from ddlcore.transports.sockets import recv_exact

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 64 << 20

_MAGIC = 0xDD5C
_REQUEST = struct.Struct("<HBBHIqq")
_REPLY = struct.Struct("<HBBIq")

_SET, _GET, _ADD, _WAIT_GE, _CHECK, _DELETE = 1, 2, 3, 4, 5, 6
_OPS = frozenset((_SET, _GET, _ADD, _WAIT_GE, _CHECK, _DELETE))
_OK, _MISSING, _ERROR = 0, 1, 2

# Extra seconds a client waits for the server's answer beyond the wait it asked the server for
# (the server answers "missing" at the deadline itself; this only covers a lost network).
_REPLY_SLACK_S = 10.0
# Backoff between connection attempts while rank 0's server is not listening yet.
_CONNECT_BACKOFF_S = (0.01, 0.25)
# How many missing ranks a barrier timeout lists by number before summarising.
_MAX_LISTED = 32


class StoreUnreachableError(RendezvousError):
    """The store could not be reached, or the connection to it was lost (rank 0, which serves
    it, has probably exited). Distinct from a wait that timed out while the store was up."""


def _recv_exact(sock: socket.socket, nbytes: int) -> bytearray | None:
    """Exactly ``nbytes`` from ``sock``; None on a clean EOF before the first byte."""
    buf = bytearray(nbytes)
    return buf if recv_exact(sock, memoryview(buf)) else None


def default_key(port: int) -> JobKey:
    """The key of a store on ``port`` when none is given: this process's job secret
    (`ddlcore.auth.job_secret`) bound to the port."""
    secret, origin = job_secret()
    return JobKey(secret, str(port), origin)


def _counter(raw: bytes | None) -> int:
    return 0 if raw is None else int(raw)


class StoreServer:
    """The rendezvous key-value server, listening on exactly ``host:port`` (port 0: any free port).

    Parameters
    ----------
    host : str
        Address to bind; only that address is served (``0.0.0.0`` only if given).
    port : int
        TCP port; the bound port is in ``self.port``.
    job_key : JobKey, optional
        What clients must prove (default: `default_key` of the bound port).

    Raises
    ------
    RendezvousError
        The address cannot be bound (in use, not an address of this host).
    """

    def __init__(self, host: str, port: int, backlog: int = 4096,
                 job_key: JobKey | None = None) -> None:
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except OSError as exc:
            raise RendezvousError(f"cannot serve the rendezvous store at {host}:{port}: "
                                  f"{host!r} does not resolve ({exc})") from None
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            raise RendezvousError(
                f"cannot serve the rendezvous store at {host}:{port}: {exc.strerror or exc}; "
                "is another job using that port, or is the address not one of this host's?"
            ) from None
        self.host = host
        self.port: int = sock.getsockname()[1]
        self.job_key = job_key if job_key is not None else default_key(self.port)
        self._sock = sock
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"ddl-store-accept-{self.port}", daemon=True)
        self._accept_thread.start()

    def sockname(self) -> tuple[str, int]:
        """The address and port actually bound."""
        return self._sock.getsockname()[:2]

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # listener shut down by close()
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                thread = threading.Thread(target=self._serve, args=(conn,),
                                          name=f"ddl-store-conn-{self.port}", daemon=True)
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                header = _recv_exact(conn, _REQUEST.size)
                if header is None:
                    return
                magic, op, flags, klen, vlen, arg, wait_ms = _REQUEST.unpack(header)
                if (magic != _MAGIC or flags or op not in _OPS or klen > MAX_KEY_BYTES
                        or vlen > MAX_VALUE_BYTES):
                    return  # malformed or oversize: drop the connection
                raw_key = _recv_exact(conn, klen) if klen else bytearray()
                value = bytes(_recv_exact(conn, vlen) or b"") if vlen else b""
                if raw_key is None:
                    return
                key = raw_key.decode("utf-8")
                status, out, out_arg = self._handle(op, key, value, arg, max(wait_ms, 0) / 1e3)
                conn.sendall(_REPLY.pack(_MAGIC, status, 0, len(out), out_arg) + out)
        except (OSError, UnicodeDecodeError, ConnectionError):
            return
        finally:
            with self._cond:
                self._conns.pop(conn, None)
                self._cond.notify_all()
            conn.close()

    def _handle(self, op: int, key: str, value: bytes, arg: int,
                wait_s: float) -> tuple[int, bytes, int]:
        data = self._data
        with self._cond:
            if op == _SET:
                data[key] = value
                self._cond.notify_all()
                return _OK, b"", 0
            if op == _GET:
                self._cond.wait_for(lambda: key in data or self._closed, wait_s)
                return (_OK, data[key], 0) if key in data else (_MISSING, b"", 0)
            if op == _CHECK:
                return (_OK if key in data else _MISSING), b"", 0
            if op == _DELETE:
                return (_OK if data.pop(key, None) is not None else _MISSING), b"", 0
            try:
                current = _counter(data.get(key))
            except ValueError:
                return _ERROR, f"key {key!r} does not hold a counter".encode(), 0
            if op == _ADD:
                current += arg
                data[key] = str(current).encode()
                self._cond.notify_all()
                return _OK, b"", current

            def reached() -> bool:
                return self._closed or _counter(data.get(key)) >= arg

            self._cond.wait_for(reached, wait_s)
            current = _counter(data.get(key))
            return (_OK if current >= arg else _MISSING), b"", current

    def clients(self) -> int:
        """How many client connections are open."""
        with self._cond:
            return len(self._conns)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no client is connected (at most ``timeout`` seconds); True if none is."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._conns, timeout)

    def close(self, timeout: float = 5.0, linger: float = 0.0) -> None:
        """Stop serving: drop every client connection and join the server's threads.

        Parameters
        ----------
        timeout : float
            Seconds to wait for the server's threads to end.
        linger : float
            Seconds to first let clients finish and disconnect on their own, so that the
            answer to a client's last request is not cut off.
        """
        with self._cond:
            if self._closed:
                return
            if linger > 0:
                self._cond.wait_for(lambda: not self._conns, linger)
            self._closed = True
            self._cond.notify_all()
            conns = dict(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in conns.values():
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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

    Raises
    ------
    RendezvousError
        The store could not be reached within ``timeout``.
    """

    def __init__(self, host: str, port: int, timeout: float, rank: int | None = None,
                 size: int | None = None, job_key: JobKey | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout={timeout} must be positive")
        self.host, self.port, self.timeout = host, int(port), float(timeout)
        self.job_key = job_key if job_key is not None else default_key(self.port)
        self.rank, self.size = rank, size
        self._lock = threading.Lock()
        self._barrier_seq: dict[str, int] = defaultdict(int)
        self._sock: socket.socket | None = self._connect(time.monotonic() + self.timeout)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _who(self) -> str:
        return "" if self.rank is None else f"rank {self.rank}: "

    def _connect(self, deadline: float) -> socket.socket:
        delay, max_delay = _CONNECT_BACKOFF_S
        attempts = 0
        while True:
            attempts += 1
            try:
                infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise RendezvousError(
                    f"{self._who()}the rendezvous store address {self.host!r} does not resolve "
                    f"({exc}); check DDL_MASTER_ADDR") from None
            last: OSError | None = None
            for family, _, _, _, sockaddr in infos:
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.settimeout(max(0.05, min(5.0, deadline - time.monotonic())))
                    sock.connect(sockaddr)
                except OSError as exc:
                    sock.close()
                    last = exc
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreUnreachableError(
                    f"{self._who()}could not reach the rendezvous store at {self.address} within "
                    f"{self.timeout:.1f} s ({attempts} attempts, last error: {last}); is rank 0 "
                    "running, and do DDL_MASTER_ADDR/DDL_MASTER_PORT name it?")
            time.sleep(min(delay, left))
            delay = min(delay * 2, max_delay)

    def _request(self, op: int, key: str, value: Any = b"", arg: int = 0,
                 wait_s: float = 0.0) -> tuple[int, bytes, int]:
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        raw_key = key.encode("utf-8")
        if len(raw_key) > MAX_KEY_BYTES:
            raise ValueError(f"key is {len(raw_key)} bytes in UTF-8; the store takes keys of at "
                             f"most {MAX_KEY_BYTES} bytes")
        if isinstance(value, str) or not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"value must be bytes-like, got {type(value).__name__}")
        nvalue = memoryview(value).nbytes
        if nvalue > MAX_VALUE_BYTES:
            raise ValueError(f"value is {nvalue} bytes; the store takes values of at most "
                             f"{MAX_VALUE_BYTES} bytes")
        header = _REQUEST.pack(_MAGIC, op, 0, len(raw_key), nvalue, arg, int(wait_s * 1e3))
        with self._lock:
            sock = self._sock
            if sock is None:
                raise StoreUnreachableError(
                    f"{self._who()}the store client for {self.address} is closed (or lost its "
                    "connection earlier)")
            try:
                sock.settimeout(wait_s + _REPLY_SLACK_S)
                sock.sendall(header + raw_key)
                if nvalue:
                    sock.sendall(value)
                reply = _recv_exact(sock, _REPLY.size)
                if reply is None:
                    raise ConnectionError("the server closed the connection")
                magic, status, flags, rlen, rarg = _REPLY.unpack(reply)
                if magic != _MAGIC or flags or rlen > MAX_VALUE_BYTES:
                    raise ConnectionError("malformed reply")
                out = bytes(_recv_exact(sock, rlen) or b"") if rlen else b""
            except (OSError, ConnectionError) as exc:
                self._sock = None
                sock.close()
                raise StoreUnreachableError(
                    f"{self._who()}lost the connection to the rendezvous store at "
                    f"{self.address} ({exc}); rank 0, which serves it, may have exited") from None
        if status == _ERROR:
            raise ValueError(out.decode("utf-8", "replace"))
        return status, out, rarg

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else max(0.0, float(timeout))

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any earlier value) and wake its waiters."""
        self._request(_SET, key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds (default: the client's) for
        some rank to set it.

        Raises
        ------
        RendezvousError
            The key was not set in time; the message names the key and the wait.
        """
        wait_s = self._deadline(timeout)
        status, value, _ = self._request(_GET, key, wait_s=wait_s)
        if status != _OK:
            raise RendezvousError(
                f"{self._who()}waited {wait_s:.1f} s for key {key!r} at the rendezvous store "
                f"{self.address}; the rank that sets it has not started, is stuck, or failed")
        return value

    def check(self, key: str) -> bool:
        """Whether ``key`` is set (no waiting)."""
        return self._request(_CHECK, key)[0] == _OK

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was set."""
        return self._request(_DELETE, key)[0] == _OK

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (missing: 0) and return the new value."""
        return self._request(_ADD, key, arg=int(amount))[2]

    def wait_count(self, key: str, target: int, timeout: float | None = None) -> int:
        """Wait until the counter ``key`` reaches ``target``; returns its value then.

        Raises
        ------
        RendezvousError
            Not reached in time; says how far the counter got.
        """
        wait_s = self._deadline(timeout)
        status, _, value = self._request(_WAIT_GE, key, arg=int(target), wait_s=wait_s)
        if status != _OK:
            raise RendezvousError(
                f"{self._who()}counter {key!r} at the rendezvous store {self.address} reached "
                f"{value} of {target} after {wait_s:.1f} s")
        return value

    def barrier(self, name: str, rank: int | None = None, size: int | None = None,
                timeout: float | None = None) -> None:
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
        self._barrier_seq[name] += 1
        base = f"barrier/{name}/{self._barrier_seq[name]}"
        self.set(f"{base}/{rank}", b"1")
        self.add(f"{base}/count", 1)
        status, _, _ = self._request(_WAIT_GE, f"{base}/count", arg=size, wait_s=wait_s)
        if status == _OK:
            return
        missing = [r for r in range(size) if not self.check(f"{base}/{r}")]
        listed = str(missing[:_MAX_LISTED])
        if len(missing) > _MAX_LISTED:
            listed = listed[:-1] + f", ... ({len(missing) - _MAX_LISTED} more)]"
        raise RendezvousError(
            f"rendezvous at {self.address}: {size - len(missing)} of {size} ranks joined "
            f"barrier {name!r} after {wait_s:.1f} s (seen from rank {rank}); missing ranks: {listed}")

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
    def timeout(self) -> float:
        return self.store.timeout  # type: ignore[attr-defined]

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self.prefix + key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self.prefix + key, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self.prefix + key, amount)

    def check(self, key: str) -> bool:
        return self.store.check(self.prefix + key)  # type: ignore[attr-defined]

    def delete(self, key: str) -> bool:
        return self.store.delete(self.prefix + key)  # type: ignore[attr-defined]

    def wait_count(self, key: str, target: int, timeout: float | None = None) -> int:
        return self.store.wait_count(self.prefix + key, target, timeout)  # type: ignore[attr-defined]

    def barrier(self, name: str, rank: int | None = None, size: int | None = None,
                timeout: float | None = None) -> None:
        self.store.barrier(self.prefix + name, rank, size, timeout)  # type: ignore[attr-defined]
