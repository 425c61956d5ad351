"""Async handles and the in-order executor behind them.

Collectives must run in the same order on every rank, so a communicator executes them strictly
in the order they were called: synchronous calls run inline when nothing is queued, otherwise they
queue behind the asynchronous ones. Async calls are queued to one worker thread per communicator
and return a `Handle` at once; the caller computes while the worker (and the transports' threads)
move and reduce the data.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ddlcore.errors import CommunicatorClosedError, DDLTimeoutError

_log = logging.getLogger("ddlcore")


class Handle:
    """The pending result of an async collective: `wait(timeout)` returns it, `done()` polls."""

    def __init__(self, label: str, default_timeout: float) -> None:
        self.label = label
        # A point-to-point receive's: the rank its message came from (known once it completed,
        # when the receive named ANY_SOURCE); None for sends and collectives.
        self.source: int | None = None
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._default_timeout = default_timeout
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Handle], Any]] | None = []

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks or [], None
        for fn in callbacks:
            self._call(fn)

    def _call(self, fn: Callable[[Handle], Any]) -> None:
        try:
            fn(self)
        except BaseException:  # a callback's bug must not take the communicator's worker down
            _log.exception("ddlcore: a done-callback of %s raised", self.label)

    def add_done_callback(self, fn: Callable[[Handle], Any]) -> None:
        """Call ``fn(handle)`` once the collective finishes, successfully or not.

        ``fn`` runs on the communicator's worker thread (or at once, on this thread, if the
        collective already finished); it should be short and must not start a collective of the
        same communicator, which would wait behind the one that is calling it. Inside ``fn``,
        ``handle.wait(0)`` returns the result or raises the collective's error. An exception
        ``fn`` raises is logged, not propagated.
        """
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def done(self) -> bool:
        """True once the collective finished (successfully or not); never blocks."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective finishes and return its result.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait. None waits as long as the collectives queued before this one and
            this one may take (each is bounded by ``DDL_TIMEOUT``), so it never hangs.

        Raises
        ------
        DDLTimeoutError
            Not finished within ``timeout``; the collective keeps running, wait again later.
        DDLError
            The collective failed; the error says which rank, collective and step.
        """
        limit = self._default_timeout if timeout is None else timeout
        if not self._event.wait(limit):
            raise DDLTimeoutError(f"{self.label} not complete after waiting {limit:g} s")
        if self._error is not None:
            raise self._error
        return self._result


class Executor:
    """Runs jobs one at a time in submission order (inline when idle, else on a worker thread)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._queue: deque[tuple[Callable[[int], Any], int, Handle]] = deque()
        self._next_seq = 0
        self._run_lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._closed = False

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def submit(self, job: Callable[[int], Any], handle: Handle) -> Handle:
        """Queue ``job(seq)``; the sequence number is taken now, in call order."""
        with self._cv:
            if self._closed:
                raise CommunicatorClosedError(f"{handle.label}: the communicator is closed")
            self._queue.append((job, self._take_seq(), handle))
            if self._worker is None:
                self._worker = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._worker.start()
            self._cv.notify()
        return handle

    def run_inline(self, job: Callable[[int], Any], make_handle: Callable[[], Handle]) -> Any:
        """Run ``job(seq)`` now if nothing is queued (the fast path), else queue it behind the
        others with a handle from ``make_handle()`` and wait for it."""
        with self._cv:
            if self._closed:
                raise CommunicatorClosedError(f"{make_handle().label}: the communicator is closed")
            idle = not self._queue and not self._run_lock.locked()
            if idle:
                self._run_lock.acquire()
                seq = self._take_seq()
        if idle:
            try:
                return job(seq)
            finally:
                self._run_lock.release()
        return self.submit(job, make_handle()).wait()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job, seq, handle = self._queue[0]
            with self._run_lock:
                try:
                    handle._finish(result=job(seq))
                except BaseException as exc:  # delivered to whoever waits on the handle
                    handle._finish(error=exc)
            with self._cv:
                self._queue.popleft()
                self._cv.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until every queued job ran; False if ``timeout`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue, timeout)

    def pending(self) -> int:
        with self._cv:
            return len(self._queue)

    def close(self, timeout: float) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout)
            self._worker = None
