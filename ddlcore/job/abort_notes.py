"""Abort notes: why a rank left, kept in the rendezvous store for peers that come later.

Pairs connect on first use, so a rank whose first message goes to a rank that already failed
and closed finds nobody to tell it why: a refused connection, a vanished segment, a lost
endpoint. So every rank that aborts writes ``abort/<rank>`` (the abort's code, then its
reason) into its communicator's store before its connections close, and a rank whose peer is
gone reads that note and fails with the abort itself, as if the peer had told it: ranks that
disagreed are told of the disagreement, not of a rank that left.

The note goes out on a thread of its own (an abort may come on a transport's thread, and the
store may be slow); closing the links, or the process's exit, waits for it a little. Reading
never waits for the note (it is there before the rank's connections close), and both ends wait
only briefly for the store: a failing rank must not sit behind another thread's wait or a
stalled store before it tells its peers.
"""

from __future__ import annotations

import atexit
import struct
import threading
import time
from typing import Any

from ddlcore.errors import DDLError, PeerFailureError
from ddlcore.transports.base import MAX_ABORT_REASON_BYTES
from ddlcore.transports.common import abort_error

KEY = "abort/{}"
_CODE = struct.Struct("<I")  # the abort code, before the reason's UTF-8
# How long posting a note may take: closing (or the exit) waits this long for it. A store
# round trip is milliseconds, also across hosts; a store that takes longer has stalled.
POST_S = 2.0
# How long a failing rank waits for the store (its connection, then the reply) to read a
# peer's note, before it fails with what it knows.
READ_S = 0.5

_pending: set[threading.Thread] = set()  # notes on their way, joined at exit
_pending_lock = threading.Lock()
_at_exit = False


def _join_at_exit() -> None:
    """A rank whose failure ends its process (nobody closes the communicator) still leaves
    its notes, before the process's connections and shared memory go."""
    deadline = time.monotonic() + POST_S
    for thread in list(_pending):
        thread.join(max(0.0, deadline - time.monotonic()))


class Note:
    """The note of one rank of one communicator (its ``store``): posted once, by `post`."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store, self._rank = store, rank
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def post(self, code: int, reason: str) -> None:
        """Start posting the abort (``code``, ``reason``); later calls do nothing."""
        global _at_exit
        with self._lock:
            if self._thread is not None:
                return
            thread = threading.Thread(
                target=self._write,
                args=(code, reason),
                daemon=True,
                name=f"ddlcore-rank{self._rank}-abort-note",
            )
            with _pending_lock:
                if not _at_exit:
                    # Registered now, after the shared memory's and the store's own exit
                    # hooks, so that it runs before them (last registered, first run).
                    atexit.register(_join_at_exit)
                    _at_exit = True
            _pending.add(thread)  # before it starts: it drops itself when done
            try:
                thread.start()
            except RuntimeError:  # no thread to be had (interpreter exit): no note
                _pending.discard(thread)
                return
            self._thread = thread

    def _write(self, code: int, reason: str) -> None:
        try:
            post = getattr(self._store, "post", None)  # ddlcore's store client has it
            if post is not None:
                post(KEY.format(self._rank), note_bytes(code, reason), POST_S)
        except Exception:  # the store is gone (rank 0 left) or stalled: peers hear less
            pass
        finally:
            _pending.discard(threading.current_thread())

    def wait(self) -> None:
        """Wait (at most `POST_S`) until the note is written, if one is on its way."""
        if self._thread is not None:
            self._thread.join(POST_S)


def explain(exc: DDLError, rank: int, store: Any) -> DDLError:
    """The failure behind ``exc``, where ``exc`` only says that a peer is gone (a
    `PeerFailureError` with no origin: could not connect, its memory vanished, its
    connection dropped) and that peer left a note in ``store``.

    Parameters
    ----------
    exc : DDLError
        What this rank (``rank``) saw.
    rank : int
        This rank.
    store : store client
        The communicator's store (a `PrefixStore`); one without ``lookup`` reads no notes.

    Returns
    -------
    DDLError
        The peer's abort, as if the peer had told us (`abort_error`); else ``exc``.
    """
    peer = getattr(exc, "peer", None)
    lookup = getattr(store, "lookup", None)
    if (
        not isinstance(exc, PeerFailureError)
        or exc.origin is not None  # a peer's own account already
        or not isinstance(peer, int)
        or peer == rank
        or lookup is None
    ):
        return exc
    try:
        note = lookup(KEY.format(peer), READ_S)
    except (DDLError, OSError, ValueError):
        return exc
    return from_note(note, peer) or exc


def from_note(note: bytes | None, peer: int) -> DDLError | None:
    """The error rank ``peer``'s note says it aborted with; None for no note, or one that is
    not well formed."""
    if note is None or len(note) < _CODE.size:
        return None
    (code,) = _CODE.unpack_from(note)
    reason = note[_CODE.size : _CODE.size + MAX_ABORT_REASON_BYTES].decode("utf-8", "replace")
    try:
        return abort_error(code, peer, reason)
    except Exception:  # a malformed reason: what we saw ourselves stands
        return None


def note_bytes(code: int, reason: str) -> bytes:
    """A note's bytes, as `Note` writes them (for tests and tools)."""
    return _CODE.pack(code) + reason.encode("utf-8", "replace")[:MAX_ABORT_REASON_BYTES]
