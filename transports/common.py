"""Pieces every thread-driven transport shares: the request a waiter blocks on, argument checks,
and the wording of mismatch, abort and timeout errors (tests match on it, so it lives once).

A transport whose requests are completed by its own threads (tcp's socket threads, shm's
progress thread) uses `ThreadRequest`: the waiter blocks on a lock that completion releases.
Its pair object provides ``_timeout_error(request, timeout)`` for the message of a timed-out wait.
"""

from __future__ import annotations

import threading
from _thread import allocate_lock
from collections import deque
from typing import Any

from ddlcore.transports.base import (
    ABORT_MISMATCH,
    ABORT_PEER_FAILURE,
    ABORT_TIMEOUT,
    Context,
    DeviceView,
    Request,
    Store,
)

from ddlcore.auth import JobKey
from ddlcore.errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
    abort_reason,
    parse_reason,
    root_cause,
)

MAX_TAG = (1 << 64) - 1
MAX_CHECK = (1 << 32) - 1
ABORT_CLASS = {ABORT_MISMATCH: CollectiveMismatchError, ABORT_TIMEOUT: DDLTimeoutError}


def loaded_libraries(fragment: str) -> list[str]:
    """Paths of the shared libraries mapped into this process whose path contains ``fragment``
    (from /proc/self/maps; [] where it cannot be read). How a transport finds the very library
    its Python binding loaded privately, to ask it something the binding does not wrap."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if fragment in path and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def take_oldest(table: dict[int, deque], tag: int) -> Any:
    """Remove and return the oldest entry queued under ``tag`` in a table of per-tag queues
    (posted receives, unexpected messages), or None; an emptied queue leaves the table, so the
    table only ever holds what is pending."""
    queue = table.get(tag)
    if not queue:
        return None
    item = queue.popleft()
    if not queue:
        del table[tag]
    return item


def queue_under(table: dict[int, deque], tag: int, item: Any) -> None:
    """Append ``item`` to the queue of ``tag`` (matching takes the oldest first)."""
    queue = table.get(tag)
    if queue is None:
        table[tag] = deque((item,))
    else:
        queue.append(item)


def copy_error(error: DDLError) -> DDLError:
    """A fresh instance of ``error`` for one request (an exception object is raised once)."""
    new = type(error)(str(error))
    new.cause, new.origin = error.cause, error.origin
    if isinstance(error, PeerFailureError) and isinstance(new, PeerFailureError):
        new.peer = error.peer
    return new


def job_key_of(store: Store, transport: str) -> JobKey:
    """The job's key the rendezvous store carries, which ``transport`` proves on its connections.

    Raises
    ------
    DDLError
        The store has none (a store object made outside ``ddlcore.store``).
    """
    key = getattr(store, "job_key", None)
    if not isinstance(key, JobKey):
        raise DDLError(f"the {transport} transport authenticates its connections with the job's "
                       f"key, but the rendezvous store it was given ({type(store).__name__}) has "
                       "no job_key; pass a ddlcore.store.StoreClient (or a PrefixStore over one)")
    return key


def seconds(t: float) -> str:
    return f"{t:.1f}" if t >= 1 else f"{t:.2g}"


def as_view(view: object) -> memoryview:
    """A flat byte view of ``view`` (TypeError for a non-contiguous buffer; ValueError for
    device memory, which only pairs with ``device_memory`` take)."""
    if type(view) is not memoryview:
        if isinstance(view, DeviceView):
            raise ValueError(f"{view!r}: this transport moves host memory only; device memory "
                             "must be staged through host memory (the device engine does that)")
        view = memoryview(view)  # type: ignore[arg-type]
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def check_tag(tag: int, check: int) -> None:
    if not (0 <= tag <= MAX_TAG and 0 <= check <= MAX_CHECK):
        raise ValueError(f"tag={tag} must be in [0, 2**64) and check={check} in [0, 2**32)")


def check_peer(rank: int, size: int, peer: int, closed: bool, transport: str) -> None:
    """The checks of ``Context.pair(peer)``: a real other rank, on an open context."""
    if not 0 <= peer < size or peer == rank:
        raise ValueError(f"peer={peer}: rank {rank} of {size} has no such peer")
    if closed:
        raise CommunicatorClosedError(f"rank {rank}: the {transport} context is closed")


def recv_view(view: object, tag: int, check: int) -> memoryview:
    """Validate the arguments of an ``irecv`` and return its flat, writable view."""
    view = as_view(view)
    if view.readonly and view.nbytes:
        raise ValueError("view must be writable to receive into it")
    check_tag(tag, check)
    return view


def checks_match(sent: int, posted: int) -> bool:
    """A zero check word on either side matches anything."""
    return not (sent and posted and sent != posted)


def mismatch_error(peer: int, rank: int, tag: int, sent_nbytes: int, sent_check: int,
                   posted_nbytes: int, posted_check: int) -> CollectiveMismatchError:
    return CollectiveMismatchError(
        f"rank {peer} sent {sent_nbytes} bytes with check {sent_check:#010x} for tag "
        f"{tag:#x}, rank {rank} posted {posted_nbytes} bytes with check "
        f"{posted_check:#010x}: the ranks are calling different collectives, or the same one "
        "with a different size, dtype, op or root")


def abort_error(code: int, who: int, reason: str, peer: int | None = None) -> DDLError:
    """The error for rank ``who`` having aborted with ``code`` and ``reason`` (raised by its
    peers when told, and by ``who`` itself, with ``peer`` the other end of the pair)."""
    origin, cause = parse_reason(reason)
    if origin is None or origin == who:  # ``who`` failed itself
        origin, cause = who, f"rank {who} aborted: {cause}"
        text = cause
    elif peer is not None:  # we pass on the failure of rank ``origin``: say its cause alone
        text = cause
    else:  # ``who`` relays the failure of rank ``origin``
        text = f"{cause} (reported by rank {who})"
    cls = ABORT_CLASS.get(code, PeerFailureError)
    err = cls(text)
    err.cause, err.origin = cause, origin
    if isinstance(err, PeerFailureError):
        err.peer = origin if origin != who or peer is None else peer
    return err


def relay_of(error: DDLError) -> tuple[int, str]:
    """The ``(code, reason)`` with which a rank that heard of ``error`` (an abort a peer told
    it of, `abort_error`) passes it on: the same class, the same origin, the cause once."""
    code = (ABORT_MISMATCH if isinstance(error, CollectiveMismatchError) else
            ABORT_TIMEOUT if isinstance(error, DDLTimeoutError) else ABORT_PEER_FAILURE)
    return code, abort_reason(error, root_cause(error))


def timeout_error(rank: int, peer: int, req: ThreadRequest, timeout: float,
                  note: str = "") -> DDLTimeoutError:
    if req.is_send:
        what = f"to send {req.nbytes} bytes with tag {req.tag:#x} to rank {peer}"
    else:
        what = f"for a message with tag {req.tag:#x} from rank {peer}"
    return DDLTimeoutError(f"rank {rank} waited {seconds(timeout)} s {what}{note}")


# Finishing a request is check-then-set: two threads may race to finish one (a reader completing
# the receive it is filling while an abort fails it), and only one may release its lock.
_FINISHING = allocate_lock()


class ThreadRequest(Request):
    """A pending send or receive, finished exactly once by whichever thread took it out of the
    transport's queues; completion releases a lock the waiter blocks on (cheaper than an Event).
    ``view`` is what the pair took: a flat byte memoryview, or a `DeviceView` on a pair with
    ``device_memory``."""

    __slots__ = ("_lock", "_done", "_error", "_pair", "tag", "view", "check", "nbytes", "is_send")

    def __init__(self, pair: Any, view: memoryview | DeviceView, tag: int, check: int,
                 is_send: bool) -> None:
        self._lock = allocate_lock()
        self._lock.acquire()
        self._done = False
        self._error: DDLError | None = None
        self._pair = pair
        self.view, self.tag, self.check, self.nbytes, self.is_send = (
            view, tag, check, len(view), is_send)

    def _complete(self) -> None:
        with _FINISHING:
            if self._done:
                return
            self._done = True
        self._lock.release()

    def _fail(self, error: DDLError) -> None:
        with _FINISHING:
            if self._done:
                return
            self._error = error
            self._done = True
        self._lock.release()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            if timeout is None:
                self._lock.acquire()
            elif not self._lock.acquire(True, max(0.0, timeout)):
                raise self._pair._timeout_error(self, timeout)
            self._lock.release()  # let any other waiter through too
        if self._error is not None:
            raise copy_error(self._error)

    def test(self) -> bool:
        if not self._done:
            return False
        if self._error is not None:
            raise copy_error(self._error)
        return True

    def describe(self) -> str:
        if self.is_send:
            return f"was sending {self.nbytes} bytes with tag {self.tag:#x}"
        return f"waited for a message with tag {self.tag:#x}"



class PairTableContext(Context):
    """A context whose pairs are made on first use, by ``pair()`` or by a peer reaching us first.
    An abort reaches every pair, also those made after it. An abort a peer tells us of
    (`_note_abort`, called by the pair that heard it, before it fails itself) aborts the whole
    context in turn, once: every pair fails with the same class, origin and cause, the peers
    still waiting on us hear of it, and ``on_abort`` passes it to the communicator's other
    contexts. Subclasses call ``_init_pairs()`` and implement ``_new_pair(peer)``."""

    rank: int
    _closed: bool

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
