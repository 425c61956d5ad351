"""Async handles and the in-order executor behind them.

Collectives must run in the same order on every rank, so a communicator executes them strictly
in the order they were called: synchronous calls run inline when nothing is queued, otherwise they
queue behind the asynchronous ones. Async calls are queued to one worker thread per communicator
and return a `Handle` at once; the caller computes while the worker (and the transports' threads)
move and reduce the data. A caller that waits on a call the worker has not started yet, with
nothing running before it, runs it itself: waking the worker would cost more than the call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ddlcore.errors import CommunicatorClosedError, DDLTimeoutError

_log = logging.getLogger("ddlcore")


class Completion:
    """Whether a call finished, and a wait for it. Most calls finish before anyone waits, so the
    Event behind a wait (a Condition and a Lock) is made only by a waiter that must block."""

    __slots__ = ("_event", "finished", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()  # also guards the owner's other completion state
        self.finished = False
        self._event: threading.Event | None = None

    def mark(self) -> threading.Event | None:
        """With ``lock`` held: record the finish; returns the Event to set once it is released
        (None: nobody blocks)."""
        self.finished = True
        return self._event

    def wait(self, limit: float) -> bool:
        """Wait up to ``limit`` seconds for the finish; whether it came (at once, without the
        lock, when it already did)."""
        if self.finished:
            return True
        with self.lock:
            if self.finished:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(limit)


class Handle:
    """The pending result of an async collective: `wait(timeout)` returns it, `done()` polls."""

    def __init__(self, label: str, default_timeout: float) -> None:
        self.label = label
        # A point-to-point receive's: the rank its message came from (known once it completed,
        # when the receive named ANY_SOURCE); None for sends and collectives.
        self.source: int | None = None
        self._done = Completion()
        self._result: Any = None
        self._error: BaseException | None = None
        self._default_timeout = default_timeout
        self._callbacks: list[Callable[[Handle], Any]] | None = []
        self._job: _Job | None = None  # while queued on an executor: the job, which wait() may run

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        with self._done.lock:
            event = self._done.mark()
            callbacks, self._callbacks = self._callbacks or [], None
        if event is not None:
            event.set()
        for fn in callbacks:
            self._call(fn)

    def _call(self, fn: Callable[[Handle], Any]) -> None:
        try:
            fn(self)
        except BaseException:  # a callback's bug must not take the communicator's worker down
            _log.exception("ddlcore: a done-callback of %s raised", self.label)

    def add_done_callback(self, fn: Callable[[Handle], Any]) -> None:
        """Call ``fn(handle)`` once the collective finishes, successfully or not.

        ``fn`` runs on the thread that ran the collective (the communicator's worker, or the
        thread that waited for it and ran it there), or at once on this thread if the
        collective already finished; it should be short and must not start a collective of the
        same communicator, which would wait behind the one that is calling it. Inside ``fn``,
        ``handle.wait(0)`` returns the result or raises the collective's error. An exception
        ``fn`` raises is logged, not propagated.
        """
        with self._done.lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def done(self) -> bool:
        """True once the collective finished (successfully or not); never blocks."""
        return self._done.finished

    def run_here(self) -> None:
        """Run the call on this thread now if it is queued, next in line and nothing runs: the
        worker would take it just as well, only later (a thread's wake-up costs more than a
        small call). Otherwise nothing happens; `wait` does this itself."""
        job = self._job
        if job is not None and not self._done.finished:
            job.executor.run_here(job)

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
        if timeout is None:
            self.run_here()  # bounded by DDL_TIMEOUT, as on the worker
        limit = self._default_timeout if timeout is None else timeout
        if not self._done.wait(limit):
            raise DDLTimeoutError(f"{self.label} not complete after waiting {limit:g} s")
        if self._error is not None:
            raise self._error
        return self._result


class _Job:
    """A queued call: ``run(seq)`` finishes ``handle``; ``started`` once a thread took it."""

    __slots__ = ("executor", "handle", "run", "seq", "started")

    def __init__(self, executor: Executor, run: Callable[[int], Any], seq: int, handle: Handle):
        self.executor, self.run, self.seq, self.handle = executor, run, seq, handle
        self.started = False

    def execute(self) -> None:
        """Run the call and finish its handle (with the call's error if it raised)."""
        result, error = None, None
        try:
            result = self.run(self.seq)
        except BaseException as exc:  # delivered to whoever waits on the handle
            error = exc
        self.handle._job = None
        self.handle._finish(result, error)


class Executor:
    """Runs jobs one at a time in submission order (inline when idle, else on a worker thread,
    or on the thread that waits for a job when it is next and the worker has not taken it)."""

    def __init__(self, name: str) -> None:
        self._name = name
        lock = threading.Lock()
        self._cv = threading.Condition(lock)  # the worker waits on it for jobs
        self._idle = threading.Condition(lock)  # drain() waits on it for an empty queue
        self._queue: deque[_Job] = deque()
        self._next_seq = 0
        self._run_lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._holding = threading.local()  # .depth: inside hold() on this thread

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def submit(self, job: Callable[[int], Any], handle: Handle) -> Handle:
        """Queue ``job(seq)``; the sequence number is taken now, in call order. Inside `hold`
        with nothing queued or running, the job runs now, on this thread."""
        with self._cv:
            if self._closed:
                raise CommunicatorClosedError(f"{handle.label}: the communicator is closed")
            held = getattr(self._holding, "depth", 0) > 0
            now = held and not self._queue and self._run_lock.acquire(blocking=False)
            handle._job = _Job(self, job, self._take_seq(), handle)
            if not now:
                self._queue.append(handle._job)
                if not held:
                    self._wake()
        if now:
            try:
                handle._job.execute()
            finally:
                self._run_lock.release()
        return handle

    def _wake(self) -> None:
        """Start the worker or wake it (holding ``_cv``)."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._worker.start()
        self._cv.notify()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """For a caller that waits for its jobs at once: a job submitted from this thread inside
        the block runs at once on this thread when nothing is queued or running, and otherwise
        is queued without waking the worker (`Handle.run_here` or ``wait()`` runs it here when
        its turn comes). Whatever is still queued when the block ends goes to the worker."""
        self._holding.depth = getattr(self._holding, "depth", 0) + 1
        try:
            yield
        finally:
            self._holding.depth -= 1
            if not self._holding.depth:
                with self._cv:
                    if self._queue and not self._queue[0].started:
                        self._wake()

    def run_inline(self, job: Callable[[int], Any], make_handle: Callable[[], Handle]) -> Any:
        """Run ``job(seq)`` now if nothing is queued (the fast path), else queue it behind the
        others with a handle from ``make_handle()`` and wait for it."""
        with self._cv:
            closed = self._closed
            idle = not closed and not self._queue and not self._run_lock.locked()
            if idle:
                self._run_lock.acquire()
                seq = self._take_seq()
        if closed:  # make_handle() takes the lock (the wait budget counts the queue)
            raise CommunicatorClosedError(f"{make_handle().label}: the communicator is closed")
        if idle:
            try:
                return job(seq)
            finally:
                self._run_lock.release()
        return self.submit(job, make_handle()).wait()

    def run_here(self, job: _Job) -> None:
        """Run ``job`` on this thread if it is next and nothing runs (else the worker will)."""
        with self._cv:
            if job.started or not self._queue or self._queue[0] is not job:
                return
            if not self._run_lock.acquire(blocking=False):  # an inline call is running:
                self._wake()  # the worker takes the job after it (it may be held)
                return
            job.started = True
        try:
            job.execute()
        finally:
            self._run_lock.release()
            self._finished()

    def _finished(self) -> None:
        with self._cv:
            self._queue.popleft()
            if not self._queue:
                self._idle.notify_all()
            elif not self._queue[0].started:
                self._cv.notify()  # not when the queue is empty: a wake-up costs a context switch

    def _loop(self) -> None:
        while True:
            with self._cv:
                # Nothing queued, or a waiting caller runs the next job: wait.
                while (self._queue and self._queue[0].started) or (
                    not self._queue and not self._closed
                ):
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue[0]
                job.started = True
            with self._run_lock:
                job.execute()
            self._finished()

    def drain(self, timeout: float) -> bool:
        """Wait until every queued job ran; False if ``timeout`` passed first."""
        with self._cv:
            return self._idle.wait_for(lambda: not self._queue, timeout)

    def pending(self) -> int:
        """Jobs queued or running on the worker (a snapshot: read without the lock, as a
        deque's length is read atomically)."""
        return len(self._queue)

    def close(self, timeout: float) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout)
            self._worker = None
