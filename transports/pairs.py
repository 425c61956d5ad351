"""Pairs made on first use: `PairTableContext`, the table of a context's pairs with the
``pair()`` every thread-driven transport shares (fast path, argument checks, connect) and the
rule that an abort reaches every pair; `LazyPair`, a pair's connect-once under a lock; and
`MatchedPair`, a pair whose failure state is its `Matcher`'s.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ddlcore.transports.base import Context, Pair
from ddlcore.transports.common import Matcher, ThreadRequest, check_peer, copy_error, relay_of

from ddlcore.errors import DDLError


class PairTableContext(Context):
    """A context whose pairs are made on first use, by ``pair()`` or by a peer reaching us first.
    An abort reaches every pair, also those made after it. An abort a peer tells us of
    (`_note_abort`, called by the pair that heard it, before it fails itself) aborts the whole
    context in turn, once: every pair fails with the same class, origin and cause, the peers
    still waiting on us hear of it, and ``on_abort`` passes it to the communicator's other
    contexts. Subclasses call ``_init_pairs()``, implement ``_new_pair(peer)`` and, unless their
    pairs are `LazyPair`s, ``_connect_pair(pair)``; their pairs have ``_connected``."""

    rank: int
    size: int
    timeout: float
    _closed: bool
    _label = ""  # the transport as messages name it ("TCP", "shm", "UCX")

    def pair(self, peer: int) -> Pair:
        found = self._pairs.get(peer)
        if found is not None and found._connected:
            return found  # the fast path: no lock
        check_peer(self.rank, self.size, peer, self._closed, self._label)
        found = self._pair_for(peer)
        self._connect_pair(found)
        return found

    def _connect_pair(self, pair: Any) -> None:
        """Connect ``pair`` (a `LazyPair`) within the context's deadline; an aborted pair fails
        its requests, so there is nothing to connect."""
        if pair._failure is None:
            pair._connect(time.monotonic() + self.timeout)

    def _init_pairs(self) -> None:
        self._lock = threading.Lock()
        self._pairs: dict[int, Any] = {}
        self._failure: tuple[int, str] | None = None  # (code, reason) of our abort
        self._first_abort: DDLError | None = None  # the first abort a peer told us of

    def _new_pair(self, peer: int) -> Any:
        raise NotImplementedError

    def _pair_for(self, peer: int) -> Any:
        with self._lock:
            found = self._pairs.get(peer)
            if found is None:
                found = self._pairs[peer] = self._new_pair(peer)
                failure = self._failure
            else:
                failure = None
        if failure is not None:  # outside the lock: aborting a pair may need it
            found.abort(*failure)
        return found

    def _pair_list(self) -> list[Any]:
        return list(self._pairs.values())  # one C-level copy: safe against a concurrent insert

    def _note_abort(self, error: DDLError) -> None:
        """A peer told us it aborted (``error``, from `abort_error`): unless we aborted already,
        abort every pair with it (the peers waiting on us then hear of it without waiting out
        their deadline) and tell ``on_abort``. Called from a transport thread; a plain
        `DDLError` of our own (no origin) is only noted."""
        with self._lock:
            if self._first_abort is None:
                self._first_abort = error
            if error.origin is None or self._failure is not None or self._closed:
                return
            self._failure = relay = relay_of(error)
            pairs = self._pair_list()
        for p in pairs:
            p.abort(*relay)
        hook = self.on_abort
        if hook is not None:
            try:
                hook(*relay)
            except Exception:  # best effort: this pair's own failure must still go on
                pass

    def abort(self, code: int, reason: str) -> None:
        with self._lock:
            if self._closed:
                return
            if self._failure is None:
                self._failure = (code, reason)
            pairs = self._pair_list()
        for p in pairs:
            p.abort(code, reason)


class LazyPair:
    """What a pair that connects on first use shares: `connect` opens the connection once,
    under a lock; its error is kept and raised again by every later call, and when the job was
    already failing (an abort a peer told the context of) it names that root cause first.
    Subclasses set ``_ctx``, ``rank``, ``peer`` and ``_connected``, call ``_init_connect()`` and
    implement ``_open(deadline)``."""

    rank: int
    peer: int
    _ctx: PairTableContext
    _connected: bool

    def _init_connect(self) -> None:
        self._connect_lock = threading.Lock()
        self._connect_error: DDLError | None = None

    def _open(self, deadline: float) -> None:
        raise NotImplementedError

    def _connect(self, deadline: float) -> None:
        with self._connect_lock:
            if self._connected:
                return
            if self._connect_error is not None:
                raise copy_error(self._connect_error)
            try:
                self._open(deadline)
            except DDLError as exc:
                cause = self._ctx._first_abort
                if cause is not None:  # the job was already failing: report the root cause
                    exc = type(cause)(
                        f"{cause} (afterwards rank {self.rank} could not connect "
                        f"to rank {self.peer}: {exc})"
                    )
                self._connect_error = exc
                raise copy_error(exc) from None
            self._connected = True


class MatchedPair:
    """A pair whose receives one `Matcher` serves (shm, ucx): the pair has failed (an abort
    either side, a local close) or lost its peer (closed, died) when its matcher has."""

    _matcher: Matcher[Any]

    @property
    def _failure(self) -> DDLError | None:
        """Final: an abort (either side) or a local close."""
        return self._matcher.failure

    @property
    def _lost(self) -> str | None:
        """Why the peer is gone (closed, died): the start of the PeerFailureErrors."""
        return self._matcher.lost

    def _error_for(self, req: ThreadRequest) -> DDLError:
        """The error a request of this pair fails with now."""
        return self._matcher.error_for(req)
