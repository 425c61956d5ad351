"""The rendezvous store's server: one event-loop thread on rank 0 serves every connection
(``selectors``, non-blocking sockets), so an idle, slow or abandoned connection costs an fd and a
few hundred bytes, never a thread, and never delays another.

What it guarantees (the wire format is in ``store_wire``; a connection's handshake, requests,
replies and leaving are ``store_conn``'s, the half of the server this module extends):

- **Authenticated.** A connection proves the job key (``ddlcore.security.auth``) before any request is
  read; one that fails, sends garbage, or does not finish within `HANDSHAKE_TIMEOUT_S` is dropped.
- **Bounded.** At most ``max_connections`` connections; of those still in the handshake, at most
  `MAX_PENDING` in all and `MAX_PENDING_PER_SOURCE` per source address. Over a cap, the oldest
  connection still in its handshake is dropped (a real rank finishes its handshake in one round
  trip and retries if it was the one dropped); authenticated connections are never dropped.
  Keys and values are read as their bytes arrive (a header announcing 64 MiB allocates nothing);
  stored values are capped at ``max_bytes`` in all; waits are clamped to ``MAX_WAIT_S``.
- **Values freed** (the rules are ``store_table``'s): after their declared reads, barriers once
  answered, everything when the last client leaves; the rest within ``max_bytes``.
- **Nothing left.** A client that leaves mid-wait is noticed at once (its socket is watched);
  `close` drops every connection and joins the thread.
"""

from __future__ import annotations

import errno
import functools
import heapq
import itertools
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable

from ddlcore.job.store_conn import _HANDSHAKE, StoreConnections, _Conn
from ddlcore.job.store_listen import listen_all, take
from ddlcore.job.store_table import StoreTable, Wait
from ddlcore.security.auth import JobKey, default_key, printable
from ddlcore.security.claims import JOB_ID_BYTES, STORE, Claim, peer_uid
from ddlcore.transports.sockets import owned

log = logging.getLogger("ddlcore")

# A real rank's handshake takes one round trip; this only bounds idle and slow strangers.
HANDSHAKE_TIMEOUT_S = 10.0
MAX_PENDING = 128
MAX_PENDING_PER_SOURCE = 32
MAX_CONNECTIONS = 4096
MAX_STORED_BYTES = 1 << 30
# Connections accepted per wake-up of the listener, so one flood cannot starve the others.
_ACCEPTS_PER_WAKE = 64
# How long the listener rests when the process is out of fds and nothing can be dropped.
_EMFILE_PAUSE_S = 0.1
# Timers kept before the answered waits' stale ones are swept out.
_COMPACT_TIMERS = 4096
# What the selector holds for a listening socket (a connection's is its _Conn).
_LISTENER = object()
# Least time between two lookups of a mismatched connector's owner (each reads the host's TCP
# tables: ~0.3 s with 20k sockets), so that wrong proofs cannot stall the store's thread.
_LOOKUP_INTERVAL_S = 1.0


class StoreServer(StoreConnections):
    """The rendezvous key-value server, listening on ``host:port`` (port 0: any free port) on
    every address ``host`` resolves to that this host has (``store_listen``).

    Parameters
    ----------
    host : str
        Name or address to bind; its addresses are served, no other (``0.0.0.0`` only if
        given).
    port : int
        TCP port; the bound port is in ``self.port``.
    backlog : int
        The listen backlog.
    job_key : JobKey, optional
        What clients must prove (default: `ddlcore.security.auth.default_key` of the bound port).
    max_connections : int
        Most connections open at once (authenticated or in their handshake).
    max_bytes : int
        Most bytes of values stored at once; a SET past it is answered with an error.

    Raises
    ------
    RendezvousError
        An address cannot be bound (in use), or none is an address of this host.
    """

    def __init__(
        self,
        host: str,
        port: int,
        backlog: int = 4096,
        job_key: JobKey | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_bytes: int = MAX_STORED_BYTES,
    ) -> None:
        listeners = take(host, port) or listen_all(host, port, backlog)
        for sock in listeners:
            owned(sock)
            sock.setblocking(False)
        self.host = host
        self.port: int = listeners[0].getsockname()[1]
        if job_key is None:
            job_key = default_key(self.port)
        self.job_key = job_key
        # This start of the job: clients learn it in their handshake and carry it in every
        # later claim, so a process of another start (same secret, same port) is told apart.
        self.job_id = secrets.token_bytes(JOB_ID_BYTES)
        job_key.job_id = self.job_id
        # rank -> (instance, pid, source, connections open): the process that holds the rank
        self._members: dict[int, tuple[bytes, int, str, int]] = {}
        self._next_lookup = 0.0  # when `_mismatch` may read the socket tables again
        self.max_connections = max(1, int(max_connections))
        self._listeners = listeners
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        for sock in listeners:
            self._selector.register(sock, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._listening = True
        self._conns: dict[socket.socket, _Conn] = {}
        self._pending: dict[_Conn, None] = {}  # in their handshake, oldest first
        self._pending_by_source: dict[str, dict[_Conn, None]] = {}
        self._table = StoreTable(self._reply, self._timer, int(max_bytes))
        self._timers: list[tuple[float, int, object]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._nclients = 0  # authenticated connections (under _cond: other threads read it)
        self._stop = False
        self._thread = threading.Thread(
            target=self._loop, name=f"ddl-store-{self.port}", daemon=True
        )
        self._thread.start()

    def sockname(self) -> tuple[str, int]:
        """The (first) address and the port actually bound."""
        return self._listeners[0].getsockname()[:2]

    def socknames(self) -> list[tuple[str, int]]:
        """Every address served, with the port."""
        return [sock.getsockname()[:2] for sock in self._listeners]

    # --- the event loop -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop:
                timeout = None
                if self._timers:
                    timeout = max(0.0, self._timers[0][0] - time.monotonic())
                for skey, events in self._selector.select(timeout):
                    obj = skey.fileobj
                    if skey.data is _LISTENER:
                        self._guarded(functools.partial(self._accept, obj))  # type: ignore[arg-type]
                    elif obj is self._wake_r:
                        self._drain_wake()
                    else:
                        conn = skey.data
                        try:
                            if events & selectors.EVENT_WRITE:
                                self._write(conn)
                            if events & selectors.EVENT_READ and not conn.closed:
                                self._read(conn)
                        except Exception as exc:  # noqa: BLE001 - one connection, not the loop
                            self._drop(conn, f"error serving it: {exc!r}")
                self._guarded(self._fire_timers)
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn, None)
            self._selector.close()
            for sock in self._listeners:
                sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:  # noqa: BLE001 - a bug here must not stop the store for everyone
            log.debug("store %d: internal error", self.port, exc_info=True)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, addr = listener.accept()
                owned(sock)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if not self._drop_oldest_pending(None):
                        self._pause_listening()
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                return  # the listener was closed
            source = addr[0] if isinstance(addr, tuple) else str(addr)
            by_source = self._pending_by_source.get(source)
            if by_source is not None and len(by_source) >= MAX_PENDING_PER_SOURCE:
                self._drop_oldest_pending(source)
            if len(self._pending) >= MAX_PENDING:
                self._drop_oldest_pending(None)
            if len(self._conns) >= self.max_connections and not self._drop_oldest_pending(None):
                log.debug(
                    "store %d: refused a connection from %s: %d connections open",
                    self.port,
                    source,
                    len(self._conns),
                )
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            acceptor = self.job_key.acceptor(
                STORE,
                sock.getsockname(),
                confirm=functools.partial(self._confirm, source=source),
                answer=self.job_id,
            )
            conn = _Conn(
                sock, source, acceptor, time.monotonic() + HANDSHAKE_TIMEOUT_S, need=acceptor.wants
            )
            self._conns[sock] = conn
            self._pending[conn] = None
            self._pending_by_source.setdefault(source, {})[conn] = None
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._timer(conn.deadline, conn)

    def _pause_listening(self) -> None:
        if self._listening:
            for sock in self._listeners:
                self._selector.unregister(sock)
            self._listening = False
            self._timer(time.monotonic() + _EMFILE_PAUSE_S, _LISTENER)

    def _drop_oldest_pending(self, source: str | None) -> bool:
        pool = self._pending if source is None else self._pending_by_source.get(source, {})
        if not pool:
            return False
        self._drop(next(iter(pool)), "over the cap on connections in their handshake")
        return True

    def _timer(self, when: float, what: object) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), what))
        if len(self._timers) > _COMPACT_TIMERS and len(self._timers) > 4 * (len(self._conns) + 1):
            # Answered waits leave their timers behind until due: drop those now and then.
            self._timers = [t for t in self._timers if self._live(t[2])]
            heapq.heapify(self._timers)

    def _live(self, what: object) -> bool:
        if isinstance(what, Wait):
            return what.conn.wait is what and not what.conn.closed
        if isinstance(what, _Conn):
            return not what.closed and what.phase == _HANDSHAKE
        return True

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, what = heapq.heappop(self._timers)
            if what is _LISTENER:
                if not self._listening and not self._stop:
                    for sock in self._listeners:
                        self._selector.register(sock, selectors.EVENT_READ, _LISTENER)
                    self._listening = True
            elif isinstance(what, _Conn):
                if self._live(what):
                    self._drop(what, "handshake not finished in time")
            elif isinstance(what, Wait):
                if self._live(what):
                    self._table.expire(what)

    # --- the job's own failures at the door --------------------------------------------------

    def _confirm(self, claim: Claim, *, source: str) -> str | None:
        """After its proof: refuse a rank that another process of the job holds already, and
        fail the job (two processes claim one rank: one is left from an earlier start)."""
        if claim.src < 0:
            return None
        held = self._members.get(claim.src)
        if held is None or held[0] == claim.instance:
            return None
        why = (
            f"two processes claim rank {claim.src}: pid {held[1]} from {held[2]} joined first, "
            f"pid {claim.pid} from {source} came later; one of them is left from an earlier "
            "start of this job (same secret, same port): stop it, then start the job again"
        )
        if not self._table.barriers_met:  # at the start: every rank hears it; later, only it
            self._table.fail(why)
        return why

    def _joined(self, conn: _Conn, claim: Claim) -> None:
        if claim.src >= 0:
            held = self._members.get(claim.src)
            count = held[3] if held is not None else 0
            self._members[claim.src] = (claim.instance, claim.pid, conn.source, count + 1)

    def _left(self, conn: _Conn) -> None:
        """A rank's process gives the rank back when its last connection closes (a process
        that takes it later is no duplicate)."""
        held = self._members.get(conn.rank) if conn.rank is not None else None
        if held is not None:
            if held[3] <= 1:
                del self._members[conn.rank]  # type: ignore[arg-type]
            else:
                self._members[conn.rank] = (*held[:3], held[3] - 1)  # type: ignore[index]

    def _mismatch(self, conn: _Conn) -> None:
        """A connector's proof was wrong, or it found ours wrong: the secrets differ. Where the
        connector is a process of this user on this host (the owner of its socket, from the
        kernel's tables), it is the job's own rank, not a stranger: fail the job at once, so
        that no rank waits out its timeout, saying where each secret came from. A stranger's
        wrong proof, or one from another host, only drops its connection."""
        claim = conn.acceptor.unproven if conn.acceptor is not None else None
        if claim is None or claim.src < 0 or self._table.barriers_met:
            return  # not a rank, or past the start: a running job is never failed from here
        now = time.monotonic()
        if now < self._next_lookup:  # each lookup reads the host's socket tables: rationed
            return
        self._next_lookup = now + _LOOKUP_INTERVAL_S
        if peer_uid(conn.sock) != os.getuid():
            return
        self._table.fail(
            f"rank {claim.src} (pid {claim.pid}) holds another job secret than the store's: the "
            f"store's comes from {self.job_key.origin or 'unknown'}, rank {claim.src}'s from "
            f"{printable(claim.origin.encode('ascii', 'replace')) or 'unknown'} (as it says); "
            "give every rank the same DDL_SECRET or DDL_SECRET_FILE (or none: ddlrun and "
            "mpiexec provide one)"
        )

    # --- what other threads may call --------------------------------------------------------

    def clients(self) -> int:
        """How many authenticated client connections are open."""
        with self._cond:
            return self._nclients

    def stats(self) -> dict[str, int]:
        """What the server holds now (approximate when read while it serves): connections
        open and in their handshake, keys, bytes of values, open barriers, parked waits."""
        return {
            "connections": len(self._conns),
            "pending": len(self._pending),
            "clients": self.clients(),
            **self._table.stats(),
        }

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no client is connected (at most ``timeout`` seconds); True if none is."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._nclients, timeout)

    def close(self, timeout: float = 5.0, linger: float = 0.0) -> None:
        """Stop serving: drop every client connection and join the server's thread.

        Parameters
        ----------
        timeout : float
            Seconds to wait for the server's thread to end.
        linger : float
            Seconds to first let clients finish and disconnect on their own, so that the
            answer to a client's last request is not cut off.
        """
        if self._stop:
            return
        if linger > 0:
            self.wait_idle(linger)
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
