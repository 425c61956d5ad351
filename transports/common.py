"""Pieces every thread-driven transport shares: the request a waiter blocks on (`ThreadRequest`),
the tag matching of received messages and the failure rules of receives (`Matcher`), argument
checks, and the wording of mismatch, abort and timeout errors (tests match on it, so it lives once).

A transport whose requests are completed by its own threads (tcp's socket threads, shm's
progress thread, ucx's progress thread) uses `ThreadRequest`: the waiter blocks on a lock that
completion releases. Its pair object provides ``_timeout_error(request, timeout)`` for the
message of a timed-out wait.
"""

from __future__ import annotations

import threading
from _thread import allocate_lock
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ddlcore.transports.base import (
    ABORT_MISMATCH,
    ABORT_OTHER,
    ABORT_PEER_FAILURE,
    ABORT_REVOKED,
    ABORT_TIMEOUT,
    DeviceView,
    Request,
    Store,
)

from ddlcore.errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    CommunicatorRevokedError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
    abort_reason,
    parse_reason,
    root_cause,
)
from ddlcore.security.auth import JobKey

_T = TypeVar("_T")

MAX_TAG = (1 << 64) - 1
MAX_CHECK = (1 << 32) - 1
ABORT_CLASS: dict[int, type[DDLError]] = {
    ABORT_MISMATCH: CollectiveMismatchError,
    ABORT_TIMEOUT: DDLTimeoutError,
    ABORT_REVOKED: CommunicatorRevokedError,  # before PeerFailureError, its base: see abort_code
}


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


def copy_error(error: DDLError) -> DDLError:
    """A fresh instance of ``error`` for one request (an exception object is raised once)."""
    new = type(error)(str(error))
    new.cause, new.origin = error.cause, error.origin
    if isinstance(error, PeerFailureError) and isinstance(new, PeerFailureError):
        new.peer = error.peer
    for name in ("sent", "posted"):  # a mismatch's facts (`mismatch_error`)
        if hasattr(error, name):
            setattr(new, name, getattr(error, name))
    return new


def job_key_of(store: Store, transport: str) -> JobKey:
    """The job's key the rendezvous store carries, which ``transport`` proves on its connections.

    Raises
    ------
    DDLError
        The store has none (a store object made outside ``ddlcore.job.store``).
    """
    key = getattr(store, "job_key", None)
    if not isinstance(key, JobKey):
        raise DDLError(
            f"the {transport} transport authenticates its connections with the job's "
            f"key, but the rendezvous store it was given ({type(store).__name__}) has "
            "no job_key; pass a ddlcore.job.store.StoreClient (or a PrefixStore over one)"
        )
    return key


def seconds(t: float) -> str:
    return f"{t:.1f}" if t >= 1 else f"{t:.2g}"


def as_view(view: object) -> memoryview:
    """A flat byte view of ``view`` (TypeError for a non-contiguous buffer; ValueError for
    device memory, which only pairs with ``device_memory`` take)."""
    if type(view) is not memoryview:
        if isinstance(view, DeviceView):
            raise ValueError(
                f"{view!r}: this transport moves host memory only; device memory "
                "must be staged through host memory (the device engine does that)"
            )
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


def mismatch_error(
    peer: int,
    rank: int,
    tag: int,
    sent_nbytes: int,
    sent_check: int,
    posted_nbytes: int,
    posted_check: int,
) -> CollectiveMismatchError:
    """The error of a message that does not match the receive posted for it. It carries
    ``sent`` = (peer, nbytes, check) and ``posted`` (nbytes): the engine, which knows the call,
    names the peer's (`ddlcore.execution.check_words.describe_check`); a transport knows bytes and check words
    only."""
    err = CollectiveMismatchError(
        f"rank {peer} sent {sent_nbytes} bytes with check {sent_check:#010x} for tag "
        f"{tag:#x}, rank {rank} posted {posted_nbytes} bytes with check "
        f"{posted_check:#010x}: the ranks are calling different collectives, or the same one "
        "with a different size, dtype, op or root, or with device (CUDA) buffers on some ranks "
        "and host buffers on others, whose schedules are chunked differently unless "
        "DDL_CHUNK_BYTES is set"
    )
    err.sent = (peer, sent_nbytes, sent_check)  # type: ignore[attr-defined]
    err.posted = posted_nbytes  # type: ignore[attr-defined]
    return err


def abort_code(exc: BaseException) -> int:
    """The code an abort note carries for ``exc``: the one `abort_error` turns back into its
    class, ABORT_OTHER for an error of none of them."""
    found = next((code for code, cls in ABORT_CLASS.items() if isinstance(exc, cls)), None)
    if found is not None:
        return found
    return ABORT_PEER_FAILURE if isinstance(exc, PeerFailureError) else ABORT_OTHER


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
    if isinstance(err, CommunicatorRevokedError):
        err.peer = origin  # the rank that revoked, also on that rank's own pairs
    elif isinstance(err, PeerFailureError):
        err.peer = origin if origin != who or peer is None else peer
    return err


def relay_of(error: DDLError) -> tuple[int, str]:
    """The ``(code, reason)`` with which a rank that heard of ``error`` (an abort a peer told
    it of, `abort_error`) passes it on: the same class, the same origin, the cause once."""
    code = abort_code(error)
    return (ABORT_PEER_FAILURE if code == ABORT_OTHER else code), abort_reason(
        error, root_cause(error)
    )


def timeout_error(
    rank: int, peer: int, req: ThreadRequest, timeout: float, note: str = ""
) -> DDLTimeoutError:
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

    def __init__(
        self, pair: Any, view: memoryview | DeviceView, tag: int, check: int, is_send: bool
    ) -> None:
        self._lock = allocate_lock()
        self._lock.acquire()
        self._done = False
        self._error: DDLError | None = None
        self._pair = pair
        self.view, self.tag, self.check, self.nbytes, self.is_send = (
            view,
            tag,
            check,
            len(view),
            is_send,
        )

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


def _take_oldest(table: dict[int, deque[_T]], tag: int) -> _T | None:
    """Remove and return the oldest entry queued under ``tag``, or None; an emptied queue leaves
    the table, so the table only ever holds what is pending."""
    queue = table.get(tag)
    if not queue:
        return None
    item = queue.popleft()
    if not queue:
        del table[tag]
    return item


def _queue_under(table: dict[int, deque[_T]], tag: int, item: _T) -> None:
    """Append ``item`` to the queue of ``tag`` (matching takes the oldest first)."""
    queue = table.get(tag)
    if queue is None:
        table[tag] = deque((item,))
    else:
        queue.append(item)


@dataclass(slots=True)
class Message:
    """A message that arrived before a receive asked for it. ``data`` holds its payload once
    ``done`` (a transport may queue it while its payload is still coming in: ucx); ``failed``:
    the payload never came; ``waiter``: a receive posted meanwhile, handed the message by
    `Matcher.settle`."""

    check: int
    nbytes: int
    data: Any = None
    done: bool = True
    failed: bool = False
    waiter: ThreadRequest | None = None


_R = TypeVar("_R", bound="ThreadRequest")


class Matcher(Generic[_R]):
    """The tag matching of the messages one peer sends on one stream (a pair, or a tcp channel),
    and the failure rules of their receives, shared by tcp, shm and ucx.

    A receive matches the oldest unmatched message with its tag, whether the message arrived
    before the receive was posted (`post` finds it among the unexpected ones) or after
    (`take` / `offer` find the receive among the posted ones). A message must have the
    receive's size and a compatible check word, else the receive fails with
    `CollectiveMismatchError`. Two ways to stop: `fail` (an abort or a local close) fails every
    posted and later receive with one error and drops the unexpected messages; `lose` (the peer
    closed or died) fails the posted receives, while messages that had fully arrived stay
    receivable. Thread-safe: every method takes ``lock``; requests are finished outside it.
    """

    __slots__ = ("lock", "rank", "peer", "transport", "posted", "unexpected", "failure", "lost")

    def __init__(
        self, rank: int, peer: int, transport: str, lock: threading.Lock | None = None
    ) -> None:
        self.lock = threading.Lock() if lock is None else lock
        self.rank, self.peer, self.transport = rank, peer, transport
        self.posted: dict[int, deque[_R]] = {}
        self.unexpected: dict[int, deque[Message]] = {}
        self.failure: DDLError | None = None  # final: abort (either side) or local close
        self.lost: str | None = None  # why the peer is gone (a PeerFailureError prefix)

    # --- matching -------------------------------------------------------------------------------
    def post(self, req: _R) -> None:
        """Match the receive ``req`` against the messages already in, or queue it: it completes
        now, later, or fails (mismatch, failure, peer lost)."""
        msg = None
        with self.lock:
            if self.failure is None:
                msg = _take_oldest(self.unexpected, req.tag)
                if msg is not None:
                    if not msg.done and self.mismatch(req, msg.check, msg.nbytes) is None:
                        msg.waiter = req  # `settle` delivers once the payload is in
                        return
                elif self.lost is None:
                    _queue_under(self.posted, req.tag, req)
                    return
        if msg is None:
            req._fail(self.error_for(req))
        else:
            self.deliver(req, msg)

    def take(self, tag: int) -> _R | None:
        """The oldest receive posted for ``tag``, taken out (a message with it is coming in)."""
        with self.lock:
            return _take_oldest(self.posted, tag)

    def offer(self, tag: int, msg: Message) -> _R | None:
        """A message with ``tag`` came in: the oldest receive posted for it (taken out; the
        caller delivers), else None, ``msg`` then queued for a later receive unless the matcher
        failed (nobody will ask for it then)."""
        with self.lock:
            req = _take_oldest(self.posted, tag)
            if req is None and self.failure is None:
                _queue_under(self.unexpected, tag, msg)
            return req

    def arrived(self, tag: int, msg: Message) -> None:
        """A whole message with ``tag`` came in: deliver it to its receive or keep it."""
        req = self.offer(tag, msg)
        if req is not None:
            self.deliver(req, msg)

    def settle(self, msg: Message, failed: bool) -> None:
        """The payload of a queued ``msg`` is in (or ``failed``): hand it to its waiter, if any."""
        with self.lock:
            msg.done, msg.failed = True, failed
            waiter, msg.waiter = msg.waiter, None
        if waiter is not None:
            self.deliver(waiter, msg)

    def deliver(self, req: ThreadRequest, msg: Message) -> None:
        """Finish ``req`` with the message ``msg`` held for it."""
        error = self.mismatch(req, msg.check, msg.nbytes)
        if error is not None:
            req._fail(error)
        elif msg.failed:
            req._fail(self.error_for(req))
        elif not msg.nbytes or self.fill(req, msg.data):
            req._complete()

    def fill(self, req: ThreadRequest, data: Any) -> bool:
        """Copy a payload held in host memory into ``req``'s view; a failed copy into device
        memory fails this receive only (False)."""
        view = req.view
        if not isinstance(view, DeviceView):
            view[:] = data
            return True
        try:
            view.upload(memoryview(data))
        except Exception as exc:
            req._fail(
                DDLError(
                    f"rank {self.rank}: copying {req.nbytes} bytes from rank "
                    f"{self.peer} into device memory failed: {exc}"
                )
            )
            return False
        return True

    def mismatch(
        self, req: ThreadRequest, check: int, nbytes: int
    ) -> CollectiveMismatchError | None:
        """The error of a message of ``nbytes`` with ``check`` meeting ``req``, or None when
        they match (exact size; a zero check word on either side matches any)."""
        if nbytes == req.nbytes and checks_match(check, req.check):
            return None
        return mismatch_error(self.peer, self.rank, req.tag, nbytes, check, req.nbytes, req.check)

    # --- failing --------------------------------------------------------------------------------
    def error_for(self, req: ThreadRequest) -> DDLError:
        """The error a request of this stream fails with now."""
        if self.failure is not None:
            return copy_error(self.failure)
        if self.lost is not None:
            return PeerFailureError(f"{self.lost} rank {self.rank} {req.describe()}", self.peer)
        return CommunicatorClosedError(
            f"rank {self.rank}: the {self.transport} pair to rank {self.peer} is not connected "
            "(use Context.pair to get a pair)"
        )

    def fail(
        self, error: DDLError, others: Callable[[], Iterable[ThreadRequest]] | None = None
    ) -> bool:
        """Fail every posted and later receive with ``error`` (first error wins) and drop the
        unexpected messages; ``others`` (called once, only by the call that failed the matcher)
        gives the transport's own pending requests (sends) to fail with it. False if failed
        already."""
        with self.lock:
            if self.failure is not None:
                return False
            self.failure = error
            self.unexpected.clear()
            pending = self._take_posted()
        self._fail_taken(pending, others)
        return True

    def lose(self, why: str, others: Callable[[], Iterable[ThreadRequest]] | None = None) -> bool:
        """The peer is gone (``why``: the start of the `PeerFailureError`s, e.g. "rank 3 closed
        its connection while"): fail the posted receives, and ``others`` (see `fail`); messages
        fully arrived stay receivable, later receives that none satisfies fail. False if lost
        already."""
        with self.lock:
            if self.lost is not None:
                return False
            self.lost = why
            pending = self._take_posted()
        self._fail_taken(pending, others)
        return True

    def _take_posted(self) -> list[ThreadRequest]:
        pending: list[ThreadRequest] = [r for waiting in self.posted.values() for r in waiting]
        self.posted.clear()
        return pending

    def _fail_taken(
        self, pending: list[ThreadRequest], others: Callable[[], Iterable[ThreadRequest]] | None
    ) -> None:
        """Fail the receives taken out of ``posted`` and the requests ``others`` gives, each
        with `error_for` (outside the lock: failing a request may wake its waiter)."""
        if others is not None:
            pending += others()
        for req in pending:
            req._fail(self.error_for(req))
